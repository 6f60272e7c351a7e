/**
 * The placement planner: which FFN neurons of each layer live on the device ("hot") and which layers' attention
 * (attention weights plus that layer's KV cache) live there, within one memory budget, minimising the expected
 * time of a token.
 *
 * Formulation (PowerInfer, Song et al. 2023, §5 "Neuron placement policy", solved there with GLPK; attention as
 * llama.cpp's `-ngl` offloads whole layers): within each layer, neurons are sorted by activation count and cut
 * into buckets of `bucketSize` (256); binary x[l,b] says bucket b of layer l is on the device, binary y[l] says
 * layer l's attention is.
 *   maximise   S = Σ_l ( R[l]·y[l] + Σ_b v[l,b]·x[l,b] )
 *   subject to Σ_l ( A[l]·y[l] + Σ_b bytes[l,b]·x[l,b] ) ≤ budget,
 *              x[l,b+1] ≤ x[l,b]                (a layer takes its hottest buckets first),
 *              x[l,0] ≤ x[l,k−1], k = ⌈min/bucketSize⌉  (a layer holds 0 or ≥ min neurons on the device),
 *              y[l] = 1 for the last `nGpuLayers` layers (llama.cpp's -ngl offloads the last layers).
 * S is the expected number of bytes per token the device reads instead of the CPU: v[l,b] = (Σ count of the
 * bucket's neurons / tokenCount) · bytesPerNeuron[l] (a sparse FFN reads a neuron's rows only when it fires),
 * R[l] = the bytes attention reads per token (dense: all its weights and, conservatively, a full KV cache),
 * A[l] = its device bytes (weights + KV cache for n_ctx).
 *
 * Why S: with device and CPU reading at D and C bytes/s (token generation is memory-bound, PowerInfer §2), a
 * token takes T = Σ_l (device bytes read / D + CPU bytes read / C) = R_total/C − S·(1/C − 1/D), counting a
 * layer's CPU and device parts one after the other (an upper bound: PowerInfer overlaps them). For any D > C,
 * minimising T is maximising S, so the choice does not depend on the two speeds; they only turn the plan into
 * expected tokens/s ({@link expectedTokensPerSecond}). With uniform bytes per neuron and no attention, S is
 * proportional to PowerInfer's objective (activations served by the device). Attention reads every byte every
 * token, so per byte it is worth at least as much as any neuron bucket.
 *
 * Solved exactly by dynamic programming: a layer's choice is attention on/off × how many of its hottest buckets go
 * to the device (0, or k…n_l). Attention and neurons of a layer are tied only by the budget, so one DP over the
 * layers' neuron choices (a knapsack with one group per layer, bucket bytes counted in units of their greatest
 * common divisor: ⌊budget / unit⌋ + 1 columns, a 70B model is ~10⁸ steps at most) gives the best neurons for
 * every remaining budget, and the attention set is enumerated over it as a count per class of equal-sized
 * layers (81 combinations for a uniform 80-layer model). Where attention sizes fall into too many classes,
 * attention joins the DP as a 0/1 item per layer with its size rounded up (a feasible plan) and, in a second
 * pass, down (a relaxation whose optimum bounds every placement): the plan's gap is then proven but may be > 0.
 * Where the table would be too large, GLPK (glpk.js, the solver PowerInfer uses) solves the program; a greedy
 * solver (most bytes read per byte first) is the last fallback and the test oracle. Every plan carries an upper
 * bound on S (as a share of all bytes read per token) and its gap.
 */
import { type GgufMetadataEntry, type GpuIndex, GgufValueType } from "@powerinfer/gguf";
import GLPK from "glpk.js/node";

/** Bad planner input: mismatched lengths, negative sizes, an impossible -ngl. */
export class PlannerInputError extends RangeError {
  readonly code = "BAD_PLANNER_INPUT";
  constructor(message: string) {
    super(message);
    this.name = "PlannerInputError";
  }
}

/** How fast each side reads weights, in bytes per second, and where the numbers came from. */
export interface Throughput {
  /** Device (GPU) bytes read per second. */
  deviceBytesPerSecond: number;
  /** CPU bytes read per second (main memory bandwidth the CPU kernels reach). */
  cpuBytesPerSecond: number;
  /** "defaults": {@link DEFAULT_THROUGHPUT}; "measured": a calibration or numbers the user gave. */
  source: "defaults" | "measured";
}

/**
 * Default throughput: the nominal memory bandwidths of PowerInfer's "PC-High" (Song et al. 2023, §8): an
 * NVIDIA RTX 4090 (1008 GB/s) and dual-channel DDR5-4800 (76.8 GB/s). Peaks, so expected tokens/s from them
 * are optimistic; pass measured numbers for real estimates. The placement itself does not depend on them.
 */
export const DEFAULT_THROUGHPUT: Readonly<Throughput> = Object.freeze({
  deviceBytesPerSecond: 1008e9,
  cpuBytesPerSecond: 76.8e9,
  source: "defaults",
});

export interface PlannerInput {
  /** Per layer, [n_ff] activation counts (from `powerinfer profile`), layers in numeric order. */
  counts: readonly Int32Array[];
  /** Tokens the counts were measured over. */
  tokenCount: number;
  /** Per layer, device bytes one hot neuron costs (its W_gate and W_up rows plus its W_down_t row). */
  bytesPerNeuron: readonly number[];
  /**
   * Device bytes for the plan: hot neurons and, when `attentionBytes` is given, offloaded attention (after
   * predictors, norms and the output layer).
   */
  budgetBytes: number;
  /** Neurons per bucket. Default 256 (PowerInfer). */
  bucketSize?: number;
  /** A layer holds either no hot neuron or at least this many. Default 0. */
  minNeuronsPerLayer?: number;
  /**
   * Per layer, device bytes of its attention: attention weights (norms, q/k/v/o or qkv, biases, q/k norms)
   * plus its KV cache for the session's n_ctx. Absent: attention stays on the CPU (a neurons-only plan).
   */
  attentionBytes?: readonly number[];
  /** Per layer, bytes its attention reads per token (default `attentionBytes`: weights and a full KV cache). */
  attentionReadBytes?: readonly number[];
  /**
   * Force the attention of the last N layers onto the device (as llama.cpp's `-ngl N` offloads the last N
   * layers); the other layers are decided by the objective. Needs `attentionBytes`.
   */
  nGpuLayers?: number;
  /**
   * With `nGpuLayers`: the last N layers' attention and no other (llama.cpp's `-ngl N` exactly); the
   * objective decides only the neurons. Default false (N is a minimum).
   */
  exactGpuLayers?: boolean;
  /** Per-backend speed for the plan's expected tokens/s (default {@link DEFAULT_THROUGHPUT}). */
  throughput?: Throughput;
}

