export { ApiError, type ApiErrorType, toApiError } from "./errors.js";
export { prometheusText } from "./metrics.js";
export { createServer, type PowerinferServer, type ServerOptions } from "./server.js";
