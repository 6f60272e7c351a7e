/** The OpenAI API: `/v1/completions`, `/v1/chat/completions`, `/v1/models` (and their llama.cpp aliases). */
import { randomBytes } from "node:crypto";
import type { BatchRequest, BatchToken, ChatMessage, PromptProgress } from "@powerinfer/engine";
import type { FastifyInstance, FastifyReply } from "fastify";
import {
  abortOnDisconnect,
  checkPrompt,
  checkSlot,
  collectAll,
  finishReason,
  cutOff,
  type Job,
  probsJson,
  type ServerContext,
  SseStream,
  samplingOptions,
  submitAll,
  timingsJson,
  tokenizePrompt,
  tokenPiece,
  usageJson,
} from "./context.js";
import { ApiError } from "./errors.js";
import { completionResult, progressJson, promptIds } from "./llamacpp.js";
import { modelMeta } from "./model-meta.js";
import { type ChatBody, type CompletionsBody, chatBody, completionsBody, parseBody } from "./schemas.js";
import { addToolSystem, assistantToolText, toolAnswer, toolDelta, toolPlan } from "./structured.js";
import { detectToolDialect, type ToolDialect, templateToolCalls } from "./tool-dialects.js";

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
    usageChunk?(usage: unknown, reqs: BatchRequest[]): unknown;
    /** With `return_progress`: a chunk reporting how far choice `index`'s prompt has been evaluated. */
    progress?(index: number, p: PromptProgress): unknown;
  },
  promptTokens: number,
): Promise<{ reqs: BatchRequest[]; outputs: { text: string; tokens: BatchToken[] }[] } | undefined> {
  const ac = abortOnDisconnect(reply);
  let sse: SseStream | undefined;
  const progress = chunks.progress;
  if (stream && progress) {
    jobs.forEach((j, i) => {
      j.options = { ...j.options, onPromptProgress: (p) => sse?.send(progress(i, p)) };
    });
  }
  const reqs = submitAll(ctx, jobs, ac.signal);
  if (!stream) {
    return { reqs, outputs: await collectAll(reqs, ac.signal) };
  }
  reply.hijack();
  sse = new SseStream(reply.raw);
  const out = sse;
  let left = reqs.length;
  await Promise.all(
    reqs.map(async (r, i) => {
      const first = chunks.first?.(i);
      if (first) out.send(first);
      try {
        for await (const t of r) {
          const c = chunks.token(i, t);
          if (c) out.send(c);
        }
      } catch (e) {
        out.send(new ApiError(500, "server_error", e instanceof Error ? e.message : String(e)).body());
      }
      left--;
      const cut = cutOff(r, ac.signal);
      // cut off by a shutdown: an error event instead of a finishing chunk
      out.send(cut ? cut.body() : chunks.finish(i, r, left === 0 ? usageJson(reqs, promptTokens) : undefined));
    }),
  );
  if (chunks.usageChunk) out.send(chunks.usageChunk(usageJson(reqs, promptTokens), reqs));
  out.done();
  return undefined;
}

async function promptJobs(ctx: ServerContext, b: CompletionsBody): Promise<{ jobs: Job[]; texts: string[] }> {
  const tok = ctx.model.tokenizer;
  const p = b.prompt;
  const prompts: (string | number[] | { prompt_string: string | (string | number)[]; multimodal_data?: unknown })[] =
    typeof p === "string" || !Array.isArray(p)
      ? [p]
      : p.every((x) => typeof x === "string")
        ? (p as string[])
        : p.every((x) => typeof x === "number")
          ? [p as number[]]
          : (p as number[][]);
  // llama.cpp reads n_predict first, max_tokens is its alias
  const maxTokens = b.n_predict ?? b.max_tokens;
  const jobs: Job[] = [];
  const texts: string[] = [];
  for (const q of prompts) {
    const ids = Array.isArray(q) && q.every((x) => typeof x === "number") ? (q as number[]) : await promptIds(ctx, q);
    checkPrompt(ctx, ids);
    const base = { promptIds: ids, options: samplingOptions(b, maxTokens, b.logprobs ?? 0, ctx) };
    const text =
      typeof q === "string"
        ? q
        : !Array.isArray(q) && typeof q.prompt_string === "string"
          ? q.prompt_string
          : tok.detokenize(ids);
    for (const j of fanOut(base, b.n ?? 1)) {
      jobs.push(j);
      texts.push(text);
    }
  }
  return { jobs, texts };
}

