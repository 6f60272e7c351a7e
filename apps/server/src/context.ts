/** What the route handlers share: the loaded model, its scheduler and chat template, plus helpers. */
import type { ServerResponse } from "node:http";
import {
  type BatchRequest,
  type BatchRequestOptions,
  type BatchScheduler,
  type BatchTimings,
  type ChatTemplate,
  type Model,
  type StopReason,
  type TokenLogprob,
  EngineError,
} from "@powerinfer/core";
import type { FastifyReply } from "fastify";
import { ApiError } from "./errors.js";
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
  logit_bias?: Record<string, number> | [number, number | false][] | null;
}

/** Request fields → scheduler options, with llama.cpp's server defaults. A seed < 0 (−1) means random. */
export function samplingOptions(
  b: SamplingFields,
  maxTokens: number,
  nProbs: number,
  /** A slot's context: `repeat_last_n: -1` looks back over all of it (as llama.cpp). */
  nCtx: number,
): BatchRequestOptions {
  const seed = b.seed ?? -1;
  return {
    maxTokens,
    temperature: b.temperature ?? 0.8,
    topK: b.top_k ?? 40,
    topP: b.top_p ?? 0.95,
    minP: b.min_p ?? 0.05,
    repeatPenalty: b.repeat_penalty ?? 1,
    penaltyLastN: b.repeat_last_n === -1 ? nCtx : (b.repeat_last_n ?? 64),
    presencePenalty: b.presence_penalty ?? 0,
    frequencyPenalty: b.frequency_penalty ?? 0,
    seed: seed >= 0 && seed <= 0xffffffff ? seed : undefined,
    stop: typeof b.stop === "string" ? [b.stop] : (b.stop ?? []),
    ignoreEos: b.ignore_eos ?? false,
    nProbs,
    cachePrompt: b.cache_prompt ?? true,
    logitBias: logitBias(b.logit_bias),
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

/** `logit_bias` in either API's form → token id → bias (false, llama.cpp's ban, is −Infinity). */
function logitBias(v: SamplingFields["logit_bias"]): Map<number, number> | undefined {
  if (!v) return undefined;
  const pairs: [number, number | false][] = Array.isArray(v)
    ? v
    : Object.entries(v).map(([k, b]) => [Number(k), b] as [number, number]);
  return new Map(pairs.map(([t, b]) => [t, b === false ? Number.NEGATIVE_INFINITY : b]));
}

/** Checks a tokenized prompt against a slot's context. @throws ApiError 400 (exceed_context_size_error). */
export function checkPrompt(ctx: ServerContext, ids: readonly number[]): void {
  if (ids.length === 0) throw new ApiError(400, "invalid_request_error", "the prompt is empty");
  const nCtx = ctx.scheduler.nCtx;
  if (ids.length > nCtx) {
    throw new ApiError(
      400,
      "exceed_context_size_error",
      `the prompt has ${ids.length} tokens, more than the ${nCtx} of a slot's context (n_ctx ${nCtx}); shorten it or give the server a larger -c`,
      { n_prompt_tokens: ids.length, n_ctx: nCtx },
    );
  }
  const nv = ctx.model.config.n_vocab;
  for (const t of ids) {
    if (t < 0 || t >= nv)
      throw new ApiError(400, "invalid_request_error", `token id ${t} is outside the vocabulary [0, ${nv})`);
  }
}

/** One generation the server runs: prompt ids and options. */
export interface Job {
  promptIds: number[];
  options: BatchRequestOptions;
}

/**
 * Submits every job; when one is refused (queue full) the ones already submitted are cancelled.
 * @throws ApiError 503 when the queue is full.
 */
export function submitAll(ctx: ServerContext, jobs: Job[], signal: AbortSignal): BatchRequest[] {
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

/** llama.cpp's `timings` object. */
export function timingsJson(t: BatchTimings) {
  const per = (ms: number, n: number) => (n > 0 ? ms / n : 0);
  const rate = (ms: number, n: number) => (ms > 0 ? (n * 1000) / ms : 0);
  return {
    prompt_n: t.promptTokens,
    prompt_ms: t.promptMs,
    prompt_per_token_ms: per(t.promptMs, t.promptTokens),
    prompt_per_second: rate(t.promptMs, t.promptTokens),
    predicted_n: t.generatedTokens,
    predicted_ms: t.generateMs,
    predicted_per_token_ms: per(t.generateMs, t.generatedTokens),
    predicted_per_second: rate(t.generateMs, t.generatedTokens),
  };
}

/** OpenAI usage over several requests (a prompt shared by `n` choices counts once). */
export function usageJson(reqs: BatchRequest[], promptTokens: number) {
  const completion = reqs.reduce((s, r) => s + r.timings.generatedTokens, 0);
  return { prompt_tokens: promptTokens, completion_tokens: completion, total_tokens: promptTokens + completion };
}

/** A token's text and bytes, for logprobs. */
export function tokenPiece(ctx: ServerContext, id: number): { token: string; bytes: number[] } {
  const tok = ctx.model.tokenizer;
  const bytes = tok.tokenToPiece(id, { special: true });
  return { token: tok.tokenToText(id, { special: true }), bytes: [...bytes] };
}

/** OpenAI chat logprobs entry of one token. */
export function chatLogprob(ctx: ServerContext, id: number, logprob: number, top: TokenLogprob[]) {
  return {
    ...tokenPiece(ctx, id),
    logprob,
    top_logprobs: top.map((t) => ({ ...tokenPiece(ctx, t.id), logprob: t.logprob })),
  };
}
