export * from "./llama.js";
export * from "./weights.js";
