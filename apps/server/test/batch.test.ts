/**
 * The engine under the server: multi-sequence decode steps (Model.decodeBatch) against one session at a time,
 * dense and sparse, and the continuous-batching scheduler (slots, queue bound, cancellation, metrics).
 */
import { join } from "node:path";
import { type CpuBackend, cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, BatchScheduler, EngineError, Model, type SparseMode } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const stories = join(models, "stories260K.gguf");
const probe = await cpuBackend.probe();

const prompts = [
  [1, 403, 407, 261, 378], // Once upon a time
  [1, 326, 381, 261, 352, 266, 268, 388], // Tim had a red ball
  [1, 403],
  [1, 326, 381, 261, 352, 266, 268, 388, 426, 346, 397, 355],
];

/** Greedy ids and every step's logits, one session alone. */
function alone(model: Model, prompt: number[], n: number) {
  const s = model.createSession({ nCtx: 64 });
  const logits: Float32Array[] = [];
  let l = s.evaluate(prompt);
  const ids: number[] = [];
  for (let i = 0; i < n; i++) {
    logits.push(Float32Array.from(l));
    ids.push(argmax(l));
    l = s.evaluate([ids[i]!]);
  }
  s.dispose();
  return { ids, logits };
}

/**
 * The same sequences in one batch: prompts chunked unevenly (so prompt chunks share steps with decoding),
 * sequence i joining at step i.
 */
function together(model: Model, ps: number[][], n: number) {
  const sessions = ps.map(() => model.createSession({ nCtx: 64 }));
  const out = ps.map(() => ({ ids: [] as number[], logits: [] as Float32Array[] }));
  const fed = ps.map(() => 0);
  const next = ps.map(() => -1);
  let widest = 0;
  for (let step = 0; out.some((o) => o.ids.length < n); step++) {
    const members: number[] = [];
    const entries = [];
    for (let i = 0; i < ps.length; i++) {
      if (step < i || out[i]!.ids.length >= n) continue;
      if (fed[i]! < ps[i]!.length) {
        const take = Math.min(3, ps[i]!.length - fed[i]!);
        const last = fed[i]! + take === ps[i]!.length;
        entries.push({
          session: sessions[i]!,
          tokens: ps[i]!.slice(fed[i]!, fed[i]! + take),
          logits: last ? ("last" as const) : ("none" as const),
        });
        fed[i]! += take;
      } else {
        entries.push({ session: sessions[i]!, tokens: [next[i]!] });
      }
      members.push(i);
    }
    widest = Math.max(widest, entries.length);
    const r = model.decodeBatch(entries);
    members.forEach((i, k) => {
      const l = r.logits[k];
      if (!l) return;
      out[i]!.logits.push(Float32Array.from(l));
      next[i] = argmax(l);
      out[i]!.ids.push(next[i]!);
    });
  }
  for (const s of sessions) s.dispose();
  return { out, widest };
}

