/**
 * The HTTP server driven by the official `openai` client (and plain fetch for llama.cpp's endpoints and for
 * malformed requests) on stories260K, listening on 127.0.0.1 only.
 */
import { readFileSync } from "node:fs";
import { connect } from "node:net";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { Model } from "@powerinfer/engine";
import OpenAI from "openai";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createServer, type PowerinferServer } from "../src/index.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const stories = join(models, "stories260K.gguf");
const reference = JSON.parse(readFileSync(join(models, "reference", "stories260K.greedy32.json"), "utf8")) as {
  results: { prompt: string; prompt_token_ids: number[]; greedy_text: string; greedy_token_ids: number[] }[];
};
const probe = await cpuBackend.probe();
const MODEL = "stories260K.gguf";

/** 16 distinct prompts. */
const PROMPTS = [
  "Once upon a time",
  "Tim had a red ball",
  "The sun was hot",
  "Lily wanted to",
  "One day, a little",
  "The dog ran to",
  "Mom said that",
  "Sam and Sue",
  "There was a big tree",
  "The cat saw a bird",
  "Ben liked to",
  "In the park",
  "She looked at the sky",
  "The little boat",
  "A girl named Amy",
  "They went to the",
];

/** Parses Prometheus text into name{labels} → value. */
function parseMetrics(text: string): Map<string, number> {
  const m = new Map<string, number>();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const i = line.lastIndexOf(" ");
    m.set(line.slice(0, i), Number(line.slice(i + 1)));
  }
  return m;
}

async function waitFor(cond: () => Promise<boolean>, ms = 2000): Promise<void> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await cond()) return;
    await new Promise((r) => setTimeout(r, 10));
  }
  throw new Error("timed out waiting");
}

