export * from "./graph.js";
export * from "./types.js";
