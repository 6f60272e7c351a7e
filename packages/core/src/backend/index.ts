export * from "./graph.js";
export * from "./types.js";
export * from "./registry.js";
export * from "./discovery.js";
