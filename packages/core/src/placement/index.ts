export * from "./planner.js";
