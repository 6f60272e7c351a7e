export * from "./backend/index.js";
export * from "./tokenizer/index.js";
