/** llama.cpp's own API: `/completion` (and `/completions`), `/tokenize`, `/detokenize`, `/props`, `/slots`. */
import type {
  BatchRequest,
  BatchRequestOptions,
  BatchToken,
  PromptProgress,
  SlotInfo,
  StopReason,
} from "@powerinfer/engine";
import type { FastifyInstance, FastifyReply } from "fastify";
import {
  abortOnDisconnect,
  checkPrompt,
  checkSlot,
  collectAll,
  cutOff,
  type Job,
  probsJson,
  type ServerContext,
  SseStream,
  samplingOptions,
  submitAll,
  timingsJson,
  tokenizePrompt,
  LLAMA_DEFAULT_SEED,
  uint32Seed,
} from "./context.js";
import { ApiError } from "./errors.js";
import { modelMeta } from "./model-meta.js";
import { detokenizeBody, llamaCompletionBody, parseBody, tokenizeBody } from "./schemas.js";

/** llama.cpp's `stop_type`. */
function stopType(r: StopReason | undefined): "eos" | "limit" | "word" | "none" {
  if (r === "eos") return "eos";
  if (r === "length" || r === "context") return "limit";
  if (r === "stop") return "word";
  return "none";
}

/**
 * A request's settings in llama.cpp's `generation_settings` / `/slots` `params` shape (task_params::to_json);
 * `o` undefined gives the server's defaults. With `onlyMetrics` (llama.cpp's `/props`), the fields that
 * describe one request (stop, logit_bias, grammar) are left out. Samplers we do not have are reported at
 * their off values.
 */
export function paramsJson(
  ctx: ServerContext,
  o: BatchRequestOptions | undefined,
  stream = false,
  onlyMetrics = false,
) {
  const d = ctx.defaults;
  const nPredict = o ? (o.maxTokens ?? -1) : (d.nPredict ?? -1);
  const seed = o ? (o.seed ?? LLAMA_DEFAULT_SEED) : d.seed === undefined ? LLAMA_DEFAULT_SEED : uint32Seed(d.seed);
  return {
    seed,
    temperature: o?.temperature ?? d.temperature ?? 0.8,
    dynatemp_range: 0,
    dynatemp_exponent: 1,
    top_k: o?.topK ?? d.topK ?? 40,
    top_p: o?.topP ?? d.topP ?? 0.95,
    min_p: o?.minP ?? d.minP ?? 0.05,
    top_n_sigma: -1,
    xtc_probability: 0,
    xtc_threshold: 0.1,
    typical_p: 1,
    repeat_last_n: o?.penaltyLastN ?? 64,
    repeat_penalty: o?.repeatPenalty ?? d.repeatPenalty ?? 1,
    presence_penalty: o?.presencePenalty ?? 0,
    frequency_penalty: o?.frequencyPenalty ?? 0,
    dry_multiplier: 0,
    dry_base: 1.75,
    dry_allowed_length: 2,
    dry_penalty_last_n: 64,
    mirostat: 0,
    mirostat_tau: 5,
    mirostat_eta: 0.1,
    adaptive_target: -1,
    adaptive_decay: 0.9,
    ...(onlyMetrics ? {} : { stop: o?.stop ?? [] }),
    max_tokens: nPredict,
    n_predict: nPredict,
    n_keep: 0,
    n_discard: 0,
    ignore_eos: o?.ignoreEos ?? false,
    stream,
    // −Infinity (a banned token) is written as null, as llama.cpp's JSON writes it
    ...(onlyMetrics ? {} : { logit_bias: [...(o?.logitBias ?? [])].map(([token, bias]) => ({ bias, token })) }),
    n_probs: o?.nProbs ?? 0,
    min_keep: 0,
    ...(onlyMetrics ? {} : { grammar: "", grammar_lazy: false, grammar_triggers: [], preserved_tokens: [] }),
    chat_format: "Content-only",
    reasoning_format: "none",
    reasoning_in_content: false,
    generation_prompt: "",
    samplers: ["penalties", "top_k", "top_p", "min_p", "temperature"],
    "speculative.types": "none",
    timings_per_token: false,
    post_sampling_probs: o?.postSamplingProbs ?? false,
    backend_sampling: false,
    lora: [],
  };
}

