/** What the route handlers share: the loaded model, its scheduler and chat template, plus helpers. */
import type { ServerResponse } from "node:http";
import {
  type BatchRequest,
  type BatchRequestOptions,
  type BatchScheduler,
  type BatchToken,
  type ChatTemplate,
  type Model,
  type StopReason,
  type TokenLogprob,
  EngineError,
} from "@powerinfer/engine";
import type { FastifyReply } from "fastify";
import { ApiError } from "./errors.js";
import type { TokenizerService } from "./tokenize.js";

/** Generation defaults of a server (llama-server's `--seed`, `--temp`, … options); a request overrides them. */
export interface GenerationDefaults {
  /** uint32, or −1 (default) = a random seed per request. */
  seed?: number;
  /** Default 0.8; ≤ 0 is greedy. */
  temperature?: number;
  /** Default 40; 0 = off. */
  topK?: number;
  /** Default 0.95; 1 = off. */
  topP?: number;
  /** Default 0.05; 0 = off. */
  minP?: number;
  /** Tokens to generate. Default −1 (no limit: until end of text or a full context); −2 = until the context is full. */
  nPredict?: number;
  /** Default 1 (off). */
  repeatPenalty?: number;
}
import { requestGrammar, type StructuredBody } from "./structured.js";

export interface ServerContext {
  model: Model;
  scheduler: BatchScheduler;
  template: ChatTemplate;
  /** The model id the API reports. */
  alias: string;
  modelPath: string;
  /** Unix seconds at load. */
  created: number;
  /** The server's generation defaults. */
  defaults: GenerationDefaults;
  /** Tokenization off the event loop for long texts, and the lower bound that refuses a prompt untokenized. */
  tokens: TokenizerService;
  /** "b<version>-<commit>" (system_fingerprint, build_info). */
  build: string;
  /** Endpoints that are on (`/props` reports them). */
  endpoints: { slots: boolean; metrics: boolean };
}

/** Sampling fields as both APIs name them. */
export interface SamplingFields extends StructuredBody {
  temperature?: number | null;
  top_k?: number | null;
  top_p?: number | null;
  min_p?: number | null;
  seed?: number | null;
  stop?: string | string[] | null;
  presence_penalty?: number | null;
  frequency_penalty?: number | null;
  repeat_penalty?: number | null;
  repeat_last_n?: number | null;
  ignore_eos?: boolean | null;
  cache_prompt?: boolean | null;
  id_slot?: number | null;
  logit_bias?: Record<string, number | false> | [number | string, number | false][] | null;
  post_sampling_probs?: boolean | null;
}

/** llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF): a seed that asks for a random one. */
export const LLAMA_DEFAULT_SEED = 0xffffffff;

/** An integer seed as llama.cpp's server reads it: modulo 2^32 (−1 → 0xFFFFFFFF, 2^32 → 0). */
export function uint32Seed(seed: number): number {
  const m = 2 ** 32;
  return ((seed % m) + m) % m;
}

/**
 * Request fields → scheduler options, with the server's defaults (llama.cpp's where the server has none).
 * The seed is taken modulo 2^32 and 0xFFFFFFFF (−1) means random, as llama.cpp's. `maxTokens` undefined: the server's n_predict; −2 (until the context is
 * full) runs as −1, which also stops there.
 */
