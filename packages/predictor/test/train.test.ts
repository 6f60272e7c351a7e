/** Gradients, warm start, training, calibration and resumption on synthetic ReLU layers. */
import { join } from "node:path";
import { openGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import {
  bakeThresholds,
  batchLossAndGradients,
  confusionAt,
  fitLogitScale,
  gatePredictor,
  gateSubspace,
  initialTrainState,
  jsMatMul,
  type LayerPredictor,
  loadCheckpoint,
  maskStride,
  type PipelineCheckpoint,
  predictLogits,
  quality,
  randomPredictor,
  Rng,
  saveCheckpoint,
  scorePredictor,
  splitDataset,
  trainLayer,
  trainPredictors,
} from "../src/index.ts";
import { tmp, toyData, toyLayers, writeToyModel } from "./fixtures.ts";

const E = 16;
const F = 48;
const mm = jsMatMul;

/** The weighted cross-entropy of a batch in float64, straight from its definition. */
function lossF64(
  fc1: Float64Array,
  fc2: Float64Array,
  r: number,
  x: Float32Array,
  m: Uint8Array,
  idx: number[],
  w: number,
): number {
  const s = maskStride(F);
  let l = 0;
  for (const t of idx) {
    const h = new Float64Array(r);
    for (let j = 0; j < r; j++) {
      let a = 0;
      for (let c = 0; c < E; c++) a += fc1[j * E + c]! * x[t * E + c]!;
      h[j] = Math.max(0, a);
    }
    for (let i = 0; i < F; i++) {
      let z = 0;
      for (let j = 0; j < r; j++) z += fc2[i * r + j]! * h[j]!;
      const y = (m[t * s + (i >> 3)]! >> (i & 7)) & 1;
      l += y ? w * Math.log1p(Math.exp(-z)) : Math.log1p(Math.exp(z));
    }
  }
  return l / (idx.length * F);
}

describe("loss gradients", () => {
  it("match central differences of the float64 loss", () => {
    const layers = toyLayers(1, E, F, 1);
    const data = toyData(layers, 24, E, F, 2);
    const r = 6;
    const p = randomPredictor(r, E, F, 3);
    const idx = Uint32Array.from({ length: 24 }, (_, i) => i);
    const { d1, d2 } = batchLossAndGradients(p, data, 0, idx, 3, mm);
    const L = data.layers[0]!;
    const fc1 = Float64Array.from(p.fc1);
    const fc2 = Float64Array.from(p.fc2);
    const h = 1e-4;
    let maxErr = 0;
    let maxG = 0;
    for (const [w, d] of [
      [fc1, d1],
      [fc2, d2],
    ] as const) {
      for (let i = 0; i < w.length; i += 7) {
        const v = w[i]!;
        w[i] = v + h;
        const lp = lossF64(fc1, fc2, r, L.inputs, L.masks, [...idx], 3);
        w[i] = v - h;
        const lm = lossF64(fc1, fc2, r, L.inputs, L.masks, [...idx], 3);
        w[i] = v;
        const num = (lp - lm) / (2 * h);
        maxErr = Math.max(maxErr, Math.abs(num - d[i]!));
        maxG = Math.max(maxG, Math.abs(num));
      }
    }
    expect(maxG).toBeGreaterThan(0);
    expect(maxErr / maxG).toBeLessThan(2e-3);
  });
});

describe("warm start from the gate", () => {
  const layers = toyLayers(1, E, F, 4);
  const data = toyData(layers, 400, E, F, 5);
  const L = data.layers[0]!;

  it("with every direction kept it reproduces the gate's sign exactly", () => {
    const sub = gateSubspace(layers[0]!.gate, layers[0]!.norm, L.inputs, 400, E, F, E, mm);
    const p = gatePredictor(sub, 2 * E);
    const z = predictLogits(p, L.inputs, 400, mm);
    const q = quality(confusionAt(z, L.masks, 400, F, 0));
    expect(q.recall).toBeGreaterThan(0.999);
    expect(q.precision).toBeGreaterThan(0.999);
  });

  it("keeps the directions in order of importance: more directions, better predictor", () => {
    const sub = gateSubspace(layers[0]!.gate, layers[0]!.norm, L.inputs, 400, E, F, 12, mm);
    for (let j = 1; j < 12; j++) expect(sub.values[j]!).toBeLessThanOrEqual(sub.values[j - 1]! * 1.05);
    const frac = [2, 6, 12].map((k) => scorePredictor(gatePredictor(sub, 2 * k), data, 0, 0.95, mm).predictedFraction);
    expect(frac[1]!).toBeLessThan(frac[0]!);
    expect(frac[2]!).toBeLessThan(frac[1]!);
  });

  it("fits the logit scale that minimises the cross-entropy", () => {
    const sub = gateSubspace(layers[0]!.gate, layers[0]!.norm, L.inputs, 400, E, F, 6, mm);
    const z = predictLogits(gatePredictor(sub, 12), L.inputs, 100, mm);
    const s = fitLogitScale(z, L.masks, 100, F, 3);
    const loss = (k: number) => {
      let l = 0;
      for (let t = 0; t < 100; t++) {
        for (let i = 0; i < F; i++) {
          const a = k * z[t * F + i]!;
          l +=
            (L.masks[t * maskStride(F) + (i >> 3)]! >> (i & 7)) & 1
              ? 3 * Math.log1p(Math.exp(-a))
              : Math.log1p(Math.exp(a));
        }
      }
      return l;
    };
    for (const k of [0.5, 0.9, 1.1, 2]) expect(loss(s)).toBeLessThanOrEqual(loss(s * k));
  });
});

describe("warm start on a residual stream with a massive activation", () => {
  // As in real LLMs (Sun et al. 2024) and the generated 7B slices: one channel of every token's residual
  // is ~10⁴× the others' RMS, and the gate reads it as each neuron's bias. W'ᵀW' and E[x xᵀ] then span
  // eigenvalues ~10¹⁰ apart; solved with them separately in float32, the subspace kept the massive
  // direction and noise (sign agreement 0.5 on a 7B-shaped layer).
  // fewer positions than channels, as on a 7B layer with a few thousand positions of a small vocabulary:
  // E[x xᵀ] is singular, and float32 rounding of the massive channel's products fills its null space
  const e = 128;
  const f = 96;
  const n = 60;
  const massive = 3;
  const rng = new Rng(21);
  const gate = new Float32Array(f * e);
  for (let i = 0; i < f; i++) {
    for (let c = 0; c < e; c++) gate[i * e + c] = (rng.normal() / Math.sqrt(e)) * 30;
    gate[i * e + massive] = (rng.normal() - 1.2) / 1000; // bias b_i ~ N(−1.2, 1) through x_massive = 1000
  }
  const x = new Float32Array(n * e);
  for (let t = 0; t < n; t++) for (let c = 0; c < e; c++) x[t * e + c] = c === massive ? 1000 : rng.normal() * 0.03;
  const masks = new Uint8Array(n * maskStride(f));
  for (let t = 0; t < n; t++) {
    for (let i = 0; i < f; i++) {
      let g = 0;
      for (let c = 0; c < e; c++) g += gate[i * e + c]! * x[t * e + c]!;
      if (g > 0) masks[t * maskStride(f) + (i >> 3)]! |= 1 << (i & 7);
    }
  }
  const data = { nEmbd: e, nFf: f, nTokens: n, layers: [{ inputs: x, masks }] };

  it("with every direction kept it still reproduces the gate's sign", () => {
    const sub = gateSubspace(gate, undefined, x, n, e, f, e, mm);
    expect(sub.k).toBeLessThanOrEqual(n);
    const z = predictLogits(gatePredictor(sub, 2 * e), x, n, mm);
    const q = quality(confusionAt(z, masks, n, f, 0));
    expect(q.recall).toBeGreaterThan(0.99);
    expect(q.precision).toBeGreaterThan(0.99);
    // and the warm start is a usable predictor: at recall 0.95 it selects about the truly active share
    const sc = scorePredictor(gatePredictor(sub, 2 * e), data, 0, 0.95, mm);
    expect(sc.predictedFraction).toBeLessThan(sc.trueFraction * 1.1);
  });
});

describe("warm start when the gate cannot give the rank asked for", () => {
  // A gate that reads only the first 6 channels of the residual (as a generated model's gates read a
  // subspace of it): K = W'ᵀW' has rank 6, so no more than 6 gate directions exist.
  const layers = toyLayers(1, E, F, 11).map(({ gate, norm }) => ({
    gate: gate.map((v, i) => (i % E < 6 ? v : 0)),
    norm,
  }));
  const few = toyData(layers, 10, E, F, 12);
  const L = few.layers[0]!;

  it("gateSubspace returns the directions there are instead of stopping", () => {
    const sub = gateSubspace(layers[0]!.gate, layers[0]!.norm, L.inputs, 10, E, F, 14, mm);
    expect(sub.k).toBe(6);
    expect(sub.p.length).toBe(sub.k * E);
    expect(sub.q.length).toBe(sub.k * F);
    for (const v of sub.p) expect(Number.isFinite(v)).toBe(true);
  });

  it("gatePredictor fills the rest of the rank with random hidden units that start silent in fc2", () => {
    const sub = gateSubspace(layers[0]!.gate, layers[0]!.norm, L.inputs, 10, E, F, 14, mm);
    const p = gatePredictor(sub, 28, 2, 5);
    const k = sub.k;
    expect(p.rank).toBe(28);
    // rows 2k.. of fc1 are random (non-zero), their fc2 columns zero
    let randomRows = 0;
    for (let j = 2 * k; j < 28; j++) if (p.fc1.subarray(j * E, (j + 1) * E).some((v) => v !== 0)) randomRows++;
    expect(randomRows).toBe(28 - 2 * k);
    for (let i = 0; i < F; i++) for (let j = 2 * k; j < 28; j++) expect(p.fc2[i * 28 + j]).toBe(0);
    // so the start computes exactly what the gate part alone computes
    const full = predictLogits(gatePredictor(sub, 2 * k, 2), L.inputs, 10, mm);
    const z = predictLogits(p, L.inputs, 10, mm);
    for (let i = 0; i < z.length; i++) expect(z[i]).toBeCloseTo(full[i]!, 4);
  });

  it("trainPredictors refuses a layer whose logits are not finite instead of writing a threshold of −∞", async () => {
    // products that overflow float32 (as a predictor with huge weights would): logits ±∞
    const overflowing = {
      name: "overflowing",
      gemmNT: (a: Float32Array, b: Float32Array, m: number, n: number, k: number, c?: Float32Array) => {
        const r = mm.gemmNT(a, b, m, n, k, c);
        for (let i = 0; i < r.length; i++) r[i]! *= 1e39;
        return r;
      },
    };
    const data = toyData(layers, 24, E, F, 13);
    const options = { rank: 2 * E, init: "random" as const, valFraction: 0.25, train: { epochs: 1, batchSize: 8 } };
    await expect(trainPredictors({ data, mm: overflowing, options })).rejects.toThrow(
      /layer 0: the predictor's logits are not finite in float16 .*; train with --predictor-type f32/,
    );
    const f32 = { ...options, predictorType: "f32" as const };
    await expect(trainPredictors({ data, mm: overflowing, options: f32 })).rejects.toThrow(
      /layer 0: the predictor's logits are not finite, so no threshold gives recall/,
    );
    expect(Number.isFinite((await trainPredictors({ data, mm, options: f32 })).layers[0]!.threshold)).toBe(true);
  });

  it("trainPredictors falls back with a note, and trains", async () => {
    const dir = tmp();
    const model = join(dir, "toy.gguf");
    writeToyModel(model, layers, E, F);
    const data = toyData(layers, 24, E, F, 13);
    const notes: string[] = [];
    const res = await trainPredictors({
      file: openGguf(model),
      data,
      mm,
      options: { rank: 2 * E, valFraction: 0.25, train: { epochs: 2, batchSize: 8 } },
      onEvent: (e) => {
        if (e.type === "note") notes.push(e.message);
      },
    });
    expect(res.complete).toBe(true);
    expect(res.layers[0]!.rank).toBe(2 * E);
    expect(notes).toHaveLength(1);
    expect(notes[0]).toMatch(
      /^layer 0: the gate spans 6 independent directions on 18 training positions, not the 16 rank 32 needs; 12 hidden units start from the gate, the rest random/,
    );
  });
});

describe("training", () => {
  const layers = toyLayers(2, E, F, 6);
  const data = toyData(layers, 1200, E, F, 7);
  const { train, val } = splitDataset(data, 0.25);

  it("lowers the active fraction needed for the target recall, and keeps the best epoch", async () => {
    const init = randomPredictor(16, E, F, 8);
    const st = initialTrainState(init);
    await trainLayer({ train, val, layer: 0, state: st, mm, options: { epochs: 6, lr: 1e-2, batchSize: 64 } });
    expect(st.done).toBe(true);
    expect(st.history.length).toBeGreaterThan(0);
    expect(st.bestScore).toBeLessThan(st.initScore!.predictedFraction * 0.8);
    expect(st.bestScore).toBe(Math.min(st.initScore!.predictedFraction, ...st.history.map((h) => h.predictedFraction)));
    // the best weights score what the history says
    expect(scorePredictor(st.best, val, 0, 0.95, mm).predictedFraction).toBeCloseTo(st.bestScore, 10);
  });

  it("an interrupted run resumes from its checkpoint file to exactly the same weights", async () => {
    const dir = tmp();
    const model = join(dir, "toy.gguf");
    writeToyModel(model, layers, E, F);
    const file = openGguf(model);
    const options = { rank: 8, train: { epochs: 3, batchSize: 100, lr: 5e-3 } };
    const full = await trainPredictors({ file, data, mm, options, key: "k" });
    expect(full.complete).toBe(true);

    const ckpt = join(dir, "run.ckpt");
    const ac = new AbortController();
    let steps = 0;
    const part = await trainPredictors({
      file,
      data,
      mm,
      options,
      key: "k",
      signal: ac.signal,
      onEvent: (e) => {
        // stop in the middle of the second layer's second epoch
        if (e.type === "step" && e.layer === 1 && e.epoch === 1 && ++steps === 3) ac.abort();
      },
      onCheckpoint: (c) => saveCheckpoint(ckpt, c),
    });
    expect(part.complete).toBe(false);
    const saved = loadCheckpoint(ckpt);
    expect(saved.done.length).toBe(1);
    expect(saved.current?.layer).toBe(1);
    expect(saved.current?.state.epoch).toBe(1);
    expect(saved.current?.state.step).toBe(3);
    // a checkpoint of another run is not used
    const other = await trainPredictors({
      file,
      data,
      mm,
      options: { ...options, train: { epochs: 0 } },
      key: "other",
      resume: saved,
    });
    expect(other.layers[0]!.history.length).toBe(0);

    const resumed = await trainPredictors({ file, data, mm, options, key: "k", resume: saved });
    expect(resumed.complete).toBe(true);
    resumed.layers.forEach((r, l) => {
      const f = full.layers[l]!;
      expect(r.rank).toBe(f.rank);
      expect(r.threshold).toBe(f.threshold);
      expect(Buffer.from(r.predictor.fc1.buffer).equals(Buffer.from(f.predictor.fc1.buffer))).toBe(true);
      expect(Buffer.from(r.predictor.fc2.buffer).equals(Buffer.from(f.predictor.fc2.buffer))).toBe(true);
      expect(r.history).toEqual(f.history);
    });
  });

  it('"auto" rank grows until the target is met at ≤ the allowed active ratio', async () => {
    const dir = tmp();
    const model = join(dir, "toy.gguf");
    writeToyModel(model, layers, E, F);
    const res = await trainPredictors({
      file: openGguf(model),
      data,
      mm,
      options: { rank: "auto", maxActiveRatio: 1.3, train: { epochs: 1, batchSize: 200 } },
    });
    for (const r of res.layers) {
      expect(r.candidates.map((c) => c.rank)).toEqual([2, 4, 8, 12, 16].slice(0, r.candidates.length));
      expect(r.rank).toBe(r.candidates[r.candidates.length - 1]!.rank);
      const last = r.candidates[r.candidates.length - 1]!;
      if (r.rank < 16) expect(last.trainedRatio!).toBeLessThanOrEqual(1.3);
      for (const c of r.candidates.slice(0, -1)) expect(c.skipped || c.trainedRatio! > 1.3).toBe(true);
      expect(r.val.recall).toBeGreaterThanOrEqual(0.95);
    }
  });

  it("rejects ranks it cannot build", async () => {
    await expect(trainPredictors({ data, mm, options: { rank: 7, init: "random" } })).rejects.toThrow(/even integer/);
    await expect(trainPredictors({ data, mm, options: { rank: 8 } })).rejects.toThrow(/needs the model file/);
  });
});

describe("one model-wide threshold", () => {
  it("per-layer thresholds folded into fc2 select exactly the same neurons", () => {
    const rng = new Rng(11);
    const x = Float32Array.from({ length: 50 * E }, () => rng.normal());
    const preds = [0, 1, 2].map((s) => randomPredictor(8, E, F, s));
    const ts = [-0.7, -0.05, 0.4]; // the last one has the other sign
    const baked = bakeThresholds(
      preds.map((p, l) => ({ predictor: p, threshold: ts[l]! })),
      false,
    );
    expect(baked.threshold).toBe(-1);
    expect(baked.inexact).toEqual([2]);
    preds.forEach((p, l) => {
      const z = predictLogits(p, x, 50, mm);
      const zb = predictLogits(baked.predictors[l]!, x, 50, mm);
      for (let i = 0; i < z.length; i++) {
        if (l < 2 && Math.abs(z[i]! - ts[l]!) > 1e-5) expect(zb[i]! >= baked.threshold).toBe(z[i]! >= ts[l]!);
        // the inexact layer selects a superset (recall kept)
        if (l === 2 && z[i]! >= ts[2]!) expect(zb[i]! >= baked.threshold).toBe(true);
      }
    });
  });

  it("F16: an inexact layer's scale stays within F16 (an overflow gave NaN logits that selected nothing)", () => {
    const rng = new Rng(12);
    const x = Float32Array.from({ length: 50 * E }, () => rng.normal());
    const preds = [0, 1].map((s) => randomPredictor(8, E, F, s + 5));
    // a tiny negative threshold: T/−tiny (tiny = 1e-3 × the smallest |t|) would scale fc2 by 1e6
    const ts = [-0.001, 0.2];
    const baked = bakeThresholds(
      preds.map((p, l) => ({ predictor: p, threshold: ts[l]! })),
      true,
    );
    expect(baked.inexact).toEqual([1]);
    const fc2 = baked.predictors[1]!.fc2;
    expect(fc2.every((v) => Number.isFinite(v) && Math.abs(v) <= 65504)).toBe(true);
    const z = predictLogits(preds[1]!, x, 50, mm);
    const zb = predictLogits(baked.predictors[1]!, x, 50, mm);
    for (let i = 0; i < z.length; i++) if (z[i]! >= ts[1]!) expect(zb[i]! >= baked.threshold).toBe(true);
  });

  it("positive thresholds everywhere give +1", () => {
    const p: LayerPredictor = randomPredictor(4, E, F, 1);
    expect(bakeThresholds([{ predictor: p, threshold: 0.3 }], true).threshold).toBe(1);
  });
});

describe("checkpoint files", () => {
  it("round-trip the state, infinities included", () => {
    const p = randomPredictor(4, E, F, 2);
    const st = initialTrainState(p);
    st.m1[3] = 0.25;
    const c: PipelineCheckpoint = {
      key: "abc",
      done: [],
      current: {
        layer: 0,
        candidates: [{ rank: 4, initRatio: Number.POSITIVE_INFINITY, skipped: false }],
        rankIndex: 0,
        logitScale: 2,
        state: st,
      },
    };
    const path = join(tmp(), "c.ckpt");
    saveCheckpoint(path, c);
    const back = loadCheckpoint(path);
    expect(back.key).toBe("abc");
    expect(back.current!.state.bestScore).toBe(Number.POSITIVE_INFINITY);
    expect(back.current!.candidates[0]!.initRatio).toBe(Number.POSITIVE_INFINITY);
    expect(back.current!.state.m1[3]).toBe(0.25);
    expect(Array.from(back.current!.state.current.fc2)).toEqual(Array.from(p.fc2));
    expect(() => loadCheckpoint(join(tmp(), "missing.ckpt"))).toThrow(/missing\.ckpt/);
  });
});