/**
 * One slot in llama.cpp's `/slots` shape: a slot that has run a request also shows that request (the one
 * running, else the last), its `params` and `next_token` (a list, as llama.cpp); an idle slot's budget is -1.
 */
export function slotJson(ctx: ServerContext, s: SlotInfo) {
  const base = { id: s.id, n_ctx: s.nCtx, speculative: false, is_processing: s.busy };
  if (s.lastRequestId === undefined) return base;
  return {
    ...base,
    id_task: s.lastRequestId,
    state: s.state,
    n_past: s.nPast,
    n_prompt_tokens: s.nPast,
    n_prompt_tokens_processed: s.processedTokens,
    n_prompt_tokens_cache: s.cachedTokens,
    params: paramsJson(ctx, s.lastOptions),
    next_token: [
      {
        has_next_token: s.busy,
        has_new_line: false,
        n_remain: s.busy ? s.remaining : -1,
        n_decoded: s.busy ? s.generatedTokens : 0,
      },
    ],
  };
}

/** A `{"prompt_string": …}` prompt (llama.cpp's multimodal form). */
type ObjectPrompt = { prompt_string: string | (string | number)[]; multimodal_data?: unknown };
type OnePrompt = string | (string | number)[] | ObjectPrompt;

/**
 * One prompt → token ids: a string (BOS added, special tokens parsed), token ids mixed with strings (BOS
 * only before a leading string, as llama.cpp's tokenize_mixed), or `{"prompt_string": …}`.
 * @throws ApiError 400 for multimodal data or a prompt that cannot fit a slot.
 */
export async function promptIds(ctx: ServerContext, q: OnePrompt): Promise<number[]> {
  if (typeof q === "string") return tokenizePrompt(ctx, q, { addSpecial: true, parseSpecial: true });
  if (!Array.isArray(q)) {
    if (q.multimodal_data !== undefined) {
      throw new ApiError(
        400,
        "invalid_request_error",
        "multimodal data was sent, but this model does not take multimodal input",
        { param: "prompt.multimodal_data" },
      );
    }
    return promptIds(ctx, q.prompt_string);
  }
  const ids: number[] = [];
  for (let i = 0; i < q.length; i++) {
    const x = q[i]!;
    if (typeof x === "number") ids.push(x);
    else ids.push(...(await tokenizePrompt(ctx, x, { addSpecial: i === 0, parseSpecial: true })));
  }
  return ids;
}

/** llama.cpp's prompt forms: one prompt, or several (an array with no token id at its top level). */
async function prompts(
  ctx: ServerContext,
  p: string | ObjectPrompt | (string | number | (string | number)[] | ObjectPrompt)[],
): Promise<number[][]> {
  if (!Array.isArray(p)) return [await promptIds(ctx, p)];
  if (p.some((x) => typeof x === "number")) {
    if (p.some((x) => typeof x === "object")) {
      throw new ApiError(
        400,
        "invalid_request_error",
        "a prompt of token ids and strings cannot also hold arrays or objects; send several prompts as an array of prompts",
        { param: "prompt" },
      );
    }
    return [await promptIds(ctx, p as (string | number)[])];
  }
  const out: number[][] = [];
  for (const x of p) out.push(await promptIds(ctx, x as OnePrompt));
  return out;
}

/** `response_fields`: only these fields, a path "a/b" lifted to the top as "a/b" (llama.cpp's json_get_nested_values). */
function pickFields(res: Record<string, unknown>, fields: string[]): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const path of fields) {
    let cur: unknown = res;
    let ok = true;
    for (const k of path.split("/")) {
      if (ok && cur !== null && typeof cur === "object" && !Array.isArray(cur) && k in (cur as object)) {
        cur = (cur as Record<string, unknown>)[k];
      } else ok = false;
    }
    if (ok) out[path] = cur;
  }
  return out;
}

