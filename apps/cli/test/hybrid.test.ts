/**
 * Hybrid execution without a GPU: two CPU backend instances, one standing in for the device with a memory
 * budget. A model with a device placement (`Model.offload`) decodes through the same graph as without one,
 * cut by the scheduler where a node's backend changes. Checked against the single-backend run of the same
 * model: greedy ids equal, logits within max |Δ| ≤ tol · max |logit|, for every architecture with a dense
 * FFN (llama, ReLU-llama, bamboo, falcon, opt), in dense, oracle and predictor modes, with attention on the
 * main backend and on the device; single sequences (sync and async), batches of 4, perplexity and profile
 * counts. The backend calls per step follow the formula in engine/offload.ts.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { type Backend, BackendError } from "@powerinfer/core";
import {
  argmax,
  attentionWeightBytes,
  type DevicePlan,
  EngineError,
  hotNeuronBytes,
  Model,
  perplexity,
  profileActivations,
  type SparseMode,
  splitLayerFixedBytes,
} from "@powerinfer/engine";
import { generateSyntheticModel, generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();
const dir = mkdtempSync(join(tmpdir(), "hybrid-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/**
 * Every other neuron by a hash of its id hot (half of each layer), attention on the device in the layers
 * `attention` selects.
 */
function halfPlan(model: Model, attention: (l: number) => boolean = () => false): DevicePlan {
  const cfg = model.config;
  return {
    layers: Array.from({ length: cfg.n_layer }, (_, l) => {
      const hot: number[] = [];
      for (let i = 0; i < cfg.n_ff; i++) if (((i * 2654435761 + l * 97) >>> 0) % 1000 < 500) hot.push(i);
      return { hot: Int32Array.from(hot), attention: attention(l) };
    }),
  };
}

/** Device bytes a plan needs: hot rows, attention weights and an F32 KV cache of n_ctx positions. */
function planBytes(model: Model, plan: DevicePlan, nCtx: number): number {
  const cfg = model.config;
  const kv = 2 * nCtx * cfg.head_dim * cfg.n_head_kv * 4;
  return plan.layers.reduce(
    (s, L, l) =>
      s +
      L.hot.length * hotNeuronBytes(model, l) +
      (L.hot.length ? splitLayerFixedBytes(model, l) : 0) +
      (L.attention ? attentionWeightBytes(model, l) + kv : 0),
    0,
  );
}

const maxAbs = (a: Float32Array) => a.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
const maxDiff = (a: Float32Array, b: Float32Array) => {
  let w = 0;
  for (let i = 0; i < a.length; i++) w = Math.max(w, Math.abs(a[i]! - b[i]!));
  return w;
};

/** Greedy decoding: ids and a copy of the logits before each. */
async function greedy(model: Model, prompt: number[], n: number, useAsync: boolean) {
  const s = model.createSession({ nCtx: 64, kvType: "f32" });
  try {
    const ev = (t: number[]) => (useAsync ? s.evaluateAsync(t) : Promise.resolve(s.evaluate(t)));
    let l = await ev(prompt);
    const ids: number[] = [];
    const logits: Float32Array[] = [];
    for (let i = 0; i < n; i++) {
      logits.push(Float32Array.from(l));
      ids.push(argmax(l));
      if (i < n - 1) l = await ev([ids[i]!]);
    }
    return { ids, logits, calls: s.stats.calls, steps: s.stats.steps, activeRows: [...s.stats.activeRows] };
  } finally {
    s.dispose();
  }
}

