/** llama.cpp's own API: `/completion`, `/tokenize`, `/detokenize`, `/props`, `/slots`. */
import type { BatchRequest, BatchRequestOptions, BatchToken, SlotInfo, StopReason } from "@powerinfer/core";
import type { FastifyInstance, FastifyReply } from "fastify";
import {
  abortOnDisconnect,
  checkPrompt,
  checkSlot,
  type Job,
  type ServerContext,
  SseStream,
  samplingOptions,
  submitAll,
  timingsJson,
  tokenPiece,
} from "./context.js";
import { ApiError } from "./errors.js";
import { detokenizeBody, llamaCompletionBody, parseBody, tokenizeBody } from "./schemas.js";

/** llama.cpp's `stop_type`. */
function stopType(r: StopReason | undefined): "eos" | "limit" | "word" | "none" {
  if (r === "eos") return "eos";
  if (r === "length" || r === "context") return "limit";
  if (r === "stop") return "word";
  return "none";
}

/** The `params` object of a slot / generation settings, in llama.cpp's names. */
export function paramsJson(o: BatchRequestOptions | undefined, stream = false) {
  return {
    n_predict: o?.maxTokens ?? -1,
    seed: o?.seed ?? 0xffffffff,
    temperature: o?.temperature ?? 0.8,
    top_k: o?.topK ?? 40,
    top_p: o?.topP ?? 0.95,
    min_p: o?.minP ?? 0.05,
    repeat_last_n: o?.penaltyLastN ?? 64,
    repeat_penalty: o?.repeatPenalty ?? 1,
    presence_penalty: o?.presencePenalty ?? 0,
    frequency_penalty: o?.frequencyPenalty ?? 0,
    stop: o?.stop ?? [],
    max_tokens: o?.maxTokens ?? -1,
    ignore_eos: o?.ignoreEos ?? false,
    stream,
    n_probs: o?.nProbs ?? 0,
    samplers: ["penalties", "top_k", "top_p", "min_p", "temperature"],
  };
}

/** One slot in llama.cpp's `/slots` shape. */
export function slotJson(s: SlotInfo) {
  return {
    id: s.id,
    id_task: s.requestId,
    n_ctx: s.nCtx,
    speculative: false,
    is_processing: s.busy,
    state: s.state,
    n_past: s.nPast,
    n_prompt_tokens: s.promptTokens,
    params: paramsJson(s.options),
    next_token: {
      has_next_token: s.busy,
      has_new_line: false,
      n_remain: s.remaining,
      n_decoded: s.generatedTokens,
    },
  };
}

/** llama.cpp's prompt forms: a string, token ids mixed with strings, or several of those. */
function prompts(ctx: ServerContext, p: string | (string | number | (string | number)[])[]): number[][] {
  const tok = ctx.model.tokenizer;
  const one = (q: string | (string | number)[]): number[] => {
    if (typeof q === "string") return tok.tokenize(q, { addSpecial: true, parseSpecial: true });
    const ids: number[] = [];
    q.forEach((x, i) => {
      if (typeof x === "number") ids.push(x);
      else ids.push(...tok.tokenize(x, { addSpecial: i === 0, parseSpecial: true }));
    });
    return ids;
  };
  if (typeof p === "string") return [one(p)];
  // only strings, or any nested array: several prompts; otherwise one mixed prompt
  if (p.every((x) => typeof x === "string") || p.some((x) => Array.isArray(x))) {
    return p.map((x) => one(typeof x === "number" ? [x] : x));
  }
  return [one(p as (string | number)[])];
}

function probsJson(ctx: ServerContext, ts: BatchToken[]) {
  return ts
    .filter((t) => t.id >= 0 && t.logprob !== undefined)
    .map((t) => ({
      id: t.id,
      ...tokenPiece(ctx, t.id),
      logprob: t.logprob!,
      top_logprobs: (t.top ?? []).map((x) => ({ id: x.id, ...tokenPiece(ctx, x.id), logprob: x.logprob })),
    }));
}

