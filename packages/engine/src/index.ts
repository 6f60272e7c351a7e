export * from "./engine/index.js";
export * from "./errors.js";
export * from "./grammar/index.js";
export * from "./model/index.js";