export interface LayerPlacement {
  /** Ascending ids of the hot neurons (the GPU index's `gpu_bucket`). */
  hot: Int32Array;
  /** Device bytes of the hot neurons. */
  bytes: number;
  /** True when the device holds this layer's attention weights and its KV cache. */
  attention: boolean;
  /** Device bytes of this layer's attention and KV cache when `attention`, else 0. */
  attentionBytes: number;
  /** Share of this layer's activations served by the device (expected, from the counts). */
  deviceShare: number;
  /** Expected bytes read per token by the device and by the CPU in this layer (NaN when unknown). */
  readBytes: { device: number; cpu: number };
}

export interface PlacementPlan {
  layers: LayerPlacement[];
  /** Device bytes of the plan: hot neurons plus offloaded attention (with its KV cache). */
  totalBytes: number;
  /** Device bytes of the hot neurons alone. */
  neuronBytes: number;
  /** Device bytes of offloaded attention alone. */
  attentionBytes: number;
  budgetBytes: number;
  /** Activations served by the device over all activations (expected). */
  deviceShare: number;
  /** The objective: share of the bytes read per token that the device reads (expected). */
  deviceReadShare: number;
  /** False when the input had no attention sizes (attention stays on the CPU; tokens/s count the FFN alone). */
  attentionPlanned: boolean;
  solver: "ilp" | "greedy";
  /**
   * How it was found: "dp" (dynamic programming: exact when gap is 0), "glpk" (exact: GLPK proved it optimal),
   * "greedy", or "index" (read from a GPU index: bound and gap unknown, NaN).
   */
  method: "dp" | "glpk" | "greedy" | "index";
  /** Upper bound on `deviceReadShare` for any placement within the budget (the optimum when proven). */
  bound: number;
  /** (bound − deviceReadShare) / bound: 0 means proven optimal. */
  gap: number;
  /** The speeds `expectedTokensPerSecond` was computed with. */
  throughput: Throughput;
  /** Expected tokens per second of the layers (attention + FFN; not the output layer), see {@link expectedTokensPerSecond}. */
  expectedTokensPerSecond: number;
  /** Milliseconds {@link planPlacement} took to solve it. */
  solveMs?: number;
}

interface Bucket {
  layer: number;
  index: number;
  neurons: number[];
  count: number;
  bytes: number;
  /** Expected bytes read per token: count / tokens · bytes per neuron. */
  value: number;
}

interface Attention {
  bytes: number;
  read: number;
  allowed: boolean;
  forced: boolean;
}

interface Prepared {
  per: Bucket[][];
  att: Attention[];
  /** Minimum buckets of a layer that has any. */
  k: number;
  /** All bytes read per token (device or CPU). */
  totalRead: number;
  /** Activations of each layer. */
  layerCounts: number[];
  throughput: Throughput;
}

function checkThroughput(t: Throughput): Throughput {
  for (const [k, v] of [
    ["deviceBytesPerSecond", t.deviceBytesPerSecond],
    ["cpuBytesPerSecond", t.cpuBytesPerSecond],
  ] as const) {
    if (!(v > 0) || !Number.isFinite(v)) throw new PlannerInputError(`throughput.${k} must be > 0, got ${v}`);
  }
  return t;
}

function sizes(name: string, v: readonly number[] | undefined, n: number): readonly number[] | undefined {
  if (v === undefined) return undefined;
  if (v.length !== n) throw new PlannerInputError(`${name} has ${v.length} layers, the counts ${n}`);
  v.forEach((b, l) => {
    if (!(b >= 0) || !Number.isFinite(b)) throw new PlannerInputError(`${name}[${l}] must be ≥ 0 bytes, got ${b}`);
  });
  return v;
}

/** Validates the input and cuts each layer into buckets. @throws PlannerInputError */
function prepare(input: PlannerInput): Prepared {
  const size = input.bucketSize ?? 256;
  const n = input.counts.length;
  if (!Number.isInteger(size) || size < 1)
    throw new PlannerInputError(`bucketSize must be an integer ≥ 1, got ${size}`);
  if (input.bytesPerNeuron.length !== n) {
    throw new PlannerInputError(`${n} layers of counts but ${input.bytesPerNeuron.length} byte sizes`);
  }
  sizes("bytesPerNeuron", input.bytesPerNeuron, n);
  if (!(input.budgetBytes >= 0)) throw new PlannerInputError(`budgetBytes must be ≥ 0, got ${input.budgetBytes}`);
  if (!(input.tokenCount >= 0)) throw new PlannerInputError(`tokenCount must be ≥ 0, got ${input.tokenCount}`);
  const attBytes = sizes("attentionBytes", input.attentionBytes, n);
  const attRead = sizes("attentionReadBytes", input.attentionReadBytes, n) ?? attBytes;
  const ngl = input.nGpuLayers ?? 0;
  if (!Number.isInteger(ngl) || ngl < 0 || ngl > n) {
    throw new PlannerInputError(`nGpuLayers must be an integer from 0 to ${n} (the layers), got ${input.nGpuLayers}`);
  }
  if (ngl > 0 && !attBytes)
    throw new PlannerInputError("nGpuLayers needs attentionBytes (each layer's attention size)");
  const att = Array.from({ length: n }, (_, l) => ({
    bytes: attBytes?.[l] ?? 0,
    read: attRead?.[l] ?? 0,
    allowed: attBytes !== undefined && (!input.exactGpuLayers || l >= n - ngl),
    forced: l >= n - ngl,
  }));
  const forcedBytes = att.reduce((s, a) => s + (a.forced ? a.bytes : 0), 0);
  if (forcedBytes > input.budgetBytes) {
    throw new PlannerInputError(
      `the attention of the last ${ngl} layers (nGpuLayers) needs ${forcedBytes} bytes, more than the ${input.budgetBytes}-byte budget`,
    );
  }
  const tokens = input.tokenCount > 0 ? input.tokenCount : 1;
  const layerCounts: number[] = [];
  let totalRead = 0;
  const per = input.counts.map((c, l) => {
    const bpn = input.bytesPerNeuron[l]!;
    const order = Array.from(c.keys()).sort((a, b) => c[b]! - c[a]! || a - b);
    const out: Bucket[] = [];
    let all = 0;
    for (let i = 0; i < order.length; i += size) {
      const neurons = order.slice(i, i + size);
      const count = neurons.reduce((s, x) => s + c[x]!, 0);
      all += count;
      out.push({
        layer: l,
        index: out.length,
        neurons,
        count,
        bytes: neurons.length * bpn,
        value: (count / tokens) * bpn,
      });
    }
    layerCounts.push(all);
    totalRead += (all / tokens) * bpn + att[l]!.read;
    return out;
  });
  const k = Math.max(1, Math.ceil((input.minNeuronsPerLayer ?? 0) / size));
  return { per, att, k, totalRead, layerCounts, throughput: checkThroughput(input.throughput ?? DEFAULT_THROUGHPUT) };
}