export function registerLlamaCpp(app: FastifyInstance, getCtx: () => ServerContext): void {
  const completion = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(llamaCompletionBody, req.body);
    checkSlot(ctx, b.id_slot);
    const nProbs = b.n_probs ?? 0;
    const jobs: Job[] = prompts(ctx, b.prompt).map((ids) => {
      checkPrompt(ctx, ids);
      return { promptIds: ids, options: samplingOptions(b, b.n_predict ?? -1, nProbs, ctx.scheduler.nCtx) };
    });
    const stream = b.stream ?? false;
    const ac = abortOnDisconnect(reply);
    const reqs = submitAll(ctx, jobs, ac.signal);
    const final = (i: number, r: BatchRequest, content: string, tokens: BatchToken[]) => ({
      index: i,
      content,
      tokens: b.return_tokens || stream ? tokens.filter((t) => t.id >= 0).map((t) => t.id) : [],
      id_slot: r.slot,
      stop: true,
      model: ctx.alias,
      tokens_predicted: r.timings.generatedTokens,
      tokens_evaluated: r.promptIds.length,
      generation_settings: { n_ctx: ctx.scheduler.nCtx, model: ctx.alias, ...paramsJson(r.options, stream) },
      prompt: ctx.model.tokenizer.detokenize([...r.promptIds], { unparseSpecial: true }),
      has_new_line: content.includes("\n"),
      truncated: false,
      stop_type: stopType(r.stopReason),
      stopping_word: r.stoppingWord ?? "",
      tokens_cached: r.cachedTokens,
      timings: timingsJson(r.timings),
      ...(nProbs > 0 ? { completion_probabilities: probsJson(ctx, tokens) } : {}),
    });
    if (!stream) {
      const outs = await Promise.all(reqs.map((r) => r.collect()));
      const results = outs.map((o, i) => final(i, reqs[i]!, o.text, o.tokens));
      return results.length === 1 ? results[0] : results;
    }
    reply.hijack();
    const sse = new SseStream(reply.raw);
    await Promise.all(
      reqs.map(async (r, i) => {
        let predicted = 0;
        try {
          for await (const t of r) {
            if (t.id >= 0) predicted++;
            sse.send({
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
          sse.send(final(i, r, "", []));
        } catch (e) {
          sse.send(new ApiError(500, "server_error", e instanceof Error ? e.message : String(e)).body());
        }
      }),
    );
    sse.end();
  };

  for (const p of ["/completion"]) app.post(p, completion);

  app.post("/tokenize", async (req) => {
    const ctx = getCtx();
    const b = parseBody(tokenizeBody, req.body);
    const tok = ctx.model.tokenizer;
    const ids = tok.tokenize(b.content, { addSpecial: b.add_special ?? false, parseSpecial: b.parse_special ?? true });
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
      default_generation_settings: {
        id: 0,
        id_task: -1,
        n_ctx: ctx.scheduler.nCtx,
        speculative: false,
        is_processing: false,
        params: paramsJson(undefined),
      },
      total_slots: ctx.scheduler.nSlots,
      model_path: ctx.modelPath,
      model_alias: ctx.alias,
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
      modalities: { vision: false, audio: false },
      backend: { name: m.backend.name, threads: m.backend.threads },
      sparse: { mode: m.sparse, threshold: m.threshold, ffn_activation: m.config.ffn.activation },
      build_info: "powerinfer-ts 0.1.0",
    };
  });

  app.get("/slots", async (req) => {
    const ctx = getCtx();
    const slots = ctx.scheduler.slots();
    const q = req.query as Record<string, string | undefined>;
    if ((q.fail_on_no_slot === "1" || q.fail_on_no_slot === "true") && slots.every((s) => s.busy)) {
      throw new ApiError(503, "unavailable_error", "no slot available");
    }
    return slots.map(slotJson);
  });
}