/** llama.cpp's `prompt_progress` object. */
export function progressJson(p: PromptProgress) {
  return { total: p.total, cache: p.cache, processed: p.processed, time_ms: Math.floor(p.timeMs) };
}

/**
 * A finished request in llama.cpp's native shape (`/completion`'s result, and `__verbose` of the OpenAI
 * endpoints). `content` and `tokens` are what the response carries (empty at the end of a stream).
 */
export function completionResult(
  ctx: ServerContext,
  i: number,
  r: BatchRequest,
  content: string,
  tokens: BatchToken[],
  o: { stream: boolean; returnTokens?: boolean; nProbs: number; hasNewLine: boolean },
) {
  return {
    index: i,
    content,
    tokens: o.returnTokens ? tokens.filter((t) => t.id >= 0).map((t) => t.id) : [],
    id_slot: r.slot,
    stop: true,
    model: ctx.alias,
    tokens_predicted: r.timings.generatedTokens,
    tokens_evaluated: r.promptIds.length,
    generation_settings: { n_ctx: ctx.scheduler.nCtx, model: ctx.alias, ...paramsJson(ctx, r.options, o.stream) },
    prompt: ctx.model.tokenizer.detokenize([...r.promptIds], { unparseSpecial: true }),
    has_new_line: o.hasNewLine,
    truncated: r.truncated,
    stop_type: stopType(r.stopReason),
    stopping_word: r.stoppingWord ?? "",
    tokens_cached: r.nPast,
    timings: timingsJson(r),
    ...(o.nProbs > 0 && !o.stream ? { completion_probabilities: probsJson(ctx, tokens) } : {}),
  };
}

