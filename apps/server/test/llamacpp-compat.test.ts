/**
 * What llama.cpp's server returns, request by request, for the fields, endpoints and status codes its users
 * rely on (the checks llama.cpp's own server tests make), on stories260K over 127.0.0.1.
 */
import { execFileSync } from "node:child_process";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { Model } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createServer, type PowerinferServer, type ServerOptions } from "../src/index.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const stories = join(models, "stories260K.gguf");
const probe = await cpuBackend.probe();

/** A response body: the tests read its fields as llama.cpp's clients do. */
// biome-ignore lint/suspicious/noExplicitAny: response bodies are read field by field
type Json = Record<string, any>;

/** Server-Sent Events of a streamed response, parsed (without the [DONE] terminator). */
async function events(res: Response): Promise<Json[]> {
  const text = await res.text();
  return text
    .split("\n\n")
    .filter((e) => e.startsWith("data: ") && e !== "data: [DONE]")
    .map((e) => JSON.parse(e.slice(6)) as Json);
}

describe.skipIf(!probe.usable)(`llama.cpp's server behaviour (${probe.reason})`, () => {
  let backend: Backend;
  let model: Model;
  const servers: PowerinferServer[] = [];

  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
    model = await Model.load(stories, { backend });
  });
  afterAll(async () => {
    for (const s of servers) await s.close();
    model?.dispose();
    backend?.dispose();
  });

  /** A server on a free port; closed after the file. */
  async function start(o: Omit<ServerOptions, "model"> = {}) {
    const server = createServer({ model, slots: 1, ctxSize: 128, ...o });
    servers.push(server);
    const url = await server.listen({ host: "127.0.0.1", port: 0 });
    const post = async (path: string, body: unknown, headers: Record<string, string> = {}) => {
      const res = await fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json", ...headers },
        body: typeof body === "string" ? body : JSON.stringify(body),
      });
      return { status: res.status, headers: res.headers, body: (await res.json()) as Json };
    };
    const get = async (path: string) => {
      const res = await fetch(`${url}${path}`);
      return { status: res.status, headers: res.headers, body: (await res.json()) as Json };
    };
    return { url, server, post, get };
  }

  describe("server defaults (--seed, --temp, --top-k, --top-p, --min-p, --n-predict, --repeat-penalty)", () => {
    it("/props reports them and requests that set nothing use them", async () => {
      const defaults = { seed: 42, temperature: 0.5, topK: 20, topP: 0.9, minP: 0.1, nPredict: 12, repeatPenalty: 1.1 };
      const a = await start({ defaults, slots: 2, ctxSize: 256 });
      const props = await a.get("/props");
      expect(props.body.default_generation_settings.n_ctx).toBe(128); // ctx / slots, as llama.cpp
      expect(props.body.default_generation_settings.params).toMatchObject({
        seed: 42,
        temperature: 0.5,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.1,
        n_predict: 12,
        max_tokens: 12,
        repeat_penalty: 1.1,
      });
      const one = await a.post("/completion", { prompt: "Once upon a time", cache_prompt: false });
      const two = await a.post("/completion", { prompt: "Once upon a time", cache_prompt: false });
      expect(one.body.tokens_predicted).toBe(12);
      expect(one.body.generation_settings).toMatchObject({ seed: 42, temperature: 0.5, top_k: 20, n_predict: 12 });
      expect(two.body.content).toBe(one.body.content); // the same default seed
      // the same as a server without defaults given the same settings in the request
      const plain = await start();
      const explicit = await plain.post("/completion", {
        prompt: "Once upon a time",
        seed: 42,
        temperature: 0.5,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.1,
        n_predict: 12,
        repeat_penalty: 1.1,
      });
      expect(explicit.body.content).toBe(one.body.content);
      // a request's own value wins
      expect((await a.post("/completion", { prompt: "Once", n_predict: 3 })).body.tokens_predicted).toBe(3);
      // top_k ≤ 0 is off, as in llama.cpp
      const noTopK = await a.post("/completion", { prompt: "Once", n_predict: 2, top_k: -5 });
      expect(noTopK.status).toBe(200);
      expect(noTopK.body.generation_settings).toMatchObject({ top_k: 0 });
    });

    it("without --seed the reported seed is llama.cpp's LLAMA_DEFAULT_SEED (a random seed is drawn per request)", async () => {
      // llama.cpp reports params.sampling.seed, which stays 0xFFFFFFFF when no seed was set
      const a = await start();
      expect((await a.get("/props")).body.default_generation_settings.params.seed).toBe(4294967295);
      const r = await a.post("/completion", { prompt: "Once", n_predict: 2 });
      expect(r.body.generation_settings.seed).toBe(4294967295);
      expect(
        (await a.post("/completion", { prompt: "Once", n_predict: 2, seed: 7 })).body.generation_settings.seed,
      ).toBe(7);
    });

    it("a seed is read as llama.cpp's uint32 (−5 → 4294967291, 2^32 → 0, −1 random); top_p 0 keeps the top token", async () => {
      const a = await start();
      const gen = async (body: Record<string, unknown>) => {
        const r = await a.post("/completion", { prompt: "Once", n_predict: 12, temperature: 1.5, ...body });
        expect(r.status, JSON.stringify(r.body)).toBe(200);
        return r.body as { content: string; generation_settings: { seed: number } };
      };
      const m5 = await gen({ seed: -5 });
      expect(m5.generation_settings.seed).toBe(4294967291);
      expect((await gen({ seed: -5 })).content).toBe(m5.content); // reproducible, not random
      expect((await gen({ seed: 4294967291 })).content).toBe(m5.content);
      const wrapped = await gen({ seed: 2 ** 32 });
      expect(wrapped.generation_settings.seed).toBe(0);
      expect((await gen({ seed: 0 })).content).toBe(wrapped.content);
      expect((await gen({ seed: -1 })).generation_settings.seed).toBe(4294967295);
      const top = await gen({ seed: 3, top_p: 0 });
      expect(top.content).toBe((await gen({ seed: 3, temperature: 0 })).content);
      expect(top.generation_settings).toMatchObject({ top_p: 0 });
    });

    it("bad defaults are refused before anything is loaded", () => {
      for (const [defaults, message] of [
        [{ seed: -2 }, "defaults.seed must be an integer in [0, 4294967295] or -1 (random), got -2"],
        [{ topP: -0.5 }, "defaults.topP must be in [0, 1], got -0.5"],
        [{ minP: 1.5 }, "defaults.minP must be in [0, 1], got 1.5"],
        [
          { nPredict: -3 },
          "defaults.nPredict must be an integer ≥ -2 (-1 = no limit, -2 = until the context is full), got -3",
        ],
        [{ repeatPenalty: 0 }, "defaults.repeatPenalty must be > 0, got 0"],
        [{ topK: 1.5 }, "defaults.topK must be an integer ≥ 0, got 1.5"],
      ] as const) {
        expect(() => createServer({ model, defaults })).toThrow(
          expect.objectContaining({ name: "EngineError", code: "BAD_INPUT", message }),
        );
      }
    });
  });

  it("system_fingerprint and build_info: b<version>-<short commit>", async () => {
    const a = await start();
    const props = await a.get("/props");
    const build = props.body.build_info as string;
    expect(build).toMatch(/^b\d+\.\d+\.\d+-([0-9a-f]{7,40}|unknown)$/);
    let head: string | undefined;
    try {
      head = execFileSync("git", ["rev-parse", "--short=7", "HEAD"], { encoding: "utf8" }).trim();
    } catch {
      head = undefined; // no git here: the build-time record or "unknown"
    }
    if (head) expect(build.endsWith(`-${head}`)).toBe(true);
    const cmpl = await a.post("/v1/completions", { prompt: "Once", max_tokens: 1 });
    expect(cmpl.body.system_fingerprint).toBe(build);
    const chat = await a.post("/v1/chat/completions", { messages: [{ role: "user", content: "Hi" }], max_tokens: 1 });
    expect(chat.body.system_fingerprint).toBe(build);
  });

  describe("a full context", () => {
    it("stops at the limit with truncated: true (8-token prompt, -c 64, n_predict 100, ignore_eos)", async () => {
      const a = await start({ ctxSize: 64 });
      const body = { prompt: "Once upon a time, there was", n_predict: 100, temperature: 0, ignore_eos: true };
      const r = await a.post("/completion", body);
      expect(r.status).toBe(200);
      expect(r.body.tokens_evaluated).toBe(8);
      // llama.cpp stops once the next token would not fit: 8 + 56 = 64
      expect(r.body.tokens_predicted).toBe(56);
      expect(r.body).toMatchObject({ truncated: true, stop_type: "limit", tokens_cached: 63 });
      // -2: until the context is full
      const full = await a.post("/completion", { ...body, n_predict: -2 });
      expect(full.status).toBe(200);
      expect(full.body).toMatchObject({ tokens_predicted: 56, truncated: true, content: r.body.content });
      // streamed: the final event says so too; OpenAI's finish_reason is "length"
      const s = await events(
        await fetch(`${a.url}/completion`, { method: "POST", body: JSON.stringify({ ...body, stream: true }) }),
      );
      expect(s[s.length - 1]).toMatchObject({ stop: true, truncated: true, stop_type: "limit" });
      const oai = await a.post("/v1/completions", {
        prompt: body.prompt,
        max_tokens: 100,
        temperature: 0,
        ignore_eos: true,
      });
      expect(oai.body.choices[0].finish_reason).toBe("length");
      expect(oai.body.usage.completion_tokens).toBe(56);
      // a limit reached first is no truncation
      const short = await a.post("/completion", { ...body, n_predict: 10 });
      expect(short.body).toMatchObject({ tokens_predicted: 10, truncated: false, tokens_cached: 17 });
    });

    it("a prompt that leaves no room: 400 with llama.cpp's message", async () => {
      const a = await start({ ctxSize: 64 });
      const ids = (await a.post("/tokenize", { content: "Once upon a time ".repeat(40), add_special: true })).body
        .tokens as number[];
      for (const prompt of [ids.slice(0, 64), ids.slice(0, 80)]) {
        const r = await a.post("/completion", { prompt, n_predict: 4 });
        expect(r.status).toBe(400);
        expect(r.body.error.type).toBe("exceed_context_size_error");
        expect(r.body.error.message).toContain("exceeds the available context size");
        expect(r.body.error).toMatchObject({ n_prompt_tokens: prompt.length, n_ctx: 64 });
      }
      expect((await a.post("/completion", { prompt: ids.slice(0, 63), n_predict: 4 })).status).toBe(200);
    });
  });

  describe("fields and shapes", () => {
    it("chat streams: the first chunk's content is null, the usage chunk has timings, logprobs carry token ids", async () => {
      const a = await start();
      const s = await events(
        await fetch(`${a.url}/v1/chat/completions`, {
          method: "POST",
          body: JSON.stringify({
            messages: [{ role: "user", content: "Tell me a story" }],
            max_tokens: 6,
            temperature: 0,
            stream: true,
            stream_options: { include_usage: true },
            logprobs: true,
            top_logprobs: 2,
          }),
        }),
      );
      expect(s[0]!.choices[0].delta).toEqual({ role: "assistant", content: null });
      for (const c of s.slice(1)) if (c.choices.length) expect(c.choices[0].delta.role).toBeUndefined();
      const usage = s[s.length - 1]!;
      expect(usage.choices).toEqual([]);
      expect(usage.usage.completion_tokens).toBe(6);
      expect(usage.timings).toMatchObject({ predicted_n: 6 });
      const lp = s.flatMap((c) => c.choices[0]?.logprobs?.content ?? []) as Json[];
      expect(lp).toHaveLength(6);
      for (const t of lp) {
        const piece = await a.post("/detokenize", { tokens: [t.id] });
        expect(piece.body.content.replace(/^ /, "")).toBe(t.token.replace(/^ /, ""));
        for (const x of t.top_logprobs) expect(Number.isInteger(x.id)).toBe(true);
      }
      // top_logprobs without logprobs: llama.cpp's (and OpenAI's) 400, not silently ignored
      const alone = await a.post("/v1/chat/completions", {
        messages: [{ role: "user", content: "Hi" }],
        max_tokens: 2,
        top_logprobs: 2,
      });
      expect(alone.status).toBe(400);
      expect(alone.body.error).toMatchObject({
        message: "top_logprobs requires logprobs to be set to true",
        type: "invalid_request_error",
        param: "top_logprobs",
      });
    });

    it("cached prompt tokens: timings.cache_n, usage.prompt_tokens_details, /metrics (with Process-Start-Time-Unix)", async () => {
      const a = await start({ metrics: true });
      const chat = { messages: [{ role: "user", content: "The cat sat on the mat" }], max_tokens: 4 };
      const first = await a.post("/v1/chat/completions", chat);
      const second = await a.post("/v1/chat/completions", chat);
      const n = first.body.usage.prompt_tokens as number;
      expect(first.body.usage.prompt_tokens_details).toEqual({ cached_tokens: 0 });
      // all but the last prompt token are found in the slot's cache (its logits are needed again)
      expect(second.body.usage.prompt_tokens_details).toEqual({ cached_tokens: n - 1 });
      expect(second.body.timings).toMatchObject({ cache_n: n - 1, prompt_n: 1 });
      const res = await fetch(`${a.url}/metrics`);
      const started = Number(res.headers.get("process-start-time-unix"));
      expect(Number.isInteger(started)).toBe(true);
      expect(started).toBeLessThanOrEqual(Date.now() / 1000);
      const text = await res.text();
      expect(text).toContain("# TYPE llamacpp:prompt_tokens_cached_total counter");
      expect(text).toMatch(new RegExp(`\\nllamacpp:prompt_tokens_cached_total ${n - 1}\\n`));
      expect(text).toMatch(new RegExp(`\\nllamacpp:prompt_tokens_total ${n + 1}\\n`));
      // n choices of one prompt: the prompt counts once in prompt_tokens, and so does its cached part
      const three = { prompt: "The cat sat on the mat", max_tokens: 2, n: 3 };
      await a.post("/v1/completions", three);
      const again = await a.post("/v1/completions", three);
      const pn = again.body.usage.prompt_tokens as number;
      expect(again.body.usage.prompt_tokens_details).toEqual({ cached_tokens: pn - 1 });
    });

    it("generation_settings: logit_bias with the end-of-generation bans of ignore_eos, and the sampler keys", async () => {
      const a = await start();
      const on = await a.post("/completion", { prompt: "Once", n_predict: 2, ignore_eos: true, temperature: 0 });
      // -Infinity is written as null, as llama.cpp's JSON writes it
      expect(on.body.generation_settings.logit_bias).toEqual(
        model.tokenizer.eogIds.map((t) => ({ bias: null, token: t })),
      );
      const off = await a.post("/completion", { prompt: "Once", n_predict: 2, temperature: 0 });
      expect(off.body.generation_settings.logit_bias).toEqual([]);
      for (const k of [
        "seed",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "repeat_last_n",
        "repeat_penalty",
        "presence_penalty",
        "frequency_penalty",
        "dry_multiplier",
        "mirostat",
        "adaptive_target",
        "adaptive_decay",
        "n_predict",
        "n_probs",
        "samplers",
        "post_sampling_probs",
      ]) {
        expect(off.body.generation_settings, k).toHaveProperty(k);
      }
    });

    it("post_sampling_probs: probabilities after the sampler chain (prob, top_probs)", async () => {
      const a = await start();
      const r = await a.post("/completion", {
        prompt: "Once upon a time",
        n_probs: 10,
        temperature: 1,
        top_k: 3,
        n_predict: 5,
        post_sampling_probs: true,
      });
      const probs = r.body.completion_probabilities as Json[];
      expect(probs).toHaveLength(5);
      for (const t of probs) {
        expect(t.logprob).toBeUndefined();
        expect(t.prob).toBeGreaterThan(0);
        expect(t.prob).toBeLessThanOrEqual(1);
        // top-k 3 leaves at most 3 candidates, whose probabilities sum to 1
        expect(t.top_probs.length).toBeGreaterThan(0);
        expect(t.top_probs.length).toBeLessThanOrEqual(3);
        expect(t.top_probs.reduce((s: number, x: Json) => s + x.prob, 0)).toBeCloseTo(1, 6);
        expect(t.top_probs.find((x: Json) => x.id === t.id).prob).toBe(t.prob);
      }
      // greedy: the chosen token alone, probability 1
      const g = await a.post("/completion", {
        prompt: "Once upon a time",
        n_probs: 5,
        temperature: 0,
        n_predict: 2,
        post_sampling_probs: true,
      });
      for (const t of g.body.completion_probabilities)
        expect(t.top_probs).toEqual([{ id: t.id, token: t.token, bytes: t.bytes, prob: 1 }]);
    });

    it("response_fields picks fields, lifting nested ones", async () => {
      const a = await start();
      const r = await a.post("/completion", {
        prompt: "Once upon a time",
        n_predict: 4,
        temperature: 0,
        response_fields: ["content", "generation_settings/n_predict", "prompt", "no/such"],
      });
      expect(r.body).toEqual({
        content: ", there was a",
        "generation_settings/n_predict": 4,
        prompt: "<s> Once upon a time",
      });
    });

    it("return_progress: prompt progress events while the prompt is evaluated in chunks", async () => {
      const a = await start({ nBatch: 16 });
      const prompt = "Once upon a time there was a little girl named Lily. She loved to play outside in the sun.";
      const ask = async (path: string, body: Json) =>
        (await events(await fetch(`${a.url}${path}`, { method: "POST", body: JSON.stringify(body) }))).filter(
          (e) => e.prompt_progress,
        );
      const p = await ask("/completion", {
        prompt,
        n_predict: 2,
        stream: true,
        return_progress: true,
        cache_prompt: false,
      });
      const total = p[0]!.prompt_progress.total as number;
      expect(total).toBeGreaterThan(16);
      expect(p[0]!.prompt_progress).toMatchObject({ cache: 0, processed: 0 });
      // each event names the slot the request took (a server of one slot: slot 0)
      for (const e of p) expect(e.id_slot).toBe(0);
      expect(p.map((e) => e.prompt_progress.processed)).toEqual([
        0,
        ...Array.from({ length: Math.ceil(total / 16) }, (_, i) => Math.min(total, 16 * (i + 1))),
      ]);
      // the same prompt again: all but its last token come from the cache
      const again = await ask("/completion", { prompt, n_predict: 2, stream: true, return_progress: true });
      expect(again.map((e) => e.prompt_progress)).toMatchObject([
        { total, cache: total - 1, processed: total - 1 },
        { total, cache: total - 1, processed: total },
      ]);
      const chat = await ask("/v1/chat/completions", {
        messages: [{ role: "user", content: prompt }],
        max_tokens: 2,
        stream: true,
        return_progress: true,
      });
      expect(chat.length).toBeGreaterThan(1);
      expect(chat[0]!.choices[0].delta).toEqual({ role: "assistant", content: null });
      expect(chat[chat.length - 1]!.prompt_progress.processed).toBe(chat[0]!.prompt_progress.total);
      // without return_progress there are none
      expect(await ask("/completion", { prompt, n_predict: 2, stream: true })).toEqual([]);
    });

    it("verbose adds __verbose (the native result, with the prompt) to OpenAI responses", async () => {
      const a = await start();
      const messages = [
        { role: "system", content: "Book" },
        { role: "user", content: "What is the best book" },
      ];
      const v = await a.post("/v1/chat/completions", { messages, max_tokens: 2, verbose: true });
      expect(v.body.__verbose.prompt).toContain("Book");
      expect(v.body.__verbose.tokens_predicted).toBe(2);
      const q = await a.post("/v1/chat/completions", { messages, max_tokens: 2 });
      expect(q.body.__verbose).toBeUndefined();
    });

    it("/slots: next_token is a list; a slot shows params only once it has run a request; --no-slots is 501", async () => {
      const a = await start({ slots: 2, ctxSize: 256 });
      const fresh = (await a.get("/slots")).body as Json[];
      expect(fresh[0]).toEqual({ id: 0, n_ctx: 128, speculative: false, is_processing: false });
      await a.post("/completion", { prompt: "Once", n_predict: 3, id_slot: 0 });
      const used = ((await a.get("/slots")).body as Json[])[0]!;
      expect(used.params).toMatchObject({ n_predict: 3 });
      expect(used.next_token).toEqual([{ has_next_token: false, has_new_line: false, n_remain: -1, n_decoded: 0 }]);
      const off = await start({ slotsEndpoint: false });
      const r = await off.get("/slots");
      expect(r.status).toBe(501);
      expect(r.body.error.type).toBe("not_supported_error");
      expect((await off.get("/props")).body.endpoint_slots).toBe(false);
    });

    it("chat text parts are joined with a newline", async () => {
      const a = await start();
      const parts = await a.post("/v1/chat/completions", {
        messages: [
          {
            role: "user",
            content: [
              { type: "text", text: "What is" },
              { type: "text", text: "the best book" },
            ],
          },
        ],
        max_tokens: 1,
        verbose: true,
      });
      expect(parts.body.__verbose.prompt).toContain("user\nWhat is\nthe best book<|im_end|>");
    });

    it("predicted_per_second leaves out the first token (it costs no decode step)", async () => {
      const a = await start();
      const one = await a.post("/completion", { prompt: "Once", n_predict: 1 });
      expect(one.body.timings).toMatchObject({ predicted_n: 1, predicted_per_second: 0, predicted_per_token_ms: 0 });
      const many = await a.post("/completion", { prompt: "Once", n_predict: 16 });
      const t = many.body.timings;
      expect(t.predicted_per_second).toBeCloseTo((15 * 1000) / t.predicted_ms, 6);
      expect(t.predicted_per_token_ms).toBeCloseTo(t.predicted_ms / 15, 6);
    });

    it("/props and /v1/models carry llama.cpp's model meta", async () => {
      const a = await start();
      const meta = (await a.get("/v1/models")).body.data[0].meta;
      const f = model.file;
      expect(meta).toMatchObject({
        vocab_type: 1, // SPM
        n_vocab: 512,
        n_ctx: 128,
        n_ctx_train: model.config.n_ctx_train,
        n_embd: model.config.n_embd,
        n_params: f.tensors.reduce((s, t) => s + t.nElements, 0),
        size: f.tensors.reduce((s, t) => s + t.byteLength, 0),
      });
      // this file has no general.file_type: llama.cpp guesses from its tensors (all F32)
      expect(f.metadata.has("general.file_type")).toBe(false);
      expect(meta.ftype).toBe("(guessed) all F32");
      expect((await a.get("/props")).body.model_ftype).toBe(meta.ftype);
    });
  });

  describe("endpoints and status codes", () => {
    it("CORS: a preflight is answered without the key; responses, streamed too, allow the origin", async () => {
      const a = await start({ apiKey: "sekrit" });
      const pre = await fetch(`${a.url}/completions`, {
        method: "OPTIONS",
        headers: {
          Origin: "web.mydomain.fr",
          "Access-Control-Request-Method": "POST",
          "Access-Control-Request-Headers": "Authorization",
        },
      });
      expect(pre.status).toBe(200);
      expect(pre.headers.get("access-control-allow-origin")).toBe("web.mydomain.fr");
      expect(pre.headers.get("access-control-allow-credentials")).toBe("true");
      expect(pre.headers.get("access-control-allow-methods")).toBe("GET, POST, DELETE, OPTIONS");
      expect(pre.headers.get("access-control-allow-headers")).toBe("*");
      const headers = { Origin: "http://localhost:3000", Authorization: "Bearer sekrit" };
      const r = await a.post("/completion", { prompt: "Once", n_predict: 1 }, headers);
      expect(r.headers.get("access-control-allow-origin")).toBe("http://localhost:3000");
      const s = await fetch(`${a.url}/completion`, {
        method: "POST",
        headers,
        body: JSON.stringify({ prompt: "Once", n_predict: 1, stream: true }),
      });
      expect(s.headers.get("access-control-allow-origin")).toBe("http://localhost:3000");
      await s.text();
      const denied = await a.post("/completion", { prompt: "Once" }, { Origin: "http://x" });
      expect(denied.status).toBe(401);
      expect(denied.headers.get("access-control-allow-origin")).toBe("http://x");
    });

    it("a bare Authorization: KEY is accepted, as llama.cpp", async () => {
      const a = await start({ apiKey: "sekrit" });
      expect((await a.post("/completion", { prompt: "Once", n_predict: 1 }, { Authorization: "sekrit" })).status).toBe(
        200,
      );
      expect((await a.post("/completion", { prompt: "Once", n_predict: 1 }, { Authorization: "wrong" })).status).toBe(
        401,
      );
    });

    it("POST /completions is llama.cpp's native endpoint", async () => {
      const a = await start();
      const body = { prompt: "Once upon a time", n_predict: 4, temperature: 0 };
      const alias = await a.post("/completions", body);
      expect(alias.body).toMatchObject({ content: ", there was a", stop: true, stop_type: "limit" });
      expect(alias.body.content).toBe((await a.post("/completion", body)).body.content);
    });

    it("POST /chat/completions/input_tokens counts the prompt tokens of a chat request", async () => {
      const a = await start();
      const messages = [
        { role: "system", content: "Book" },
        { role: "user", content: "What is the best book" },
      ];
      for (const path of ["/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"]) {
        const r = await a.post(path, { messages });
        expect(r.status).toBe(200);
        const chat = await a.post("/v1/chat/completions", { messages, max_tokens: 1 });
        expect(r.body).toEqual({ input_tokens: chat.body.usage.prompt_tokens, object: "response.input_tokens" });
      }
    });

    it("chat: a final assistant message is continued; 400 for two at the end and for add_generation_prompt with continue_final_message", async () => {
      const a = await start();
      const user = { role: "user", content: "Tell me a story" };
      const pre = await a.post("/v1/chat/completions", {
        messages: [user, { role: "assistant", content: "Once upon" }],
        max_tokens: 3,
        temperature: 0,
        verbose: true,
      });
      expect(pre.status).toBe(200);
      expect(pre.body.__verbose.prompt.endsWith("<|im_start|>assistant\nOnce upon")).toBe(true);
      const explicit = await a.post("/v1/chat/completions", {
        messages: [user, { role: "assistant", content: "Once upon" }],
        max_tokens: 3,
        temperature: 0,
        add_generation_prompt: false,
        continue_final_message: true,
      });
      expect(explicit.body.choices[0].message.content).toBe(pre.body.choices[0].message.content);
      for (const body of [
        { messages: [user, { role: "assistant", content: "a" }, { role: "assistant", content: "b" }] },
        {
          messages: [user, { role: "assistant", content: "a" }],
          add_generation_prompt: true,
          continue_final_message: true,
        },
        // add_generation_prompt defaults to true (llama.cpp)
        { messages: [user, { role: "assistant", content: "a" }], continue_final_message: true },
      ]) {
        const r = await a.post("/v1/chat/completions", { ...body, max_tokens: 1 });
        expect(r.status, JSON.stringify(body)).toBe(400);
        expect(r.body.error.type).toBe("invalid_request_error");
      }
    });

    it("invalid UTF-8 in a body: 400", async () => {
      const a = await start();
      const res = await fetch(`${a.url}/completion`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: Buffer.concat([Buffer.from('{"prompt":"Once '), Buffer.from([0xff, 0xfe]), Buffer.from('"}')]),
      });
      expect(res.status).toBe(400);
      expect(((await res.json()) as Json).error.message).toBe("the body is not valid UTF-8");
    });

    it('a JSON-object prompt {"prompt_string": …} is a prompt; multimodal data is refused', async () => {
      const a = await start();
      const text = await a.post("/completion", { prompt: "Once upon a time", n_predict: 4, temperature: 0 });
      const obj = await a.post("/completion", {
        prompt: { prompt_string: "Once upon a time" },
        n_predict: 4,
        temperature: 0,
      });
      expect(obj.status).toBe(200);
      expect(obj.body.content).toBe(text.body.content);
      const ids = (await a.post("/tokenize", { content: "Once upon a time", add_special: true })).body.tokens;
      const mixed = await a.post("/completion", {
        prompt: [ids, { prompt_string: "Once upon a time" }],
        n_predict: 4,
        temperature: 0,
      });
      expect(mixed.body.map((r: Json) => r.content)).toEqual([text.body.content, text.body.content]);
      const oai = await a.post("/v1/completions", {
        prompt: { prompt_string: "Once upon a time" },
        max_tokens: 4,
        temperature: 0,
      });
      expect(oai.body.choices[0].text).toBe(text.body.content);
      const mm = await a.post("/completion", { prompt: { prompt_string: "x <__media__>", multimodal_data: ["AAAA"] } });
      expect(mm.status).toBe(400);
    });

    it("string-keyed logit_bias: the text's tokens get the bias", async () => {
      const a = await start();
      const plain = await a.post("/completion", { prompt: "Once upon a time", n_predict: 8, temperature: 0 });
      expect(plain.body.content).toContain(" there");
      const there = (await a.post("/tokenize", { content: " there" })).body.tokens as number[];
      for (const logit_bias of [{ " there": -100 }, [[" there", false]]]) {
        const r = await a.post("/completion", { prompt: "Once upon a time", n_predict: 8, temperature: 0, logit_bias });
        expect(r.status).toBe(200);
        expect(r.body.content).not.toContain(" there");
        expect(r.body.generation_settings.logit_bias.map((b: Json) => b.token)).toEqual(there);
      }
    });
  });

  describe("large and odd inputs", () => {
    it("a 4,200-level nested array prompt: 400, not a stack overflow", async () => {
      const a = await start();
      const nested = `${"[".repeat(4200)}0${"]".repeat(4200)}`;
      for (const [path, body] of [
        ["/v1/completions", `{"prompt":${nested}}`],
        ["/completion", `{"prompt":${nested}}`],
        ["/v1/chat/completions", `{"messages":[{"role":"user","content":${nested}}]}`],
      ] as const) {
        const r = await a.post(path, body);
        expect(r.status, path).toBe(400);
        expect(r.body.error.type).toBe("invalid_request_error");
        expect(r.body.error.message).toMatch(/got \[\[\[/);
      }
    });

    it('{"max_tokens": 1e400} names the value, not "null"', async () => {
      const a = await start();
      const r = await a.post("/v1/completions", '{"prompt":"Once","max_tokens":1e400}');
      expect(r.status).toBe(400);
      expect(r.body.error.message).toBe('"max_tokens": expected an integer ≥ -2, got Infinity');
    });

    it("/completion reads max_tokens (and max_completion_tokens) when n_predict is absent", async () => {
      const a = await start();
      expect((await a.post("/completion", { prompt: "Once", max_tokens: 5 })).body.tokens_predicted).toBe(5);
      expect((await a.post("/completion", { prompt: "Once", max_completion_tokens: 3 })).body.tokens_predicted).toBe(3);
      expect((await a.post("/completion", { prompt: "Once", max_tokens: 5, n_predict: 2 })).body.tokens_predicted).toBe(
        2,
      );
    });

    it("a prompt that cannot fit is refused before it is tokenized; a long text is tokenized off the event loop", async () => {
      const a = await start();
      const tok = model.tokenizer;
      const original = tok.tokenize.bind(tok);
      const seen: number[] = [];
      tok.tokenize = (text, opts) => {
        seen.push(text.length);
        return original(text, opts);
      };
      try {
        const huge = "Once upon a time there was a dog. ".repeat(30_000); // ~1 MB
        const r = await a.post("/v1/completions", { prompt: huge, max_tokens: 4 });
        expect(r.status).toBe(400);
        expect(r.body.error.type).toBe("exceed_context_size_error");
        expect(r.body.error.message).toContain("exceeds the available context size");
        expect(r.body.error.n_prompt_tokens).toBeGreaterThanOrEqual(Math.ceil(Buffer.byteLength(huge) / 9));
        const chat = await a.post("/v1/chat/completions", { messages: [{ role: "user", content: huge }] });
        expect(chat.status).toBe(400);
        expect(seen.filter((n) => n > 1000)).toEqual([]); // nothing of it was tokenized
        // /tokenize has no context to fit: a long text goes to the worker, with the same ids
        const long = "The little boat sailed on the blue sea. ".repeat(500);
        const ids = (await a.post("/tokenize", { content: long })).body.tokens;
        expect(seen.filter((n) => n > 1000)).toEqual([]);
        expect(ids).toEqual(original(long, { addSpecial: false, parseSpecial: true }));
        // and while a very long one is tokenized there, the server answers
        const big = fetch(`${a.url}/tokenize`, {
          method: "POST",
          body: JSON.stringify({ content: "Lily and Ben played in the park all day long. ".repeat(15_000) }),
        }).then(() => "tokenize");
        const health = fetch(`${a.url}/health`).then(() => "health");
        expect(await Promise.race([big, health])).toBe("health");
        await big;
      } finally {
        tok.tokenize = original;
      }
    });

    it("decode steps are computed off the JS thread (computeAsync)", async () => {
      const a = await start();
      const b = model.backend;
      const sync = b.compute.bind(b);
      const async_ = b.computeAsync.bind(b);
      let syncCalls = 0;
      let asyncCalls = 0;
      b.compute = (g) => {
        syncCalls++;
        return sync(g);
      };
      b.computeAsync = (g) => {
        asyncCalls++;
        return async_(g);
      };
      try {
        const r = await a.post("/completion", { prompt: "Once upon a time", n_predict: 8 });
        expect(r.body.tokens_predicted).toBe(8);
        expect(asyncCalls).toBe(8); // the prompt's step and 7 more (the last token is sampled, not evaluated)
        expect(syncCalls).toBe(0);
      } finally {
        b.compute = sync;
        b.computeAsync = async_;
      }
    });
  });
});
