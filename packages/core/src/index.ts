export * from "./backend/index.js";
export * from "./tokenizer/index.js";
export * from "./engine/index.js";
export * from "./model/index.js";
export * from "./conformance/index.js";
export * from "./placement/index.js";
export * from "./synthetic/index.js";
export * from "./grammar/index.js";
