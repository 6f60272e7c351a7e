// Attention placement (issue 14): the planner decides per layer whether attention + KV cache live on the device,
// competing with hot neurons for one budget; checked against brute-force enumeration of every placement.
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readGpuIndex, writeGpuIndex } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import {
  attentionByRule,
  DEFAULT_THROUGHPUT,
  evaluatePlacement,
  explainPlan,
  expectedTokensPerSecond,
  gpuIndexToPlan,
  type PlacementPlan,
  type PlannerInput,
  PlannerInputError,
  planExact,
  planGlpk,
  planGreedy,
  planPlacement,
  planToGpuIndex,
} from "../src/placement/index.js";

function lcg(seed: number) {
  let s = seed >>> 0;
  return () => {
    s = (s * 1664525 + 1013904223) >>> 0;
    return s / 2 ** 32;
  };
}

function randomCounts(nLayers: number, nFf: number, rnd: () => number, tokens: number): Int32Array[] {
  return Array.from({ length: nLayers }, () => Int32Array.from({ length: nFf }, () => Math.floor(tokens * rnd() ** 3)));
}

/** S: expected bytes per token the device reads (the planner's objective). */
const S = (plan: Pick<PlacementPlan, "layers">) => plan.layers.reduce((s, L) => s + L.readBytes.device, 0);

/**
 * The optimum of the program by enumerating every placement: per layer attention on/off (forced on for the last
 * nGpuLayers) × its hottest j buckets (j = 0 or ≥ the minimum), within the budget.
 */
function bruteForce(input: PlannerInput): { S: number; choice: { attention: boolean; buckets: number }[] } {
  const size = input.bucketSize ?? 256;
  const tokens = input.tokenCount || 1;
  const k = Math.max(1, Math.ceil((input.minNeuronsPerLayer ?? 0) / size));
  const n = input.counts.length;
  const ngl = input.nGpuLayers ?? 0;
  const options = input.counts.map((c, l) => {
    const sorted = Array.from(c).sort((a, b) => b - a);
    const nb = Math.ceil(sorted.length / size);
    const out: { attention: boolean; buckets: number; bytes: number; value: number }[] = [];
    for (const a of input.attentionBytes ? [false, true] : [false]) {
      if (!a && l >= n - ngl) continue;
      for (let j = 0; j <= nb; j++) {
        if (j > 0 && j < k && nb >= k) continue;
        const neurons = Math.min(sorted.length, j * size);
        const fired = sorted.slice(0, neurons).reduce((s, x) => s + x, 0);
        const bpn = input.bytesPerNeuron[l]!;
        out.push({
          attention: a,
          buckets: j,
          bytes: neurons * bpn + (a ? input.attentionBytes![l]! : 0),
          value: (fired / tokens) * bpn + (a ? (input.attentionReadBytes ?? input.attentionBytes)![l]! : 0),
        });
      }
    }
    return out;
  });
  let best = { S: Number.NEGATIVE_INFINITY, choice: [] as { attention: boolean; buckets: number }[] };
  const walk = (l: number, bytes: number, value: number, choice: { attention: boolean; buckets: number }[]) => {
    if (bytes > input.budgetBytes) return;
    if (l === n) {
      if (value > best.S) best = { S: value, choice: [...choice] };
      return;
    }
    for (const o of options[l]!) {
      choice.push({ attention: o.attention, buckets: o.buckets });
      walk(l + 1, bytes + o.bytes, value + o.value, choice);
      choice.pop();
    }
  };
  walk(0, 0, 0, []);
  return best;
}