/** The text of a chat message's content (text parts joined by "\n", as llama.cpp). @throws ApiError 400 for other part types. */
function messageText(content: ChatBody["messages"][number]["content"], i: number): string {
  if (content === undefined || content === null) return "";
  if (typeof content === "string") return content;
  return content
    .map((part, j) => {
      if (part.type !== "text") {
        throw new ApiError(
          400,
          "invalid_request_error",
          `messages[${i}].content[${j}]: only text parts are supported, got type "${part.type}"`,
          { param: `messages[${i}].content[${j}].type` },
        );
      }
      if (typeof part.text !== "string") {
        throw new ApiError(
          400,
          "invalid_request_error",
          `messages[${i}].content[${j}]: a text part needs "text" (a string)`,
          { param: `messages[${i}].content[${j}].text` },
        );
      }
      return part.text;
    })
    .join("\n");
}

/**
 * The chat prompt of a request, as llama.cpp builds it: the template over the messages, ending with the
 * assistant's turn opening (`add_generation_prompt`, default true); a final assistant message is continued
 * instead (prefill: its text ends the prompt, no end of turn), as is the last message with
 * `continue_final_message`.
 * @throws ApiError 400 for two assistant messages at the end, or both add_generation_prompt and
 *   continue_final_message set.
 */
function chatPrompt(ctx: ServerContext, b: ChatBody, plan: ReturnType<typeof toolPlan>): string {
  // a template with its own tool-call format gets calls and tool results as fields (as llama.cpp passes
  // them); the generic format writes calls into the assistant's text
  const native = toolDialectOf(ctx) !== "generic";
  const messages: ChatMessage[] = b.messages.map((m, i) => {
    const text = messageText(m.content, i);
    if (!m.tool_calls?.length) {
      return {
        role: m.role,
        content: text,
        ...(native && m.tool_call_id ? { tool_call_id: m.tool_call_id } : {}),
        ...(native && m.name ? { name: m.name } : {}),
      };
    }
    return native
      ? { role: m.role, content: text, tool_calls: templateToolCalls(m.tool_calls) }
      : { role: m.role, content: assistantToolText(m.tool_calls, text) };
  });
  if (plan?.system) addToolSystem(messages, plan.system);
  const extra = plan && plan.dialect !== "generic" ? { tools: plan.tools } : {};
  let addGenerationPrompt = b.add_generation_prompt ?? true;
  let continueFinal = b.continue_final_message ?? false;
  const n = messages.length;
  if (!continueFinal && messages[n - 1]?.role === "assistant") {
    if (messages[n - 2]?.role === "assistant") {
      throw new ApiError(
        400,
        "invalid_request_error",
        "Cannot have 2 or more assistant messages at the end of the list.",
        { param: "messages" },
      );
    }
    continueFinal = true;
    addGenerationPrompt = false;
  }
  if (continueFinal && addGenerationPrompt) {
    throw new ApiError(
      400,
      "invalid_request_error",
      "Cannot set both add_generation_prompt and continue_final_message to true.",
      { param: "add_generation_prompt" },
    );
  }
  if (!continueFinal) return ctx.template.apply(messages, addGenerationPrompt, extra);
  // render with a marker in place of the final message's text, cut there (dropping its end of turn), and
  // append the text: whatever the template does around a message, the prompt ends inside it
  const last = messages[n - 1]!;
  const marker = `\u0000powerinfer-continue-${Math.random().toString(36).slice(2)}\u0000`;
  const rendered = ctx.template.apply([...messages.slice(0, -1), { ...last, content: marker }], false, extra);
  const at = rendered.lastIndexOf(marker);
  return at >= 0 ? rendered.slice(0, at) + last.content : rendered + last.content;
}

