/**
 * The designed statistics of generated models with routed experts (core's generateSyntheticMoeModel
 * with `design`, gen-model's default for the expert presets), measured by running the model (CPU
 * backend, dense experts, captured router probabilities and chosen experts' gate pre-activations) on 256
 * seeded random tokens through a 4-layer SmallThinker-layout slice (16 experts, 4 per token, 256 neurons
 * each):
 * - expert selection counts per (layer, expert) follow the design's inclusion probabilities (router bias
 *   −s·ln(rank) plus a unit Gaussian term, top-k; {@link moeRoutingProbabilities}): total variation
 *   distance per layer below 0.1, and the most popular quarter of the experts (by designed rank) takes
 *   the designed share of selections within 0.05;
 * - the chosen experts' neurons fire (gate > 0) at the designed mean (0.4) within 0.03, and neurons
 *   binned by designed frequency (deciles) fire at their bin's designed mean within 0.05 — the power law
 *   inside experts;
 * - with exponent 0 the experts are equally popular (largest share below 2× the uniform one).
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { type LayerCapture, Model } from "@powerinfer/engine";
import {
  generateSyntheticMoeModel,
  moeRoutingProbabilities,
  planMoeDesign,
  type SyntheticMoeShape,
} from "@powerinfer/synthetic";
import { DESIGN_MOE_SHAPE } from "./moe-shape.js";
import { afterAll, describe, expect, it } from "vitest";

const probe = await cpuBackend.probe();
const dir = mkdtempSync(join(tmpdir(), "moe-design-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const shape: SyntheticMoeShape = DESIGN_MOE_SHAPE;
const T = 256;

/** Selection counts [layer][expert] and per-layer firing of the chosen experts' neurons. */
async function measure(zipf: number) {
  const path = join(dir, `st-${zipf}.gguf`);
  const seed = 11;
  generateSyntheticMoeModel(path, {
    arch: "smallthinker",
    shape,
    dtype: "F32",
    vocabSize: 512,
    untiedOutput: false,
    seed,
    design: { zipf },
  });
  const backend = await cpuBackend.load({ threads: 1 });
  const model = await Model.load(path, { backend });
  const s = model.createSession({ nCtx: 512, kvType: "f32" });
  let caps: LayerCapture[] = [];
  // seeded tokens (an LCG), not the special ones
  let x = 12345;
  const tokens = Array.from({ length: T }, () => {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    return 3 + (x % 500);
  });
  s.evaluate(tokens, { onCapture: (layers) => (caps = layers) });
  s.dispose();
  model.dispose();
  backend.dispose();
  const { n_expert: X, n_expert_used: U, n_ff_exp: F } = shape;
  const plan = planMoeDesign("smallthinker", shape, seed, { zipf });
  return caps.map((c, l) => {
    const counts = new Float64Array(X);
    const chosen: number[] = [];
    for (let t = 0; t < T; t++) {
      const p = c.routerProbs!.subarray(t * X, (t + 1) * X);
      const order = Array.from({ length: X }, (_, e) => e).sort((a, b) => p[b]! - p[a]! || a - b);
      for (let u = 0; u < U; u++) {
        counts[order[u]!]! += 1;
        chosen.push(order[u]!);
      }
    }
    // chosen[t·U + u] is the expert of slot u, token t, in the order the graph computes them (top_k order)
    const freq = plan.firing(l);
    const gate = c.expertGate!;
    let fired = 0;
    const bins = Array.from({ length: 10 }, () => ({ designed: 0, fired: 0, n: 0 }));
    for (let j = 0; j < U * T; j++) {
      const e = chosen[j]!;
      for (let i = 0; i < F; i++) {
        const on = gate[j * F + i]! > 0 ? 1 : 0;
        fired += on;
        const q = freq[e * F + i]!;
        const b = bins[Math.min(9, Math.floor(q * 10))]!;
        b.designed += q;
        b.fired += on;
        b.n++;
      }
    }
    return { counts, bias: plan.routerBias(l), firing: fired / (U * T * F), bins, active: plan.active };
  });
}

describe.skipIf(!probe.usable)("designed statistics of generated expert models", () => {
  it("expert selections follow the Zipf-like design and in-expert firing the power law (exponent 1, active 0.4)", async () => {
    const layers = await measure(1);
    expect(layers).toHaveLength(4);
    const U = shape.n_expert_used;
    for (const [l, m] of layers.entries()) {
      const want = moeRoutingProbabilities(m.bias, U);
      const got = m.counts.map((c) => c / T);
      let tv = 0;
      for (let e = 0; e < got.length; e++) tv += Math.abs(got[e]! - want[e]!);
      tv /= 2 * U; // distance between the two distributions of a single selection
      expect(
        tv,
        `layer ${l}: measured ${Array.from(got, (v) => v.toFixed(2))} vs ${Array.from(want, (v) => v.toFixed(2))}`,
      ).toBeLessThan(0.1);
      // the popular quarter (ranks 1..4: the largest biases) takes its designed share of the selections
      const top = Array.from(m.bias.keys())
        .sort((a, b) => m.bias[b]! - m.bias[a]!)
        .slice(0, 4);
      const share = (v: ArrayLike<number>) => top.reduce((a, e) => a + v[e]!, 0) / U;
      expect(Math.abs(share(got) - share(want)), `layer ${l}`).toBeLessThan(0.05);
      expect(share(want)).toBeGreaterThan(0.45); // skewed: 4 of 16 experts take about half the selections
      expect(Math.abs(m.firing - m.active), `layer ${l} firing ${m.firing}`).toBeLessThan(0.03);
      for (const [k, b] of m.bins.entries()) {
        if (b.n < 2000) continue; // too few (neuron, selection) pairs for a 0.05 bound
        expect(Math.abs(b.fired / b.n - b.designed / b.n), `layer ${l} decile ${k}`).toBeLessThan(0.05);
      }
    }
  }, 120_000);

  it("with exponent 0 the experts are about equally popular", async () => {
    const layers = await measure(0);
    for (const m of layers) {
      const got = m.counts.map((c) => c / T / shape.n_expert_used);
      expect(Math.max(...got)).toBeLessThan(2 / shape.n_expert);
    }
  }, 120_000);
});
