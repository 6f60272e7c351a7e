/**
 * Models with routed experts (mixture of experts) and the dense Qwen layouts that share their blocks,
 * on small generated files (core's generateSyntheticMoeModel), against llama.cpp built for this CPU
 * (node-llama-cpp, 1 thread), a one-token prompt and a 16-token batch prompt, 12 greedy steps:
 * - greedy ids equal;
 * - logits within the tolerances of the dense llama tests against the same peer (golden.test.ts:
 *   1e-2 for F32 and F16 weights, 0.1 for Q8_0, 0.5 for Q4_0) at every step. Measured here: F32, F16
 *   and Q8_0 agree to < 1e-6 at almost every step.
 * - Q4_0 only: llama.cpp on AVX2 runs Q4_0 through its repacked kernels, whose activations round
 *   differently at a few half-way points (golden.test.ts pins such divergences on the dense Q4_0 file);
 *   where a step's routing is a near-tie that is enough for llama.cpp to choose another expert, and the
 *   step's logits then differ by that expert's output. A step's routing margin is the smallest gap, over
 *   layers and tokens, between the last chosen expert's probability and the next one's (ours, captured);
 *   Q4_0 steps with a margin below 5e-3 are exempt from the logits check, counted, and must be at most a
 *   quarter of the steps.
 */
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, buildLlamaGraph, KvCache, EngineError, type LayerCapture, Model } from "@powerinfer/engine";
import {
  generateSyntheticMoeModel,
  MOE_SHAPE_PRESETS,
  type SyntheticMoeArch,
  type SyntheticMoeOptions,
  type SyntheticMoeShape,
} from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";
import { type LlamaCppPeer, loadLlamaCpp } from "../src/bench/llama-cpp.js";