/** The chat template's tool-call format (tool-dialects.ts). */
function toolDialectOf(ctx: ServerContext): ToolDialect {
  return ctx.template.isFallback ? "generic" : detectToolDialect(ctx.template.source);
}

/** The tool plan of a chat request for the server's template. */
function planOf(ctx: ServerContext, b: ChatBody) {
  return toolPlan(b, toolDialectOf(ctx), /\btools\b/.test(ctx.template.source));
}

/** llama.cpp's `verbose`: the native `/completion` result of a request as `__verbose` beside OpenAI's shape. */
function verboseOf(ctx: ServerContext, on: boolean | null | undefined, stream: boolean, nProbs: number) {
  return (r: BatchRequest, text: string, tokens: BatchToken[]) =>
    on
      ? { __verbose: completionResult(ctx, 0, r, text, tokens, { stream, nProbs, hasNewLine: text.includes("\n") }) }
      : {};
}

export function registerOpenAi(app: FastifyInstance, getCtx: () => ServerContext): void {
  const completions = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(completionsBody, req.body);
    checkSlot(ctx, b.id_slot);
    const { jobs, texts } = await promptJobs(ctx, b);
    const id = newId("cmpl");
    const created = now();
    const promptTokens = [...new Set(jobs.map((j) => j.promptIds))].reduce((s, p) => s + p.length, 0);
    const base = { id, object: "text_completion", created, model: ctx.alias, system_fingerprint: ctx.build };
    const echo = b.echo ?? false;
    const stream = b.stream ?? false;
    const verbose = verboseOf(ctx, b.verbose, stream, b.logprobs ?? 0);
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
          ...(usage ? { usage, timings: timingsJson(r) } : {}),
          ...verbose(r, "", []),
        }),
        usageChunk: b.stream_options?.include_usage
          ? (usage, reqs) => ({ ...base, choices: [], usage, timings: timingsJson(reqs[0]!) })
          : undefined,
        progress: b.return_progress
          ? (i, p) => ({
              ...base,
              choices: [{ index: i, text: "", logprobs: null, finish_reason: null }],
              prompt_progress: progressJson(p),
            })
          : undefined,
      },
      promptTokens,
    );
    if (!res) return;
    return {
      ...base,
      ...verbose(res.reqs[0]!, res.outputs[0]!.text, res.outputs[0]!.tokens),
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
      timings: timingsJson(res.reqs[0]!),
    };
  };

  const chat = async (req: { body: unknown }, reply: FastifyReply) => {
    const ctx = getCtx();
    const b = parseBody(chatBody, req.body);
    checkSlot(ctx, b.id_slot);
    const plan = planOf(ctx, b);
    const prompt = chatPrompt(ctx, b, plan);
    const ids = await tokenizePrompt(ctx, prompt, { addSpecial: true, parseSpecial: true });
    checkPrompt(ctx, ids);
    const wantLogprobs = b.logprobs ?? false;
    // as llama.cpp and OpenAI: top_logprobs alone is an error, not silently ignored
    if (!wantLogprobs && b.top_logprobs !== undefined && b.top_logprobs !== null)
      throw new ApiError(400, "invalid_request_error", "top_logprobs requires logprobs to be set to true", {
        param: "top_logprobs",
      });
    const stream = b.stream ?? false;
    const options = samplingOptions(
      b,
      // llama.cpp: n_predict, else its aliases
      b.n_predict ?? b.max_completion_tokens ?? b.max_tokens,
      wantLogprobs ? Math.max(1, b.top_logprobs ?? 0) : 0,
      ctx,
    );
    // ChatML through text (the model has no <|im_end|> token): stop at the end-of-turn marker
    if (ctx.template.isFallback) options.stop = [...(options.stop ?? []), "<|im_end|>"];
    // tools: the answer is a JSON object in llama.cpp's generic format, streamed as one delta at the end
    if (plan) options.grammar = plan.grammar;
    const toolTexts: string[] = [];
    const topN = b.top_logprobs ?? 0;
    const logprobsOf = (ts: BatchToken[]) => (wantLogprobs ? { content: probsJson(ctx, ts, topN) } : null);
    const id = newId("chatcmpl");
    const created = now();
    const base = { id, object: "chat.completion.chunk", created, model: ctx.alias, system_fingerprint: ctx.build };
    const verbose = verboseOf(ctx, b.verbose, stream, options.nProbs ?? 0);
    // the opening chunk: the role, and no content yet (null, as OpenAI and llama.cpp)
    const opening = (i: number) => ({
      ...base,
      choices: [{ index: i, delta: { role: "assistant", content: null }, logprobs: null, finish_reason: null }],
    });
    const res = await runJobs(
      ctx,
      reply,
      fanOut({ promptIds: ids, options }, b.n ?? 1),
      stream,
      {
        first: opening,
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
              ? {
                  index: i,
                  ...toolDelta(toolTexts[i] ?? "", finishReason(r.stopReason), plan.dialect),
                  logprobs: null,
                }
              : { index: i, delta: {}, logprobs: null, finish_reason: finishReason(r.stopReason) },
          ],
          ...(usage ? { usage, timings: timingsJson(r) } : {}),
          ...verbose(r, "", []),
        }),
        usageChunk: b.stream_options?.include_usage
          ? (usage, reqs) => ({ ...base, choices: [], usage, timings: timingsJson(reqs[0]!) })
          : undefined,
        progress: b.return_progress ? (i, p) => ({ ...opening(i), prompt_progress: progressJson(p) }) : undefined,
      },
      ids.length,
    );
    if (!res) return;
    return {
      id,
      object: "chat.completion",
      created,
      model: ctx.alias,
      system_fingerprint: ctx.build,
      ...verbose(res.reqs[0]!, res.outputs[0]!.text, res.outputs[0]!.tokens),
      choices: res.outputs.map((o, i) => {
        const finish = finishReason(res.reqs[i]!.stopReason);
        const a = plan
          ? toolAnswer(o.text, finish, plan.dialect)
          : { message: { content: o.text }, finish_reason: finish };
        return {
          index: i,
          message: { role: "assistant", ...a.message },
          logprobs: logprobsOf(o.tokens),
          finish_reason: a.finish_reason,
        };
      }),
      usage: usageJson(res.reqs, ids.length),
      timings: timingsJson(res.reqs[0]!),
    };
  };

  /** llama.cpp's `/chat/completions/input_tokens`: the prompt tokens a chat request would have. */
  const inputTokens = async (req: { body: unknown }) => {
    const ctx = getCtx();
    const b = parseBody(chatBody, req.body);
    const ids = await ctx.tokens.tokenize(chatPrompt(ctx, b, planOf(ctx, b)), { addSpecial: true, parseSpecial: true });
    return { input_tokens: ids.length, object: "response.input_tokens" };
  };

  /** llama.cpp's `/apply-template`: the prompt a chat request would have, as text. */
  const applyTemplate = async (req: { body: unknown }) => {
    const ctx = getCtx();
    const b = parseBody(chatBody, req.body);
    return { prompt: chatPrompt(ctx, b, planOf(ctx, b)) };
  };

  const models = async () => {
    const ctx = getCtx();
    return {
      object: "list",
      data: [
        {
          id: ctx.alias,
          object: "model",
          created: ctx.created,
          owned_by: "powerinfer-ts",
          // llama.cpp's meta (vocab_type, n_vocab, n_ctx, n_ctx_train, n_embd, n_params, size, ftype) and ours
          meta: { ...modelMeta(ctx), sparse: ctx.model.sparse },
        },
      ],
    };
  };

  // /completions (no /v1) is llama.cpp's native endpoint, registered with /completion
  app.post("/v1/completions", completions);
  for (const p of ["/v1/chat/completions", "/chat/completions"]) app.post(p, chat);
  for (const p of ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"]) app.post(p, inputTokens);
  for (const p of ["/v1/models", "/models"]) app.get(p, models);
  app.post("/apply-template", applyTemplate);
}