/**
 * The expected tokens per second of a plan: 1 / Σ_l (device bytes read / D + CPU bytes read / C), with each
 * layer's expected bytes read per token (`layers[l].readBytes`), the two sides counted one after the other
 * (see the module comment; memory-bound decoding, PowerInfer §2).
 * @param extra bytes per token read outside the layers (e.g. the output layer on the CPU); default none.
 * @returns tokens/s; NaN when the plan's read bytes are unknown (a GPU index without statistics).
 * @throws PlannerInputError when a speed is not > 0.
 */
export function expectedTokensPerSecond(
  plan: Pick<PlacementPlan, "layers">,
  throughput: Throughput = DEFAULT_THROUGHPUT,
  extra: { cpuBytesPerToken?: number; deviceBytesPerToken?: number } = {},
): number {
  const t = checkThroughput(throughput);
  let s =
    (extra.cpuBytesPerToken ?? 0) / t.cpuBytesPerSecond + (extra.deviceBytesPerToken ?? 0) / t.deviceBytesPerSecond;
  for (const L of plan.layers) s += L.readBytes.device / t.deviceBytesPerSecond + L.readBytes.cpu / t.cpuBytesPerSecond;
  return s > 0 ? 1 / s : Number.isNaN(s) ? Number.NaN : Number.POSITIVE_INFINITY;
}

/** Fractional knapsack's S: forced attention first, then every item by value per byte, the last one cut to fit. */
function fractionalBound(input: PlannerInput, p: Prepared): number {
  let left = input.budgetBytes;
  let served = 0;
  const items: { value: number; bytes: number }[] = [];
  for (const a of p.att) {
    if (a.forced) {
      left -= a.bytes;
      served += a.read;
    } else if (a.allowed) items.push({ value: a.read, bytes: a.bytes });
  }
  for (const b of p.per.flat()) items.push(b);
  const density = (x: { value: number; bytes: number }) => (x.bytes > 0 ? x.value / x.bytes : Number.POSITIVE_INFINITY);
  items.sort((a, b) => density(b) - density(a));
  for (const b of items) {
    if (b.bytes <= left) {
      served += b.value;
      left -= b.bytes;
    } else {
      served += (b.value * Math.max(0, left)) / b.bytes;
      break;
    }
  }
  return served;
}

/** The bound on S a plan carries: "exact" (it is optimal), a proven bound on S, or the fractional bound. */
type BoundOf = "exact" | number | undefined;

function toPlan(
  input: PlannerInput,
  p: Prepared,
  chosen: (b: Bucket) => boolean,
  attention: readonly boolean[],
  method: PlacementPlan["method"],
  boundOf: BoundOf,
): PlacementPlan {
  const tokens = input.tokenCount > 0 ? input.tokenCount : 1;
  let neuronBytes = 0;
  let attentionBytes = 0;
  let served = 0;
  let all = 0;
  let S = 0;
  const layers: LayerPlacement[] = p.per.map((bs, l) => {
    const on = bs.filter(chosen);
    const hot = on.flatMap((b) => b.neurons);
    const bytes = on.reduce((s, b) => s + b.bytes, 0);
    const layerServed = on.reduce((s, b) => s + b.count, 0);
    const a = p.att[l]!;
    const att = attention[l] === true;
    const ffnRead = (p.layerCounts[l]! / tokens) * input.bytesPerNeuron[l]!;
    const hotRead = on.reduce((s, b) => s + b.value, 0);
    const device = hotRead + (att ? a.read : 0);
    neuronBytes += bytes;
    attentionBytes += att ? a.bytes : 0;
    served += layerServed;
    all += p.layerCounts[l]!;
    S += device;
    return {
      hot: Int32Array.from(hot).sort(),
      bytes,
      attention: att,
      attentionBytes: att ? a.bytes : 0,
      deviceShare: p.layerCounts[l]! ? layerServed / p.layerCounts[l]! : 0,
      readBytes: { device, cpu: Math.max(0, ffnRead - hotRead) + (att ? 0 : a.read) },
    };
  });
  const share = (x: number) => (p.totalRead > 0 ? Math.min(1, x / p.totalRead) : 0);
  const deviceReadShare = share(S);
  const ub =
    method === "index"
      ? Number.NaN
      : boundOf === "exact"
        ? deviceReadShare
        : Math.max(deviceReadShare, share(boundOf ?? fractionalBound(input, p)));
  const plan: PlacementPlan = {
    layers,
    totalBytes: neuronBytes + attentionBytes,
    neuronBytes,
    attentionBytes,
    budgetBytes: input.budgetBytes,
    deviceShare: all ? served / all : 0,
    deviceReadShare,
    attentionPlanned: input.attentionBytes !== undefined,
    solver: method === "greedy" ? "greedy" : "ilp",
    method,
    bound: ub,
    gap: Number.isNaN(ub) ? Number.NaN : ub > 0 ? Math.max(0, (ub - deviceReadShare) / ub) : 0,
    throughput: p.throughput,
    expectedTokensPerSecond: 0,
  };
  plan.expectedTokensPerSecond = expectedTokensPerSecond(plan, p.throughput);
  return plan;
}