describe.skipIf(!probe.usable)(`the server (${probe.reason})`, () => {
  let backend: Backend;
  let model: Model;
  let server: PowerinferServer;
  let url: string;
  let client: OpenAI;

  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
    model = await Model.load(stories, { backend });
    server = createServer({ model, slots: 16, ctxSize: 16 * 128, metrics: true });
    url = await server.listen({ host: "127.0.0.1", port: 0 });
    client = new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
  });
  afterAll(async () => {
    await server?.close();
    model?.dispose();
    backend?.dispose();
  });

  const metrics = async () => parseMetrics(await (await fetch(`${url}/metrics`)).text());

  it("greedy completion gives llama.cpp's reference text", async () => {
    const ref = reference.results[0]!;
    const r = await client.completions.create({
      model: MODEL,
      prompt: ref.prompt,
      max_tokens: 32,
      temperature: 0,
    });
    expect(r.object).toBe("text_completion");
    expect(r.choices[0]!.text).toBe(ref.greedy_text);
    expect(r.choices[0]!.finish_reason).toBe("length");
    expect(r.usage).toEqual({
      prompt_tokens: 5,
      completion_tokens: 32,
      total_tokens: 37,
      prompt_tokens_details: { cached_tokens: 0 },
    });
  });

  it("a negative temperature is greedy, as in llama.cpp's server (not a 400)", async () => {
    const ref = reference.results[0]!;
    for (const path of ["/completion", "/v1/completions"]) {
      const text = async (temperature: number) => {
        const res = await fetch(`${url}${path}`, {
          method: "POST",
          body: JSON.stringify({ prompt: ref.prompt, n_predict: 8, max_tokens: 8, temperature, seed: 7 }),
        });
        expect(res.status, `${path} temperature ${temperature}`).toBe(200);
        const b = (await res.json()) as { content?: string; choices?: { text: string }[] };
        return b.content ?? b.choices?.[0]?.text;
      };
      const greedy = await text(0);
      expect(greedy, path).toBeTruthy();
      expect(ref.greedy_text.startsWith(greedy!), path).toBe(true);
      expect(await text(-1), path).toBe(greedy);
    }
  });

  it("logit_bias: OpenAI's {id: bias} and llama.cpp's [[id, false]] both move greedy decoding off the token", async () => {
    const ref = reference.results[0]!; // "Once upon a time" → ", there was …"; "," is the first greedy token
    const comma = ref.greedy_token_ids[0]!;
    const a = await client.completions.create({
      model: MODEL,
      prompt: ref.prompt,
      max_tokens: 3,
      temperature: 0,
      logit_bias: { [String(comma)]: -100 },
    });
    expect(a.choices[0]!.text.startsWith(",")).toBe(false);
    const res = await fetch(`${url}/completion`, {
      method: "POST",
      body: JSON.stringify({ prompt: ref.prompt, n_predict: 3, temperature: 0, logit_bias: [[comma, false]] }),
    });
    const b = (await res.json()) as { content: string };
    expect(b.content).toBe(a.choices[0]!.text);
    const bad = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt: "x", logit_bias: { [String(comma)]: "x" } }),
    });
    expect(bad.status).toBe(400);
  });

  it("llama.cpp's /completion gives the same text, with token log-probabilities", async () => {
    const ref = reference.results[1]!;
    const res = await fetch(`${url}/completion`, {
      method: "POST",
      body: JSON.stringify({ prompt: ref.prompt, n_predict: 32, temperature: 0, n_probs: 3 }),
    });
    const r = (await res.json()) as Record<string, unknown> & {
      completion_probabilities: { id: number; logprob: number; top_logprobs: { logprob: number }[] }[];
    };
    expect(r.content).toBe(ref.greedy_text);
    expect(r.stop_type).toBe("limit");
    expect(r.tokens_predicted).toBe(32);
    expect(r.completion_probabilities).toHaveLength(32);
    const p0 = r.completion_probabilities[0]!;
    expect(p0.top_logprobs).toHaveLength(3);
    expect(p0.logprob).toBe(p0.top_logprobs[0]!.logprob); // greedy picks the most likely token
    expect(r.tokens_evaluated).toBe(ref.prompt_token_ids.length);
    // a free slot still holds an earlier prompt's BOS (prompt caching): only the rest is evaluated
    const timings = r.timings as { prompt_n: number; cache_n: number; predicted_n: number };
    expect(timings.cache_n).toBeGreaterThan(0);
    expect(timings.prompt_n + timings.cache_n).toBe(ref.prompt_token_ids.length);
    expect(timings.predicted_n).toBe(32);
    // tokens_cached is llama.cpp's: the slot's positions, the prompt and every generated token but the last
    expect(r.tokens_cached).toBe(ref.prompt_token_ids.length + 31);
  });

  it("streamed completions equal non-streamed ones, with a final chunk carrying finish_reason and usage", async () => {
    for (const params of [
      { model: MODEL, prompt: "Tim had a red ball", max_tokens: 40, temperature: 0 },
      { model: MODEL, prompt: "The sun was hot", max_tokens: 40, temperature: 0.9, seed: 7 },
    ]) {
      const whole = await client.completions.create(params);
      const stream = await client.completions.create({ ...params, stream: true });
      let text = "";
      let last: OpenAI.Completions.Completion | undefined;
      for await (const chunk of stream) {
        text += chunk.choices[0]?.text ?? "";
        last = chunk;
      }
      expect(text).toBe(whole.choices[0]!.text);
      expect(last!.choices[0]!.finish_reason).toBe(whole.choices[0]!.finish_reason);
      // the same counts; the second request finds its prompt in a slot's cache
      const { prompt_tokens_details: cached, ...counts } = last!.usage!;
      expect({ ...whole.usage, prompt_tokens_details: undefined }).toEqual({
        ...counts,
        prompt_tokens_details: undefined,
      });
      expect(cached!.cached_tokens).toBe(whole.usage!.prompt_tokens - 1);
    }
  });

  it("chat uses llama.cpp's fallback template (ChatML), says so in /props, and streams the same text", async () => {
    const props = (await (await fetch(`${url}/props`)).json()) as Record<string, unknown>;
    expect(props.chat_template_is_fallback).toBe(true);
    expect(props.chat_template).toContain("<|im_start|>");
    expect(props.total_slots).toBe(16);
    const params = {
      model: MODEL,
      messages: [
        { role: "system" as const, content: "You tell stories." },
        { role: "user" as const, content: "Tell me about a cat." },
      ],
      max_tokens: 48,
      temperature: 0.7,
      seed: 42,
      // both requests evaluate the whole prompt (ChatML makes it ≥ 64 tokens, so in the tiled attention
      // arithmetic); a cached prefix would leave the last prompt token to a one-row evaluation, whose last
      // bits differ (as in llama.cpp), and a 0.7 sampler can turn that into another token
      cache_prompt: false,
    };
    const whole = await client.chat.completions.create(params);
    expect(whole.object).toBe("chat.completion");
    expect(whole.choices[0]!.message.role).toBe("assistant");
    expect(whole.choices[0]!.message.content!.length).toBeGreaterThan(0);
    const prompt = (await (
      await fetch(`${url}/tokenize`, {
        method: "POST",
        body: JSON.stringify({
          content:
            "<|im_start|>system\nYou tell stories.<|im_end|>\n<|im_start|>user\nTell me about a cat.<|im_end|>\n<|im_start|>assistant\n",
          add_special: true,
        }),
      })
    ).json()) as { tokens: number[] };
    expect(whole.usage!.prompt_tokens).toBe(prompt.tokens.length);
    const stream = await client.chat.completions.create({ ...params, stream: true });
    let text = "";
    const chunks: OpenAI.Chat.Completions.ChatCompletionChunk[] = [];
    for await (const c of stream) {
      chunks.push(c);
      text += c.choices[0]?.delta.content ?? "";
    }
    expect(chunks[0]!.object).toBe("chat.completion.chunk");
    expect(chunks[0]!.choices[0]!.delta.role).toBe("assistant");
    expect(text).toBe(whole.choices[0]!.message.content);
    const final = chunks[chunks.length - 1]!;
    expect(final.choices[0]!.finish_reason).toBe(whole.choices[0]!.finish_reason);
    expect(final.usage!.completion_tokens).toBe(whole.usage!.completion_tokens);
    expect(final.usage!.prompt_tokens).toBe(whole.usage!.prompt_tokens);
  });

  it("logprobs, stop strings and several choices", async () => {
    const chat = await client.chat.completions.create({
      model: MODEL,
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 6,
      temperature: 0,
      logprobs: true,
      top_logprobs: 2,
    });
    const lp = chat.choices[0]!.logprobs!.content!;
    expect(lp).toHaveLength(6);
    for (const t of lp) {
      expect(t.top_logprobs).toHaveLength(2);
      expect(t.logprob).toBeCloseTo(t.top_logprobs[0]!.logprob, 6); // greedy: the best token
      expect(Buffer.from(t.bytes!).toString("utf8")).toBe(t.token);
    }
    const legacy = await client.completions.create({
      model: MODEL,
      prompt: "Once upon a time",
      max_tokens: 4,
      temperature: 0,
      logprobs: 3,
    });
    expect(legacy.choices[0]!.logprobs!.tokens).toEqual([",", " there", " was", " a"]);
    expect(legacy.choices[0]!.logprobs!.text_offset).toEqual([0, 1, 7, 11]);
    expect(Object.keys(legacy.choices[0]!.logprobs!.top_logprobs![0]!)).toHaveLength(3);

    const stopped = await client.completions.create({
      model: MODEL,
      prompt: "Once upon a time",
      max_tokens: 32,
      temperature: 0,
      stop: ["Lily"],
    });
    expect(stopped.choices[0]!.text).toBe(", there was a little girl named ");
    expect(stopped.choices[0]!.finish_reason).toBe("stop");
    const native = (await (
      await fetch(`${url}/completion`, {
        method: "POST",
        body: JSON.stringify({ prompt: "Once upon a time", n_predict: 32, temperature: 0, stop: ["Lily"] }),
      })
    ).json()) as { content: string; stop_type: string; stopping_word: string };
    expect(native).toMatchObject({
      content: ", there was a little girl named ",
      stop_type: "word",
      stopping_word: "Lily",
    });

    const two = await client.completions.create({
      model: MODEL,
      prompt: "The dog",
      max_tokens: 12,
      temperature: 1,
      seed: 3,
      n: 2,
    });
    expect(two.choices.map((c) => c.index)).toEqual([0, 1]);
    expect(two.choices[0]!.text).not.toBe(two.choices[1]!.text);
    const seeded = await client.completions.create({
      model: MODEL,
      prompt: "The dog",
      max_tokens: 12,
      temperature: 1,
      seed: 4,
    });
    expect(seeded.choices[0]!.text).toBe(two.choices[1]!.text); // choice i uses seed + i
    // the prompt (BOS + 3 tokens) counts once for both choices
    expect(two.usage).toMatchObject({ prompt_tokens: 4, completion_tokens: 24 });
  });

  it("16 parallel streams each equal their single-request output, decoded together", async () => {
    const params = (i: number) => ({
      model: MODEL,
      prompt: PROMPTS[i]!,
      max_tokens: 48,
      temperature: i % 3 === 0 ? 0 : 0.8,
      seed: 1000 + i,
    });
    const single: string[] = [];
    for (let i = 0; i < PROMPTS.length; i++) single.push((await client.completions.create(params(i))).choices[0]!.text);
    expect(new Set(single).size).toBe(PROMPTS.length);
    const before = await metrics();
    const streamed = await Promise.all(
      PROMPTS.map(async (_, i) => {
        let text = "";
        for await (const c of await client.completions.create({ ...params(i), stream: true }))
          text += c.choices[0]?.text ?? "";
        return text;
      }),
    );
    expect(streamed).toEqual(single);
    const after = await metrics();
    const d = (k: string) => after.get(k)! - (before.get(k) ?? 0);
    const steps = d("llamacpp:n_decode_total");
    const tokens = d("llamacpp:tokens_predicted_total");
    // one after another would need a step per token; together the steps carried several sequences
    expect(steps).toBeLessThan(tokens / 4);
    expect(d("powerinfer:shared_decode_steps_total")).toBeGreaterThan(20);
    expect(after.get("powerinfer:max_sequences_per_decode")).toBeGreaterThanOrEqual(8);
    let wide = 0;
    for (const [k, v] of after) {
      const m = /^powerinfer:decode_steps_by_sequences_total\{sequences="(\d+)"\}$/.exec(k);
      if (m && Number(m[1]) >= 8) wide += v - (before.get(k) ?? 0);
    }
    expect(wide).toBeGreaterThan(10);
  });

  it("a client that disconnects mid-stream frees its slot at the next step, without disturbing others", async () => {
    const ref = reference.results[0]!;
    const other = client.completions.create({ model: MODEL, prompt: ref.prompt, max_tokens: 32, temperature: 0 });
    const before = await metrics();
    const stream = await client.completions.create({
      model: MODEL,
      prompt: "Tim had a red ball",
      max_tokens: 120,
      temperature: 0,
      ignore_eos: true,
      stream: true,
    } as OpenAI.Completions.CompletionCreateParamsStreaming);
    let n = 0;
    for await (const _ of stream) {
      if (++n === 3) break; // leaving the loop aborts the HTTP request
    }
    await waitFor(async () => {
      const slots = (await (await fetch(`${url}/slots`)).json()) as { is_processing: boolean }[];
      return slots.every((s) => !s.is_processing);
    });
    const after = await metrics();
    expect(
      after.get('powerinfer:requests_total{outcome="aborted"}')! -
        (before.get('powerinfer:requests_total{outcome="aborted"}') ?? 0),
    ).toBe(1);
    // stopped long before its 120 tokens
    expect(after.get("llamacpp:tokens_predicted_total")! - before.get("llamacpp:tokens_predicted_total")!).toBeLessThan(
      32 + 60,
    );
    expect((await other).choices[0]!.text).toBe(ref.greedy_text);
    const again = await client.completions.create({ model: MODEL, prompt: ref.prompt, max_tokens: 32, temperature: 0 });
    expect(again.choices[0]!.text).toBe(ref.greedy_text);
  });

  describe("malformed input gets OpenAI-shaped errors", () => {
    const post = async (path: string, body: string, headers: Record<string, string> = {}) => {
      const r = await fetch(`${url}${path}`, {
        method: "POST",
        body,
        headers: { "content-type": "application/json", ...headers },
      });
      return { status: r.status, body: (await r.json()) as { error: { code: number; message: string; type: string } } };
    };

    it("broken JSON, a non-object body, a missing field", async () => {
      for (const [body, pattern] of [
        ['{"prompt": "x", ', /not valid JSON/],
        ["[1, 2]", /must be a JSON object/],
        ['{"max_tokens": 3}', /^"prompt" is missing: expected a string, an array of strings or an array of token ids$/],
        ['{"messages": []}', /^"messages": expected an array of messages \(at least 1 item\), got \[\]$/],
      ] as const) {
        const path = body.includes("messages") ? "/v1/chat/completions" : "/v1/completions";
        const r = await post(path, body);
        expect(r.status, body).toBe(400);
        expect(r.body.error.type).toBe("invalid_request_error");
        expect(r.body.error.code).toBe(400);
        expect(r.body.error.message).toMatch(pattern);
      }
    });

    it("a token id outside the vocabulary names the prompt", async () => {
      for (const path of ["/v1/completions", "/completion"]) {
        const r = await post(path, JSON.stringify({ prompt: [1, 999999], max_tokens: 1 }));
        expect(r.status, path).toBe(400);
        expect(r.body.error).toMatchObject({ type: "invalid_request_error", param: "prompt" });
        expect(r.body.error.message).toMatch(/^token id 999999 is outside the vocabulary \[0, \d+\)$/);
      }
    });

    it("a body over the limit is a 413 that names the limit", async () => {
      const r = await post("/v1/completions", JSON.stringify({ prompt: "x".repeat(9 * 1024 * 1024) }));
      expect(r.status).toBe(413);
      expect(r.body.error).toMatchObject({ code: 413, type: "invalid_request_error" });
      expect(r.body.error.message).toBe("the body is too large (the limit is 8 MiB)");
    });

    it("a wrong type names the field; unknown fields are ignored", async () => {
      await expect(
        client.completions.create({
          model: MODEL,
          prompt: "Once",
          max_tokens: 2,
          temperature: "hot" as unknown as number,
        }),
      ).rejects.toMatchObject({
        status: 400,
        type: "invalid_request_error",
        message: expect.stringMatching(/temperature/),
      });
      await expect(
        client.chat.completions.create({
          model: MODEL,
          messages: [{ role: "user", content: "hi" }],
          max_tokens: "5" as unknown as number,
        }),
      ).rejects.toMatchObject({ status: 400, message: expect.stringMatching(/max_tokens/) });
      const ok = await client.completions.create({
        model: MODEL,
        prompt: "Once upon a time",
        max_tokens: 4,
        temperature: 0,
        some_future_field: { a: 1 },
        user: "me",
      } as OpenAI.Completions.CompletionCreateParamsNonStreaming);
      expect(ok.choices[0]!.text).toBe(", there was a");
    });

    it("a bad field: one line naming it, what it must be and what was sent, on every endpoint", async () => {
      const chat = { messages: [{ role: "user", content: "hi" }] };
      const cases: [string, unknown, string, string][] = [
        [
          "/v1/completions",
          { prompt: "x", max_tokens: -3 },
          '"max_tokens": expected an integer ≥ -2, got -3',
          "max_tokens",
        ],
        ["/v1/completions", { prompt: "x", n: 20 }, '"n": expected an integer in [1, 16], got 20', "n"],
        ["/v1/completions", { prompt: [1, -2] }, '"prompt[1]": expected an integer ≥ 0, got -2', "prompt[1]"],
        ["/v1/completions", { prompt: "x", stop: [1] }, '"stop[0]": expected a string, got 1', "stop[0]"],
        [
          "/v1/completions",
          { prompt: "x", stop: Array(20).fill("ab") },
          '"stop": expected a string or an array of at most 16 strings, got ["ab","ab","ab","ab","ab","ab","ab","ab…',
          "stop",
        ],
        [
          "/v1/chat/completions",
          { ...chat, temperature: "hot" },
          '"temperature": expected a number, got "hot"',
          "temperature",
        ],
        [
          "/v1/chat/completions",
          { ...chat, max_completion_tokens: 1.5 },
          '"max_completion_tokens": expected an integer ≥ -2, got 1.5',
          "max_completion_tokens",
        ],
        [
          "/v1/chat/completions",
          { messages: [{ content: "hi" }] },
          '"messages[0].role" is missing: expected one of "system", "developer", "user", "assistant", "tool"',
          "messages[0].role",
        ],
        [
          "/v1/chat/completions",
          { messages: [{ role: "bogus", content: "hi" }] },
          '"messages[0].role": expected one of "system", "developer", "user", "assistant", "tool", got "bogus"',
          "messages[0].role",
        ],
        [
          "/v1/chat/completions",
          { messages: [{ role: "user" }] },
          '"messages[0].content": required for a non-assistant message (a string or an array of content parts)',
          "messages[0].content",
        ],
        [
          "/v1/chat/completions",
          { messages: [{ role: "user", content: [{ text: "hi" }] }] },
          '"messages[0].content[0].type" is missing: expected a string',
          "messages[0].content[0].type",
        ],
        ["/completion", { prompt: "x", n_predict: -5 }, '"n_predict": expected an integer ≥ -2, got -5', "n_predict"],
        [
          "/completion",
          { prompt: "x", top_p: 3, n_probs: 1000 },
          '"top_p": expected a number in [0, 1], got 3; "n_probs": expected an integer in [0, 100], got 1000',
          "top_p",
        ],
        [
          "/completion",
          { prompt: [[1, {}]] },
          '"prompt[0][1]": expected a string or a token id, got {}',
          "prompt[0][1]",
        ],
        ["/tokenize", { content: 5 }, '"content": expected a string, got 5', "content"],
        ["/detokenize", { tokens: [1, "a"] }, '"tokens[1]": expected an integer ≥ 0, got "a"', "tokens[1]"],
        // where a schema has no words of its own, zod's defaults are said the same way (not "expected Invalid input")
        [
          "/v1/completions",
          { prompt: { a: 1 } },
          '"prompt.prompt_string" is missing: expected a string or an array of strings and token ids',
          "prompt.prompt_string",
        ],
        [
          "/v1/completions",
          { prompt: { prompt_string: 5 } },
          '"prompt.prompt_string": expected a string or an array of strings and token ids, got 5',
          "prompt.prompt_string",
        ],
        [
          "/completion",
          { prompt: "x", logit_bias: { upon: -1e30 } },
          '"logit_bias.upon": expected a number ≥ -100, got -1e+30',
          "logit_bias.upon",
        ],
      ];
      for (const [path, body, message, param] of cases) {
        const r = await post(path, JSON.stringify(body));
        expect(r.status, message).toBe(400);
        expect(r.body).toEqual({ error: { code: 400, message, type: "invalid_request_error", param } });
      }
      // more than three problems: the first three and a count, still one line
      const many = await post(
        "/v1/completions",
        JSON.stringify({ prompt: "x", temperature: "hot", top_k: 2.5, min_p: 2, max_tokens: -3 }),
      );
      expect(many.body.error.message).toBe(
        '"temperature": expected a number, got "hot"; "top_k": expected an integer, got 2.5; "min_p": expected a number in [0, 1], got 2 (and 1 more)',
      );
      // the official client sees the same message and the field as `param`
      const err = await client.completions
        .create({ model: MODEL, prompt: "Once", max_tokens: -3 })
        .catch((e: unknown) => e);
      expect(err).toBeInstanceOf(OpenAI.BadRequestError);
      expect(err).toMatchObject({ param: "max_tokens", type: "invalid_request_error" });
      expect((err as Error).message).toContain('"max_tokens": expected an integer ≥ -2, got -3');
    });

    it("repeat_last_n -1 looks back over the whole slot context (llama.cpp), not a 400", async () => {
      const ask = async (n: number) => {
        const r = await fetch(`${url}/completion`, {
          method: "POST",
          body: JSON.stringify({
            prompt: "Once upon a time",
            n_predict: 64,
            temperature: 0,
            repeat_penalty: 1.5,
            repeat_last_n: n,
          }),
        });
        expect(r.status).toBe(200);
        return (await r.json()) as { content: string; generation_settings: { repeat_last_n: number } };
      };
      const all = await ask(-1);
      expect(all.generation_settings.repeat_last_n).toBe(128);
      expect(all.content).toBe((await ask(128)).content);
      expect(all.content).not.toBe((await ask(0)).content); // the penalty does act
    });

    it("bad server options are refused before anything is loaded", () => {
      for (const [o, message] of [
        [{ slots: 0 }, "slots must be an integer ≥ 1, got 0"],
        [{ slots: 4, ctxSize: 3 }, "ctxSize 3 leaves no context for 4 slots"],
        [{ ctxSize: 0 }, "ctxSize must be an integer ≥ 1, got 0"],
        [{ queueLimit: -1 }, "queueLimit must be an integer ≥ 0, got -1"],
        [{ nBatch: 1.5 }, "nBatch must be an integer ≥ 1, got 1.5"],
        [{ kvType: "q4" }, "kvType must be f16 or f32, got q4"],
      ] as const) {
        expect(() => createServer({ model, ...(o as object) })).toThrow(
          expect.objectContaining({ name: "EngineError", code: "BAD_INPUT", message }),
        );
      }
    });

    it("a prompt longer than a slot's context: 400 with the numbers", async () => {
      const err = await client.completions
        .create({ model: MODEL, prompt: "Once upon a time there was a dog. ".repeat(20), max_tokens: 4 })
        .catch((e: unknown) => e);
      expect(err).toBeInstanceOf(OpenAI.BadRequestError);
      const e = err as InstanceType<typeof OpenAI.BadRequestError>;
      expect(e.type).toBe("exceed_context_size_error");
      // llama.cpp's words first, then ours
      expect(e.message).toMatch(
        /request \(\d+ tokens\) exceeds the available context size \(128 tokens\), try increasing it: the prompt has (at least )?\d+ tokens, a slot's context \(n_ctx\) holds 128/,
      );
      expect((e.error as { n_ctx: number }).n_ctx).toBe(128);
      expect((e.error as { n_prompt_tokens: number }).n_prompt_tokens).toBeGreaterThan(128);
    });

    it("a route called with the wrong method: 405 with an Allow header and OpenAI's error shape", async () => {
      for (const path of ["/v1/completions", "/v1/chat/completions", "/completion"]) {
        const r = await fetch(`${url}${path}`);
        expect(r.status, path).toBe(405);
        expect(r.headers.get("allow")).toBe("POST");
        expect(await r.json()).toEqual({
          error: { code: 405, message: `GET is not allowed on ${path}; use POST`, type: "invalid_request_error" },
        });
      }
      const m = await fetch(`${url}/v1/models`, { method: "POST", body: "{}" });
      expect(m.status).toBe(405);
      expect(m.headers.get("allow")).toBe("GET, HEAD");
    });

    it("an id_slot that does not exist: 400 naming it, on every generation endpoint", async () => {
      for (const [path, body] of [
        ["/completion", { prompt: "Once", n_predict: 2, id_slot: 16 }],
        ["/v1/completions", { prompt: "Once", max_tokens: 2, id_slot: 99 }],
        ["/v1/chat/completions", { messages: [{ role: "user", content: "Hi" }], max_tokens: 2, id_slot: 16 }],
      ] as const) {
        const r = await post(path, JSON.stringify(body));
        expect(r.status, path).toBe(400);
        expect(r.body.error.type).toBe("invalid_request_error");
        expect(r.body.error.message).toBe(
          `id_slot must be -1 (any free slot) or a slot of this server (0–15), got ${body.id_slot}`,
        );
      }
      expect((await post("/completion", JSON.stringify({ prompt: "Once", id_slot: -2 }))).status).toBe(400);
    });

    it("an id_slot that exists runs the request in that slot", async () => {
      for (const slot of [0, 7, 15]) {
        const r = await post("/completion", JSON.stringify({ prompt: "Once", n_predict: 2, id_slot: slot }));
        expect(r.status).toBe(200);
        expect((r.body as unknown as { id_slot: number }).id_slot).toBe(slot);
      }
      const any = await post("/completion", JSON.stringify({ prompt: "Once", n_predict: 2, id_slot: -1 }));
      expect(any.status).toBe(200);
    });

    it("unknown routes and endpoints that are off", async () => {
      expect((await fetch(`${url}/v2/nothing`)).status).toBe(404);
      const r = await post(
        "/v1/chat/completions",
        JSON.stringify({ messages: [{ role: "user", content: [{ type: "image_url" }] }] }),
      );
      expect(r.status).toBe(400);
      expect(r.body.error.message).toMatch(/only text parts/);
      const noText = await post(
        "/v1/chat/completions",
        JSON.stringify({ messages: [{ role: "user", content: [{ type: "text" }] }] }),
      );
      expect(noText.status).toBe(400);
      expect(noText.body.error.message).toBe('messages[0].content[0]: a text part needs "text" (a string)');
    });
  });

  it("tokenize, detokenize, models and slots", async () => {
    const t = (await (
      await fetch(`${url}/tokenize`, {
        method: "POST",
        body: JSON.stringify({ content: "Once upon a time", with_pieces: true }),
      })
    ).json()) as { tokens: { id: number; piece: string }[] };
    expect(t.tokens.map((x) => x.id)).toEqual([403, 407, 261, 378]);
    expect(t.tokens[0]!.piece).toBe(" Once");
    const d = (await (
      await fetch(`${url}/detokenize`, { method: "POST", body: JSON.stringify({ tokens: [403, 407] }) })
    ).json()) as {
      content: string;
    };
    expect(d.content).toBe(" Once upon");
    const list = await client.models.list();
    expect(list.data.map((m) => m.id)).toEqual(["stories260K.gguf"]);
    const slots = (await (await fetch(`${url}/slots`)).json()) as { id: number; n_ctx: number }[];
    expect(slots).toHaveLength(16);
    expect(slots[15]).toMatchObject({ id: 15, n_ctx: 128 });
  });

  it("an API key: missing or wrong gives 401, the right one passes, /health stays public", async () => {
    const keyed = createServer({ model, slots: 1, ctxSize: 128, apiKey: "sekrit" });
    const u = await keyed.listen({ host: "127.0.0.1", port: 0 });
    try {
      const wrong = new OpenAI({ baseURL: `${u}/v1`, apiKey: "wrong", maxRetries: 0 });
      await expect(wrong.completions.create({ model: MODEL, prompt: "Once", max_tokens: 1 })).rejects.toMatchObject({
        status: 401,
        type: "authentication_error",
        message: expect.stringMatching(/Invalid API key/),
      });
      const missing = await fetch(`${u}/completion`, { method: "POST", body: "{}" });
      expect(missing.status).toBe(401);
      expect(await missing.json()).toEqual({
        error: { code: 401, message: "Missing API key", type: "authentication_error" },
      });
      const c = new OpenAI({ baseURL: `${u}/v1`, apiKey: "sekrit", maxRetries: 0 });
      expect(
        (await c.completions.create({ model: MODEL, prompt: "Once upon a time", max_tokens: 3, temperature: 0 }))
          .choices[0]!.text,
      ).toBe(", there was");
      expect((await fetch(`${u}/health`)).status).toBe(200);
    } finally {
      await keyed.close();
    }
  });

  it("a full server queues up to its bound, then answers 503", async () => {
    const small = createServer({ model, slots: 1, ctxSize: 256, queueLimit: 1 });
    const u = await small.listen({ host: "127.0.0.1", port: 0 });
    try {
      const body = JSON.stringify({ prompt: "Once upon a time", max_tokens: 150, temperature: 0, ignore_eos: true });
      const send = () =>
        fetch(`${u}/v1/completions`, { method: "POST", body, headers: { "content-type": "application/json" } });
      const statuses = await Promise.all(
        [send(), send(), send(), send()].map(async (p) => {
          const r = await p;
          return { status: r.status, body: (await r.json()) as { error?: { message: string; type: string } } };
        }),
      );
      const refused = statuses.filter((s) => s.status === 503);
      expect(statuses.filter((s) => s.status === 200)).toHaveLength(2);
      expect(refused).toHaveLength(2);
      expect(refused[0]!.body.error!.type).toBe("unavailable_error");
      expect(refused[0]!.body.error!.message).toMatch(/all 1 slots are in use and 1 requests are waiting \(limit 1\)/);
    } finally {
      await small.close();
    }
  });

  it("a request with more generations than slots + queue can ever hold is a 400 naming the limit, not a 503 'retry later'", async () => {
    const small = createServer({ model, slots: 1, ctxSize: 256, queueLimit: 1 });
    const u = await small.listen({ host: "127.0.0.1", port: 0 });
    try {
      const post = (body: object) =>
        fetch(`${u}/v1/completions`, {
          method: "POST",
          body: JSON.stringify(body),
          headers: { "content-type": "application/json" },
        });
      for (const body of [
        { prompt: "Once upon a time", max_tokens: 2, n: 3 },
        { prompt: ["Once", "The dog", "A cat"], max_tokens: 2 },
      ]) {
        const r = await post(body);
        expect(r.status).toBe(400);
        expect(await r.json()).toEqual({
          error: {
            code: 400,
            type: "invalid_request_error",
            message:
              "this request makes 3 generations (n × prompts); the server holds at most 2 at once (1 slots + a queue of 1): ask for fewer, or start it with more --parallel or --queue",
          },
        });
      }
      // two fit (one decoding, one waiting)
      const ok = await post({ prompt: "Once upon a time", max_tokens: 2, n: 2, temperature: 0 });
      expect(ok.status).toBe(200);
      expect(((await ok.json()) as { choices: unknown[] }).choices).toHaveLength(2);
    } finally {
      await small.close();
    }
  });

  it("a generation cut off by the server's shutdown is a 503 (or a streamed error event), not a finished answer", async () => {
    const s = createServer({ model, slots: 3, ctxSize: 256 });
    const u = await s.listen({ host: "127.0.0.1", port: 0 });
    const long = { max_tokens: 250, temperature: 0, ignore_eos: true };
    const json = (path: string, body: object) =>
      fetch(`${u}${path}`, {
        method: "POST",
        body: JSON.stringify(body),
        headers: { "content-type": "application/json" },
      });
    const plain = json("/v1/completions", { prompt: "Once upon a time", ...long });
    const native = json("/completion", {
      prompt: "Once upon a time",
      n_predict: 250,
      temperature: 0,
      ignore_eos: true,
    });
    const streamed = await json("/v1/completions", { prompt: "Once upon a time", ...long, stream: true });
    // once all three decode, shut down
    const reader = streamed.body!.getReader();
    let text = new TextDecoder().decode((await reader.read()).value);
    for (let busy = 0; busy < 3; ) {
      const slots = (await (await fetch(`${u}/slots`)).json()) as { is_processing: boolean }[];
      busy = slots.filter((x) => x.is_processing).length;
    }
    await s.close();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      text += new TextDecoder().decode(value);
    }
    const cut = /^the server is shutting down: the generation was cut off after \d+ tokens$/;
    for (const r of [await plain, await native]) {
      expect(r.status).toBe(503);
      const e = ((await r.json()) as { error: { type: string; message: string } }).error;
      expect(e.type).toBe("unavailable_error");
      expect(e.message).toMatch(cut);
    }
    const events = text
      .split("\n")
      .filter((l) => l.startsWith("data: ") && l !== "data: [DONE]")
      .map((l) => JSON.parse(l.slice(6)) as { error?: { message: string }; choices?: { finish_reason: unknown }[] });
    expect(events.at(-1)!.error!.message).toMatch(cut);
    expect(events.some((e) => e.choices?.some((c) => c.finish_reason !== null))).toBe(false);
  });

  it("a malformed HTTP request gets a 400 in the OpenAI error shape, and the server keeps serving", async () => {
    const s = createServer({ model, slots: 1, ctxSize: 128 });
    const u = await s.listen({ host: "127.0.0.1", port: 0 });
    try {
      const { port } = new URL(u);
      const raw = await new Promise<string>((resolve, reject) => {
        const c = connect(Number(port), "127.0.0.1", () => c.write("THIS IS NOT HTTP\r\n\r\n"));
        let got = "";
        c.on("data", (d) => {
          got += d.toString();
        });
        c.on("close", () => resolve(got));
        c.on("error", reject);
      });
      expect(raw).toMatch(/^HTTP\/1\.1 400 Bad Request\r\n/);
      const body = JSON.parse(raw.slice(raw.indexOf("\r\n\r\n") + 4)) as { error: Record<string, unknown> };
      expect(body.error).toMatchObject({ code: 400, type: "invalid_request_error" });
      expect(body.error.message).toMatch(/^malformed HTTP request \(HPE_/);
      expect((await fetch(`${u}/health`)).status).toBe(200);
    } finally {
      await s.close();
    }
  });

  it("answers 503 while the model loads, then serves", async () => {
    let resolve!: (m: Model) => void;
    const loading = createServer({ model: new Promise<Model>((r) => (resolve = r)), slots: 1, ctxSize: 128 });
    const u = await loading.listen({ host: "127.0.0.1", port: 0 });
    try {
      const h = await fetch(`${u}/health`);
      expect(h.status).toBe(503);
      expect(await h.json()).toEqual({ error: { code: 503, message: "Loading model", type: "unavailable_error" } });
      expect((await fetch(`${u}/v1/models`)).status).toBe(503);
      resolve(model);
      await loading.ready;
      expect(await (await fetch(`${u}/health`)).json()).toEqual({ status: "ok" });
    } finally {
      await loading.close();
    }
  });
});
