/**
 * The neuron placement planner: which FFN neurons of each layer live on the device ("hot") within a
 * memory budget, maximising the activations the device serves.
 *
 * Formulation (PowerInfer, Song et al. 2023, §5 "Neuron placement policy", solved there with GLPK):
 * within each layer, neurons are sorted by activation count and cut into buckets of `bucketSize`
 * (256); binary x[l,b] says bucket b of layer l is on the device.
 *   maximise   Σ count[l,b]·x[l,b]
 *   subject to Σ bytes[l,b]·x[l,b] ≤ budget,
 *              x[l,b+1] ≤ x[l,b]                (a layer takes its hottest buckets first),
 *              x[l,0] ≤ x[l,k−1], k = ⌈min/bucketSize⌉  (a layer holds 0 or ≥ min neurons on the device).
 * Solved exactly by dynamic programming over the layers: a layer's choice is how many of its hottest
 * buckets go to the device (0, or k…n_l), so the program is a knapsack with one group per layer, and with
 * bucket bytes counted in units of their greatest common divisor the table has ⌊budget / unit⌋ + 1 columns
 * (a 70B model, 80 layers × 112 buckets, is ~10⁸ steps at most). Where the table would be larger, GLPK
 * (glpk.js, the solver PowerInfer uses) solves it; a greedy solver (hottest bucket per byte first) is the
 * last fallback and the test oracle. Every plan carries an upper bound on what any placement can serve
 * (the exact optimum, or the fractional knapsack's value) and its gap to it.
 */
import { type GpuIndex, GgufValueType } from "@powerinfer/gguf";
import GLPK from "glpk.js/node";

export interface PlannerInput {
  /** Per layer, [n_ff] activation counts (from `powerinfer profile`), layers in numeric order. */
  counts: readonly Int32Array[];
  /** Tokens the counts were measured over. */
  tokenCount: number;
  /** Per layer, device bytes one hot neuron costs (its W_gate and W_up rows plus its W_down_t row). */
  bytesPerNeuron: readonly number[];
  /** Device bytes available for hot neurons (after attention, predictors, norms, KV cache). */
  budgetBytes: number;
  /** Neurons per bucket. Default 256 (PowerInfer). */
  bucketSize?: number;
  /** A layer holds either no hot neuron or at least this many. Default 0. */
  minNeuronsPerLayer?: number;
}

export interface LayerPlacement {
  /** Ascending ids of the hot neurons (the GPU index's `gpu_bucket`). */
  hot: Int32Array;
  /** Device bytes of the hot neurons. */
  bytes: number;
  /** Share of this layer's activations served by the device (expected, from the counts). */
  deviceShare: number;
}

export interface PlacementPlan {
  layers: LayerPlacement[];
  /** Device bytes of all hot neurons. */
  totalBytes: number;
  budgetBytes: number;
  /** Activations served by the device over all activations (expected). */
  deviceShare: number;
  solver: "ilp" | "greedy";
  /**
   * How it was found: "dp" (exact), "glpk" (exact: GLPK proved it optimal), "greedy", or "index" (read
   * from a GPU index: bound and gap unknown, NaN).
   */
  method: "dp" | "glpk" | "greedy" | "index";
  /** Upper bound on `deviceShare` for any placement within the budget (the optimum when proven). */
  bound: number;
  /** (bound − deviceShare) / bound: 0 means proven optimal. */
  gap: number;
  /** Milliseconds {@link planPlacement} took to solve it. */
  solveMs?: number;
}

interface Bucket {
  layer: number;
  index: number;
  neurons: number[];
  count: number;
  bytes: number;
}

function buckets(input: PlannerInput): Bucket[][] {
  const size = input.bucketSize ?? 256;
  if (input.counts.length !== input.bytesPerNeuron.length) {
    throw new RangeError(`${input.counts.length} layers of counts but ${input.bytesPerNeuron.length} byte sizes`);
  }
  return input.counts.map((c, l) => {
    const order = Array.from(c.keys()).sort((a, b) => c[b]! - c[a]! || a - b);
    const out: Bucket[] = [];
    for (let i = 0; i < order.length; i += size) {
      const neurons = order.slice(i, i + size);
      out.push({
        layer: l,
        index: out.length,
        neurons,
        count: neurons.reduce((s, n) => s + c[n]!, 0),
        bytes: neurons.length * input.bytesPerNeuron[l]!,
      });
    }
    return out;
  });
}