/**
 * A plan from a given placement (e.g. a GPU index's hot sets): its device bytes, shares and expected tokens/s
 * from the input's statistics; method "index", bound and gap NaN. The placement is not checked against the budget.
 * @param hot per layer, the hot neuron ids.
 * @param attention per layer, whether the device holds the layer's attention (needs `input.attentionBytes` for true).
 * @throws PlannerInputError for bad input or a neuron id out of range.
 */
export function evaluatePlacement(
  input: PlannerInput,
  hot: readonly Int32Array[],
  attention: readonly boolean[],
): PlacementPlan {
  // each neuron on its own (hot sets need not be whole buckets); the placement says which layers' attention is
  // on the device, so -ngl's constraints (nGpuLayers, exactGpuLayers) do not apply to it
  const p = prepare({ ...input, bucketSize: 1, nGpuLayers: 0, exactGpuLayers: false, minNeuronsPerLayer: 0 });
  if (hot.length !== p.per.length) throw new PlannerInputError(`${hot.length} hot sets for ${p.per.length} layers`);
  const sets = hot.map((h, l) => {
    const nFf = input.counts[l]!.length;
    for (const n of h) if (!(n >= 0 && n < nFf)) throw new PlannerInputError(`layer ${l}: neuron ${n} out of range`);
    return new Set(h);
  });
  if (attention.some((a, l) => a && !p.att[l]?.allowed)) {
    throw new PlannerInputError("attention on the device needs attentionBytes");
  }
  return toPlan(input, p, (b) => sets[b.layer]!.has(b.neurons[0]!), attention, "index", undefined);
}

/** Greedy: most bytes read per byte first (attention, or a layer's next bucket), within each layer's order and minimum. */
export function planGreedy(input: PlannerInput): PlacementPlan {
  const p = prepare(input);
  const { per, att, k } = p;
  const next = per.map(() => 0);
  const attention = att.map((a) => a.forced);
  const chosen = new Set<Bucket>();
  let left = input.budgetBytes - att.reduce((s, a) => s + (a.forced ? a.bytes : 0), 0);
  for (;;) {
    let best: { layer: number; buckets?: Bucket[]; bytes: number } | undefined;
    let bestDensity = -1;
    const consider = (layer: number, value: number, bytes: number, buckets?: Bucket[]) => {
      if (bytes > left) return;
      const density = bytes > 0 ? value / bytes : Number.POSITIVE_INFINITY;
      if (density > bestDensity) {
        bestDensity = density;
        best = { layer, buckets, bytes };
      }
    };
    per.forEach((bs, l) => {
      // a layer's first pick is its k hottest buckets together (the minimum), then one bucket at a time
      const take = next[l] === 0 ? bs.slice(0, k) : bs.slice(next[l]!, next[l]! + 1);
      if (take.length > 0) {
        consider(
          l,
          take.reduce((s, b) => s + b.value, 0),
          take.reduce((s, b) => s + b.bytes, 0),
          take,
        );
      }
      if (att[l]!.allowed && !attention[l]) consider(l, att[l]!.read, att[l]!.bytes);
    });
    const b = best as { layer: number; buckets?: Bucket[]; bytes: number } | undefined;
    if (!b) break;
    if (b.buckets) {
      for (const x of b.buckets) chosen.add(x);
      next[b.layer] = b.buckets[b.buckets.length - 1]!.index + 1;
    } else attention[b.layer] = true;
    left -= b.bytes;
  }
  return toPlan(input, p, (b) => chosen.has(b), attention, "greedy", undefined);
}

function gcd(a: number, b: number): number {
  while (b) [a, b] = [b, a % b];
  return a;
}

/** Largest DP table (Σ_l (buckets + 1) × budget units) solved exactly; larger goes to a coarser unit or GLPK. */
const MAX_DP_STEPS = 2e8;
/** Steps of each of the two passes of the rounded DP (the fallback when attention sizes fall into many classes). */
const ROUNDED_DP_STEPS = 1e8;
/** Most combinations of attention counts per size class enumerated exactly over the neuron DP's table. */
const MAX_ATTENTION_COMBOS = 1e5;

interface DpTable {
  /** best[u]: most S with at most u units. */
  best: Float64Array;
  /** The choice per layer (buckets, attention) reaching best[u]. */
  choose(u: number): { counts: number[]; attention: boolean[] };
}

/**
 * One DP pass over the layers with sizes in units: bucket sizes `cost[l][b]`, and, when `attCost` is given, each
 * layer's attention as a 0/1 item of `attCost[l]` units (forced ones always taken; −∞ where they do not fit).
 */
