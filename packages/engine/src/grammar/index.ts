export * from "./gbnf.js";
export * from "./matcher.js";
export * from "./constraint.js";
export * from "./schema.js";
