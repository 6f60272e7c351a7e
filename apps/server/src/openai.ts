/** The OpenAI API: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (and their llama.cpp aliases). */
import { randomBytes } from "node:crypto";
import type { BatchRequest, BatchToken, ChatMessage } from "@powerinfer/core";
import type { FastifyInstance, FastifyReply } from "fastify";
import {
  abortOnDisconnect,
  chatLogprob,
  checkPrompt,
  checkSlot,
  finishReason,
  type Job,
  type ServerContext,
  SseStream,
  samplingOptions,
  submitAll,
  timingsJson,
  tokenPiece,
  usageJson,
} from "./context.js";
import { ApiError } from "./errors.js";
import { type ChatBody, type CompletionsBody, chatBody, completionsBody, parseBody } from "./schemas.js";
import { addToolSystem, assistantToolText, toolAnswer, toolDelta, toolPlan } from "./structured.js";

const FINGERPRINT = "powerinfer-ts-0.1.0";

const newId = (prefix: string) => `${prefix}-${randomBytes(12).toString("hex")}`;
const now = () => Math.floor(Date.now() / 1000);

/** `n` choices: choice i gets seed + i when a seed is given, so choices differ but stay reproducible. */
function fanOut(base: Job, n: number): Job[] {
  return Array.from({ length: n }, (_, i) => ({
    promptIds: base.promptIds,
    options: { ...base.options, seed: base.options.seed === undefined ? undefined : (base.options.seed + i) >>> 0 },
  }));
}

/** Legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset. */
function legacyLogprobs(ctx: ServerContext, tokens: BatchToken[], start: number) {
  let offset = start;
  const out = {
    tokens: [] as string[],
    token_logprobs: [] as number[],
    top_logprobs: [] as Record<string, number>[],
    text_offset: [] as number[],
  };
  for (const t of tokens) {
    if (t.id < 0 || t.logprob === undefined) continue;
    const piece = tokenPiece(ctx, t.id).token;
    out.tokens.push(piece);
    out.token_logprobs.push(t.logprob);
    out.top_logprobs.push(Object.fromEntries((t.top ?? []).map((x) => [tokenPiece(ctx, x.id).token, x.logprob])));
    out.text_offset.push(offset);
    offset += piece.length;
  }
  return out;
}

/** Runs the jobs; streams chunks made by `chunk`, or collects the texts. */
async function runJobs(
  ctx: ServerContext,
  reply: FastifyReply,
  jobs: Job[],
  stream: boolean,
  chunks: {
    /** A streamed chunk for choice `index`. */
    token(index: number, t: BatchToken): unknown | undefined;
    first?(index: number): unknown;
    /** The finishing chunk of choice `index` (`usage` set on the last one to finish). */
    finish(index: number, r: BatchRequest, usage?: unknown): unknown;
    /** The extra usage-only chunk (stream_options.include_usage). */
    usageChunk?(usage: unknown): unknown;
  },
  promptTokens: number,
): Promise<{ reqs: BatchRequest[]; outputs: { text: string; tokens: BatchToken[] }[] } | undefined> {
  const ac = abortOnDisconnect(reply);
  const reqs = submitAll(ctx, jobs, ac.signal);
  if (!stream) {
    const outputs = await Promise.all(reqs.map((r) => r.collect()));
    return { reqs, outputs };
  }
  reply.hijack();
  const sse = new SseStream(reply.raw);
  let left = reqs.length;
  await Promise.all(
    reqs.map(async (r, i) => {
      const first = chunks.first?.(i);
      if (first) sse.send(first);
      try {
        for await (const t of r) {
          const c = chunks.token(i, t);
          if (c) sse.send(c);
        }
      } catch (e) {
        sse.send(new ApiError(500, "server_error", e instanceof Error ? e.message : String(e)).body());
      }
      left--;
      sse.send(chunks.finish(i, r, left === 0 ? usageJson(reqs, promptTokens) : undefined));
    }),
  );
  if (chunks.usageChunk) sse.send(chunks.usageChunk(usageJson(reqs, promptTokens)));
  sse.done();
  return undefined;
}