export function samplingOptions(
  b: SamplingFields,
  maxTokens: number | null | undefined,
  nProbs: number,
  ctx: ServerContext,
): BatchRequestOptions {
  const d = ctx.defaults;
  // llama.cpp reads the seed as a uint32 (−5 is 4294967291, 2^32 is 0) and 0xFFFFFFFF (−1,
  // LLAMA_DEFAULT_SEED) draws a random one
  const seed = uint32Seed(b.seed ?? d.seed ?? -1);
  const nPredict = maxTokens ?? d.nPredict ?? -1;
  const bias = logitBias(ctx, b.logit_bias);
  if (b.ignore_eos) {
    // llama.cpp: ignore_eos bans the end-of-generation tokens (they show in generation_settings.logit_bias)
    for (const t of ctx.model.tokenizer.eogIds) bias.set(t, Number.NEGATIVE_INFINITY);
  }
  return {
    maxTokens: nPredict < 0 ? -1 : nPredict,
    temperature: b.temperature ?? d.temperature ?? 0.8,
    topK: Math.max(0, b.top_k ?? d.topK ?? 40), // ≤ 0 = off, as llama.cpp
    topP: b.top_p ?? d.topP ?? 0.95,
    minP: b.min_p ?? d.minP ?? 0.05,
    repeatPenalty: b.repeat_penalty ?? d.repeatPenalty ?? 1,
    penaltyLastN: b.repeat_last_n === -1 ? ctx.scheduler.nCtx : (b.repeat_last_n ?? 64),
    presencePenalty: b.presence_penalty ?? 0,
    frequencyPenalty: b.frequency_penalty ?? 0,
    seed: seed === LLAMA_DEFAULT_SEED ? undefined : seed,
    stop: typeof b.stop === "string" ? [b.stop] : (b.stop ?? []),
    ignoreEos: b.ignore_eos ?? false,
    nProbs,
    postSamplingProbs: b.post_sampling_probs ?? false,
    cachePrompt: b.cache_prompt ?? true,
    logitBias: bias.size > 0 ? bias : undefined,
    slot: b.id_slot ?? -1,
    grammar: requestGrammar(b),
  };
}

/**
 * Checks `id_slot` against the server's slots.
 * @throws ApiError 400 naming the field, the slots there are and the value
 */
export function checkSlot(ctx: ServerContext, idSlot: number | null | undefined): void {
  if (idSlot === undefined || idSlot === null || idSlot === -1) return;
  const n = ctx.scheduler.nSlots;
  if (idSlot >= n) {
    throw new ApiError(
      400,
      "invalid_request_error",
      `id_slot must be -1 (any free slot) or a slot of this server (${n === 1 ? "0" : `0–${n - 1}`}), got ${idSlot}`,
    );
  }
}

/**
 * `logit_bias` in either API's form → token id → bias, as llama.cpp reads it: false bans the token
 * (−Infinity); a key that is not a token id is text, and each of its tokens gets the bias; ids outside the
 * vocabulary are ignored; biases of the same token add up.
 */
function logitBias(ctx: ServerContext, v: SamplingFields["logit_bias"]): Map<number, number> {
  const out = new Map<number, number>();
  if (!v) return out;
  const tok = ctx.model.tokenizer;
  const pairs: [number | string, number | false][] = Array.isArray(v) ? v : Object.entries(v);
  for (const [key, b] of pairs) {
    const bias = b === false ? Number.NEGATIVE_INFINITY : b;
    const ids =
      typeof key === "number"
        ? [key]
        : /^[+-]?\d+$/.test(key)
          ? [Number(key)]
          : tok.tokenize(key, { addSpecial: false, parseSpecial: false });
    for (const t of ids) {
      if (Number.isInteger(t) && t >= 0 && t < tok.nVocab) out.set(t, (out.get(t) ?? 0) + bias);
    }
  }
  return out;
}

/** llama.cpp's context-overflow error (its message first, then ours). */
function exceedsContext(ctx: ServerContext, nTokens: number, what: string): ApiError {
  const nCtx = ctx.scheduler.nCtx;
  return new ApiError(
    400,
    "exceed_context_size_error",
    `request (${nTokens} tokens) exceeds the available context size (${nCtx} tokens), try increasing it: ${what}, a slot's context (n_ctx) holds ${nCtx} and the prompt must leave room for a generated token; shorten it or give the server a larger -c`,
    { n_prompt_tokens: nTokens, n_ctx: nCtx },
  );
}

/**
 * Tokenizes a text prompt for a slot: a text that cannot fit (by {@link TokenizerService.minTokens}) is refused
 * before any of it is tokenized; a long one is tokenized off the event loop.
 * @throws ApiError 400 (exceed_context_size_error)
 */
export async function tokenizePrompt(
  ctx: ServerContext,
  text: string,
  opts: { addSpecial: boolean; parseSpecial: boolean },
): Promise<number[]> {
  const atLeast = ctx.tokens.minTokens(text);
  if (atLeast >= ctx.scheduler.nCtx) throw exceedsContext(ctx, atLeast, `the prompt has at least ${atLeast} tokens`);
  return ctx.tokens.tokenize(text, opts);
}

