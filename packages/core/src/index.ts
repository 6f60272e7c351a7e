/**
 * `@powerinfer/core`: the contract backends are built on. The backend interface, the graph (ops, dtypes,
 * encoding), the registry with discovery, the conformance kit and the reference TypeScript backend. No
 * runtime dependency; the placement planner has its own entry, `@powerinfer/core/placement`.
 */
export * from "./backend/index.js";
export * from "./conformance/index.js";
export * from "./reference/backend.js";
export * from "./native/adapter.js";