function dpPass(p: Prepared, cost: readonly Int32Array[], width: number, attCost?: readonly number[]): DpTable {
  const { per, att, k } = p;
  let best = new Float64Array(width);
  const takeN: Int32Array[] = [];
  const takeA: (Uint8Array | undefined)[] = [];
  for (let l = 0; l < per.length; l++) {
    const bs = per[l]!;
    // the layer's buckets: take 0, or k…n of its hottest
    const next = Float64Array.from(best);
    const choice = new Int32Array(width);
    let c = 0;
    let value = 0;
    for (let j = 1; j <= bs.length; j++) {
      c += cost[l]![j - 1]!;
      value += bs[j - 1]!.value;
      if (j < k && bs.length >= k) continue; // a layer holds 0 or at least k buckets
      for (let u = c; u < width; u++) {
        const v = best[u - c]! + value;
        if (v > next[u]!) {
          next[u] = v;
          choice[u] = j;
        }
      }
    }
    takeN.push(choice);
    best = next;
    // its attention: a 0/1 item (forced: 1)
    const a = att[l]!;
    if (attCost && a.allowed) {
      const ac = attCost[l]!;
      const withA = new Float64Array(width);
      const flag = new Uint8Array(width);
      for (let u = 0; u < width; u++) {
        const keep = a.forced ? Number.NEGATIVE_INFINITY : best[u]!;
        const v = u >= ac ? best[u - ac]! + a.read : Number.NEGATIVE_INFINITY;
        if (v > keep) {
          withA[u] = v;
          flag[u] = 1;
        } else withA[u] = keep;
      }
      takeA.push(flag);
      best = withA;
    } else takeA.push(undefined);
  }
  const choose = (from: number) => {
    let u = from;
    const counts = new Array<number>(per.length);
    const attention = new Array<boolean>(per.length);
    for (let l = per.length - 1; l >= 0; l--) {
      attention[l] = takeA[l]?.[u] === 1;
      if (attention[l]) u -= attCost![l]!;
      const j = takeN[l]![u]!;
      counts[l] = j;
      for (let i = 0; i < j; i++) u -= cost[l]![i]!;
    }
    return { counts, attention };
  };
  return { best, choose };
}

/**
 * Exact attention over an exact neuron DP: a layer's attention and its neurons are tied only by the budget, so the
 * optimum is max over attention sets T of R(T) + best[⌊(budget − A(T)) / unit⌋]. Layers whose attention has the
 * same size and worth are interchangeable, so T is enumerated as a count per such class (the last layers of a
 * class first, as -ngl; forced layers always): Π (class size + 1) combinations, 81 for a uniform 80-layer model.
 * Undefined when there are more than `maxCombos` or no combination fits.
 */
function attentionOverNeurons(
  input: PlannerInput,
  p: Prepared,
  table: DpTable,
  unit: number,
  maxCombos: number,
): { counts: number[]; attention: boolean[] } | undefined {
  const classes = new Map<string, { bytes: number; read: number; layers: number[]; forced: number }>();
  for (let l = p.att.length - 1; l >= 0; l--) {
    const a = p.att[l]!;
    if (!a.allowed) continue;
    const key = `${a.bytes}:${a.read}`;
    const c = classes.get(key) ?? { bytes: a.bytes, read: a.read, layers: [], forced: 0 };
    // forced layers (the last ones) come first in a class's order
    c.layers.push(l);
    if (a.forced) c.forced++;
    classes.set(key, c);
  }
  const cls = [...classes.values()];
  const combos = cls.reduce((n, c) => n * (c.layers.length - c.forced + 1), 1);
  if (combos > maxCombos) return undefined;
  const take = cls.map((c) => c.forced);
  let bestValue = Number.NEGATIVE_INFINITY;
  let bestTake: number[] | undefined;
  let bestU = 0;
  const width = table.best.length;
  const walk = (i: number, bytes: number, value: number) => {
    if (bytes > input.budgetBytes) return;
    if (i === cls.length) {
      const u = Math.min(width - 1, Math.floor((input.budgetBytes - bytes) / unit));
      const v = value + table.best[u]!;
      if (v > bestValue) {
        bestValue = v;
        bestTake = [...take];
        bestU = u;
      }
      return;
    }
    const c = cls[i]!;
    for (let m = c.layers.length; m >= c.forced; m--) {
      take[i] = m;
      walk(i + 1, bytes + m * c.bytes, value + m * c.read);
    }
  };
  walk(0, 0, 0);
  if (!bestTake) return undefined;
  const { counts } = table.choose(bestU);
  const attention = p.att.map(() => false);
  bestTake.forEach((m, i) => {
    for (const l of cls[i]!.layers.slice(0, m)) attention[l] = true;
  });
  return { counts, attention };
}

/**
 * The optimum by dynamic programming (see the module comment). Exact (gap 0) when the neuron table in units of
 * the bucket sizes' gcd fits and attention sizes fall into few classes (any real model: one or a few layer
 * shapes); otherwise attention joins the DP rounded up and down to a unit dividing the bucket sizes, within a
 * proven gap. Undefined when bucket bytes are not integers or the table would be too large (GLPK's case).
 * @param opts.maxAttentionCombos limit of the exact attention enumeration (default 10⁵; tests lower it).
 * @throws PlannerInputError for bad input.
 */
