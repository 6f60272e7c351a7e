// The planner on real-sized instances: 7B- and 70B-shaped activation statistics from the synthetic generator's
// power law (what `gen-model` writes), so it lives with the app that composes the two packages.
import {
  explainPlan,
  type PlacementPlan,
  type PlannerInput,
  planExact,
  planGreedy,
  planPlacement,
} from "@powerinfer/core/placement";
import { powerLawFrequencies } from "@powerinfer/synthetic";
import { describe, expect, it } from "vitest";

/** Activations the plan keeps on the device (the integer program's objective). */
const objective = (input: PlannerInput, plan: { layers: { hot: Int32Array }[] }) =>
  plan.layers.reduce((s, L, l) => s + L.hot.reduce((t, n) => t + input.counts[l]![n]!, 0), 0);

/** 7B- and 70B-shaped counts from gen-model's power law, with the layer's shuffled neuron order. */
function shapedCounts(nLayer: number, nFf: number): Int32Array[] {
  const freq = powerLawFrequencies(nFf, { mean: 0.1, hotShare: 0.25 });
  let s = nLayer >>> 0;
  const rnd = () => {
    s = (s * 1664525 + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
  return Array.from({ length: nLayer }, () => {
    const c = new Int32Array(nFf);
    for (let i = 0; i < nFf; i++)
      c[(i * 7919 + Math.floor(rnd() * 97)) % nFf] += Math.round(freq[i]! * 100_000 * (0.9 + 0.2 * rnd()));
    return c;
  });
}

/** The objective: expected bytes per token the device reads. */
const deviceRead = (plan: PlacementPlan) => plan.layers.reduce((s, L) => s + L.readBytes.device, 0);

describe("placement planner at real sizes", () => {
  it("solves 7B- and 70B-shaped instances (gen-model's power law) at 10-50 % budgets, proven optimal", async () => {
    // n_layer × n_ff, device bytes per neuron of an F16 PowerInfer file (gate, up and down_t rows)
    for (const [nLayer, nFf, nEmbd] of [
      [32, 11008, 4096],
      [80, 28672, 8192],
    ] as const) {
      const freq = powerLawFrequencies(nFf, { mean: 0.1, hotShare: 0.25 });
      let s = nLayer >>> 0;
      const rnd = () => {
        s = (s * 1664525 + 1013904223) >>> 0;
        return s / 2 ** 32;
      };
      const counts = Array.from({ length: nLayer }, () => {
        const c = new Int32Array(nFf);
        for (let i = 0; i < nFf; i++)
          c[(i * 7919 + Math.floor(rnd() * 97)) % nFf] += Math.round(freq[i]! * 100_000 * (0.9 + 0.2 * rnd()));
        return c;
      });
      const bytesPerNeuron = counts.map(() => 3 * nEmbd * 2);
      const ffnBytes = nLayer * nFf * 3 * nEmbd * 2;
      for (const share of nLayer === 80 ? [0.1, 0.5] : [0.1, 0.25, 0.5]) {
        const input: PlannerInput = { counts, tokenCount: 100_000, bytesPerNeuron, budgetBytes: share * ffnBytes };
        const plan = await planPlacement(input);
        expect(plan.method, `${nLayer} layers at ${share}`).toBe("dp");
        expect(plan.gap).toBe(0);
        expect(plan.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
        expect(plan.totalBytes).toBeGreaterThan(input.budgetBytes - nLayer * 256 * bytesPerNeuron[0]!);
        expect(objective(input, plan)).toBeGreaterThanOrEqual(objective(input, planGreedy(input)));
        expect(explainPlan(plan, nFf).split("\n")[0]).toMatch(/proven optimal \(solved by dp, [0-9.]+ s\)$/);
      }
    }
  });

  it("attention + KV cache (n_ctx 4096, f16) competes with hot neurons: 7B and 70B at 10/25/50 % budgets, within 0.5 % of the optimum", async () => {
    // Llama-2-7B: 32 × 11008, n_embd 4096, 32 KV heads of 128; Llama-2-70B: 80 × 28672, n_embd 8192, 8 KV heads (GQA)
    for (const [nLayer, nFf, nEmbd, nEmbdKv] of [
      [32, 11008, 4096, 4096],
      [80, 28672, 8192, 1024],
    ] as const) {
      const counts = shapedCounts(nLayer, nFf);
      const maxCount = counts.reduce((m, c) => c.reduce((a, b) => Math.max(a, b), m), 0);
      const bytesPerNeuron = counts.map(() => 3 * nEmbd * 2);
      // F16 wq, wo [n_embd²], wk, wv [n_embd·n_embd_kv], F32 attn_norm, and K + V for 4096 positions in F16
      const attention = 2 * nEmbd * nEmbd * 2 + 2 * nEmbd * nEmbdKv * 2 + nEmbd * 4 + 2 * 4096 * nEmbdKv * 2;
      const attentionBytes = counts.map(() => attention);
      const ffnBytes = nLayer * nFf * 3 * nEmbd * 2;
      const modelBytes = ffnBytes + nLayer * attention;
      for (const share of [0.1, 0.25, 0.5]) {
        const input: PlannerInput = {
          counts,
          tokenCount: maxCount, // no neuron fires more often than every token
          bytesPerNeuron,
          attentionBytes,
          budgetBytes: Math.floor(share * modelBytes),
        };
        const plan = await planPlacement(input);
        const what = `${nLayer} layers at ${share}`;
        console.log(
          `${what}: ${plan.method}, gap ${(plan.gap * 100).toFixed(4)} %, ${plan.layers.filter((L) => L.attention).length} attention layers, ${((plan.solveMs ?? 0) / 1000).toFixed(2)} s, ${plan.expectedTokensPerSecond.toFixed(1)} tokens/s (defaults)`,
        );
        expect(plan.method, what).toBe("dp");
        expect(plan.gap, what).toBeLessThanOrEqual(0.005);
        expect(plan.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
        expect(plan.totalBytes).toBe(plan.neuronBytes + plan.attentionBytes);
        // what is left is less than one bucket or one attention block
        expect(plan.totalBytes).toBeGreaterThan(input.budgetBytes - Math.max(attention, 256 * bytesPerNeuron[0]!));
        // every attention byte is read every token, a neuron's only when it fires (p ≤ 1): attention goes first,
        // only the knapsack's leftovers may favour buckets
        const nAtt = plan.layers.filter((L) => L.attention).length;
        expect(nAtt).toBeGreaterThanOrEqual(Math.min(nLayer, Math.floor(input.budgetBytes / attention)) - 1);
        expect(deviceRead(plan)).toBeGreaterThanOrEqual(deviceRead(planGreedy(input)) - 1e-6);
        const text = explainPlan(plan, nFf).split("\n");
        expect(text[0]).toMatch(
          /attention \+ KV cache of \d+ of \d+ layers .* proven optimal \(solved by dp, [0-9.]+ s\)$/,
        );
        expect(text[1]).toMatch(
          /^expected [0-9.]+ tokens\/s for the layers \(device 1008.0 GB\/s, CPU 76.8 GB\/s: defaults;/,
        );
      }
      // the fallback for many attention size classes (attention rounded into the DP) still proves its gap
      const rounded = planExact(
        { counts, tokenCount: maxCount, bytesPerNeuron, attentionBytes, budgetBytes: Math.floor(0.25 * modelBytes) },
        { maxAttentionCombos: 1 },
      )!;
      console.log(`${nLayer} layers at 0.25, attention rounded into the DP: gap ${(rounded.gap * 100).toFixed(4)} %`);
      expect(rounded.method).toBe("dp");
      expect(rounded.gap).toBeLessThanOrEqual(0.005);
      expect(rounded.totalBytes).toBeLessThanOrEqual(Math.floor(0.25 * modelBytes));
      // -ngl: the last 4 layers' attention forced on at a budget that would not otherwise hold it all
      const forced = await planPlacement({
        counts,
        tokenCount: 100_000,
        bytesPerNeuron,
        attentionBytes,
        nGpuLayers: 4,
        budgetBytes: 4 * attention + 1000 * bytesPerNeuron[0]!,
      });
      expect(forced.layers.slice(-4).every((L) => L.attention)).toBe(true);
      expect(forced.layers.filter((L) => L.attention)).toHaveLength(4);
      expect(forced.gap).toBeLessThanOrEqual(0.005);
    }
  });
});