describe.skipIf(!probe.usable)(`hybrid execution with two CPU backends (${probe.reason})`, () => {
  let main: Backend;
  const generated: Record<string, string> = {};
  beforeAll(async () => {
    main = await cpuBackend.load({ threads: 1 });
    for (const arch of ["bamboo", "falcon", "opt"] as const) {
      generated[arch] = join(dir, `${arch}.pwri.gguf`);
      await generateSyntheticModel(
        generated[arch],
        { preset: "tiny", arch, dtype: "F32", vocabSize: 512, statsTokens: 64, format: "PWRI" },
        { fsync: false },
      );
    }
  }, 180_000);
  afterAll(() => main?.dispose());

  // Only the summation order differs (y_hot + y_cold against one sum), for F32, F16 and Q4_0 weights alike:
  // logits within 1e-4 of the largest (the bound), with an F32 KV cache (an F16 cache would round a
  // 1e-7 difference of K and V into whole F16 steps).
  const relu = () => join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
  const cases: [string, () => string, SparseMode[], number][] = [
    ["stories260K (llama, SiLU)", () => join(models, "stories260K.gguf"), ["off"], 1e-4],
    ["ReLU model", relu, ["off", "oracle"], 1e-4],
    [
      "PowerInfer F32 fixture",
      () => join(models, "powerinfer", "tiny-f32.powerinfer.gguf"),
      ["predictor", "oracle"],
      1e-4,
    ],
    ["PowerInfer F16 fixture", () => join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), ["predictor"], 1e-4],
    ["PowerInfer Q4_0 fixture", () => join(models, "powerinfer", "tiny-q4_0.powerinfer.gguf"), ["predictor"], 1e-4],
    ["generated bamboo", () => generated.bamboo!, ["off", "oracle", "predictor"], 1e-4],
    ["generated falcon", () => generated.falcon!, ["off", "oracle", "predictor"], 1e-4],
    ["generated opt", () => generated.opt!, ["off", "oracle", "predictor"], 1e-4],
  ];
  const placements: [string, (l: number) => boolean][] = [
    ["attention on main", () => false],
    ["attention of odd layers on the device", (l) => l % 2 === 1],
  ];
  for (const [what, file, modes, tol] of cases) {
    for (const sparse of modes) {
      for (const [where, attention] of placements) {
        it(`${what}, ${sparse}, ${where}: the single-backend greedy ids, logits within ${tol} of max |logit|`, async () => {
          const model = await Model.load(file(), { backend: main, sparse });
          let device: Backend | undefined;
          try {
            const prompt = [1, 259, 260, 261, 262].map((t) => t % model.config.n_vocab);
            const single = await greedy(model, prompt, 10, false);
            const plan = halfPlan(model, attention);
            const need = planBytes(model, plan, 64);
            device = await cpuBackend.load({ threads: 1, memoryBudget: need + 4096 });
            const placed = model.offload(device, plan);
            // the device holds what the plan says (the KV cache comes with the session)
            expect(placed.deviceBytes()).toBeLessThanOrEqual(need);
            for (const useAsync of [false, true]) {
              const h = await greedy(model, prompt, 10, useAsync);
              expect(h.ids, useAsync ? "async" : "sync").toEqual(single.ids);
              h.logits.forEach((l, i) => {
                expect(maxDiff(l, single.logits[i]!), `step ${i}`).toBeLessThanOrEqual(tol * maxAbs(single.logits[i]!));
              });
              // the neurons computed are the single run's, hot and cold counted together
              if (sparse === "oracle") expect(h.activeRows).toEqual(single.activeRows);
            }
          } finally {
            model.dispose();
            device?.dispose();
          }
        });
      }
    }
  }

  it("backend calls per step follow the formula: 3 per split layer + 1 with attention on main, + 3 with attention on the device", async () => {
    const model = await Model.load(generated.bamboo!, { backend: main, sparse: "predictor" });
    const device = await cpuBackend.load({ threads: 1 });
    try {
      expect(model.config.n_layer).toBe(2);
      const one = await greedy(model, [1, 5], 3, true);
      expect(one.calls / one.steps).toBe(1);
      model.offload(device, halfPlan(model));
      const a = await greedy(model, [1, 5], 3, true);
      expect(a.calls / a.steps).toBe(3 * 2 + 1);
      model.offload(
        device,
        halfPlan(model, () => true),
      );
      const d = await greedy(model, [1, 5], 3, true);
      expect(d.calls / d.steps).toBe(3 * 2 + 3);
      // a layer wholly on one backend merges with its neighbours: layer 0 all cold, layer 1 all hot with attention
      const cfg = model.config;
      model.offload(device, {
        layers: [
          { hot: new Int32Array(0) },
          { hot: Int32Array.from({ length: cfg.n_ff }, (_, i) => i), attention: true },
        ],
      });
      const w = await greedy(model, [1, 5], 3, true);
      expect(w.calls / w.steps).toBe(3); // main [embd, layer 0] → device [layer 1] → main [head]
      expect(w.ids).toEqual(one.ids);
    } finally {
      model.dispose();
      device.dispose();
    }
  });

  for (const arch of ["llama-moe", "smallthinker"] as const) {
    it(`routed experts (${arch}): attention of layer 1 on the device, experts on main — the single-backend ids; a pair out of range refused`, async () => {
      const path = join(dir, `${arch}.gguf`);
      generateSyntheticMoeModel(path, {
        arch,
        shape: TINY_MOE_SHAPE,
      });
      const model = await Model.load(path, { backend: main });
      const device = await cpuBackend.load({ threads: 1 });
      try {
        const prompt = [1, 20, 30, 40];
        const single = await greedy(model, prompt, 8, false);
        const none = new Int32Array(0);
        // a pair outside n_ff_exp × n_expert is refused
        const pairs = model.config.moe!.n_ff_exp * model.config.moe!.n_expert;
        expect(() => model.offload(device, { layers: [{ hot: Int32Array.of(pairs) }, { hot: none }] })).toThrow(
          /plan layer 0: neuron \d+ outside n_ff_exp × n_expert = \d+/,
        );
        model.offload(device, { layers: [{ hot: none }, { hot: none, attention: true }] });
        const h = await greedy(model, prompt, 8, true);
        expect(h.ids).toEqual(single.ids);
        h.logits.forEach((l, i) => {
          expect(maxDiff(l, single.logits[i]!), `step ${i}`).toBeLessThanOrEqual(1e-4 * maxAbs(single.logits[i]!));
        });
        // main [embd, layer 0 and layer 1's norm-to-experts input]: the device piece reads the layer input
        expect(h.calls / h.steps).toBeGreaterThan(1);
      } finally {
        model.dispose();
        device.dispose();
      }
    });
  }

  // Routed experts: half of each layer's (expert, neuron) pairs on the device by a hash of the pair id, the
  // rest on main; only the summation order differs (y_hot + y_cold, and a pair's router weight applied
  // before its down row), except that a quantized down stack's hot rows become F32 on the device (main's
  // quantized product rounds the activations to Q8_0 first).
  const expertCases: [string, Parameters<typeof generateSyntheticMoeModel>[1], SparseMode[], number][] = [
    ["llama-moe (SiLU, dense experts)", { arch: "llama-moe", shape: TINY_MOE_SHAPE }, ["off"], 1e-4],
    [
      "smallthinker F32 with predictors",
      { arch: "smallthinker", shape: TINY_MOE_SHAPE, design: {}, predictors: {} },
      ["off", "oracle", "predictor"],
      1e-4,
    ],
    [
      "llama-moe dReLU Q8_0 with predictors",
      { arch: "llama-moe", shape: TINY_MOE_SHAPE, upActivation: "relu", design: {}, predictors: {}, dtype: "Q8_0" },
      ["oracle", "predictor"],
      // main rounds the activations to Q8_0 for its quantized down product; the device's F32 rows do not
      // (measured: ≤ 4.1e-3 of max |logit|)
      1e-2,
    ],
  ];
  for (const [what, opts, modes, tol] of expertCases) {
    for (const sparse of modes) {
      it(`routed experts, ${what}, ${sparse}: half the (expert, neuron) pairs on the device — the single-backend ids, logits within ${tol} of max |logit|`, async () => {
        const path = join(dir, `${what.replace(/\W+/g, "-")}.gguf`);
        generateSyntheticMoeModel(path, opts);
        const model = await Model.load(path, { backend: main, sparse });
        let device: Backend | undefined;
        try {
          const cfg = model.config;
          const pairs = cfg.moe!.n_ff_exp * cfg.moe!.n_expert;
          const prompt = [1, 20, 30, 40, 50];
          const single = await greedy(model, prompt, 8, false);
          for (const attention of [false, true]) {
            const plan: DevicePlan = {
              layers: Array.from({ length: cfg.n_layer }, (_, l) => {
                const hot: number[] = [];
                for (let i = 0; i < pairs; i++) if (((i * 2654435761 + l * 97) >>> 0) % 1000 < 500) hot.push(i);
                return { hot: Int32Array.from(hot), attention: attention && l === 1 };
              }),
            };
            device ??= await cpuBackend.load({ threads: 1 });
            const placed = model.offload(device, plan);
            expect(placed.hotNeurons).toBe(plan.layers.reduce((s, L) => s + L.hot.length, 0));
            const expectBytes = plan.layers.reduce((s, L, l) => s + L.hot.length * hotNeuronBytes(model, l), 0);
            const attBytes = attention ? attentionWeightBytes(model, 1) : 0;
            expect(placed.deviceBytes()).toBe(expectBytes + attBytes);
            for (const useAsync of [false, true]) {
              const h = await greedy(model, prompt, 8, useAsync);
              expect(h.ids, `attention ${attention}, ${useAsync ? "async" : "sync"}`).toEqual(single.ids);
              h.logits.forEach((l, i) => {
                expect(maxDiff(l, single.logits[i]!), `step ${i}`).toBeLessThanOrEqual(tol * maxAbs(single.logits[i]!));
              });
              // the neurons computed are the single run's, hot and cold counted together
              if (sparse === "oracle") expect(h.activeRows).toEqual(single.activeRows);
              // main [embd, layer 0 to its router] → device [hot 0] ∥ main [cold 0] → main [sum 0, layer 1 to its
              // router] → device [hot 1] ∥ main [cold 1] → main [sum 1, head]: 3·n_layer + 1; with layer 1's attention
              // on the device, main [sum 0] → device [attention 1] → main [router 1] → device [hot 1] ∥
              // main [cold 1] → device [sum 1] → main [head]: 3 more (the router and predictors stay on main)
              expect(cfg.n_layer).toBe(2);
              expect(h.calls / h.steps).toBe(attention ? 10 : 7);
            }
          }
        } finally {
          model.dispose();
          device?.dispose();
        }
      });
    }
  }

  it("device and CPU halves of a split layer overlap in time", async () => {
    const model = await Model.load(relu(), { backend: main, sparse: "off" });
    const device = await cpuBackend.load({ threads: 1 });
    try {
      model.offload(device, halfPlan(model));
      const { computeScheduledAsync } = await import("@powerinfer/engine");
      const { buildLlamaGraph } = await import("@powerinfer/engine");
      const s = model.createSession({ nCtx: 256 });
      const built = buildLlamaGraph(
        model.config,
        model.weights,
        s.kv,
        Int32Array.from({ length: 128 }, (_, i) => 3 + i),
        0,
        {
          offload: model.placement!.layers,
        },
      );
      const r = await computeScheduledAsync(built.graph, built.nodeBackend, model.backends);
      let overlapping = 0;
      const dev = r.timeline.filter((t) => t.backend === 1);
      for (const d of dev) {
        if (r.timeline.some((c) => c.backend === 0 && c.start < d.end && d.start < c.end)) overlapping++;
      }
      // on a loaded 2-core machine one side may now and then finish before the other starts
      expect(dev.length).toBe(model.config.n_layer);
      expect(overlapping).toBeGreaterThanOrEqual(1);
      s.dispose();
    } finally {
      model.dispose();
      device.dispose();
    }
  });

  it("a batch of 4 sequences gives each its single-backend greedy ids (attention on main and on the device)", async () => {
    const model = await Model.load(join(models, "powerinfer", "tiny-f32.powerinfer.gguf"), { backend: main });
    const device = await cpuBackend.load({ threads: 1 });
    try {
      const prompts = [
        [1, 259],
        [1, 200, 201],
        [1, 100],
        [1, 259, 262, 263],
      ];
      const refs = await Promise.all(prompts.map((p) => greedy(model, p, 6, false)));
      for (const attention of [() => false, (l: number) => l === 0]) {
        model.offload(device, halfPlan(model, attention));
        const sessions = prompts.map(() => model.createSession({ nCtx: 64, kvType: "f32" }));
        const ids: number[][] = prompts.map(() => []);
        let r = await model.decodeBatchAsync(sessions.map((session, i) => ({ session, tokens: prompts[i]! })));
        expect(r.calls).toBeGreaterThan(1);
        for (let step = 0; step < 6; step++) {
          r.logits.forEach((l, i) => {
            ids[i]!.push(argmax(l!));
          });
          if (step < 5)
            r = await model.decodeBatchAsync(sessions.map((session, i) => ({ session, tokens: [ids[i]!.at(-1)!] })));
        }
        ids.forEach((got, i) => {
          expect(got, `sequence ${i}`).toEqual(refs[i]!.ids);
        });
        for (const s of sessions) s.dispose();
      }
    } finally {
      model.dispose();
      device.dispose();
    }
  });

  it("perplexity within 1e-5 relative and profile counts identical", async () => {
    const model = await Model.load(relu(), { backend: main, sparse: "off" });
    const device = await cpuBackend.load({ threads: 1 });
    try {
      const text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.";
      const tokens = model.tokenizer.tokenize(text, { addSpecial: false });
      const run = () => {
        const s = model.createSession({ nCtx: 16, kvType: "f32" });
        const ppl = perplexity(s, tokens, { protocol: "llama.cpp", bosId: 1, addBos: true });
        s.dispose();
        const p = model.createSession({ nCtx: 32, kvType: "f32" });
        const prof = profileActivations(p, tokens, { bosId: 1 });
        p.dispose();
        return { ppl: ppl.perplexity, counts: prof.counts };
      };
      const a = run();
      model.offload(
        device,
        halfPlan(model, (l) => l === 1),
      );
      const b = run();
      expect(Math.abs(b.ppl - a.ppl) / a.ppl).toBeLessThan(1e-5);
      expect(b.counts).toEqual(a.counts);
    } finally {
      model.dispose();
      device.dispose();
    }
  });

  it("a plan larger than the device's memory fails with a typed out-of-memory error, leaving nothing allocated", async () => {
    const model = await Model.load(join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), { backend: main });
    const device = await cpuBackend.load({ threads: 1, memoryBudget: 10_000 });
    try {
      let err: unknown;
      try {
        model.offload(device, halfPlan(model));
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(BackendError);
      expect((err as BackendError).code).toBe("OUT_OF_MEMORY");
      expect(device.allocatedBytes()).toBe(0);
      expect(model.placement).toBeUndefined();
    } finally {
      model.dispose();
      device.dispose();
    }
  });

  it("a session opened before the placement changed is refused with a typed error", async () => {
    const model = await Model.load(relu(), { backend: main, sparse: "off" });
    const device = await cpuBackend.load({ threads: 1 });
    try {
      const s = model.createSession({ nCtx: 16 });
      model.offload(device, halfPlan(model));
      expect(() => s.evaluate([1])).toThrow(EngineError);
      s.dispose();
      // a plan of another shape
      expect(() => model.offload(device, { layers: [] })).toThrow(EngineError);
    } finally {
      model.dispose();
      device.dispose();
    }
  });
});
