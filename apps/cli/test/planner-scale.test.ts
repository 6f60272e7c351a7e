// The planner on real-sized instances: 7B- and 70B-shaped activation statistics from the synthetic generator's
// power law (what `gen-model` writes), so it lives with the app that composes the two packages.
import { explainPlan, type PlannerInput, planGreedy, planPlacement } from "@powerinfer/core/placement";
import { powerLawFrequencies } from "@powerinfer/synthetic";
import { describe, expect, it } from "vitest";

/** Activations the plan keeps on the device (the integer program's objective). */
const objective = (input: PlannerInput, plan: { layers: { hot: Int32Array }[] }) =>
  plan.layers.reduce((s, L, l) => s + L.hot.reduce((t, n) => t + input.counts[l]![n]!, 0), 0);

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
        expect(explainPlan(plan, nFf).split("\n")[0]).toMatch(/proven optimal \(dp, [0-9.]+ s\)$/);
      }
    }
  });
});