describe.skipIf(!probe.usable)(`continuous batching in the engine (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
  });
  afterAll(() => backend?.dispose());

  for (const file of ["stories260K.gguf", "stories260K-Q8_0-ffn_down-F16.gguf"]) {
    it(`${file}: every sequence of a batch gets bit-identical logits to running alone`, async () => {
      const model = await Model.load(join(models, file), { backend });
      try {
        const { out, widest } = together(model, prompts, 12);
        expect(widest).toBe(prompts.length);
        prompts.forEach((p, i) => {
          const a = alone(model, p, 12);
          expect(out[i]!.ids).toEqual(a.ids);
          a.logits.forEach((l, j) => {
            expect(Buffer.from(out[i]!.logits[j]!.buffer).equals(Buffer.from(l.buffer))).toBe(true);
          });
        });
      } finally {
        model.dispose();
      }
    });
  }

  for (const [file, sparse] of [
    ["relu/tinystories-relu-llama-7m.f32.gguf", "oracle"],
    ["powerinfer/tiny-f16.powerinfer.gguf", "predictor"],
    ["powerinfer/tiny-q4_0.powerinfer.gguf", "predictor"],
    ["powerinfer/tiny-q4_0.powerinfer.gguf", "off"],
  ] as const) {
    it(`${file.split("/")[1]} (${sparse}): each sequence of a batch gets bit-identical logits to running alone (sparse: its own active neurons)`, async () => {
      const model = await Model.load(join(models, file), { backend, sparse: sparse as SparseMode });
      try {
        const ps = file.startsWith("relu") ? prompts : prompts.map((p) => p.map((t) => (t < 265 ? t : 259 + (t % 6))));
        const { out } = together(model, ps, 8);
        ps.forEach((p, i) => {
          const a = alone(model, p, 8);
          expect(out[i]!.ids).toEqual(a.ids);
          a.logits.forEach((l, j) => {
            expect(Buffer.from(out[i]!.logits[j]!.buffer).equals(Buffer.from(l.buffer)), `seq ${i} step ${j}`).toBe(
              true,
            );
          });
        });
      } finally {
        model.dispose();
      }
    });
  }

  it("copyFrom gives another session the same cache: its continuation is identical", async () => {
    const model = await Model.load(stories, { backend });
    try {
      const a = model.createSession({ nCtx: 64 });
      const b = model.createSession({ nCtx: 64 });
      a.evaluate(prompts[0]!);
      b.copyFrom(a);
      expect(b.nPast).toBe(prompts[0]!.length);
      const r = model.decodeBatch([
        { session: a, tokens: [432] },
        { session: b, tokens: [432] },
      ]);
      expect(Buffer.from(r.logits[0]!.slice().buffer).equals(Buffer.from(r.logits[1]!.slice().buffer))).toBe(true);
      expect(() => b.copyFrom(a, 99)).toThrow(/cannot copy 99 positions/);
      a.dispose();
      b.dispose();
    } finally {
      model.dispose();
    }
  });

  it("rejects a bad batch without touching any cache", async () => {
    const model = await Model.load(stories, { backend });
    try {
      const a = model.createSession({ nCtx: 8 });
      const b = model.createSession({ nCtx: 8 });
      expect(() => model.decodeBatch([])).toThrow(/empty batch/);
      expect(() =>
        model.decodeBatch([
          { session: a, tokens: [1] },
          { session: a, tokens: [2] },
        ]),
      ).toThrow(/twice/);
      expect(() =>
        model.decodeBatch([
          { session: a, tokens: [1] },
          { session: b, tokens: [600] },
        ]),
      ).toThrow(/outside/);
      expect(() =>
        model.decodeBatch([
          { session: a, tokens: [1, 2, 3] },
          { session: b, tokens: [1, 2, 3, 4, 5, 6, 7, 8, 9] },
        ]),
      ).toThrow(EngineError);
      expect(a.nPast).toBe(0);
      expect(b.nPast).toBe(0);
      a.dispose();
      b.dispose();
    } finally {
      model.dispose();
    }
  });

  it("Model.load returns once a deferring backend's huge-page copies are made (serve answers meanwhile)", async () => {
    const b = (await cpuBackend.load({
      threads: 1,
      hugePageCopyBytes: 2 ** 40,
      deferHugePageCopies: true,
    })) as CpuBackend;
    try {
      const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
      const m = await Model.load(relu, { backend: b, sparse: "off" });
      expect(b.pendingHugePageCopyBytes()).toBe(0);
      expect(b.hugePageCopyBytes()).toBeGreaterThan(2 ** 21); // its 2 MiB-and-larger tensors were copied
      const s = m.createSession({ nCtx: 64 });
      const ref = await Model.load(relu, { backend, sparse: "off" });
      const r = ref.createSession({ nCtx: 64 });
      expect(Array.from(s.evaluate(prompts[0]!))).toEqual(Array.from(r.evaluate(prompts[0]!)));
      s.dispose();
      r.dispose();
      ref.dispose();
      m.dispose();
    } finally {
      b.dispose();
    }
  });

  describe("the scheduler", () => {
    let model: Model;
    beforeAll(async () => {
      model = await Model.load(stories, { backend });
    });
    afterAll(() => model?.dispose());

    it("runs more requests than slots, each equal to Session.generate, with shared decode steps", async () => {
      const sched = new BatchScheduler(model, { slots: 4, nCtx: 64, nBatch: 16 });
      try {
        const opts = (i: number) => ({
          maxTokens: 20,
          temperature: i % 2 ? 0.9 : 0,
          seed: 100 + i,
          stop: i === 3 ? ["Lily"] : [],
        });
        const texts = [
          "Once upon a time",
          "Tim had a red ball",
          "The sun",
          "One day",
          "A cat",
          "Sam and",
          "Mom said",
          "The dog",
        ];
        const reqs = texts.map((t, i) => sched.submit(t, opts(i)));
        const got = await Promise.all(reqs.map((r) => r.collect()));
        for (const [i, t] of texts.entries()) {
          const s = model.createSession({ nCtx: 64 });
          let want = "";
          for await (const tok of s.generate(t, opts(i))) want += tok.text;
          expect(got[i]!.text).toBe(want);
          expect(got[i]!.stopReason).toBe(s.timings.stopReason);
          s.dispose();
        }
        const m = sched.metrics;
        expect(m.requestsFinished).toBe(8);
        expect(m.maxSequencesPerStep).toBe(4);
        expect(m.sharedDecodeSteps).toBeGreaterThan(10);
        expect(m.decodeSteps).toBeLessThan(m.generatedTokens / 2);
        expect(sched.slots().every((s) => !s.busy)).toBe(true);
      } finally {
        await sched.close();
      }
    });

    it("a cancelled request leaves its slot at the next step; the others are unaffected", async () => {
      const sched = new BatchScheduler(model, { slots: 2, nCtx: 128 });
      try {
        const keep = sched.submit("Once upon a time", { maxTokens: 32, temperature: 0 });
        const ac = new AbortController();
        const gone = sched.submit("Tim had a red ball", {
          maxTokens: 100,
          ignoreEos: true,
          temperature: 0,
          signal: ac.signal,
        });
        let n = 0;
        for await (const _ of gone) if (++n === 3) ac.abort();
        expect(gone.stopReason).toBe("aborted");
        expect(gone.timings.generatedTokens).toBeLessThanOrEqual(4);
        const r = await keep.collect();
        expect(r.text).toBe(
          ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw",
        );
        expect(sched.metrics.requestsAborted).toBe(1);
        expect(sched.slots().every((s) => !s.busy)).toBe(true);
      } finally {
        await sched.close();
      }
    });

    it("reuses a free slot's cached prefix (prompt caching) with the same output", async () => {
      const sched = new BatchScheduler(model, { slots: 2, nCtx: 128 });
      try {
        const prompt = "Once upon a time";
        const first = await sched.submit(prompt, { maxTokens: 32, temperature: 0 }).collect();
        // the slot holds the prompt and every generated token but the last (never evaluated)
        const cached = [...model.tokenizer.tokenize(prompt), ...first.tokens.slice(0, -1).map((t) => t.id)];
        const text = `${prompt}${first.text}. Then`;
        const ids = model.tokenizer.tokenize(text);
        let lcp = 0;
        while (lcp < cached.length && cached[lcp] === ids[lcp]) lcp++;
        expect(lcp).toBeGreaterThan(20);
        const opts = { maxTokens: 16, temperature: 0.8, seed: 5 };
        const longer = sched.submit(text, opts);
        const l = await longer.collect();
        expect(longer.cachedTokens).toBe(lcp);
        expect(longer.timings.promptTokens).toBe(ids.length - lcp);
        const s = model.createSession({ nCtx: 128 });
        let want = "";
        for await (const t of s.generate(text, opts)) want += t.text;
        s.dispose();
        expect(l.text).toBe(want);
        const again = sched.submit(prompt, { maxTokens: 32, temperature: 0 });
        expect((await again.collect()).text).toBe(first.text);
        expect(again.cachedTokens).toBe(4); // the whole prompt but its last token, whose logits are needed
        const off = sched.submit(prompt, { maxTokens: 4, temperature: 0, cachePrompt: false });
        await off.collect();
        expect(off.cachedTokens).toBe(0);
      } finally {
        await sched.close();
      }
    });

    it("refuses beyond the queue bound and prompts longer than a slot", async () => {
      const sched = new BatchScheduler(model, { slots: 1, nCtx: 32, queueLimit: 1 });
      try {
        const a = sched.submit("Once", { maxTokens: 8, temperature: 0 });
        const b = sched.submit("Once", { maxTokens: 8, temperature: 0 });
        expect(() => sched.submit("Once", {})).toThrow(/all 1 slots are in use and 1 requests are waiting \(limit 1\)/);
        expect(() => sched.submit("Once upon a time ".repeat(10), {})).toThrow(/prompt has \d+ tokens, .*\(n_ctx 32\)/);
        const [ra, rb] = await Promise.all([a.collect(), b.collect()]);
        expect(ra.text).toBe(rb.text);
        expect(sched.metrics.requestsRejected).toBe(1);
      } finally {
        await sched.close();
      }
    });

    it("refuses slots whose KV caches together exceed free memory, before making them", () => {
      // one stories260K cache of 128 positions is 80 KiB: 10^9 of them exceed any machine's memory; before
      // the check, serve -np 100000 on a 7B shape filled the memory one cache at a time
      const slots = 1e9;
      const t0 = performance.now();
      let err: unknown;
      try {
        new BatchScheduler(model, { slots, nCtx: 128 });
      } catch (e) {
        err = e;
      }
      expect((err as { code?: string }).code).toBe("OUT_OF_MEMORY");
      expect(String((err as Error).message)).toMatch(
        /^1000000000 slots need KV caches of [0-9.]+ GiB \(n_ctx 128 each\), cpu has [0-9.]+ GiB free; use fewer slots \(-np\) or a smaller -c$/,
      );
      expect(performance.now() - t0).toBeLessThan(5000);
    });
  });
});