export function planExact(input: PlannerInput, opts: { maxAttentionCombos?: number } = {}): PlacementPlan | undefined {
  const p = prepare(input);
  const { per, att } = p;
  const all = per.flat();
  if (all.some((b) => !Number.isInteger(b.bytes))) return undefined;
  const anyAttention = att.some((a) => a.allowed);
  const neuronBytes = all.reduce((s, b) => s + b.bytes, 0);
  const attBytes = att.reduce((s, a) => s + (a.allowed ? a.bytes : 0), 0);
  const bucketCosts = (scale: number) => per.map((bs) => Int32Array.from(bs, (b) => Math.round(b.bytes * scale)));
  const bucketGcd = all.reduce((g, b) => gcd(g, b.bytes), 0);
  const chosen = (counts: readonly number[]) => (b: Bucket) => b.index < counts[b.layer]!;
  // the neurons exactly, in units of the bucket sizes' gcd; columns beyond the FFN's size change nothing
  const unit = bucketGcd || 1;
  const width = Math.min(Math.floor(input.budgetBytes / unit), neuronBytes / unit) + 1;
  const neuronSteps = per.reduce((s, bs) => s + bs.length + 1, 0) * width;
  if (neuronSteps <= MAX_DP_STEPS) {
    const table = dpPass(p, bucketCosts(1 / unit), width);
    if (!anyAttention) {
      const r = table.choose(width - 1);
      return toPlan(input, p, chosen(r.counts), r.attention, "dp", "exact");
    }
    const r = attentionOverNeurons(input, p, table, unit, opts.maxAttentionCombos ?? MAX_ATTENTION_COMBOS);
    if (r) return toPlan(input, p, chosen(r.counts), r.attention, "dp", "exact");
  }
  if (!anyAttention || bucketGcd <= 0) return undefined;
  // attention in the DP: a unit dividing every bucket's size (bucketGcd / d), attention sizes rounded up (a
  // feasible plan) and down (a relaxation: any placement within the budget fits it, so its optimum bounds S)
  const stepsPerColumn = per.reduce((s, bs, l) => s + bs.length + 1 + (att[l]!.allowed ? 1 : 0), 0);
  const span = Math.max(1, Math.min(input.budgetBytes, neuronBytes + attBytes) / bucketGcd);
  const d = Math.floor((ROUNDED_DP_STEPS / stepsPerColumn - 1) / span);
  if (d < 1) return undefined;
  const scale = d / bucketGcd;
  const costs = bucketCosts(scale);
  const pass = (attCost: number[]) => {
    const w =
      Math.min(
        Math.floor(input.budgetBytes * scale + 1e-9),
        costs.reduce((s, c) => s + c.reduce((t, x) => t + x, 0), 0) +
          attCost.reduce((s, c, l) => s + (att[l]!.allowed ? c : 0), 0),
      ) + 1;
    const t = dpPass(p, costs, w, attCost);
    return { value: t.best[w - 1]!, choice: () => t.choose(w - 1) };
  };
  const feasible = pass(att.map((a) => Math.ceil(a.bytes * scale - 1e-9)));
  if (!Number.isFinite(feasible.value)) return undefined;
  const relaxed = pass(att.map((a) => Math.floor(a.bytes * scale + 1e-9)));
  const r = feasible.choice();
  const plan = toPlan(input, p, chosen(r.counts), r.attention, "dp", relaxed.value);
  return plan.totalBytes <= input.budgetBytes ? plan : undefined;
}

let glpkPromise: ReturnType<typeof GLPK> | undefined;

/**
 * Solves the program ({@link planExact}); where its table would be too large, with GLPK ({@link planGlpk}),
 * which falls back to {@link planGreedy}.
 * @throws PlannerInputError for bad input (lengths, sizes, nGpuLayers, forced attention over the budget).
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
 * Solves the program with GLPK; falls back to {@link planGreedy} when the solver fails or finds no optimal
 * solution within `timeLimitMs` (default 10 s).
 * @throws PlannerInputError for bad input.
 */
export async function planGlpk(input: PlannerInput, opts: { timeLimitMs?: number } = {}): Promise<PlacementPlan> {
  const p = prepare(input);
  const { per, att, k } = p;
  const name = (b: Bucket) => `x_${b.layer}_${b.index}`;
  const aName = (l: number) => `y_${l}`;
  try {
    glpkPromise ??= GLPK();
    const glpk = await glpkPromise;
    const all = per.flat();
    const attVars = att.flatMap((a, l) => (a.allowed ? [l] : []));
    const subjectTo = [
      {
        name: "budget",
        vars: [
          ...all.map((b) => ({ name: name(b), coef: b.bytes })),
          ...attVars.map((l) => ({ name: aName(l), coef: att[l]!.bytes })),
        ],
        bnds: { type: glpk.GLP_UP, ub: input.budgetBytes, lb: 0 },
      },
    ];
    for (const l of attVars) {
      if (att[l]!.forced) {
        subjectTo.push({
          name: `ngl_${l}`,
          vars: [{ name: aName(l), coef: 1 }],
          bnds: { type: glpk.GLP_LO, ub: 0, lb: 1 },
        });
      }
    }
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
          name: "device_bytes_read",
          vars: [
            ...all.map((b) => ({ name: name(b), coef: b.value })),
            ...attVars.map((l) => ({ name: aName(l), coef: att[l]!.read })),
          ],
        },
        subjectTo,
        binaries: [...all.map(name), ...attVars.map(aName)],
      },
      { msglev: glpk.GLP_MSG_OFF, tmlim: (opts.timeLimitMs ?? 10_000) / 1000 },
    );
    if (res.result.status !== glpk.GLP_OPT) return planGreedy(input);
    const attention = att.map((_, l) => res.result.vars[aName(l)] === 1);
    const plan = toPlan(input, p, (b) => res.result.vars[name(b)] === 1, attention, "glpk", "exact");
    return plan.totalBytes <= input.budgetBytes ? plan : planGreedy(input);
  } catch {
    return planGreedy(input);
  }
}

/**
 * The attention layers a plan whose neurons were decided elsewhere (a GPU index PowerInfer wrote, which records no
 * attention) gets: the last `nGpuLayers` layers, then every other layer from the last one backwards whose
 * attention still fits in the budget left after the neurons (llama.cpp's -ngl order; each attention byte is read
 * every token, so any attention that fits is worth placing).
 * @param neuronBytes device bytes the given hot neurons take (all layers).
 * @param exact only the forced layers (llama.cpp's `-ngl N` exactly).
 * @returns per layer, whether the device holds its attention; undefined when the forced layers do not fit.
 * @throws PlannerInputError for a bad nGpuLayers or sizes.
 */
export function attentionByRule(
  attentionBytes: readonly number[],
  neuronBytes: number,
  budgetBytes: number,
  nGpuLayers = 0,
  exact = false,
): boolean[] | undefined {
  const n = attentionBytes.length;
  sizes("attentionBytes", attentionBytes, n);
  if (!Number.isInteger(nGpuLayers) || nGpuLayers < 0 || nGpuLayers > n) {
    throw new PlannerInputError(`nGpuLayers must be an integer from 0 to ${n} (the layers), got ${nGpuLayers}`);
  }
  let left = budgetBytes - neuronBytes;
  const on = attentionBytes.map(() => false);
  for (let l = n - 1; l >= 0; l--) {
    const forced = l >= n - nGpuLayers;
    if (exact && !forced) continue;
    if (attentionBytes[l]! <= left) {
      on[l] = true;
      left -= attentionBytes[l]!;
    } else if (forced) return undefined;
  }
  return on;
}