const probe = await cpuBackend.probe();
const peer = await loadLlamaCpp();
const peerReason = "unavailable" in peer ? peer.unavailable : "";
const dir = mkdtempSync(join(tmpdir(), "moe-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The smallest gap between the k-th and (k+1)-th router probability over every layer and token. */
function routingMargin(layers: LayerCapture[], nExpert: number, k: number): number {
  let m = Number.POSITIVE_INFINITY;
  for (const c of layers) {
    const p = c.routerProbs!;
    for (let t = 0; t < p.length / nExpert; t++) {
      const s = Array.from(p.subarray(t * nExpert, (t + 1) * nExpert)).sort((a, b) => b - a);
      if (k < nExpert) m = Math.min(m, s[k - 1]! - s[k]!);
    }
  }
  return m;
}

/** Greedy ids, the logits before each and the routing margin of each step (one token at a time after the prompt). */
function greedy(model: Model, prompt: number[], n: number) {
  const s = model.createSession({ nCtx: 128, kvType: "f16" });
  const moe = model.config.moe;
  const margins: number[] = [];
  const onCapture = moe
    ? (layers: LayerCapture[]) => margins.push(routingMargin(layers, moe.n_expert, moe.n_expert_used))
    : undefined;
  let l = s.evaluate(prompt, { onCapture });
  const ids: number[] = [];
  const logits: Float32Array[] = [];
  for (let i = 0; i < n; i++) {
    logits.push(Float32Array.from(l));
    ids.push(argmax(l));
    if (i < n - 1) l = s.evaluate([ids[i]!], { onCapture });
  }
  s.dispose();
  return { ids, logits, margins };
}

type WeightType = "F32" | "F16" | "Q8_0" | "Q4_0";
/** golden.test.ts's tolerances for the dense llama files against the same peer. */
const TOL: Record<WeightType, number> = { F32: 1e-2, F16: 1e-2, Q8_0: 0.1, Q4_0: 0.5 };
/**
 * The 4100-token SmallThinker case: 5 layers over 4100 positions of F16 cache, where the two
 * implementations' F16 roundings part at more half-way points (measured 0.04–0.16 over the 8 steps;
 * the test prints them).
 */
const LONG_TOL = 0.25;
/** Routing margins below which a step is a near-tie (Q4_0 only, see the module comment). */
const ROUTING_NOISE: Record<WeightType, number> = { F32: 0, F16: 0, Q8_0: 0, Q4_0: 5e-3 };

const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>) => {
  let w = 0;
  for (let i = 0; i < a.length; i++) w = Math.max(w, Math.abs(a[i]! - b[i]!));
  return w;
};

// the last: five repeats of one token (where SmallThinker Q8_0 once parted from the peer, see its case)
const PROMPTS = [[1], [1, 17, 250, 300, 42, 9, 480, 3, 77, 91, 200, 150, 12, 64, 5, 311], [1, 42, 42, 42, 42, 42]];

const SHAPE: SyntheticMoeShape = TINY_MOE_SHAPE;

describe.skipIf(!probe.usable)(`routed experts (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());

  it("reads llama with experts (Mixtral layout): expert count, experts per token, neurons per expert", async () => {
    const path = join(dir, "cfg.gguf");
    generateSyntheticMoeModel(path, { arch: "llama-moe", shape: SHAPE });
    const m = await Model.load(path, { backend });
    try {
      expect(m.config.arch).toBe("llama");
      expect(m.config.moe).toEqual({
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 64,
        gating: "softmax",
        norm_weights: true,
        weights_scale: 1,
        router_input: "ffn_input",
      });
    } finally {
      m.dispose();
    }
  });

  it("refuses a backend without the expert ops with a typed error", async () => {
    const path = join(dir, "noops.gguf");
    generateSyntheticMoeModel(path, { arch: "llama-moe", shape: SHAPE });
    const without = new Proxy(backend, {
      get: (t, k) =>
        k === "supportsOp"
          ? (op: string, d: string[]) => op !== "mul_mat_id" && t.supportsOp(op as never, d as never)
          : Reflect.get(t, k),
    });
    const err = await Model.load(path, { backend: without }).catch((e) => e);
    expect(err).toBeInstanceOf(EngineError);
    expect((err as EngineError).code).toBe("UNSUPPORTED_OP");
    expect(String(err.message)).toMatch(/does not implement mul_mat_id for f32/);
  });

  it("continuous batching: two sequences decoded in one graph get, bit for bit, their logits alone (qwen3moe, smallthinker with windows)", async () => {
    for (const [arch, opts] of [
      ["qwen3moe", { shape: { ...SHAPE, head_dim: 32 } }],
      ["smallthinker", { shape: SHAPE, layers: 5, slidingWindow: 4096, untiedOutput: false }],
    ] as const) {
      const path = join(dir, `batch-${arch}.gguf`);
      generateSyntheticMoeModel(path, { arch, seed: 9, dtype: "Q8_0", ...opts });
      const m = await Model.load(path, { backend });
      try {
        const pa = [1, 40, 300, 7, 99];
        const pb = [1, 250, 3];
        const alone = (p: number[]) => {
          const s = m.createSession({ nCtx: 32 });
          const l = Float32Array.from(s.evaluate(p));
          s.dispose();
          return l;
        };
        const a = m.createSession({ nCtx: 32 });
        const b = m.createSession({ nCtx: 32 });
        const r = m.decodeBatch([
          { session: a, tokens: pa },
          { session: b, tokens: pb },
        ]);
        expect(Array.from(r.logits[0]!), arch).toEqual(Array.from(alone(pa)));
        expect(Array.from(r.logits[1]!), arch).toEqual(Array.from(alone(pb)));
        a.dispose();
        b.dispose();
      } finally {
        m.dispose();
      }
    }
  });

  interface PeerCase {
    arch: SyntheticMoeArch;
    dtype: WeightType;
    opts?: Partial<SyntheticMoeOptions>;
    label?: string;
    /** Overrides TOL[dtype] (documented where used). */
    tol?: number;
  }
  const cases: PeerCase[] = [
    { arch: "llama-moe", dtype: "F32" },
    { arch: "llama-moe", dtype: "Q8_0" },
    { arch: "llama-moe", dtype: "Q4_0" },
    { arch: "llama-moe", dtype: "F16" },
    { arch: "qwen3moe", dtype: "F32" },
    { arch: "qwen3moe", dtype: "Q8_0" },
    { arch: "qwen3moe", dtype: "Q4_0" },
    { arch: "qwen2", dtype: "F32" },
    { arch: "qwen2", dtype: "Q8_0" },
    { arch: "qwen3", dtype: "F32" },
    { arch: "qwen3", dtype: "Q4_0" },
    // SmallThinker: router on the layer input, ReGLU experts, tied output; softmax and sigmoid gating
    { arch: "smallthinker", dtype: "F32", opts: { untiedOutput: false }, label: "softmax gating" },
    { arch: "smallthinker", dtype: "F32", opts: { untiedOutput: false, gating: "sigmoid" }, label: "sigmoid gating" },
    { arch: "smallthinker", dtype: "F16", opts: { untiedOutput: true, gating: "sigmoid" }, label: "sigmoid gating" },
    // Q8_0: equal to the peer bit for bit on the 2-vCPU AMD EPYC with AVX-512 (2026-12-04). On the machine of
    // an earlier session, the repeated-token prompt parted from node-llama-cpp's prebuilt by up to 0.24 in the
    // logits through attn_output (then skipped, not understood); the tolerance stays TOL.Q8_0.
    { arch: "smallthinker", dtype: "Q8_0", opts: { untiedOutput: false }, label: "softmax gating" },
    { arch: "smallthinker", dtype: "Q8_0", opts: { untiedOutput: true, gating: "sigmoid" }, label: "sigmoid gating" },
    // 5 layers with a sliding window: layers 1-3 windowed (4096), layers 0 and 4 NoPE with full attention.
    // Deeper: the two implementations' F16 KV-cache and F16-query roundings part at a few half-way points
    // per layer; measured ≤ 1.1e-2 on these files, hence 3e-2 for this case (ids must still be equal).
    {
      arch: "smallthinker",
      dtype: "F32",
      opts: { untiedOutput: false, gating: "sigmoid", slidingWindow: 4096, layers: 5 },
      label: "sliding window, NoPE layers 0 and 4",
      tol: 3e-2,
    },
  ];
  for (const { arch, dtype, opts, label, tol } of cases) {
    it.skipIf("unavailable" in peer)(
      `${arch} ${dtype}${label ? ` (${label})` : ""} equals llama.cpp built for this CPU ${peerReason}`,
      async () => {
        const llama = peer as LlamaCppPeer;
        const path = join(dir, `${arch}-${dtype}-${label ?? ""}.gguf`.replace(/[^\w.-]/g, "_"));
        // qwen3 and qwen3moe: head_dim 32 with 4 heads (n_head·head_dim = 128 ≠ n_embd, as Qwen3's 128 ≠ 2048)
        const shape = arch.startsWith("qwen3") ? { ...SHAPE, head_dim: 32 } : SHAPE;
        generateSyntheticMoeModel(path, { arch, shape, dtype, seed: 3, ...opts });
        const runner = await llama.open(path, { contextSize: 128, batchSize: 128, threads: 1 });
        const m = await Model.load(path, { backend });
        try {
          let steps = 0;
          let nearTies = 0;
          for (const prompt of PROMPTS) {
            const theirs = await runner.greedy(prompt, 12);
            const ours = greedy(m, prompt, 12);
            expect(ours.ids).toEqual(theirs.ids);
            ours.logits.forEach((l, i) => {
              steps++;
              if (m.config.moe && ours.margins[i]! < ROUTING_NOISE[dtype]) {
                nearTies++;
                return;
              }
              expect(maxDiff(l, theirs.logits[i]!), `${dtype} step ${i}`).toBeLessThan(tol ?? TOL[dtype]);
            });
          }
          expect(nearTies, `${nearTies} of ${steps} steps with a routing near-tie`).toBeLessThanOrEqual(steps / 4);
        } finally {
          m.dispose();
          await runner.dispose();
        }
      },
      120_000,
    );
  }

  it.skipIf("unavailable" in peer)(
    `smallthinker decodes past position 4096 like llama.cpp (window 4096 on layers 1-3 of 5) ${peerReason}`,
    async () => {
      const llama = peer as LlamaCppPeer;
      const path = join(dir, "st-long.gguf");
      generateSyntheticMoeModel(path, {
        arch: "smallthinker",
        shape: { ...SHAPE, n_ctx: 8192 },
        layers: 5,
        dtype: "F32",
        seed: 5,
        untiedOutput: false,
        gating: "sigmoid",
        slidingWindow: 4096,
      });
      const m = await Model.load(path, { backend });
      expect(m.config.layer_attention).toEqual([
        { rope: false, window: 0 },
        { rope: true, window: 4096 },
        { rope: true, window: 4096 },
        { rope: true, window: 4096 },
        { rope: false, window: 0 },
      ]);
      // 4100 prompt tokens, then 8 greedy steps at positions 4100..4107: the windowed layers drop the
      // first positions, the NoPE layer 0 still sees them all
      const prompt = [1, ...Array.from({ length: 4099 }, (_, i) => 3 + ((i * 37) % 500))];
      const runner = await llama.open(path, { contextSize: 4224, batchSize: 512, threads: 2 });
      try {
        const theirs = await runner.greedy(prompt, 8);
        const s = m.createSession({ nCtx: 4224, kvType: "f16" });
        let l = s.evaluate(prompt);
        const diffs: number[] = [];
        const ids: number[] = [];
        for (let i = 0; i < 8; i++) {
          ids.push(argmax(l));
          diffs.push(maxDiff(l, theirs.logits[i]!));
          if (i < 7) l = s.evaluate([theirs.ids[i]!]);
        }
        console.log(
          `smallthinker past 4096: logits differ from llama.cpp by ${diffs.map((d) => d.toExponential(1)).join(" ")}`,
        );
        expect(ids).toEqual(theirs.ids);
        for (const [i, d] of diffs.entries()) expect(d, `step ${i}`).toBeLessThan(LONG_TOL);
        s.dispose();
        // the window is what llama.cpp does: over the whole sequence (prompt + 7 steps) in one batch, the
        // last logits with full attention on every layer are further from llama.cpp's than with the window
        // (both in one batch, so in the same arithmetic: a batch of ≥ 64 tokens takes the tiled attention)
        const seq = Int32Array.from([...prompt, ...theirs.ids.slice(0, 7)]);
        const full = { ...m.config, layer_attention: m.config.layer_attention!.map((a) => ({ ...a, window: 0 })) };
        const lastLogits = (config: typeof m.config) => {
          const kv = new KvCache(backend, 5, SHAPE.n_head_kv * (SHAPE.n_embd / SHAPE.n_head), 4224, "f16");
          const { graph, logits } = buildLlamaGraph(config, m.weights, kv, seq, 0);
          backend.compute(graph);
          kv.dispose();
          return logits;
        };
        const dFull = maxDiff(lastLogits(full), theirs.logits[7]!);
        const dWindow = maxDiff(lastLogits(m.config), theirs.logits[7]!);
        console.log(`smallthinker past 4096, step 7 in one batch: full attention ${dFull}, window ${dWindow}`);
        expect(dWindow).toBeLessThan(dFull);
      } finally {
        m.dispose();
        await runner.dispose();
      }
    },
    600_000,
  );

  afterAll(async () => {
    if (!("unavailable" in peer)) await (peer as LlamaCppPeer).dispose();
  });
});

describe.skipIf(!probe.usable)(`sparse experts (oracle) (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());

  /** Greedy ids and logits of a model opened dense and with oracle-sparse experts. */
  async function denseVsOracle(path: string, prompt: number[], n: number) {
    const dense = await Model.load(path, { backend });
    const oracle = await Model.load(path, { backend, sparse: "oracle" });
    try {
      const d = greedy(dense, prompt, n);
      const o = greedy(oracle, prompt, n);
      // row counters: the oracle's rows read in the up projection per layer equal the chosen experts'
      // gate pre-activations > 0 that a dense run captures for the same prompt
      const fired: number[] = [];
      const sd = dense.createSession({ nCtx: 64 });
      sd.evaluate(prompt, {
        onCapture: (layers) => {
          for (const [l, c] of layers.entries()) fired[l] = c.expertGate!.reduce((s, v) => s + (v > 0 ? 1 : 0), 0);
        },
      });
      sd.dispose();
      const so = oracle.createSession({ nCtx: 64 });
      so.evaluate(prompt, { allLogits: true }); // every token through the last layer's experts too
      const rows = so.stats.activeRows;
      so.dispose();
      return { d, o, fired, rows, cfg: dense.config };
    } finally {
      dense.dispose();
      oracle.dispose();
    }
  }

  it("smallthinker (ReGLU experts): oracle-sparse experts give the dense logits and read only the firing neurons of the chosen experts", async () => {
    const path = join(dir, "st-oracle.gguf");
    generateSyntheticMoeModel(path, { arch: "smallthinker", shape: SHAPE, seed: 7, untiedOutput: false });
    const prompt = [1, 17, 250, 300, 42, 9, 480, 3];
    const { d, o, fired, rows, cfg } = await denseVsOracle(path, prompt, 10);
    expect(o.ids).toEqual(d.ids);
    // float rounding only: the dense path sums each down row as ggml's dot product, the sparse one by axpy
    // over the firing rows (a wrong neuron set moves logits by far more, see the conformance kit's cases)
    for (const [i, l] of o.logits.entries()) expect(maxDiff(l, d.logits[i]!), `step ${i}`).toBeLessThan(5e-4);
    const perLayer = cfg.moe!.n_ff_exp * cfg.moe!.n_expert_used * prompt.length;
    expect(rows).toEqual(fired);
    for (const r of rows) {
      expect(r).toBeGreaterThan(0);
      expect(r).toBeLessThan(perLayer); // ReLU gates: some chosen neurons are off
    }
  });

  it("smallthinker Q4_0 and Q8_0: oracle-sparse experts give the dense logits bit for bit (quantized down projections run densely over the sparse activations)", async () => {
    for (const dtype of ["Q4_0", "Q8_0"] as const) {
      const path = join(dir, `st-oracle-${dtype}.gguf`);
      generateSyntheticMoeModel(path, { arch: "smallthinker", shape: SHAPE, seed: 11, dtype, untiedOutput: false });
      const prompt = [1, 17, 250, 300, 42, 9, 480, 3];
      const { d, o, fired, rows } = await denseVsOracle(path, prompt, 8);
      expect(o.ids, dtype).toEqual(d.ids);
      // up rows by the same dot as the dense product (Q4_0: its repacked tiles, bit-identical); skipped
      // neurons' activations are 0 in both runs, so the down product and everything after it are equal
      for (const [i, l] of o.logits.entries())
        expect(Array.from(l), `${dtype} step ${i}`).toEqual(Array.from(d.logits[i]!));
      expect(rows, dtype).toEqual(fired);
    }
  });

  it("refuses predictor mode for routed experts without predictors and oracle mode for SiLU experts with typed errors", async () => {
    const silu = join(dir, "silu-oracle.gguf");
    generateSyntheticMoeModel(silu, { arch: "llama-moe", shape: SHAPE });
    const e1 = await Model.load(silu, { backend, sparse: "oracle" }).catch((e) => e);
    expect(e1).toBeInstanceOf(EngineError);
    expect(String(e1.message)).toMatch(/needs a ReLU FFN/);
    const relu = join(dir, "relu-pred.gguf");
    generateSyntheticMoeModel(relu, { arch: "smallthinker", shape: SHAPE });
    const e2 = await Model.load(relu, { backend, sparse: "predictor" }).catch((e) => e);
    expect(e2).toBeInstanceOf(EngineError);
    expect(String(e2.message)).toMatch(/needs per-expert predictors \(blk\.N\.fc1_exps\/fc2_exps/);
    // SiLU experts in predictor mode: the activation is the reason (no predictor would help), not missing predictors
    const e3 = await Model.load(silu, { backend, sparse: "predictor" }).catch((e) => e);
    expect(String(e3.message)).toMatch(/sparse mode "predictor" needs a ReLU FFN; this model's FFN uses silu/);
  });

  it("profile counts firings per (layer, expert, neuron) and selections per (layer, expert): they equal the oracle kernels' row counters and read back from the statistics file", async () => {
    const { profileActivations, summarizeSparsity, checkStatsForModel } = await import("@powerinfer/engine");
    const { readActivationStats, writeActivationStats } = await import("@powerinfer/gguf");
    const path = join(dir, "st-profile.gguf");
    generateSyntheticMoeModel(path, { arch: "smallthinker", shape: SHAPE, seed: 5, untiedOutput: false, design: {} });
    const tokens = Array.from({ length: 40 }, (_, i) => (i * 37 + 11) % 500);
    const dense = await Model.load(path, { backend });
    const oracle = await Model.load(path, { backend, sparse: "oracle" });
    try {
      const s = dense.createSession({ nCtx: 64 });
      const prof = profileActivations(s, tokens, { bosId: 1 });
      s.dispose();
      const cfg = dense.config;
      const { n_expert: E, n_expert_used: U, n_ff_exp: F } = cfg.moe!;
      expect(prof.tokens).toBe(41);
      expect(prof.nExpert).toBe(E);
      for (const [l, sel] of prof.selections!.entries()) {
        expect(
          sel.reduce((a, b) => a + b, 0),
          `layer ${l}`,
        ).toBe(41 * U); // each token counted once per chosen expert
        // a neuron fires at most on the tokens routed to its expert
        for (let e = 0; e < E; e++) {
          for (let i = 0; i < F; i++) expect(prof.counts[l]![e * F + i]!).toBeLessThanOrEqual(sel[e]!);
        }
      }
      // the oracle's up projection reads exactly the firing neurons of the chosen experts
      const so = oracle.createSession({ nCtx: 64 });
      so.evaluate([1, ...tokens], { allLogits: true });
      const rows = so.stats.activeRows;
      so.dispose();
      expect(prof.counts.map((c) => c.reduce((a, b) => a + b, 0))).toEqual(rows);
      // designed: 40 % of a chosen expert's neurons fire per token (gen-model's default)
      const layers = summarizeSparsity(prof);
      for (const L of layers) {
        expect(L.mean).toBeGreaterThan(0.3);
        expect(L.mean).toBeLessThan(0.5);
        expect(L.hotExperts80).toBeGreaterThan(0);
        expect(L.hotExperts80).toBeLessThanOrEqual(1);
      }
      // the file: written, read back, checked against the model; a dense model's statistics are refused
      const stats = {
        counts: prof.counts,
        nFf: F,
        nExpert: E,
        selections: prof.selections,
        tokenCount: prof.tokens,
        corpusName: "t",
        corpusSha256: "",
        modelSha256: "",
      };
      const out = join(dir, "st-profile.activations.gguf");
      writeActivationStats(out, stats);
      const back = readActivationStats(out);
      expect(back.nExpert).toBe(E);
      expect(back.selections).toEqual(prof.selections);
      expect(back.counts).toEqual(prof.counts);
      expect(() => checkStatsForModel(back, cfg)).not.toThrow();
      expect(() => checkStatsForModel({ ...back, nExpert: undefined, selections: undefined }, cfg)).toThrow(
        /have no experts; this model routes tokens to experts/,
      );
      expect(() => checkStatsForModel(back, { n_layer: cfg.n_layer, n_ff: F })).toThrow(
        /routed experts; this model has none/,
      );
      expect(() => writeActivationStats(out, { ...stats, selections: undefined })).toThrow(
        /both nExpert and selections/,
      );
      // the command: its report and its file (default path next to the model)
      const text = join(dir, "st-profile.txt");
      writeFileSync(text, "Once upon a time there was a little cat. ".repeat(8));
      const bin = join(import.meta.dirname, "..", "dist", "bin.js");
      const r = spawnSync(process.execPath, [bin, "profile", "-m", path, "-f", text, "-c", "64", "-t", "2"], {
        encoding: "utf8",
        timeout: 120_000,
      });
      expect(r.status, r.stderr).toBe(0);
      expect(r.stdout).toMatch(
        /routed experts: 2 of 8 per token; active = share of the chosen experts' 64 neurons each/,
      );
      expect(r.stdout).toMatch(/experts with 80 % of routed tokens/);
      const rep = readActivationStats(out);
      expect(rep.nExpert).toBe(E);
      for (const sel of rep.selections!) expect(sel.reduce((a, b) => a + b, 0)).toBe(rep.tokenCount * U);
    } finally {
      dense.dispose();
      oracle.dispose();
    }
  });

  it("a SmallThinker-21B-shaped slice (4 layers, Q4_0): oracle-sparse experts give the dense run's greedy ids and logits, and compute only the chosen experts' firing neurons", async () => {
    const path = join(dir, "st21b-slice.gguf");
    const p = MOE_SHAPE_PRESETS["smallthinker-21b-a3b"];
    // the published shape (64 experts of 768 neurons, 6 per token, n_embd 2560), gen-model's designed
    // routing and firing statistics, a 512-token vocabulary: 0.8 GiB
    generateSyntheticMoeModel(path, {
      arch: p.arch,
      shape: p.shape,
      layers: 4,
      dtype: "Q4_0",
      seed: 2,
      untiedOutput: false,
      design: {},
    });
    const prompt = [1, 300, 42, 77, 5];
    const { d, o, fired, rows } = await denseVsOracle(path, prompt, 8);
    rmSync(path, { force: true });
    expect(o.ids).toEqual(d.ids);
    // exact: up rows by the dense product's dot, a Q4_0 down projection run densely over activations whose
    // skipped entries are 0 — so every layer's input, gates and counters equal the dense run's
    for (const [i, l] of o.logits.entries()) expect(Array.from(l), `step ${i}`).toEqual(Array.from(d.logits[i]!));
    expect(rows).toEqual(fired);
    const perLayer = p.shape.n_ff_exp * p.shape.n_expert_used * prompt.length;
    for (const r of rows) expect(r).toBeLessThan(perLayer);
    console.log(
      `SmallThinker-21B-shaped slice: neurons computed per layer ${rows.join(", ")} of ${perLayer} in the chosen experts (${rows.map((r) => ((100 * r) / perLayer).toFixed(1)).join(" %, ")} %)`,
    );
  }, 300_000);
});

describe("inspect reports experts", () => {
  it("counts experts, experts per token, neurons per expert and the parameters one token reads", async () => {
    const { inspectFile, formatInspect } = await import("../src/commands/inspect.js");
    const path = join(dir, "inspect-moe.gguf");
    generateSyntheticMoeModel(path, { arch: "llama-moe", shape: SHAPE });
    const r = inspectFile(path);
    const { n_embd: E, n_ff_exp: F, n_expert: X, n_expert_used: U, n_layer: L } = SHAPE;
    const dH = 64;
    const dKv = 32;
    const perLayer = E * dH + 2 * E * dKv + dH * E + 2 * E + E * X + 3 * E * F * U;
    expect(r.experts).toEqual({
      n_expert: 8,
      n_expert_used: 2,
      n_ff_exp: 64,
      gating: "softmax",
      router_input: "ffn_input",
      activeParametersPerToken: L * perLayer + E + E * 512,
    });
    expect(formatInspect(r, {})).toMatch(
      /experts: 8, 2 used per token, 64 neurons each; softmax gating of the FFN input/,
    );
    const st = join(dir, "inspect-st.gguf");
    generateSyntheticMoeModel(st, { arch: "smallthinker", shape: SHAPE, untiedOutput: false });
    const rs = inspectFile(st);
    expect(rs.experts?.router_input).toBe("layer_input");
    expect(rs.sparse.reason).toMatch(/oracle mode/);
  });
});