/**
 * Share of all activations that the fractional knapsack serves: buckets by count per byte, the last one
 * cut to fit. It relaxes the integer program (no order or minimum constraints, fractional buckets), so no
 * placement within the budget serves more.
 */
function fractionalBound(input: PlannerInput, per: Bucket[][]): number {
  const all = per.flat().sort((a, b) => b.count / (b.bytes || 1) - a.count / (a.bytes || 1));
  let left = input.budgetBytes;
  let served = 0;
  let total = 0;
  for (const b of all) total += b.count;
  for (const b of all) {
    if (b.bytes <= left) {
      served += b.count;
      left -= b.bytes;
    } else {
      served += (b.count * left) / b.bytes;
      break;
    }
  }
  return total ? Math.min(1, served / total) : 0;
}

function toPlan(
  input: PlannerInput,
  perLayer: Bucket[][],
  chosen: (b: Bucket) => boolean,
  method: "dp" | "glpk" | "greedy",
  /** "exact": the plan is proven optimal, so it is its own bound; otherwise the fractional bound. */
  bound?: "exact",
): PlacementPlan {
  let total = 0;
  let served = 0;
  let all = 0;
  const layers = perLayer.map((bs, l) => {
    const hot = bs.filter(chosen).flatMap((b) => b.neurons);
    const bytes = bs.filter(chosen).reduce((s, b) => s + b.bytes, 0);
    const layerCount = input.counts[l]!.reduce((s, v) => s + v, 0);
    const layerServed = bs.filter(chosen).reduce((s, b) => s + b.count, 0);
    total += bytes;
    served += layerServed;
    all += layerCount;
    return {
      hot: Int32Array.from(hot).sort(),
      bytes,
      deviceShare: layerCount ? layerServed / layerCount : 0,
    };
  });
  const deviceShare = all ? served / all : 0;
  const ub = bound === "exact" ? deviceShare : Math.max(deviceShare, fractionalBound(input, perLayer));
  return {
    layers,
    totalBytes: total,
    budgetBytes: input.budgetBytes,
    deviceShare,
    solver: method === "greedy" ? "greedy" : "ilp",
    method,
    bound: ub,
    gap: ub > 0 ? Math.max(0, (ub - deviceShare) / ub) : 0,
  };
}

/** Greedy: hottest bucket per byte first, respecting the order within a layer and the per-layer minimum. */
export function planGreedy(input: PlannerInput): PlacementPlan {
  const per = buckets(input);
  const size = input.bucketSize ?? 256;
  const k = Math.max(1, Math.ceil((input.minNeuronsPerLayer ?? 0) / size));
  // a layer's first pick is its k hottest buckets together (the minimum), then one bucket at a time
  const next = per.map(() => 0);
  const chosen = new Set<Bucket>();
  let left = input.budgetBytes;
  for (;;) {
    let best: Bucket[] | undefined;
    let bestDensity = -1;
    per.forEach((bs, l) => {
      const take = next[l] === 0 ? bs.slice(0, k) : bs.slice(next[l]!, next[l]! + 1);
      if (take.length === 0) return;
      const bytes = take.reduce((s, b) => s + b.bytes, 0);
      const count = take.reduce((s, b) => s + b.count, 0);
      if (bytes > left) return;
      const density = bytes > 0 ? count / bytes : Number.POSITIVE_INFINITY;
      if (density > bestDensity) {
        bestDensity = density;
        best = take;
      }
    });
    if (!best) break;
    for (const b of best) chosen.add(b);
    next[best[0]!.layer] = best[best.length - 1]!.index + 1;
    left -= best.reduce((s, b) => s + b.bytes, 0);
  }
  return toPlan(input, per, (b) => chosen.has(b), "greedy");
}

function gcd(a: number, b: number): number {
  while (b) [a, b] = [b, a % b];
  return a;
}

/** Largest DP table (layers × buckets × budget units) solved by {@link planExact}; larger goes to GLPK. */
const MAX_DP_STEPS = 3e8;

/**
 * The exact optimum by dynamic programming (see the module comment), or undefined when bucket bytes are
 * not integers or the table would exceed {@link MAX_DP_STEPS} steps.
 */