/** Where one layer's routed experts stand in a plan: (expert, neuron) pairs on the device, per expert. */
export interface ExpertLayerPlacement {
  /** [n_expert]: the expert's neurons on the device. */
  hotPerExpert: Int32Array;
  /** Experts with at least one neuron on the device. */
  experts: number;
  /** Experts with every neuron on the device. */
  whole: number;
  /**
   * Share of routed tokens (from `expert_selection_count`) sent to an expert with at least one neuron on the
   * device; NaN without selection counts.
   */
  routedShare: number;
}

/**
 * Groups a layer's hot pairs by expert. Pair ids are expert-major: expert e's neuron i is e·n_ff_exp + i (the
 * layout of `powerinfer.activation_stats.expert_count` statistics and of an expert GPU index).
 * @param hot ascending pair ids, each < nFfExp·nExpert
 * @param selections [n_expert] tokens routed to each expert (optional)
 * @throws PlannerInputError for a pair id out of range or selections of another length
 */
export function expertLayerPlacement(
  hot: Int32Array,
  nFfExp: number,
  nExpert: number,
  selections?: Int32Array,
): ExpertLayerPlacement {
  if (selections && selections.length !== nExpert) {
    throw new PlannerInputError(`${selections.length} expert selection counts for ${nExpert} experts`);
  }
  const hotPerExpert = new Int32Array(nExpert);
  for (const n of hot) {
    if (!(n >= 0 && n < nFfExp * nExpert)) {
      throw new PlannerInputError(`pair ${n} is outside n_ff_exp × n_expert = ${nFfExp} × ${nExpert}`);
    }
    hotPerExpert[Math.floor(n / nFfExp)]!++;
  }
  let experts = 0;
  let whole = 0;
  let routed = 0;
  let all = 0;
  hotPerExpert.forEach((h, e) => {
    if (h > 0) experts++;
    if (h === nFfExp) whole++;
    all += selections?.[e] ?? 0;
    if (h > 0) routed += selections?.[e] ?? 0;
  });
  return { hotPerExpert, experts, whole, routedShare: selections && all > 0 ? routed / all : Number.NaN };
}

/** Routed experts of the model a plan is for, so {@link explainPlan} can show experts beside neurons. */
export interface PlanExperts {
  nExpert: number;
  nFfExp: number;
  /** Per layer, [n_expert] tokens routed to each expert (activation statistics), when known. */
  selections?: readonly Int32Array[];
  /** What ranked the pairs: their firing counts (sparse experts) or their expert's selections (dense experts). */
  rankedBy?: "activations" | "selections";
}

/**
 * A human-readable account of a plan: per layer attention and hot neurons, bytes, shares, and expected tokens/s.
 * With `experts`, neurons are (expert, neuron) pairs (nFf = n_ff_exp · n_expert) and each layer also says how
 * many experts hold neurons on the device, how many are there whole, and the share of routed tokens sent to them.
 */
export function explainPlan(plan: PlacementPlan, nFf: number, experts?: PlanExperts): string {
  const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
  const took = plan.solveMs === undefined ? "" : `, ${(plan.solveMs / 1000).toFixed(2)} s`;
  const nAtt = plan.layers.filter((L) => L.attention).length;
  const neuronBytes = plan.neuronBytes ?? plan.layers.reduce((s, L) => s + L.bytes, 0);
  const t = plan.throughput ?? DEFAULT_THROUGHPUT;
  const tps = plan.expectedTokensPerSecond;
  const gbps = (x: number) => `${(x / 1e9).toFixed(1)} GB/s`;
  // a plan read from a GPU index without activation statistics has no shares
  const pct = (x: number | undefined) => (x === undefined || Number.isNaN(x) ? "n/a" : `${(x * 100).toFixed(1)} %`);
  const fromIndex = plan.method === "index";
  const noStats = Number.isNaN(plan.deviceShare) ? " (no activation statistics)" : "";
  const lines = [
    `placement (${fromIndex ? "GPU index" : plan.solver === "ilp" ? "integer program" : "greedy"}): ${mib(plan.totalBytes)} of ${mib(plan.budgetBytes)} budget on the device ` +
      `(hot neurons ${mib(neuronBytes)}; attention + KV cache of ${nAtt} of ${plan.layers.length} layers ${mib(plan.attentionBytes ?? 0)}); ` +
      `expected share of activations served by the device ${pct(plan.deviceShare)}, ` +
      `of bytes read per token ${pct(plan.deviceReadShare)}${noStats}; ` +
      (Number.isNaN(plan.gap)
        ? "read from the GPU index"
        : plan.gap === 0
          ? `proven optimal (solved by ${plan.method}${took})`
          : `within ${(plan.gap * 100).toFixed(2)} % of the optimum (solved by ${plan.method}${took}; bound ${(plan.bound * 100).toFixed(1)} %)`),
    `expected ${tps === undefined || Number.isNaN(tps) ? "? (no statistics)" : tps.toFixed(1)} tokens/s for the layers ` +
      `(device ${gbps(t.deviceBytesPerSecond)}, CPU ${gbps(t.cpuBytesPerSecond)}: ${t.source}` +
      `${plan.attentionPlanned === false ? "; FFN only: no attention sizes given" : ""}; output layer not counted)`,
    ...(experts
      ? [
          `routed experts: ${experts.nExpert} per layer of ${experts.nFfExp} neurons; a hot neuron is an (expert, neuron) pair, ranked by ${experts.rankedBy === "selections" ? "its expert's selection count (dense experts read every neuron of a chosen expert)" : "its firing count (tokens routed to the expert on which it fired)"}`,
        ]
      : []),
    `layer | attention | hot neurons | device bytes | device share | CPU share${experts ? " | experts on device (whole) | routed to them" : ""}`,
    ...plan.layers.map((L, l) => {
      let row = `${String(l).padStart(5)} | ${(L.attention ? "device" : "cpu").padStart(9)} | ${String(L.hot.length).padStart(5)} / ${nFf} | ${mib(L.bytes + (L.attentionBytes ?? 0)).padStart(12)} | ${pct(L.deviceShare).padStart(12)} | ${pct(1 - L.deviceShare).padStart(9)}`;
      if (experts) {
        const x = expertLayerPlacement(L.hot, experts.nFfExp, experts.nExpert, experts.selections?.[l]);
        const share = Number.isNaN(x.routedShare) ? "?" : `${(x.routedShare * 100).toFixed(1)} %`;
        row += ` | ${`${x.experts} / ${experts.nExpert} (${x.whole})`.padStart(25)} | ${share.padStart(14)}`;
      }
      return row;
    }),
  ];
  return lines.join("\n");
}

