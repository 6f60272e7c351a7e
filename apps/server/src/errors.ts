/** Errors in OpenAI's shape: `{ error: { code, message, type } }` (llama.cpp's server uses the same). */
import { EngineError } from "@powerinfer/engine";

export type ApiErrorType =
  | "invalid_request_error"
  | "authentication_error"
  | "not_found_error"
  | "unavailable_error"
  | "server_error"
  | "not_supported_error"
  | "exceed_context_size_error";

/** An error the server answers with a status and OpenAI's error body; `extra` fields join the error object. */
export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly type: ApiErrorType,
    message: string,
    readonly extra: Record<string, unknown> = {},
  ) {
    super(message);
    this.name = "ApiError";
  }

  body(): { error: Record<string, unknown> } {
    return { error: { code: this.status, message: this.message, type: this.type, ...this.extra } };
  }
}

/** Largest request body the server reads (bytes); a larger one is a 413. */
export const BODY_LIMIT_BYTES = 8 * 1024 * 1024;

/** Fastify's own error codes we answer in OpenAI's shape. */
const FASTIFY_CODES: Record<string, [number, ApiErrorType, string]> = {
  FST_ERR_CTP_INVALID_JSON_BODY: [400, "invalid_request_error", "the body is not valid JSON"],
  FST_ERR_CTP_EMPTY_JSON_BODY: [400, "invalid_request_error", "the body is empty; send a JSON object"],
  FST_ERR_CTP_BODY_TOO_LARGE: [
    413,
    "invalid_request_error",
    `the body is too large (the limit is ${BODY_LIMIT_BYTES / 1024 / 1024} MiB)`,
  ],
  FST_ERR_CTP_INVALID_MEDIA_TYPE: [415, "invalid_request_error", "unsupported content type; send application/json"],
};

/** Maps anything thrown while handling a request to an {@link ApiError}. */
export function toApiError(e: unknown): ApiError {
  if (e instanceof ApiError) return e;
  if (e instanceof EngineError) {
    switch (e.code) {
      case "QUEUE_FULL":
        return new ApiError(503, "unavailable_error", e.message);
      case "BAD_INPUT":
      case "PROMPT_TOO_LONG":
      case "CONTEXT_FULL":
        return new ApiError(400, "invalid_request_error", e.message);
      default:
        return new ApiError(500, "server_error", e.message);
    }
  }
  if (e instanceof SyntaxError)
    return new ApiError(400, "invalid_request_error", `the body is not valid JSON: ${e.message}`);
  const code = (e as { code?: unknown })?.code;
  if (typeof code === "string" && code in FASTIFY_CODES) {
    const [status, type, what] = FASTIFY_CODES[code]!;
    const cause = (e as { cause?: unknown }).cause;
    return new ApiError(status, type, cause instanceof Error ? `${what}: ${cause.message}` : what);
  }
  const status = (e as { statusCode?: unknown })?.statusCode;
  if (typeof status === "number" && status >= 400 && status < 500) {
    return new ApiError(status, "invalid_request_error", (e as Error).message);
  }
  return new ApiError(500, "server_error", e instanceof Error ? e.message : String(e));
}
