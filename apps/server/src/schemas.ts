/**
 * Request bodies (zod). Unknown fields are dropped, as OpenAI's API ignores them; `null` is accepted wherever
 * a field may be left out (clients send explicit nulls). Field names and defaults follow the OpenAI API and
 * llama.cpp's server.
 */
import { z } from "zod";
import { ApiError } from "./errors.js";
import { structuredFields, toolFields } from "./structured.js";

/*
 * Every schema carries what it expects in words ("an integer ≥ -1") as its error, so that a 400 names the
 * field, what it must be and what was sent: `"max_tokens": expected an integer ≥ -1, got -3`.
 */

function bounds(what: string, min?: number, max?: number): string {
  if (min !== undefined && max !== undefined) return `${what} in [${min}, ${max}]`;
  if (min !== undefined) return `${what} ≥ ${min}`;
  if (max !== undefined) return `${what} ≤ ${max}`;
  return what;
}

function number(min?: number, max?: number): z.ZodNumber {
  const error = bounds("a number", min, max);
  let s = z.number({ error });
  if (min !== undefined) s = s.min(min, { error });
  if (max !== undefined) s = s.max(max, { error });
  return s;
}

function integer(min?: number, max?: number): z.ZodNumber {
  const error = bounds("an integer", min, max);
  let s = z.number({ error }).int({ error });
  if (min !== undefined) s = s.min(min, { error });
  if (max !== undefined) s = s.max(max, { error });
  return s;
}

/** An array of `item`; `what` describes the whole ("an array of strings"). */
function array<T extends z.ZodType>(item: T, what: string, min?: number, max?: number): z.ZodArray<T> {
  const error =
    min !== undefined && max !== undefined
      ? `${what} (${min} to ${max} items)`
      : min !== undefined
        ? `${what} (at least ${min} item${min === 1 ? "" : "s"})`
        : max !== undefined
          ? `${what} (at most ${max} items)`
          : what;
  let s = z.array(item, { error });
  if (min !== undefined) s = s.min(min, { error });
  if (max !== undefined) s = s.max(max, { error });
  return s;
}

const string = () => z.string({ error: "a string" });
const boolean = () => z.boolean({ error: "true or false" });
const tokenId = integer(0);
const stop = z
  .union([string(), array(string(), "an array of strings", undefined, 16)], {
    error: "a string or an array of at most 16 strings",
  })
  .nullish();

/** Tokens to generate (llama.cpp's n_predict and its aliases): −1 = no limit, −2 = until the context is full. */
const nPredict = () => integer(-2).nullish();

/** A logit bias: a number (OpenAI's range), or false (llama.cpp: the token is banned). */
const bias = z.union([z.number().min(-100).max(100), z.literal(false)], { error: "a bias in [-100, 100] or false" });

/** Sampling and stopping fields shared by every generation endpoint. */
const sampling = {
  model: string().nullish(),
  /** ≤ 0: greedy (llama.cpp's server accepts negative temperatures the same way). */
  temperature: number().nullish(),
  top_k: integer().nullish(), // ≤ 0 = off, as llama.cpp
  top_p: number(0, 1).nullish(),
  min_p: number(0, 1).nullish(),
  seed: integer().nullish(),
  stop,
  presence_penalty: number(-2, 2).nullish(),
  frequency_penalty: number(-2, 2).nullish(),
  repeat_penalty: number(0).nullish(),
  repeat_last_n: integer(-1).nullish(),
  ignore_eos: boolean().nullish(),
  stream: boolean().nullish(),
  n_predict: nPredict(),
  cache_prompt: boolean().nullish(),
  /** llama.cpp: the slot to run in; -1 = any free one. */
  id_slot: integer(-1).nullish(),
  /**
   * OpenAI: {"token id": bias}; llama.cpp: [[token id, bias or false (banned)], …]. In both, a key that is not
   * a token id is text whose tokens all get the bias (llama.cpp).
   */
  logit_bias: z
    .union(
      [
        z.record(z.string(), bias, { error: 'an object of "token id or text": bias' }),
        z.array(z.tuple([z.union([integer(0), string()]), z.union([z.number(), z.literal(false)])]), {
          error: "an array of [token id or text, bias or false] pairs",
        }),
      ],
      {
        error:
          'an object {"token id or text": bias in [-100, 100]} or an array of [token id or text, bias or false] pairs',
      },
    )
    .nullish(),
  /** llama.cpp: with n_probs, report probabilities after the sampler chain (`prob`, `top_probs`). */
  post_sampling_probs: boolean().nullish(),
  /** llama.cpp: stream prompt-processing progress events (`prompt_progress`). */
  return_progress: boolean().nullish(),
  /** llama.cpp: add `__verbose` (the native result) to OpenAI-shaped responses. */
  verbose: boolean().nullish(),
  ...structuredFields,
};

