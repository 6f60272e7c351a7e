export * from "./planner.js";
export * from "./resolve.js";