function promptJobs(ctx: ServerContext, b: CompletionsBody): { jobs: Job[]; texts: string[] } {
  const tok = ctx.model.tokenizer;
  const p = b.prompt;
  const prompts: (string | number[])[] =
    typeof p === "string"
      ? [p]
      : p.every((x) => typeof x === "string")
        ? (p as string[])
        : p.every((x) => typeof x === "number")
          ? [p as number[]]
          : (p as number[][]);
  const maxTokens = b.max_tokens ?? b.n_predict ?? -1;
  const jobs: Job[] = [];
  const texts: string[] = [];
  for (const q of prompts) {
    const ids = typeof q === "string" ? tok.tokenize(q, { addSpecial: true, parseSpecial: true }) : q;
    checkPrompt(ctx, ids);
    const base = { promptIds: ids, options: samplingOptions(b, maxTokens, b.logprobs ?? 0, ctx.scheduler.nCtx) };
    for (const j of fanOut(base, b.n ?? 1)) {
      jobs.push(j);
      texts.push(typeof q === "string" ? q : tok.detokenize(q));
    }
  }
  return { jobs, texts };
}

/** The text of a chat message's content (text parts joined). @throws ApiError 400 for other part types. */
function messageText(content: ChatBody["messages"][number]["content"], i: number): string {
  if (content === undefined || content === null) return "";
  if (typeof content === "string") return content;
  return content
    .map((part, j) => {
      if (part.type !== "text" || typeof part.text !== "string") {
        throw new ApiError(
          400,
          "invalid_request_error",
          `messages[${i}].content[${j}]: only text parts are supported, got type "${part.type}"`,
          { param: `messages[${i}].content[${j}].type` },
        );
      }
      return part.text;
    })
    .join("");
}