/** llama.cpp's object prompt: `{"prompt_string": …}` (`multimodal_data` needs a multimodal model). */
const objectPrompt = z.object(
  {
    prompt_string: z.union([string(), z.array(z.union([string(), tokenId]))], {
      error: "a string or an array of strings and token ids",
    }),
    multimodal_data: z.unknown().optional(),
  },
  { error: 'an object {"prompt_string": …}' },
);

const streamOptions = z.object({ include_usage: boolean().nullish() }, { error: "an object" }).nullish();

/** `POST /v1/completions` (OpenAI legacy completions). */
export const completionsBody = z.object({
  ...sampling,
  prompt: z.union(
    [
      string(),
      array(string(), "an array of strings", 1, 16),
      array(tokenId, "an array of token ids", 1),
      array(array(tokenId, "an array of token ids", 1), "an array of arrays of token ids", 1, 16),
      objectPrompt,
    ],
    { error: "a string, an array of strings or an array of token ids" },
  ),
  max_tokens: nPredict(),
  n: integer(1, 16).nullish(),
  logprobs: integer(0, 20).nullish(),
  echo: boolean().nullish(),
  stream_options: streamOptions,
});
export type CompletionsBody = z.infer<typeof completionsBody>;

const contentPart = z.object({ type: string(), text: string().nullish() }, { error: "a content part object" });

/** `POST /v1/chat/completions`. */
export const chatBody = z.object({
  ...sampling,
  messages: array(
    z
      .object(
        {
          role: z.enum(["system", "developer", "user", "assistant", "tool", "function"], {
            error: 'one of "system", "developer", "user", "assistant", "tool"',
          }),
          content: z
            .union([string(), array(contentPart, "an array of content parts"), z.null()], {
              error: "a string or an array of content parts",
            })
            .optional(),
          name: string().nullish(),
          /** an assistant turn that called tools (OpenAI's shape), and a tool result's call id */
          tool_calls: z
            .array(
              z
                .object({
                  id: string().nullish(),
                  type: string().nullish(),
                  function: z.object({ name: string(), arguments: string() }).partial(),
                })
                .partial(),
              {
                error: "an array of tool calls",
              },
            )
            .nullish(),
          tool_call_id: string().nullish(),
        },
        { error: "a message object" },
      )
      // only an assistant message (one that called tools) may come without content
      .refine((m) => m.role === "assistant" || (m.content !== undefined && m.content !== null), {
        path: ["content"],
        message: "required for a non-assistant message (a string or an array of content parts)",
      }),
    "an array of messages",
    1,
  ),
  max_tokens: nPredict(),
  max_completion_tokens: nPredict(),
  n: integer(1, 16).nullish(),
  logprobs: boolean().nullish(),
  /** End the prompt with the assistant's turn opening (default true). */
  add_generation_prompt: boolean().nullish(),
  /** Continue the final (assistant) message instead of opening a new turn (vLLM/transformers' name). */
  continue_final_message: boolean().nullish(),
  top_logprobs: integer(0, 20).nullish(),
  stream_options: streamOptions,
  ...toolFields,
});
export type ChatBody = z.infer<typeof chatBody>;

const mixedPrompt = array(
  z.union([string(), tokenId], { error: "a string or a token id" }),
  "an array of strings and token ids",
);

/** `POST /completion` (llama.cpp). */
export const llamaCompletionBody = z.object({
  ...sampling,
  prompt: z.union(
    [
      string(),
      array(
        z.union([string(), tokenId, mixedPrompt, objectPrompt], {
          error: 'a string, a token id, an array of them or {"prompt_string": …}',
        }),
        "an array of prompts",
        1,
      ),
      objectPrompt,
    ],
    { error: 'a string, an array of strings and token ids, or {"prompt_string": …}' },
  ),
  max_tokens: nPredict(),
  max_completion_tokens: nPredict(),
  n_probs: integer(0, 100).nullish(),
  return_tokens: boolean().nullish(),
  /** Only these fields of the result ("a/b" lifts a nested field to the top as "a/b"). */
  response_fields: array(string(), "an array of field names").nullish(),
});
export type LlamaCompletionBody = z.infer<typeof llamaCompletionBody>;

/** `POST /tokenize`. */
export const tokenizeBody = z.object({
  content: string(),
  add_special: boolean().nullish(),
  parse_special: boolean().nullish(),
  with_pieces: boolean().nullish(),
});

/** `POST /detokenize`. */
export const detokenizeBody = z.object({ tokens: array(tokenId, "an array of token ids").nullish() });

/** "messages[0].role" for the path ["messages", 0, "role"]. */
function pathText(path: readonly PropertyKey[]): string {
  let s = "";
  for (const p of path) s += typeof p === "number" ? `[${p}]` : s ? `.${String(p)}` : String(p);
  return s;
}

