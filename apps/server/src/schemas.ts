/**
 * Request bodies (zod). Unknown fields are dropped, as OpenAI's API ignores them; `null` is accepted wherever
 * a field may be left out (clients send explicit nulls). Field names and defaults follow the OpenAI API and
 * llama.cpp's server.
 */
import { z } from "zod";
import { ApiError } from "./errors.js";

const int = z.number().int();
const stop = z.union([z.string(), z.array(z.string()).max(16)]).nullish();

/** Sampling and stopping fields shared by every generation endpoint. */
const sampling = {
  model: z.string().nullish(),
  temperature: z.number().min(0).nullish(),
  top_k: int.nullish(),
  top_p: z.number().min(0).max(1).nullish(),
  min_p: z.number().min(0).max(1).nullish(),
  seed: int.nullish(),
  stop,
  presence_penalty: z.number().min(-2).max(2).nullish(),
  frequency_penalty: z.number().min(-2).max(2).nullish(),
  repeat_penalty: z.number().min(0).nullish(),
  repeat_last_n: int.min(-1).nullish(),
  ignore_eos: z.boolean().nullish(),
  stream: z.boolean().nullish(),
  n_predict: int.min(-1).nullish(),
  cache_prompt: z.boolean().nullish(),
};

const streamOptions = z.object({ include_usage: z.boolean().nullish() }).nullish();

/** `POST /v1/completions` (OpenAI legacy completions). */
export const completionsBody = z.object({
  ...sampling,
  prompt: z.union([
    z.string(),
    z.array(z.string()).min(1).max(16),
    z.array(int).min(1),
    z.array(z.array(int).min(1)).min(1).max(16),
  ]),
  max_tokens: int.min(-1).nullish(),
  n: int.min(1).max(16).nullish(),
  logprobs: int.min(0).max(20).nullish(),
  echo: z.boolean().nullish(),
  stream_options: streamOptions,
});
export type CompletionsBody = z.infer<typeof completionsBody>;

const contentPart = z.object({ type: z.string(), text: z.string().nullish() });

/** `POST /v1/chat/completions`. */
export const chatBody = z.object({
  ...sampling,
  messages: z
    .array(
      z.object({
        role: z.string(),
        content: z.union([z.string(), z.array(contentPart), z.null()]).optional(),
        name: z.string().nullish(),
      }),
    )
    .min(1),
  max_tokens: int.min(-1).nullish(),
  max_completion_tokens: int.min(-1).nullish(),
  n: int.min(1).max(16).nullish(),
  logprobs: z.boolean().nullish(),
  top_logprobs: int.min(0).max(20).nullish(),
  stream_options: streamOptions,
});
export type ChatBody = z.infer<typeof chatBody>;

const mixedPrompt = z.array(z.union([z.string(), int]));

/** `POST /completion` (llama.cpp). */
export const llamaCompletionBody = z.object({
  ...sampling,
  prompt: z.union([z.string(), z.array(z.union([z.string(), int, mixedPrompt])).min(1)]),
  n_probs: int.min(0).max(100).nullish(),
  return_tokens: z.boolean().nullish(),
});
export type LlamaCompletionBody = z.infer<typeof llamaCompletionBody>;

/** `POST /tokenize`. */
export const tokenizeBody = z.object({
  content: z.string(),
  add_special: z.boolean().nullish(),
  parse_special: z.boolean().nullish(),
  with_pieces: z.boolean().nullish(),
});

/** `POST /detokenize`. */
export const detokenizeBody = z.object({ tokens: z.array(int.min(0)).nullish() });

/** "messages[0].role" for the path ["messages", 0, "role"]. */
function pathText(path: readonly PropertyKey[]): string {
  let s = "";
  for (const p of path) s += typeof p === "number" ? `[${p}]` : s ? `.${String(p)}` : String(p);
  return s;
}

/**
 * Validates a body against a schema.
 * @throws ApiError 400 naming every offending field.
 */
export function parseBody<T extends z.ZodType>(schema: T, body: unknown): z.infer<T> {
  if (body === undefined || body === null || typeof body !== "object" || Array.isArray(body)) {
    throw new ApiError(400, "invalid_request_error", "the body must be a JSON object");
  }
  const r = schema.safeParse(body);
  if (r.success) return r.data;
  const first = r.error.issues[0];
  const message = r.error.issues
    .slice(0, 5)
    .map((i) => `${pathText(i.path) || "body"}: ${i.message}`)
    .join("; ");
  return failWith(message, first ? pathText(first.path) : undefined);
}

function failWith(message: string, param?: string): never {
  throw new ApiError(400, "invalid_request_error", message, param ? { param } : {});
}
