export * from "./engine.js";
export * from "./errors.js";
export * from "./kv-cache.js";
export * from "./perplexity.js";
export * from "./sampler.js";
export * from "./chat.js";
export * from "./profile.js";
export * from "./hybrid.js";