/** A sent value in a few characters: `-3`, `"hot"`, `[1,2,3,…]`; `undefined` is "nothing". */
function shown(v: unknown): string {
  if (v === undefined) return "nothing";
  // a number beyond the double range (1e400) parses as ±Infinity, which JSON would write as null
  if (typeof v === "number" && !Number.isFinite(v)) return String(v);
  let json: string;
  try {
    json = JSON.stringify(v) ?? String(v);
  } catch {
    json = preview(v, 0); // nested too deeply for JSON.stringify's stack
  }
  return json.length > 40 ? `${json.slice(0, 39)}…` : json;
}

/** The start of a value in JSON, however deeply it nests (enough of it for {@link shown}). */
function preview(v: unknown, depth: number): string {
  if (depth > 40) return "…";
  if (Array.isArray(v)) return `[${v.length > 0 ? preview(v[0], depth + 1) : ""}${v.length > 1 ? ",…" : ""}]`;
  if (v !== null && typeof v === "object") {
    const [k, x] = Object.entries(v)[0] ?? [];
    return k === undefined ? "{}" : `{${JSON.stringify(k)}:${preview(x, depth + 1)},…}`;
  }
  return JSON.stringify(v) ?? String(v);
}

/**
 * The issue to report for `issue` at `path`: when a value matched the shape of exactly one alternative of a
 * union (an array of content parts, say) but failed inside it, the issue inside, which names the element.
 */
function specific(
  issue: z.core.$ZodIssue,
  path: readonly PropertyKey[],
): { issue: z.core.$ZodIssue; path: PropertyKey[] } {
  if (issue.code === "invalid_union") {
    const inside = issue.errors.filter((branch) => branch.length > 0 && branch.every((i) => i.path.length > 0));
    if (inside.length === 1) {
      const i = inside[0]![0]!;
      return specific(i, [...path, ...i.path]);
    }
  }
  return { issue, path: [...path] };
}

/**
 * What a field must be, for "expected …": the schemas' own words ("a string", "an integer ≥ 0", lower case), or
 * zod's default messages ("Invalid input", "Too small: expected number to be >=-100") said the same way.
 */
function expectation(issue: z.core.$ZodIssue): string {
  const article = (t: string) => `${/^[aeiou]/.test(t) ? "an" : "a"} ${t}`;
  if (!/^[A-Z]/.test(issue.message)) return issue.message;
  const kind = (origin: string) =>
    origin === "number" || origin === "int"
      ? "a number"
      : origin === "array" || origin === "set"
        ? "a list"
        : `a ${origin}`;
  switch (issue.code) {
    case "too_small":
      return issue.origin === "number" || issue.origin === "int"
        ? `${kind(issue.origin)} ${issue.inclusive ? "≥" : ">"} ${issue.minimum}`
        : `${kind(issue.origin)} of at least ${issue.minimum} ${issue.origin === "string" ? "characters" : "items"}`;
    case "too_big":
      return issue.origin === "number" || issue.origin === "int"
        ? `${kind(issue.origin)} ${issue.inclusive ? "≤" : "<"} ${issue.maximum}`
        : `${kind(issue.origin)} of at most ${issue.maximum} ${issue.origin === "string" ? "characters" : "items"}`;
    case "invalid_type":
      return article(issue.expected);
    case "invalid_union": {
      // every alternative wanted another type: name them
      const types = issue.errors.flatMap((b) => b.map((i) => (i.code === "invalid_type" ? i.expected : undefined)));
      if (types.length > 0 && types.every((t) => t !== undefined))
        return [...new Set(types)].map((t) => article(t!)).join(" or ");
      return "a valid value (see the API reference)";
    }
    default:
      return "a valid value (see the API reference)";
  }
}

/**
 * Validates a body against a schema.
 * @throws ApiError 400 whose message names each offending field (at most 3), what it must be and what was
 *   sent, on one line; `param` is the first field.
 */
export function parseBody<T extends z.ZodType>(schema: T, body: unknown): z.infer<T> {
  if (body === undefined || body === null || typeof body !== "object" || Array.isArray(body)) {
    throw new ApiError(400, "invalid_request_error", "the body must be a JSON object");
  }
  const r = schema.safeParse(body, { reportInput: true });
  if (r.success) return r.data;
  const issues = r.error.issues.map((i) => specific(i, i.path));
  const message = issues
    .slice(0, 3)
    .map(({ issue, path }) => {
      const field = pathText(path);
      const input = (issue as { input?: unknown }).input;
      const what = field ? `"${field}"` : "the body";
      if (issue.code === "unrecognized_keys" || issue.code === "custom") return `${what}: ${issue.message}`;
      return input === undefined
        ? `${what} is missing: expected ${expectation(issue)}`
        : `${what}: expected ${expectation(issue)}, got ${shown(input)}`;
    })
    .join("; ");
  const more = issues.length > 3 ? ` (and ${issues.length - 3} more)` : "";
  const first = issues[0] ? pathText(issues[0].path) : "";
  throw new ApiError(400, "invalid_request_error", message + more, first ? { param: first } : {});
}