export function registerLlamaCpp(app: FastifyInstance, getCtx: () => ServerContext): void {
  const completion = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(llamaCompletionBody, req.body);
    checkSlot(ctx, b.id_slot);
    const nProbs = b.n_probs ?? 0;
    const stream = b.stream ?? false;
    // llama.cpp reads n_predict, else its aliases max_completion_tokens and max_tokens
    const maxTokens = b.n_predict ?? b.max_completion_tokens ?? b.max_tokens;
    let sse: SseStream | undefined;
    const jobs: Job[] = (await prompts(ctx, b.prompt)).map((ids, i) => {
      checkPrompt(ctx, ids);
      const options = samplingOptions(b, maxTokens, nProbs, ctx);
      if (stream && b.return_progress) {
        options.onPromptProgress = (p) =>
          sse?.send({
            index: i,
            content: "",
            tokens: [],
            stop: false,
            id_slot: p.slot,
            tokens_predicted: 0,
            tokens_evaluated: p.total,
            prompt_progress: progressJson(p),
          });
      }
      return { promptIds: ids, options };
    });
    const ac = abortOnDisconnect(reply);
    const reqs = submitAll(ctx, jobs, ac.signal);
    const fields = b.response_fields ?? [];
    const pick = (res: Record<string, unknown>) => (fields.length > 0 ? pickFields(res, fields) : res);
    if (!stream) {
      const outs = await collectAll(reqs, ac.signal);
      const results = outs.map((o, i) =>
        pick(
          completionResult(ctx, i, reqs[i]!, o.text, o.tokens, {
            stream,
            returnTokens: b.return_tokens ?? false,
            nProbs,
            hasNewLine: o.text.includes("\n"),
          }),
        ),
      );
      return results.length === 1 ? results[0] : results;
    }
    reply.hijack();
    sse = new SseStream(reply.raw);
    const out = sse;
    await Promise.all(
      reqs.map(async (r, i) => {
        let predicted = 0;
        let newLine = false;
        try {
          for await (const t of r) {
            if (t.id >= 0) predicted++;
            if (t.text.includes("\n")) newLine = true;
            out.send({
              index: i,
              content: t.text,
              tokens: t.id >= 0 ? [t.id] : [],
              stop: false,
              id_slot: r.slot,
              tokens_predicted: predicted,
              tokens_evaluated: r.promptIds.length,
              ...(nProbs > 0 ? { completion_probabilities: probsJson(ctx, [t]) } : {}),
            });
          }
          const cut = cutOff(r, ac.signal);
          out.send(
            cut ? cut.body() : pick(completionResult(ctx, i, r, "", [], { stream, nProbs, hasNewLine: newLine })),
          );
        } catch (e) {
          out.send(new ApiError(500, "server_error", e instanceof Error ? e.message : String(e)).body());
        }
      }),
    );
    out.end();
  };

  // llama.cpp: /completions is the native endpoint too (OpenAI's is /v1/completions)
  for (const p of ["/completion", "/completions"]) app.post(p, completion);

  app.post("/tokenize", async (req) => {
    const ctx = getCtx();
    const b = parseBody(tokenizeBody, req.body);
    const tok = ctx.model.tokenizer;
    const ids = await ctx.tokens.tokenize(b.content, {
      addSpecial: b.add_special ?? false,
      parseSpecial: b.parse_special ?? true,
    });
    if (!b.with_pieces) return { tokens: ids };
    return {
      tokens: ids.map((id) => {
        const bytes = tok.tokenToPiece(id, { special: true });
        const text = new TextDecoder("utf-8", { fatal: false }).decode(bytes);
        const valid = new TextEncoder().encode(text).length === bytes.length && !text.includes("\uFFFD");
        return { id, piece: valid ? text : [...bytes] };
      }),
    };
  });

  app.post("/detokenize", async (req) => {
    const ctx = getCtx();
    const b = parseBody(detokenizeBody, req.body);
    const tok = ctx.model.tokenizer;
    const ids = b.tokens ?? [];
    const bad = ids.find((t) => t >= ctx.model.config.n_vocab);
    if (bad !== undefined)
      throw new ApiError(
        400,
        "invalid_request_error",
        `token id ${bad} is outside the vocabulary [0, ${ctx.model.config.n_vocab})`,
        {
          param: "tokens",
        },
      );
    return { content: tok.detokenize(ids, { unparseSpecial: true, stripLeadingSpace: false }) };
  });

  app.get("/props", async () => {
    const ctx = getCtx();
    const m = ctx.model;
    return {
      default_generation_settings: { params: paramsJson(ctx, undefined, false, true), n_ctx: ctx.scheduler.nCtx },
      total_slots: ctx.scheduler.nSlots,
      model_alias: ctx.alias,
      model_ftype: modelMeta(ctx).ftype,
      model_path: ctx.modelPath,
      modalities: { vision: false, video: false, audio: false },
      endpoint_slots: ctx.endpoints.slots,
      endpoint_props: false,
      endpoint_metrics: ctx.endpoints.metrics,
      chat_template: ctx.template.source,
      chat_template_is_fallback: ctx.template.isFallback,
      ...(ctx.template.isFallback
        ? {
            chat_template_note:
              "the model has no chat template (tokenizer.chat_template); using ChatML, llama.cpp's fallback",
          }
        : {}),
      bos_token: m.tokenizer.bosId === undefined ? "" : m.tokenizer.tokenText(m.tokenizer.bosId),
      eos_token: m.tokenizer.eosId === undefined ? "" : m.tokenizer.tokenText(m.tokenizer.eosId),
      build_info: ctx.build,
      is_sleeping: false,
      backend: { name: m.backend.name, threads: m.backend.threads },
      sparse: { mode: m.sparse, threshold: m.threshold, ffn_activation: m.config.ffn.activation },
    };
  });

  app.get("/slots", async (req) => {
    const ctx = getCtx();
    if (!ctx.endpoints.slots) {
      throw new ApiError(
        501,
        "not_supported_error",
        "This server does not support slots endpoint. Start it with `--slots`",
      );
    }
    const slots = ctx.scheduler.slots();
    const q = req.query as Record<string, string | undefined>;
    if ((q.fail_on_no_slot === "1" || q.fail_on_no_slot === "true") && slots.every((s) => s.busy)) {
      throw new ApiError(503, "unavailable_error", "no slot available");
    }
    return slots.map((s) => slotJson(ctx, s));
  });
}