export function planExact(input: PlannerInput): PlacementPlan | undefined {
  const per = buckets(input);
  const size = input.bucketSize ?? 256;
  const k = Math.max(1, Math.ceil((input.minNeuronsPerLayer ?? 0) / size));
  const all = per.flat();
  if (all.some((b) => !Number.isInteger(b.bytes) || b.bytes < 0)) return undefined;
  const unit = all.reduce((g, b) => gcd(g, b.bytes), 0) || 1;
  const cap = Math.max(0, Math.floor(input.budgetBytes / unit));
  // columns beyond the whole model's size change nothing
  const width =
    Math.min(
      cap,
      all.reduce((s, b) => s + b.bytes / unit, 0),
    ) + 1;
  if (per.reduce((s, bs) => s + (bs.length + 1) * width, 0) > MAX_DP_STEPS) return undefined;
  // best[u]: most activations served with at most u units over the layers so far
  let best = new Float64Array(width);
  const take: Int32Array[] = [];
  for (const bs of per) {
    const next = Float64Array.from(best); // take 0 buckets of this layer
    const choice = new Int32Array(width);
    let cost = 0;
    let value = 0;
    for (let j = 1; j <= bs.length; j++) {
      cost += bs[j - 1]!.bytes / unit;
      value += bs[j - 1]!.count;
      if (j < k && bs.length >= k) continue; // a layer holds 0 or at least k buckets
      for (let u = cost; u < width; u++) {
        const v = best[u - cost]! + value;
        if (v > next[u]!) {
          next[u] = v;
          choice[u] = j;
        }
      }
    }
    take.push(choice);
    best = next;
  }
  const counts = new Array<number>(per.length);
  let u = width - 1;
  for (let l = per.length - 1; l >= 0; l--) {
    const j = take[l]![u]!;
    counts[l] = j;
    for (let i = 0; i < j; i++) u -= per[l]![i]!.bytes / unit;
  }
  return toPlan(input, per, (b) => b.index < counts[b.layer]!, "dp", "exact");
}

let glpkPromise: ReturnType<typeof GLPK> | undefined;

/**
 * Solves the integer program exactly ({@link planExact}); where its table would be too large, with GLPK
 * ({@link planGlpk}), which falls back to {@link planGreedy}.
 */
export async function planPlacement(
  input: PlannerInput,
  opts: { solver?: "ilp" | "greedy"; timeLimitMs?: number } = {},
): Promise<PlacementPlan> {
  const start = performance.now();
  const plan = opts.solver === "greedy" ? planGreedy(input) : (planExact(input) ?? (await planGlpk(input, opts)));
  return { ...plan, solveMs: performance.now() - start };
}

/**
 * Solves the integer program with GLPK; falls back to {@link planGreedy} when the solver fails or
 * finds no optimal solution within `timeLimitMs` (default 10 s).
 */
export async function planGlpk(input: PlannerInput, opts: { timeLimitMs?: number } = {}): Promise<PlacementPlan> {
  const per = buckets(input);
  const size = input.bucketSize ?? 256;
  const k = Math.ceil((input.minNeuronsPerLayer ?? 0) / size);
  const name = (b: Bucket) => `x_${b.layer}_${b.index}`;
  try {
    glpkPromise ??= GLPK();
    const glpk = await glpkPromise;
    const all = per.flat();
    const subjectTo = [
      {
        name: "budget",
        vars: all.map((b) => ({ name: name(b), coef: b.bytes })),
        bnds: { type: glpk.GLP_UP, ub: input.budgetBytes, lb: 0 },
      },
    ];
    for (const bs of per) {
      for (let i = 1; i < bs.length; i++) {
        subjectTo.push({
          name: `order_${bs[i]!.layer}_${i}`,
          vars: [
            { name: name(bs[i]!), coef: 1 },
            { name: name(bs[i - 1]!), coef: -1 },
          ],
          bnds: { type: glpk.GLP_UP, ub: 0, lb: 0 },
        });
      }
      if (k > 1 && bs.length >= k) {
        subjectTo.push({
          name: `min_${bs[0]!.layer}`,
          vars: [
            { name: name(bs[0]!), coef: 1 },
            { name: name(bs[k - 1]!), coef: -1 },
          ],
          bnds: { type: glpk.GLP_UP, ub: 0, lb: 0 },
        });
      }
    }
    const res = glpk.solve(
      {
        name: "placement",
        objective: {
          direction: glpk.GLP_MAX,
          name: "served",
          vars: all.map((b) => ({ name: name(b), coef: b.count })),
        },
        subjectTo,
        binaries: all.map(name),
      },
      { msglev: glpk.GLP_MSG_OFF, tmlim: (opts.timeLimitMs ?? 10_000) / 1000 },
    );
    if (res.result.status !== glpk.GLP_OPT) return planGreedy(input);
    const plan = toPlan(input, per, (b) => res.result.vars[name(b)] === 1, "glpk", "exact");
    return plan.totalBytes <= input.budgetBytes ? plan : planGreedy(input);
  } catch {
    return planGreedy(input);
  }
}

