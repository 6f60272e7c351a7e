import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readGpuIndex, writeGpuIndex } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import {
  expertLayerPlacement,
  explainPlan,
  gpuIndexToPlan,
  type PlannerInput,
  planExact,
  planGlpk,
  planGreedy,
  planPlacement,
  planToGpuIndex,
} from "../src/placement/index.js";

/** Power-law activation counts: neuron i of a layer fires with probability ∝ (rank+1)^−alpha. */
function powerLawCounts(nLayers: number, nFf: number, seed: number, tokens = 10_000): Int32Array[] {
  let s = seed >>> 0;
  const rnd = () => {
    s = (s * 1664525 + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
  return Array.from({ length: nLayers }, () => {
    const alpha = 0.6 + rnd() * 0.8;
    const perm = Array.from({ length: nFf }, (_, i) => i).sort(() => rnd() - 0.5);
    const c = new Int32Array(nFf);
    perm.forEach((n, rank) => {
      c[n] = Math.floor(tokens * Math.min(1, 0.9 * (rank + 1) ** -alpha) * (0.5 + rnd()));
    });
    return c;
  });
}

const objective = (input: PlannerInput, plan: { layers: { hot: Int32Array }[] }) =>
  plan.layers.reduce((s, L, l) => s + L.hot.reduce((t, n) => t + input.counts[l]![n]!, 0), 0);

describe("placement planner", () => {
  it("ILP and greedy agree where greedy is optimal (equal bucket bytes, no per-layer minimum)", async () => {
    for (const seed of [1, 2, 3]) {
      const counts = powerLawCounts(14, 2048, seed);
      const input: PlannerInput = {
        counts,
        tokenCount: 10_000,
        bytesPerNeuron: counts.map(() => 3 * 4096 * 2),
        budgetBytes: 3 * 4096 * 2 * 256 * 37, // room for 37 buckets
      };
      const ilp = await planPlacement(input);
      const greedy = planGreedy(input);
      expect(ilp.solver).toBe("ilp");
      expect(objective(input, ilp)).toBe(objective(input, greedy));
      expect(ilp.layers.map((L) => L.hot.length)).toEqual(greedy.layers.map((L) => L.hot.length));
      expect(ilp.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
    }
  });

  it("never exceeds the budget, and the ILP is at least as good as greedy with a per-layer minimum and mixed dtypes", async () => {
    for (const seed of [4, 5, 6, 7]) {
      const counts = powerLawCounts(12, 1024 + 256 * (seed % 3), seed);
      const input: PlannerInput = {
        counts,
        tokenCount: 10_000,
        bytesPerNeuron: counts.map((_, l) => (l % 3 === 0 ? 3 * 4096 * 2 : 3 * 4096 * 0.5625)),
        budgetBytes: 5_000_000 + seed * 1_234_567,
        minNeuronsPerLayer: 512,
      };
      const ilp = await planPlacement(input);
      const greedy = planGreedy(input);
      for (const plan of [ilp, greedy]) {
        expect(plan.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
        for (const L of plan.layers) expect(L.hot.length === 0 || L.hot.length >= 512).toBe(true);
      }
      expect(objective(input, ilp)).toBeGreaterThanOrEqual(objective(input, greedy));
    }
  });

  it("the exact solver equals GLPK's proven optimum on small instances (mixed bytes, per-layer minimum), and bounds greedy", async () => {
    for (const seed of [21, 22, 23, 24, 25]) {
      const counts = powerLawCounts(6, 768 + 256 * (seed % 3), seed);
      const input: PlannerInput = {
        counts,
        tokenCount: 10_000,
        bytesPerNeuron: counts.map((_, l) => [24_576, 6_912, 13_056][l % 3]!),
        budgetBytes: 2_000_000 + seed * 911_111,
        minNeuronsPerLayer: seed % 2 ? 512 : 0,
      };
      const exact = planExact(input)!;
      const glpk = await planGlpk(input);
      const greedy = planGreedy(input);
      expect(exact.method).toBe("dp");
      expect(glpk.method).toBe("glpk"); // proven optimal by GLPK on instances this small
      expect(objective(input, exact)).toBe(objective(input, glpk));
      expect(exact.gap).toBe(0);
      expect(exact.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
      for (const L of exact.layers)
        if (input.minNeuronsPerLayer) expect(L.hot.length === 0 || L.hot.length >= 512).toBe(true);
      // greedy's gap is measured against the fractional bound, which no placement exceeds
      expect(greedy.bound).toBeGreaterThanOrEqual(exact.deviceReadShare - 1e-12);
      expect(greedy.gap).toBeGreaterThanOrEqual(0);
      expect(greedy.deviceReadShare).toBeLessThanOrEqual(exact.deviceReadShare + 1e-12);
    }
  });

  it("a zero budget puts everything on the CPU; an ample one everything on the device", async () => {
    const counts = powerLawCounts(3, 512, 9);
    const base = { counts, tokenCount: 10_000, bytesPerNeuron: [100, 100, 100] };
    const none = await planPlacement({ ...base, budgetBytes: 0 });
    expect(none.layers.every((L) => L.hot.length === 0)).toBe(true);
    const all = await planPlacement({ ...base, budgetBytes: 10 ** 9 });
    expect(all.layers.every((L) => L.hot.length === 512)).toBe(true);
    expect(all.deviceShare).toBe(1);
  });

  it("hot sets are the hottest neurons, ascending, and the explanation is stable", async () => {
    const counts = [Int32Array.from([5, 50, 1, 40, 0, 30, 2, 20]), Int32Array.from([9, 9, 9, 9, 1, 1, 1, 1])];
    const input: PlannerInput = { counts, tokenCount: 100, bytesPerNeuron: [10, 10], budgetBytes: 60, bucketSize: 2 };
    const { solveMs: _, ...plan } = await planPlacement(input);
    // buckets of 2 by count: layer0 {1,3}=90, {5,7}=50, {0,6}=7…; layer1 {0,1}=18, {2,3}=18 — 6 neurons fit
    expect(Array.from(plan.layers[0]!.hot)).toEqual([1, 3, 5, 7]);
    expect(Array.from(plan.layers[1]!.hot)).toEqual([0, 1]);
    expect(plan.layers[0]!.deviceShare).toBeCloseTo(140 / 148, 10);
    expect(explainPlan(plan, 8)).toBe(
      [
        "placement (integer program): 0.00 MiB of 0.00 MiB budget on the device (hot neurons 0.00 MiB; attention + KV cache of 0 of 2 layers 0.00 MiB); expected share of activations served by the device 84.0 %, of bytes read per token 84.0 %; proven optimal (solved by dp)",
        "expected 18269143633.9 tokens/s for the layers (device 1008.0 GB/s, CPU 76.8 GB/s: defaults; FFN only: no attention sizes given; output layer not counted)",
        "layer | attention | hot neurons | device bytes | device share | CPU share",
        "    0 |       cpu |     4 / 8 |     0.00 MiB |       94.6 % |     5.4 %",
        "    1 |       cpu |     2 / 8 |     0.00 MiB |       45.0 % |    55.0 %",
      ].join("\n"),
    );
  });

  it("a plan read from a GPU index without activation statistics says n/a, not NaN", async () => {
    const counts = [Int32Array.from([5, 50, 1, 40, 0, 30, 2, 20]), Int32Array.from([9, 9, 9, 9, 1, 1, 1, 1])];
    const { solveMs: _, ...solved } = await planPlacement({
      counts,
      tokenCount: 100,
      bytesPerNeuron: [10, 10],
      budgetBytes: 60,
      bucketSize: 2,
    });
    // what the CLI holds for a PowerInfer .gpuidx and no statistics: the placement, no shares
    const plan = {
      ...solved,
      method: "index" as const,
      gap: Number.NaN,
      bound: Number.NaN,
      deviceShare: Number.NaN,
      deviceReadShare: Number.NaN,
      expectedTokensPerSecond: Number.NaN,
      layers: solved.layers.map((L) => ({ ...L, deviceShare: Number.NaN })),
    };
    const text = explainPlan(plan, 8);
    expect(text).not.toMatch(/NaN/);
    expect(text.split("\n")).toEqual([
      "placement (GPU index): 0.00 MiB of 0.00 MiB budget on the device (hot neurons 0.00 MiB; attention + KV cache of 0 of 2 layers 0.00 MiB); expected share of activations served by the device n/a, of bytes read per token n/a (no activation statistics); read from the GPU index",
      "expected ? (no statistics) tokens/s for the layers (device 1008.0 GB/s, CPU 76.8 GB/s: defaults; FFN only: no attention sizes given; output layer not counted)",
      "layer | attention | hot neurons | device bytes | device share | CPU share",
      "    0 |       cpu |     4 / 8 |     0.00 MiB |          n/a |       n/a",
      "    1 |       cpu |     2 / 8 |     0.00 MiB |          n/a |       n/a",
    ]);
  });

  it("GPU index round-trip keeps numeric layer order (≥ 12 layers) and what the plan was solved for", async () => {
    const counts = powerLawCounts(13, 1024, 11);
    const input: PlannerInput = {
      counts,
      tokenCount: 1,
      bytesPerNeuron: counts.map(() => 64),
      budgetBytes: 64 * 256 * 20,
    };
    const plan = await planPlacement(input);
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-plan-"));
    const path = join(dir, "m.generated.gpuidx");
    writeGpuIndex(
      path,
      planToGpuIndex(plan, 1024, { budgetBytes: input.budgetBytes, backend: "cpu", statsFile: "s.gguf" }),
    );
    const back = gpuIndexToPlan(readGpuIndex(path), input.bytesPerNeuron);
    expect(back.layers.map((L) => Array.from(L.hot))).toEqual(plan.layers.map((L) => Array.from(L.hot)));
    // a neurons-only plan: no attention bytes, no attention layer
    expect(back.provenance).toEqual({
      budgetBytes: input.budgetBytes,
      backend: "cpu",
      statsFile: "s.gguf",
      attentionBytes: 0,
      nGpuLayers: 0,
      exactGpuLayers: false,
      solver: "ilp",
    });
    expect(back.attention).toEqual(plan.layers.map(() => false));
  });

  it("reads PowerInfer's own GPU index fixture", () => {
    const idx = readGpuIndex(join(process.env.POWERINFER_TEST_MODELS!, "powerinfer", "tiny.generated.gpuidx"));
    const plan = gpuIndexToPlan(idx, [1, 1]);
    expect(plan.layers.map((L) => L.hot.length)).toEqual([512, 256]);
    expect(plan.provenance).toBeUndefined();
  });
});

describe("placement of routed experts: (expert, neuron) pairs", () => {
  it("groups a layer's hot pairs by expert and weighs experts by routed tokens", () => {
    // 3 experts of 4 neurons: expert 0 whole, expert 2 one neuron, expert 1 none
    const x = expertLayerPlacement(Int32Array.from([0, 1, 2, 3, 9]), 4, 3, Int32Array.from([50, 30, 20]));
    expect(Array.from(x.hotPerExpert)).toEqual([4, 0, 1]);
    expect(x.experts).toBe(2);
    expect(x.whole).toBe(1);
    expect(x.routedShare).toBeCloseTo(70 / 100, 12);
    expect(expertLayerPlacement(Int32Array.from([5]), 4, 3).routedShare).toBeNaN();
    expect(() => expertLayerPlacement(Int32Array.from([12]), 4, 3)).toThrow(
      /pair 12 is outside n_ff_exp × n_expert = 4 × 3/,
    );
    expect(() => expertLayerPlacement(Int32Array.from([1]), 4, 3, new Int32Array(2))).toThrow(
      /2 expert selection counts for 3 experts/,
    );
  });

  it("dense experts (every pair counted as its expert's selections) go to the device whole, most routed first", async () => {
    // 4 experts of 4 neurons, selected 10, 40, 30, 20 times: the budget holds 8 pairs → experts 1 and 2
    const sel = [10, 40, 30, 20];
    const counts = [Int32Array.from({ length: 16 }, (_, i) => sel[Math.floor(i / 4)]!)];
    const plan = await planPlacement({ counts, tokenCount: 50, bytesPerNeuron: [10], budgetBytes: 80, bucketSize: 4 });
    expect(Array.from(plan.layers[0]!.hot)).toEqual([4, 5, 6, 7, 8, 9, 10, 11]);
    const text = explainPlan(plan, 16, {
      nExpert: 4,
      nFfExp: 4,
      selections: [Int32Array.from(sel)],
      rankedBy: "selections",
    });
    expect(text).toMatch(
      /routed experts: 4 per layer of 4 neurons; a hot neuron is an \(expert, neuron\) pair, ranked by its expert's selection count/,
    );
    expect(text).toMatch(
      /\| experts on device \(whole\) \| routed to them\n +0 \| +cpu \| +8 \/ 16 \|.*\| +2 \/ 4 \(2\) \| +70\.0 %$/,
    );
  });

  it("an expert GPU index records n_expert and the ranking, and reads back", async () => {
    const counts = powerLawCounts(2, 3 * 256, 5);
    const input: PlannerInput = { counts, tokenCount: 10_000, bytesPerNeuron: [64, 64], budgetBytes: 64 * 512 };
    const plan = await planPlacement(input);
    const idx = planToGpuIndex(plan, 3 * 256, {
      budgetBytes: input.budgetBytes,
      backend: "cpu",
      statsFile: "s.gguf",
      expertCount: 3,
      expertRanking: "selections",
    });
    const path = join(mkdtempSync(join(tmpdir(), "powerinfer-plan-")), "x.gpuidx");
    writeGpuIndex(path, idx);
    const back = gpuIndexToPlan(readGpuIndex(path), input.bytesPerNeuron);
    expect(back.provenance).toMatchObject({ expertCount: 3, expertRanking: "selections" });
    expect(back.layers.map((L) => Array.from(L.hot))).toEqual(plan.layers.map((L) => Array.from(L.hot)));
    expect(readGpuIndex(path).layers[0]!.gpuIdx.length).toBe(3 * 256);
  });
});