/** What a plan was solved for, recorded in the GPU index so a later run knows whether it can reuse it. */
export interface PlanProvenance {
  budgetBytes: number;
  backend: string;
  statsFile: string;
  /**
   * Device bytes of all layers' attention the plan could place (Σ attentionBytes; 0 = a neurons-only plan,
   * and what an index written before attention placement reads as). Key `powerinfer.plan.attention_bytes`.
   */
  attentionBytes?: number;
  /** The nGpuLayers it was solved with (0 = none). Key `powerinfer.plan.n_gpu_layers`. */
  nGpuLayers?: number;
  /** Whether nGpuLayers was exact ({@link PlannerInput.exactGpuLayers}). Key `powerinfer.plan.exact_gpu_layers` (0/1). */
  exactGpuLayers?: boolean;
  /**
   * Models with routed experts: n_expert (key `powerinfer.plan.expert_count`, absent for a dense FFN). Each layer's
   * `gpu_idx` then has n_ff_exp · n_expert entries and `gpu_bucket` lists (expert, neuron) pairs as e·n_ff_exp + i.
   */
  expertCount?: number;
  /** With experts: what ranked the pairs (key `powerinfer.plan.expert_ranking`, "activations" or "selections"). */
  expertRanking?: "activations" | "selections";
  /**
   * A digest of the statistics' counts (key `powerinfer.plan.stats_digest`): a profile run again at the same
   * path gives a new one, so the plan is solved again. Absent in indexes written before it (then not compared).
   */
  statsDigest?: string;
  /** The solver asked for (key `powerinfer.plan.solver`, written from the plan). */
  solver?: "ilp" | "greedy";
}

/**
 * A plan as PowerInfer's GPU index (`<model>.generated.gpuidx`), with what it was solved for. PowerInfer's format
 * has no attention field: the layers whose attention the plan puts on the device are an extra key,
 * `powerinfer.plan.attention_layers` (ascending layer ids, comma-separated; "" for none), which PowerInfer ignores.
 */
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
      {
        key: "powerinfer.plan.attention_bytes",
        type: { type: GgufValueType.UINT64 },
        value: BigInt(prov.attentionBytes ?? 0),
      },
      { key: "powerinfer.plan.n_gpu_layers", type: { type: GgufValueType.UINT32 }, value: prov.nGpuLayers ?? 0 },
      {
        key: "powerinfer.plan.exact_gpu_layers",
        type: { type: GgufValueType.UINT32 },
        value: prov.exactGpuLayers ? 1 : 0,
      },
      {
        key: "powerinfer.plan.attention_layers",
        type: { type: GgufValueType.STRING },
        value: plan.layers.flatMap((L, l) => (L.attention ? [l] : [])).join(","),
      },
      ...(prov.statsDigest !== undefined
        ? ([
            { key: "powerinfer.plan.stats_digest", type: { type: GgufValueType.STRING }, value: prov.statsDigest },
          ] as GgufMetadataEntry[])
        : []),
      ...(prov.expertCount !== undefined
        ? ([
            { key: "powerinfer.plan.expert_count", type: { type: GgufValueType.UINT32 }, value: prov.expertCount },
            {
              key: "powerinfer.plan.expert_ranking",
              type: { type: GgufValueType.STRING },
              value: prov.expertRanking ?? "activations",
            },
          ] as GgufMetadataEntry[])
        : []),
    ],
  };
}

/**
 * The hot sets of a GPU index (ours or PowerInfer's), what it was solved for when recorded, and the layers whose
 * attention it puts on the device when recorded (ours; undefined for PowerInfer's, which decides no attention:
 * the caller places it by {@link attentionByRule}). An index of ours written before attention placement reads as
 * a neurons-only plan (attentionBytes 0, no attention layer).
 * @throws RangeError when gpu_idx and gpu_bucket disagree, or the attention layers key is malformed.
 */
export function gpuIndexToPlan(
  idx: GpuIndex,
  bytesPerNeuron: readonly number[],
): {
  layers: { hot: Int32Array; bytes: number }[];
  provenance?: Partial<PlanProvenance>;
  attention?: boolean[];
} {
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
  if (budget === undefined) return { layers };
  const provenance = {
    budgetBytes: Number(budget),
    backend: String(get("powerinfer.plan.backend") ?? ""),
    statsFile: String(get("powerinfer.plan.stats_file") ?? ""),
    attentionBytes: Number(get("powerinfer.plan.attention_bytes") ?? 0),
    nGpuLayers: Number(get("powerinfer.plan.n_gpu_layers") ?? 0),
    exactGpuLayers: Number(get("powerinfer.plan.exact_gpu_layers") ?? 0) === 1,
    solver: (String(get("powerinfer.plan.solver") ?? "ilp") === "greedy" ? "greedy" : "ilp") as "ilp" | "greedy",
    ...(get("powerinfer.plan.stats_digest") !== undefined
      ? { statsDigest: String(get("powerinfer.plan.stats_digest")) }
      : {}),
    ...(get("powerinfer.plan.expert_count") !== undefined
      ? {
          expertCount: Number(get("powerinfer.plan.expert_count")),
          expertRanking: String(get("powerinfer.plan.expert_ranking") ?? "activations") as "activations",
        }
      : {}),
  };
  const list = String(get("powerinfer.plan.attention_layers") ?? "");
  const attention = layers.map(() => false);
  for (const x of list ? list.split(",") : []) {
    const l = Number(x);
    if (!Number.isInteger(l) || l < 0 || l >= layers.length) {
      throw new RangeError(`powerinfer.plan.attention_layers names layer "${x}", the index has ${layers.length}`);
    }
    attention[l] = true;
  }
  return { layers, provenance, attention };
}
