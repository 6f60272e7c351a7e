export * from "./llama.js";
export * from "./weights.js";
export * from "./blocks.js";
export * from "./kv-cache.js";
export * from "./ram-budget.js";
export * from "./bundle.js";