describe("attention placement", () => {
  it("a budget that fits exactly one layer's attention takes the attention worth most; one that fits only buckets takes buckets", async () => {
    // 2 layers × 4 neurons, buckets of 2 neurons × 10 bytes = 20 bytes; attention 50 and 40 bytes
    const counts = [Int32Array.from([90, 80, 10, 5]), Int32Array.from([70, 60, 50, 1])];
    const base = { counts, tokenCount: 100, bytesPerNeuron: [10, 10], bucketSize: 2, attentionBytes: [50, 40] };
    // 50 bytes: layer 0's attention (reads 50 B/token) beats layer 1's (40) + nothing, and 2 buckets (≤ 40 B/token)
    const one = await planPlacement({ ...base, budgetBytes: 50 });
    expect(one.layers.map((L) => L.attention)).toEqual([true, false]);
    expect(one.layers.map((L) => L.hot.length)).toEqual([0, 0]);
    expect(one.totalBytes).toBe(50);
    expect(S(one)).toBe(50);
    expect(one.gap).toBe(0);
    // 39 bytes: no attention fits; one bucket: layer 0's {0,1} reads (90+80)/100·10 = 17 B/token
    const buckets = await planPlacement({ ...base, budgetBytes: 39 });
    expect(buckets.layers.map((L) => L.attention)).toEqual([false, false]);
    expect(Array.from(buckets.layers[0]!.hot)).toEqual([0, 1]);
    expect(S(buckets)).toBeCloseTo(17, 12);
    // 90 bytes: both attentions (90 B/token), nothing else fits
    const both = await planPlacement({ ...base, budgetBytes: 90 });
    expect(both.layers.map((L) => L.attention)).toEqual([true, true]);
    expect(both.attentionBytes).toBe(90);
    expect(both.neuronBytes).toBe(0);
    expect(both.attentionPlanned).toBe(true);
    for (const b of [0, 20, 39, 40, 50, 60, 70, 89, 90, 110, 130, 170]) {
      const plan = await planPlacement({ ...base, budgetBytes: b });
      expect(S(plan), `budget ${b}`).toBeCloseTo(bruteForce({ ...base, budgetBytes: b }).S, 9);
    }
  });

  it("the DP equals brute-force enumeration (random sizes, per-layer minimum, -ngl) and GLPK's optimum; greedy never beats it", async () => {
    for (let seed = 1; seed <= 24; seed++) {
      const rnd = lcg(seed);
      const nLayers = 2 + (seed % 3);
      const nFf = 6 + Math.floor(rnd() * 7);
      const counts = randomCounts(nLayers, nFf, rnd, 1000);
      const bytesPerNeuron = counts.map(() => 4 * (1 + Math.floor(rnd() * 6)));
      const attentionBytes = counts.map(() => 8 * (2 + Math.floor(rnd() * 20)));
      const total =
        counts.reduce((s, c, l) => s + c.length * bytesPerNeuron[l]!, 0) + attentionBytes.reduce((s, b) => s + b, 0);
      const nGpuLayers = seed % 4 === 0 ? 1 : 0;
      const forced = nGpuLayers ? attentionBytes[nLayers - 1]! : 0;
      const input: PlannerInput = {
        counts,
        tokenCount: 1000,
        bytesPerNeuron,
        bucketSize: 2 + (seed % 2),
        minNeuronsPerLayer: seed % 3 === 0 ? 4 : 0,
        attentionBytes,
        // attention reading only part of its KV cache per token: worth less than its size
        attentionReadBytes: seed % 5 === 0 ? attentionBytes.map((b) => b * 0.5) : undefined,
        nGpuLayers,
        budgetBytes: forced + Math.floor(rnd() * (total - forced)),
      };
      const want = bruteForce(input);
      const exact = planExact(input)!;
      expect(exact.method).toBe("dp");
      expect(exact.gap).toBe(0);
      expect(S(exact), `seed ${seed}`).toBeCloseTo(want.S, 9);
      expect(exact.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
      if (nGpuLayers) expect(exact.layers[nLayers - 1]!.attention).toBe(true);
      const glpk = await planGlpk(input);
      expect(glpk.method).toBe("glpk");
      expect(S(glpk)).toBeCloseTo(want.S, 6);
      const greedy = planGreedy(input);
      expect(greedy.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
      expect(S(greedy)).toBeLessThanOrEqual(want.S + 1e-9);
      // the fractional bound greedy carries is a bound on the optimum
      expect(greedy.bound).toBeGreaterThanOrEqual(exact.deviceReadShare - 1e-12);
      if (nGpuLayers) expect(greedy.layers[nLayers - 1]!.attention).toBe(true);
    }
  });

  it("attention sizes of many classes: exact by enumeration, or (past the enumeration limit) rounded into the DP within a proven gap", () => {
    for (let seed = 30; seed < 34; seed++) {
      const rnd = lcg(seed);
      const counts = randomCounts(3, 16, rnd, 1000);
      // buckets of 4 × 250 000 bytes; three different attention sizes with gcd 1
      const attentionBytes = counts.map(() => 2_000_001 + Math.floor(rnd() * 3_000_000) * 2);
      const input: PlannerInput = {
        counts,
        tokenCount: 1000,
        bytesPerNeuron: [250_000, 250_000, 250_000],
        bucketSize: 4,
        attentionBytes,
        budgetBytes: 8_000_000 + Math.floor(rnd() * 12_000_000),
      };
      const want = bruteForce(input);
      const exact = planExact(input)!;
      expect(exact.gap).toBe(0);
      expect(S(exact)).toBeCloseTo(want.S, 6);
      const plan = planExact(input, { maxAttentionCombos: 1 })!;
      expect(plan.method).toBe("dp");
      expect(plan.totalBytes).toBeLessThanOrEqual(input.budgetBytes);
      expect(S(plan)).toBeLessThanOrEqual(want.S + 1e-6);
      const total = S(plan) / plan.deviceReadShare;
      expect(plan.bound * total).toBeGreaterThanOrEqual(want.S - 1e-6); // the bound is proven
      expect(plan.gap).toBeLessThan(0.005);
    }
  });

  it("nGpuLayers forces the last N layers' attention on the device, the rest decided by the objective", async () => {
    const rnd = lcg(7);
    const counts = randomCounts(6, 64, rnd, 1000);
    const base: PlannerInput = {
      counts,
      tokenCount: 1000,
      bytesPerNeuron: counts.map(() => 100),
      bucketSize: 8,
      attentionBytes: counts.map(() => 5_000),
      budgetBytes: 0,
    };
    // attention reads all its bytes every token: the planner takes it before any neuron bucket
    const free = await planPlacement({ ...base, budgetBytes: 10_000 });
    expect(free.layers.filter((L) => L.attention)).toHaveLength(2);
    // -ngl 3 with room for 2.4 attentions: the last 3 are placed, and then the budget left holds buckets
    const ngl = await planPlacement({ ...base, budgetBytes: 17_000, nGpuLayers: 3 });
    expect(ngl.layers.map((L) => L.attention)).toEqual([false, false, false, true, true, true]);
    expect(ngl.neuronBytes).toBe(1_600);
    expect(S(ngl)).toBeCloseTo(bruteForce({ ...base, budgetBytes: 17_000, nGpuLayers: 3 }).S, 9);
    // -ngl 0 and -ngl 6
    expect((await planPlacement({ ...base, budgetBytes: 40_000, nGpuLayers: 6 })).attentionBytes).toBe(30_000);
    // exact (llama.cpp's -ngl N): the last N layers' attention and no other, the rest of the budget for neurons
    const exact = await planPlacement({ ...base, budgetBytes: 40_000, nGpuLayers: 2, exactGpuLayers: true });
    expect(exact.layers.map((L) => L.attention)).toEqual([false, false, false, false, true, true]);
    expect(exact.neuronBytes).toBe(40_000 - 10_000 - ((40_000 - 10_000) % 800));
    // the optimum over neurons with those two layers' attention taken (the others' attention worth nothing)
    const others = { ...base, budgetBytes: 40_000, nGpuLayers: 2, attentionBytes: [0, 0, 0, 0, 5_000, 5_000] };
    expect(S(exact)).toBeCloseTo(bruteForce(others).S, 9);
    const none = await planPlacement({ ...base, budgetBytes: 40_000, nGpuLayers: 0, exactGpuLayers: true });
    expect(none.attentionBytes).toBe(0);
    expect(attentionByRule(base.attentionBytes!, 0, 40_000, 1, true)).toEqual([
      false,
      false,
      false,
      false,
      false,
      true,
    ]);
    expect(() => planGreedy({ ...base, budgetBytes: 14_999, nGpuLayers: 3 })).toThrow(
      /attention of the last 3 layers \(nGpuLayers\) needs 15000 bytes, more than the 14999-byte budget/,
    );
    await expect(planPlacement({ ...base, budgetBytes: 14_999, nGpuLayers: 3 })).rejects.toBeInstanceOf(
      PlannerInputError,
    );
    expect(() => planExact({ ...base, budgetBytes: 1e6, nGpuLayers: 7 })).toThrow(/from 0 to 6/);
    expect(() => planExact({ ...base, budgetBytes: 1e6, nGpuLayers: 1.5 })).toThrow(PlannerInputError);
    expect(() => planExact({ ...base, attentionBytes: undefined, budgetBytes: 1e6, nGpuLayers: 2 })).toThrow(
      /nGpuLayers needs attentionBytes/,
    );
    expect(() => planExact({ ...base, attentionBytes: [1, 2], budgetBytes: 1e6 })).toThrow(
      /attentionBytes has 2 layers, the counts 6/,
    );
    expect(() => planExact({ ...base, attentionBytes: base.attentionBytes!.map(() => -1), budgetBytes: 1 })).toThrow(
      /attentionBytes\[0\] must be ≥ 0 bytes/,
    );
  });

  it("expected tokens/s: 1 / Σ (device bytes / D + CPU bytes / C), hand-computed", async () => {
    // one layer, 4 neurons of 10 bytes firing 100 %, 50 %, 0 %, 0 %; attention 100 bytes; D = 1000 B/s, C = 100 B/s
    const input: PlannerInput = {
      counts: [Int32Array.from([10, 5, 0, 0])],
      tokenCount: 10,
      bytesPerNeuron: [10],
      bucketSize: 1,
      attentionBytes: [100],
      budgetBytes: 110, // attention + the hottest neuron
      throughput: { deviceBytesPerSecond: 1000, cpuBytesPerSecond: 100, source: "measured" },
    };
    const plan = await planPlacement(input);
    expect(plan.layers[0]!.attention).toBe(true);
    expect(Array.from(plan.layers[0]!.hot)).toEqual([0]);
    // device reads 100 + 10 = 110 bytes (0.11 s), the CPU 5 bytes (0.05 s): 6.25 tokens/s
    expect(plan.layers[0]!.readBytes).toEqual({ device: 110, cpu: 5 });
    expect(plan.expectedTokensPerSecond).toBeCloseTo(6.25, 12);
    expect(plan.throughput.source).toBe("measured");
    expect(expectedTokensPerSecond(plan, input.throughput)).toBeCloseTo(6.25, 12);
    // the output layer on the CPU (10 bytes): 1 / 0.26
    expect(expectedTokensPerSecond(plan, input.throughput, { cpuBytesPerToken: 10 })).toBeCloseTo(1 / 0.26, 12);
    // defaults: the plan is the same, the estimate is from the documented bandwidths
    const d = await planPlacement({ ...input, throughput: undefined });
    expect(d.throughput).toEqual(DEFAULT_THROUGHPUT);
    expect(d.expectedTokensPerSecond).toBeCloseTo(1 / (110 / 1008e9 + 5 / 76.8e9), 0);
    expect(() =>
      expectedTokensPerSecond(plan, { deviceBytesPerSecond: 0, cpuBytesPerSecond: 1, source: "measured" }),
    ).toThrow(/throughput.deviceBytesPerSecond must be > 0/);
    expect(explainPlan(plan, 4).split("\n").slice(0, 4)).toEqual([
      "placement (integer program): 0.00 MiB of 0.00 MiB budget on the device (hot neurons 0.00 MiB; attention + KV cache of 1 of 1 layers 0.00 MiB); expected share of activations served by the device 66.7 %, of bytes read per token 95.7 %; proven optimal (solved by dp, " +
        `${(plan.solveMs! / 1000).toFixed(2)} s)`,
      "expected 6.3 tokens/s for the layers (device 0.0 GB/s, CPU 0.0 GB/s: measured; output layer not counted)",
      "layer | attention | hot neurons | device bytes | device share | CPU share",
      "    0 |    device |     1 / 4 |     0.00 MiB |       66.7 % |    33.3 %",
    ]);
  });

  it("the GPU index records the attention layers and what they were solved for; PowerInfer's gets them by the rule", async () => {
    const rnd = lcg(3);
    const counts = randomCounts(13, 512, rnd, 1000);
    const input: PlannerInput = {
      counts,
      tokenCount: 1000,
      bytesPerNeuron: counts.map(() => 64),
      bucketSize: 64,
      attentionBytes: counts.map(() => 64 * 200),
      budgetBytes: 64 * 64 * 30,
      nGpuLayers: 2,
    };
    const plan = await planPlacement(input);
    const nAtt = plan.layers.filter((L) => L.attention).length;
    expect(nAtt).toBeGreaterThan(2);
    const path = join(mkdtempSync(join(tmpdir(), "powerinfer-plan-")), "m.generated.gpuidx");
    const prov = {
      budgetBytes: input.budgetBytes,
      backend: "cpu",
      statsFile: "s.gguf",
      attentionBytes: 13 * 64 * 200,
      nGpuLayers: 2,
      exactGpuLayers: true,
    };
    writeGpuIndex(path, planToGpuIndex(plan, 512, prov));
    const idx = readGpuIndex(path);
    expect(idx.vramCapacity).toBe(BigInt(plan.totalBytes));
    const back = gpuIndexToPlan(idx, input.bytesPerNeuron);
    expect(back.provenance).toEqual({ ...prov, solver: plan.solver });
    expect(back.attention).toEqual(plan.layers.map((L) => L.attention));
    // evaluating the read-back placement gives the same objective and tokens/s
    const again = evaluatePlacement(
      input,
      back.layers.map((L) => L.hot),
      back.attention!,
    );
    expect(again.method).toBe("index");
    expect(again.totalBytes).toBe(plan.totalBytes);
    expect(S(again)).toBeCloseTo(S(plan), 6);
    expect(again.expectedTokensPerSecond).toBeCloseTo(plan.expectedTokensPerSecond, 6);
    // a reused index under the -ngl input it was planned with (exactGpuLayers) evaluates the same (it threw
    // "attention on the device needs attentionBytes": -ngl's rule was applied to the stored placement)
    const reused = evaluatePlacement(
      { ...input, nGpuLayers: 2, exactGpuLayers: true },
      back.layers.map((L) => L.hot),
      back.attention!,
    );
    expect(reused.totalBytes).toBe(plan.totalBytes);
    // PowerInfer's index has no attention: the last layers first, as long as they fit beside the given neurons
    expect(attentionByRule([10, 10, 10, 10], 15, 40)).toEqual([false, false, true, true]);
    expect(attentionByRule([10, 30, 10, 10], 0, 35)).toEqual([true, false, true, true]);
    expect(attentionByRule([10, 10, 10, 10], 15, 40, 2)).toEqual([false, false, true, true]);
    expect(attentionByRule([10, 10, 10, 10], 15, 40, 3)).toBeUndefined();
    expect(() => attentionByRule([10], 0, 1, 2)).toThrow(PlannerInputError);
  });
});