/**
 * Checks a tokenized prompt against a slot's context: as llama.cpp, it must leave room for at least one
 * generated token. @throws ApiError 400 (exceed_context_size_error).
 */
export function checkPrompt(ctx: ServerContext, ids: readonly number[]): void {
  if (ids.length === 0) throw new ApiError(400, "invalid_request_error", "the prompt is empty");
  if (ids.length >= ctx.scheduler.nCtx) throw exceedsContext(ctx, ids.length, `the prompt has ${ids.length} tokens`);
  const nv = ctx.model.config.n_vocab;
  for (const t of ids) {
    if (t < 0 || t >= nv)
      throw new ApiError(400, "invalid_request_error", `token id ${t} is outside the vocabulary [0, ${nv})`, {
        param: "prompt",
      });
  }
}

/** One generation the server runs: prompt ids and options. */
export interface Job {
  promptIds: number[];
  options: BatchRequestOptions;
}

/**
 * Submits every job; when one is refused (queue full) the ones already submitted are cancelled.
 * @throws ApiError 400 when the request has more jobs (choices × prompts) than the server can ever hold at
 *   once (its slots plus its queue limit): waiting would not help; 503 when the queue is full.
 */
export function submitAll(ctx: ServerContext, jobs: Job[], signal: AbortSignal): BatchRequest[] {
  const cap = ctx.scheduler.nSlots + ctx.scheduler.queueLimit;
  if (jobs.length > cap) {
    throw new ApiError(
      400,
      "invalid_request_error",
      `this request makes ${jobs.length} generations (n × prompts); the server holds at most ${cap} at once (${ctx.scheduler.nSlots} slots + a queue of ${ctx.scheduler.queueLimit}): ask for fewer, or start it with more --parallel or --queue`,
    );
  }
  const out: BatchRequest[] = [];
  try {
    for (const j of jobs) out.push(ctx.scheduler.submit(j.promptIds, { ...j.options, signal }));
  } catch (e) {
    for (const r of out) r.cancel();
    if (e instanceof EngineError && e.code === "QUEUE_FULL") throw new ApiError(503, "unavailable_error", e.message);
    throw e;
  }
  return out;
}

/**
 * The error for a request cut off while its client was still there: the scheduler ended it ("aborted")
 * because the server is shutting down. A client must not take such a partial answer for a finished one.
 * Undefined when the request finished, or when the client itself went away.
 */
export function cutOff(r: BatchRequest, client: AbortSignal): ApiError | undefined {
  if (r.stopReason !== "aborted" || client.aborted) return undefined;
  return new ApiError(
    503,
    "unavailable_error",
    `the server is shutting down: the generation was cut off after ${r.timings.generatedTokens} tokens`,
  );
}

/**
 * Waits for every request's whole output (a non-streamed response).
 * @throws ApiError 503 ({@link cutOff}) when the server's shutdown cut one off while its client waited.
 */
export async function collectAll(reqs: BatchRequest[], client: AbortSignal) {
  const outputs = await Promise.all(reqs.map((r) => r.collect()));
  for (const r of reqs) {
    const cut = cutOff(r, client);
    if (cut) throw cut;
  }
  return outputs;
}

/** An AbortController that aborts when the client goes away before the response is complete. */
export function abortOnDisconnect(reply: FastifyReply): AbortController {
  const ac = new AbortController();
  reply.raw.on("close", () => {
    if (!reply.raw.writableFinished) ac.abort();
  });
  return ac;
}

/** Server-Sent Events on a hijacked response. */
export class SseStream {
  constructor(private readonly res: ServerResponse) {
    res.writeHead(200, {
      "Content-Type": "text/event-stream",
      "Cache-Control": "no-cache",
      Connection: "keep-alive",
      "X-Accel-Buffering": "no",
    });
  }

  get open(): boolean {
    return !this.res.destroyed && !this.res.writableEnded;
  }

  send(data: unknown): void {
    if (this.open) this.res.write(`data: ${JSON.stringify(data)}\n\n`);
  }

  /** OpenAI's terminator, then the end of the response. */
  done(): void {
    if (this.open) this.res.write("data: [DONE]\n\n");
    this.end();
  }