/** A human-readable account of a plan: per layer hot count, bytes and expected device share. */
export function explainPlan(plan: PlacementPlan, nFf: number): string {
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
  const took = plan.solveMs === undefined ? "" : `, ${(plan.solveMs / 1000).toFixed(2)} s`;
  const lines = [
    `placement (${plan.solver}): ${mib(plan.totalBytes)} of ${mib(plan.budgetBytes)} budget on the device; ` +
      `expected share of activations served by the device ${(plan.deviceShare * 100).toFixed(1)} %; ` +
      (Number.isNaN(plan.gap)
        ? "read from the GPU index"
        : plan.gap === 0
          ? `proven optimal (${plan.method}${took})`
          : `within ${(plan.gap * 100).toFixed(2)} % of the optimum (${plan.method}${took}; bound ${(plan.bound * 100).toFixed(1)} %)`),
    "layer | hot neurons | device bytes | device share | CPU share",
    ...plan.layers.map(
      (L, l) =>
        `${String(l).padStart(5)} | ${String(L.hot.length).padStart(5)} / ${nFf} | ${mib(L.bytes).padStart(12)} | ${(L.deviceShare * 100).toFixed(1).padStart(10)} % | ${((1 - L.deviceShare) * 100).toFixed(1).padStart(7)} %`,
    ),
  ];
  return lines.join("\n");
}

/** What a plan was solved for, recorded in the GPU index so a later run knows whether it can reuse it. */
export interface PlanProvenance {
  budgetBytes: number;
  backend: string;
  statsFile: string;
}

/** A plan as PowerInfer's GPU index (`<model>.generated.gpuidx`), with what it was solved for. */
export function planToGpuIndex(plan: PlacementPlan, nFf: number, prov: PlanProvenance): GpuIndex {
  return {
    blockCount: plan.layers.length,
    vramCapacity: BigInt(plan.totalBytes),
    layers: plan.layers.map((L) => {
      const gpuIdx = new Int32Array(nFf);
      for (const n of L.hot) gpuIdx[n] = 1;
      return { gpuIdx, gpuBucket: Int32Array.from(L.hot) };
    }),
    extra: [
      { key: "powerinfer.plan.budget_bytes", type: { type: GgufValueType.UINT64 }, value: BigInt(prov.budgetBytes) },
      { key: "powerinfer.plan.backend", type: { type: GgufValueType.STRING }, value: prov.backend },
      { key: "powerinfer.plan.stats_file", type: { type: GgufValueType.STRING }, value: prov.statsFile },
      { key: "powerinfer.plan.solver", type: { type: GgufValueType.STRING }, value: plan.solver },
    ],
  };
}

/**
 * The hot sets of a GPU index (ours or PowerInfer's), and what it was solved for when recorded.
 * @throws RangeError when gpu_idx and gpu_bucket disagree.
 */
export function gpuIndexToPlan(
  idx: GpuIndex,
  bytesPerNeuron: readonly number[],
): { layers: { hot: Int32Array; bytes: number }[]; provenance?: Partial<PlanProvenance> } {
  const layers = idx.layers.map((L, l) => {
    const hot = Int32Array.from(L.gpuBucket).sort();
    const flagged = L.gpuIdx.reduce((n, v) => n + (v ? 1 : 0), 0);
    if (flagged !== hot.length || hot.some((n) => L.gpuIdx[n] !== 1)) {
      throw new RangeError(`layer ${l}: gpu_idx marks ${flagged} neurons but gpu_bucket lists ${hot.length}`);
    }
    return { hot, bytes: hot.length * (bytesPerNeuron[l] ?? 0) };
  });
  const get = (k: string) => idx.extra?.find((e) => e.key === k)?.value;
  const budget = get("powerinfer.plan.budget_bytes");
  const provenance =
    budget === undefined
      ? undefined
      : {
          budgetBytes: Number(budget),
          backend: String(get("powerinfer.plan.backend") ?? ""),
          statsFile: String(get("powerinfer.plan.stats_file") ?? ""),
        };
  return { layers, provenance };
}