export function registerOpenAi(app: FastifyInstance, getCtx: () => ServerContext): void {
  const completions = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(completionsBody, req.body);
    checkSlot(ctx, b.id_slot);
    const { jobs, texts } = promptJobs(ctx, b);
    const id = newId("cmpl");
    const created = now();
    const promptTokens = [...new Set(jobs.map((j) => j.promptIds))].reduce((s, p) => s + p.length, 0);
    const base = { id, object: "text_completion", created, model: ctx.alias, system_fingerprint: FINGERPRINT };
    const echo = b.echo ?? false;
    const res = await runJobs(
      ctx,
      reply,
      jobs,
      b.stream ?? false,
      {
        first: (i) =>
          echo ? { ...base, choices: [{ index: i, text: texts[i], logprobs: null, finish_reason: null }] } : undefined,
        token: (i, t) =>
          t.text || t.logprob !== undefined
            ? {
                ...base,
                choices: [
                  {
                    index: i,
                    text: t.text,
                    logprobs: t.logprob !== undefined ? legacyLogprobs(ctx, [t], 0) : null,
                    finish_reason: null,
                  },
                ],
              }
            : undefined,
        finish: (i, r, usage) => ({
          ...base,
          choices: [{ index: i, text: "", logprobs: null, finish_reason: finishReason(r.stopReason) }],
          ...(usage ? { usage, timings: timingsJson(r.timings) } : {}),
        }),
        usageChunk: b.stream_options?.include_usage ? (usage) => ({ ...base, choices: [], usage }) : undefined,
      },
      promptTokens,
    );
    if (!res) return;
    return {
      ...base,
      choices: res.outputs.map((o, i) => {
        const prefix = echo ? texts[i]! : "";
        return {
          index: i,
          text: prefix + o.text,
          logprobs: (b.logprobs ?? 0) > 0 ? legacyLogprobs(ctx, o.tokens, prefix.length) : null,
          finish_reason: finishReason(res.reqs[i]!.stopReason),
        };
      }),
      usage: usageJson(res.reqs, promptTokens),
      timings: timingsJson(res.reqs[0]!.timings),
    };
  };

  const chat = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(chatBody, req.body);
    checkSlot(ctx, b.id_slot);
    const plan = toolPlan(b);
    const messages: ChatMessage[] = b.messages.map((m, i) => ({
      role: m.role,
      content: m.tool_calls?.length
        ? assistantToolText(m.tool_calls, messageText(m.content, i))
        : messageText(m.content, i),
    }));
    if (plan) addToolSystem(messages, plan.system);
    const prompt = ctx.template.apply(messages, true);
    const ids = ctx.model.tokenizer.tokenize(prompt, { addSpecial: true, parseSpecial: true });
    checkPrompt(ctx, ids);
    const wantLogprobs = b.logprobs ?? false;
    const options = samplingOptions(
      b,
      b.max_completion_tokens ?? b.max_tokens ?? b.n_predict ?? -1,
      wantLogprobs ? Math.max(1, b.top_logprobs ?? 0) : 0,
      ctx.scheduler.nCtx,
    );
    // ChatML through text (the model has no <|im_end|> token): stop at the end-of-turn marker
    if (ctx.template.isFallback) options.stop = [...(options.stop ?? []), "<|im_end|>"];
    // tools: the answer is a JSON object in llama.cpp's generic format, streamed as one delta at the end
    if (plan) options.grammar = plan.grammar;
    const toolTexts: string[] = [];
    const topN = b.top_logprobs ?? 0;
    const logprobsOf = (ts: BatchToken[]) =>
      wantLogprobs
        ? {
            content: ts
              .filter((t) => t.id >= 0 && t.logprob !== undefined)
              .map((t) => chatLogprob(ctx, t.id, t.logprob!, (t.top ?? []).slice(0, topN))),
          }
        : null;
    const id = newId("chatcmpl");
    const created = now();
    const base = { id, object: "chat.completion.chunk", created, model: ctx.alias, system_fingerprint: FINGERPRINT };
    const res = await runJobs(
      ctx,
      reply,
      fanOut({ promptIds: ids, options }, b.n ?? 1),
      b.stream ?? false,
      {
        first: (i) => ({
          ...base,
          choices: [{ index: i, delta: { role: "assistant", content: "" }, logprobs: null, finish_reason: null }],
        }),
        token: (i, t) => {
          if (plan) {
            toolTexts[i] = (toolTexts[i] ?? "") + t.text;
            return undefined;
          }
          return t.text || (wantLogprobs && t.logprob !== undefined)
            ? {
                ...base,
                choices: [{ index: i, delta: { content: t.text }, logprobs: logprobsOf([t]), finish_reason: null }],
              }
            : undefined;
        },
        finish: (i, r, usage) => ({
          ...base,
          choices: [
            plan
              ? { index: i, ...toolDelta(toolTexts[i] ?? "", finishReason(r.stopReason)), logprobs: null }
              : { index: i, delta: {}, logprobs: null, finish_reason: finishReason(r.stopReason) },
          ],
          ...(usage ? { usage, timings: timingsJson(r.timings) } : {}),
        }),
        usageChunk: b.stream_options?.include_usage ? (usage) => ({ ...base, choices: [], usage }) : undefined,
      },
      ids.length,
    );
    if (!res) return;
    return {
      id,
      object: "chat.completion",
      created,
      model: ctx.alias,
      system_fingerprint: FINGERPRINT,
      choices: res.outputs.map((o, i) => {
        const finish = finishReason(res.reqs[i]!.stopReason);
        const a = plan ? toolAnswer(o.text, finish) : { message: { content: o.text }, finish_reason: finish };
        return {
          index: i,
          message: { role: "assistant", ...a.message },
          logprobs: logprobsOf(o.tokens),
          finish_reason: a.finish_reason,
        };
      }),
      usage: usageJson(res.reqs, ids.length),
      timings: timingsJson(res.reqs[0]!.timings),
    };
  };

  const models = async () => {
    const ctx = getCtx();
    const c = ctx.model.config;
    return {
      object: "list",
      data: [
        {
          id: ctx.alias,
          object: "model",
          created: ctx.created,
          owned_by: "powerinfer-ts",
          meta: {
            n_vocab: c.n_vocab,
            n_ctx_train: c.n_ctx_train,
            n_embd: c.n_embd,
            size: ctx.model.weightBytes,
            sparse: ctx.model.sparse,
          },
        },
      ],
    };
  };

  for (const p of ["/v1/completions", "/completions"]) app.post(p, completions);
  for (const p of ["/v1/chat/completions", "/chat/completions"]) app.post(p, chat);
  for (const p of ["/v1/models", "/models"]) app.get(p, models);
}