  end(): void {
    if (this.open) this.res.end();
  }
}

/** OpenAI's finish_reason. */
export function finishReason(r: StopReason | undefined): "stop" | "length" | null {
  if (r === "eos" || r === "stop") return "stop";
  if (r === "length" || r === "context") return "length";
  return null;
}

/**
 * llama.cpp's `timings` object of a request. `cache_n` prompt tokens came from the slot's cache; the
 * generation rate is over the decode steps after the first token (which comes from the prompt's logits and
 * costs none), so one token gives 0 tokens/s, as llama.cpp.
 */
export function timingsJson(r: BatchRequest) {
  const t = r.timings;
  const per = (ms: number, n: number) => (n > 0 ? ms / n : 0);
  const rate = (ms: number, n: number) => (ms > 0 ? (n * 1000) / ms : 0);
  const steps = Math.max(0, t.generatedTokens - 1);
  return {
    cache_n: r.cachedTokens,
    prompt_n: t.promptTokens,
    prompt_ms: t.promptMs,
    prompt_per_token_ms: per(t.promptMs, t.promptTokens),
    prompt_per_second: rate(t.promptMs, t.promptTokens),
    predicted_n: t.generatedTokens,
    predicted_ms: t.generateMs,
    predicted_per_token_ms: per(t.generateMs, steps),
    predicted_per_second: rate(t.generateMs, steps),
  };
}

/**
 * OpenAI usage over several requests (a prompt shared by `n` choices counts once), with llama.cpp's
 * `prompt_tokens_details.cached_tokens` (prompt tokens found in a slot's cache).
 */
export function usageJson(reqs: BatchRequest[], promptTokens: number) {
  const completion = reqs.reduce((s, r) => s + r.timings.generatedTokens, 0);
  // per prompt (by its tokens: the `n` choices of one prompt are separate requests), the most any of its
  // requests found in a slot's cache, so cached_tokens never exceeds prompt_tokens
  const perPrompt = new Map<string, number>();
  for (const r of reqs) {
    const key = r.promptIds.join(",");
    perPrompt.set(key, Math.max(perPrompt.get(key) ?? 0, r.cachedTokens));
  }
  let cached = 0;
  for (const c of perPrompt.values()) cached += c;
  return {
    prompt_tokens: promptTokens,
    completion_tokens: completion,
    total_tokens: promptTokens + completion,
    prompt_tokens_details: { cached_tokens: cached },
  };
}

/** A token's text and bytes, for logprobs. */
export function tokenPiece(ctx: ServerContext, id: number): { token: string; bytes: number[] } {
  const tok = ctx.model.tokenizer;
  const bytes = tok.tokenToPiece(id, { special: true });
  return { token: tok.tokenToText(id, { special: true }), bytes: [...bytes] };
}

/** OpenAI chat logprobs entry of one token, with llama.cpp's token `id`s. */
export function chatLogprob(ctx: ServerContext, id: number, logprob: number, top: TokenLogprob[]) {
  return {
    id,
    ...tokenPiece(ctx, id),
    logprob,
    top_logprobs: top.map((t) => ({ id: t.id, ...tokenPiece(ctx, t.id), logprob: t.logprob })),
  };
}

/**
 * llama.cpp's per-token probabilities (`completion_probabilities`, chat `logprobs.content`): log-probabilities
 * of the raw logits, or with `post_sampling_probs` the probabilities after the sampler chain
 * (`prob`, `top_probs`).
 */
export function probsJson(ctx: ServerContext, ts: BatchToken[], topN?: number) {
  const out = [];
  for (const t of ts) {
    if (t.id < 0) continue;
    if (t.post) {
      const top = t.post.top.slice(0, topN ?? t.post.top.length);
      out.push({
        id: t.id,
        ...tokenPiece(ctx, t.id),
        prob: t.post.prob,
        top_probs: top.map((x) => ({ id: x.id, ...tokenPiece(ctx, x.id), prob: x.p })),
      });
    } else if (t.logprob !== undefined) {
      out.push(chatLogprob(ctx, t.id, t.logprob, (t.top ?? []).slice(0, topN ?? t.top?.length ?? 0)));
    }
  }
  return out;
}
