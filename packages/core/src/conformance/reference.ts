/**
 * Float64 reference implementations of every op of the backend interface, and a pure-TypeScript
 * interpreter of a {@link Graph} built on them ({@link referenceCompute}).
 *
 * Each op follows the contract in the header of `backend/graph.ts`. Matrices are column-major in
 * ggml's sense: a tensor with ne = [n, T] stores column t at offset t·n. Weights of any dtype are
 * dequantized exactly to float64 ({@link dequantizeReference}) and every sum is taken in float64, so
 * the reference differs from the exact result by far less than any backend's float32 rounding.
 *
 * Formulas and sources:
 * - rms_norm: x / sqrt(mean(x²) + eps) — Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
 * - norm: (x − mean) / sqrt(var + eps), var the population variance — Ba, Kiros & Hinton 2016
 *   ("Layer Normalization") without the affine part.
 * - rope: θ_i = pos·freq_scale·freq_base^(−2i/n_dims), pair (a, b) ↦ (a·cosθ − b·sinθ, a·sinθ + b·cosθ);
 *   "normal" pairs are (2i, 2i+1), NeoX pairs are (i, i + n_dims/2) — Su et al. 2021, "RoFormer".
 * - softmax: exp(s·x − max) / Σ exp(s·x − max).
 * - attention: softmax(scale·qᵀK) V per head with a causal mask and grouped-query heads
 *   (Vaswani et al. 2017; GQA: Ainslie et al. 2023).
 * - routed experts (mul_mat_id, moe_sum and their sparse forms): the mixture-of-experts layer of Shazeer
 *   et al. 2017 as Mixtral (Jiang et al. 2024) and llama.cpp's `build_moe_ffn` run it: top-k experts per
 *   token, each expert's output weighted by its router probability (optionally renormalised over the k).
 * - silu(x) = x·σ(x) (Elfwing et al. 2017); gelu: the tanh approximation
 *   0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) of Hendrycks & Gimpel 2016, the form ggml computes.
 */
import type { Graph, GraphNode, GraphTensor, TensorId } from "../backend/graph.js";
import { ROPE_NEOX } from "../backend/graph.js";
import type { DType, OpName, TensorHandle } from "../backend/types.js";
import { numberToBf16, numberToHalf } from "./float.js";
import { dequantizeReference } from "./quant.js";

/** Columns of a tensor: ne[1]·ne[2]·ne[3] (every op treats a tensor as [ne0, columns]). */
export function columns(ne: readonly number[]): number {
  return (ne[1] ?? 1) * (ne[2] ?? 1) * (ne[3] ?? 1);
}

/** `get_rows`: out[:, t] = row ids[t] of W (W has K values per row). */
export function refGetRows(w: Float64Array, k: number, ids: ArrayLike<number>): Float64Array {
  const out = new Float64Array(k * ids.length);
  for (let t = 0; t < ids.length; t++) out.set(w.subarray(ids[t]! * k, ids[t]! * k + k), t * k);
  return out;
}

/** Dot product of w[wo..wo+k) and x[xo..xo+k) in float64. */
export function dot(w: Float64Array, wo: number, x: ArrayLike<number>, xo: number, k: number): number {
  let s = 0;
  for (let i = 0; i < k; i++) s += w[wo + i]! * x[xo + i]!;
  return s;
}

/** `mul_mat`: W [K, N], x [K, T] → y [N, T], y[n, t] = Σ_k W[k, n]·x[k, t]. */
export function refMulMat(w: Float64Array, k: number, n: number, x: ArrayLike<number>, t: number): Float64Array {
  const y = new Float64Array(n * t);
  for (let c = 0; c < t; c++) for (let r = 0; r < n; r++) y[c * n + r] = dot(w, r * k, x, c * k, k);
  return y;
}

/** `rms_norm` per column of x [n, T] (Zhang & Sennrich 2019). */
export function refRmsNorm(x: ArrayLike<number>, n: number, eps: number): Float64Array {
  const t = x.length / n;
  const y = new Float64Array(x.length);
  for (let c = 0; c < t; c++) {
    let ss = 0;
    for (let i = 0; i < n; i++) ss += x[c * n + i]! ** 2;
    const r = 1 / Math.sqrt(ss / n + eps);
    for (let i = 0; i < n; i++) y[c * n + i] = x[c * n + i]! * r;
  }
  return y;
}

/** `norm` (layer norm without affine) per column of x [n, T]. */
export function refNorm(x: ArrayLike<number>, n: number, eps: number): Float64Array {
  const t = x.length / n;
  const y = new Float64Array(x.length);
  for (let c = 0; c < t; c++) {
    let mean = 0;
    for (let i = 0; i < n; i++) mean += x[c * n + i]!;
    mean /= n;
    let v = 0;
    for (let i = 0; i < n; i++) v += (x[c * n + i]! - mean) ** 2;
    const r = 1 / Math.sqrt(v / n + eps);
    for (let i = 0; i < n; i++) y[c * n + i] = (x[c * n + i]! - mean) * r;
  }
  return y;
}

/** Parameters of `rope` (see {@link Graph.rope}). */
export interface RefRopeParams {
  headDim: number;
  nDims: number;
  mode: number;
  freqBase: number;
  freqScale: number;
}

/** θ of pair i at position pos (Su et al. 2021). */
export function refRopeTheta(pos: number, i: number, p: RefRopeParams): number {
  return pos * p.freqScale * p.freqBase ** ((-2 * i) / p.nDims);
}

/** The two indices (within a head) that pair i rotates. */
export function refRopePair(i: number, p: RefRopeParams): [number, number] {
  return p.mode === ROPE_NEOX ? [i, i + p.nDims / 2] : [2 * i, 2 * i + 1];
}

/** `rope`: x [headDim·H, T], pos [T]; each head rotated independently; dims ≥ nDims pass through. */
export function refRope(x: ArrayLike<number>, n: number, pos: ArrayLike<number>, p: RefRopeParams): Float64Array {
  const y = Float64Array.from(x);
  for (let c = 0; c < pos.length; c++) {
    for (let h = 0; h < n / p.headDim; h++) {
      const base = c * n + h * p.headDim;
      for (let i = 0; i < p.nDims / 2; i++) {
        const th = refRopeTheta(pos[c]!, i, p);
        const [i0, i1] = refRopePair(i, p);
        const a = x[base + i0]!;
        const b = x[base + i1]!;
        y[base + i0] = a * Math.cos(th) - b * Math.sin(th);
        y[base + i1] = a * Math.sin(th) + b * Math.cos(th);
      }
    }
  }
  return y;
}

/** `softmax(scale·x)` per column of x [n, R]. */
export function refSoftmax(x: ArrayLike<number>, n: number, scale: number): Float64Array {
  const y = new Float64Array(x.length);
  for (let c = 0; c < x.length / n; c++) {
    let m = Number.NEGATIVE_INFINITY;
    for (let i = 0; i < n; i++) m = Math.max(m, scale * x[c * n + i]!);
    let z = 0;
    for (let i = 0; i < n; i++) z += y[c * n + i] = Math.exp(scale * x[c * n + i]! - m);
    for (let i = 0; i < n; i++) y[c * n + i]! /= z;
  }
  return y;
}

/** Parameters of `attention` (see {@link Graph.attention}). */
export interface RefAttentionParams {
  headDim: number;
  nHead: number;
  nHeadKv: number;
  nPast: number;
  scale: number;
  /** Sliding window (attention_swa): positions p with (nPast + t) − p ≥ window get weight 0. 0 or absent: none. */
  window?: number;
}

/**
 * Attention probabilities of head h, query t over cache positions 0..nPast+t (causal), float64.
 * `k` is the cache [headDim·nHeadKv, C].
 */
export function refAttentionWeights(
  q: ArrayLike<number>,
  k: ArrayLike<number>,
  h: number,
  t: number,
  p: RefAttentionParams,
): Float64Array {
  const d = p.headDim;
  const g = Math.floor(h / (p.nHead / p.nHeadKv));
  const kRow = d * p.nHeadKv;
  const n = p.nPast + t + 1;
  const s = new Float64Array(n);
  const qo = t * d * p.nHead + h * d;
  const first = p.window ? Math.max(0, n - p.window) : 0;
  let m = Number.NEGATIVE_INFINITY;
  for (let c = first; c < n; c++) {
    let acc = 0;
    for (let j = 0; j < d; j++) acc += q[qo + j]! * k[c * kRow + g * d + j]!;
    s[c] = p.scale * acc;
    m = Math.max(m, s[c]!);
  }
  let z = 0;
  for (let c = first; c < n; c++) z += s[c] = Math.exp(s[c]! - m);
  for (let c = 0; c < n; c++) s[c]! /= z;
  return s;
}

/** `attention`: q [d·H, T], caches [d·H_kv, C] → [d·H, T] (causal, GQA: head h reads KV head h/(H/H_kv)). */
export function refAttention(
  q: ArrayLike<number>,
  k: ArrayLike<number>,
  v: ArrayLike<number>,
  t: number,
  p: RefAttentionParams,
): Float64Array {
  const d = p.headDim;
  const out = new Float64Array(d * p.nHead * t);
  const kRow = d * p.nHeadKv;
  for (let c = 0; c < t; c++) {
    for (let h = 0; h < p.nHead; h++) {
      const g = Math.floor(h / (p.nHead / p.nHeadKv));
      const w = refAttentionWeights(q, k, h, c, p);
      const o = c * d * p.nHead + h * d;
      for (let pos = 0; pos < w.length; pos++) {
        for (let j = 0; j < d; j++) out[o + j]! += w[pos]! * v[pos * kRow + g * d + j]!;
      }
    }
  }
  return out;
}

/** `add` / `mul`: b broadcast over columns when it has a single column. */
export function refBinary(a: ArrayLike<number>, b: ArrayLike<number>, op: "add" | "mul"): Float64Array {
  const y = new Float64Array(a.length);
  for (let i = 0; i < a.length; i++) {
    const bv = b[i % b.length]!;
    y[i] = op === "add" ? a[i]! + bv : a[i]! * bv;
  }
  return y;
}

/** SiLU x·σ(x) (Elfwing et al. 2017). */
export function refSilu(x: number): number {
  return x / (1 + Math.exp(-x));
}

/** √(2/π), the constant of the tanh approximation of GELU. */
export const GELU_SQRT_2_OVER_PI = Math.sqrt(2 / Math.PI);
/** The cubic coefficient of the tanh approximation of GELU (Hendrycks & Gimpel 2016). */
export const GELU_COEF_A = 0.044715;

/** GELU, tanh approximation (Hendrycks & Gimpel 2016), the form ggml computes. */
export function refGelu(x: number): number {
  return 0.5 * x * (1 + Math.tanh(GELU_SQRT_2_OVER_PI * x * (1 + GELU_COEF_A * x * x)));
}

/** Is neuron i active for token t (sparse ops)? `rowSet` = the ids listed in `rows`, when given. */
function active(
  i: number,
  t: number,
  nOut: number,
  logits: ArrayLike<number> | null,
  thr: number,
  rowSet: Set<number> | null,
) {
  if (rowSet && !rowSet.has(i)) return false;
  return !logits || logits[t * nOut + i]! >= thr;
}

/** Sparse-op arguments after the weight: logits [nOut, T] and rows (neuron ids) may be absent. */
export interface RefSparseArgs {
  logits: ArrayLike<number> | null;
  rows: ArrayLike<number> | null;
  threshold: number;
  nOut: number;
}

/** Weight row that holds neuron i: compact when rows is given and W has exactly rows.length rows. */
function rowIndexOf(wRows: number, a: RefSparseArgs): Map<number, number> | null {
  if (!a.rows || wRows !== a.rows.length) return null;
  const m = new Map<number, number>();
  for (let j = 0; j < a.rows.length; j++) m.set(a.rows[j]!, j);
  return m;
}

/**
 * `mul_mat_sparse`: W [K, M], x [K, T] → [nOut, T]; active outputs = W-row·x, all others exactly 0.
 * Returns the output and the number of (row, token) pairs read.
 */
export function refMulMatSparse(
  w: Float64Array,
  k: number,
  m: number,
  x: ArrayLike<number>,
  t: number,
  a: RefSparseArgs,
): { y: Float64Array; rowsRead: number } {
  const y = new Float64Array(a.nOut * t);
  const rowSet = a.rows ? new Set(Array.from(a.rows)) : null;
  const compact = rowIndexOf(m, a);
  let read = 0;
  for (let c = 0; c < t; c++) {
    for (let i = 0; i < a.nOut; i++) {
      if (!active(i, c, a.nOut, a.logits, a.threshold, rowSet)) continue;
      const r = compact ? compact.get(i)! : i;
      y[c * a.nOut + i] = dot(w, r * k, x, c * k, k);
      read++;
    }
  }
  return { y, rowsRead: read };
}

/**
 * `axpy_sparse`: Wt [E, M] (one row of E values per neuron), act [nOut, T] → [E, T],
 * y[:, t] = Σ_{active i} act[i, t]·Wt-row(i). Returns the output and the (row, token) pairs read.
 */
export function refAxpySparse(
  wt: Float64Array,
  e: number,
  m: number,
  act: ArrayLike<number>,
  t: number,
  a: RefSparseArgs,
): { y: Float64Array; rowsRead: number } {
  const y = new Float64Array(e * t);
  const rowSet = a.rows ? new Set(Array.from(a.rows)) : null;
  const compact = rowIndexOf(m, a);
  let read = 0;
  for (let c = 0; c < t; c++) {
    for (let i = 0; i < a.nOut; i++) {
      if (!active(i, c, a.nOut, a.logits, a.threshold, rowSet)) continue;
      const r = compact ? compact.get(i)! : i;
      const s = act[c * a.nOut + i]!;
      for (let j = 0; j < e; j++) y[c * e + j]! += s * wt[r * e + j]!;
      read++;
    }
  }
  return { y, rowsRead: read };
}

/** σ(x) = 1 / (1 + e^(−x)). */
export function refSigmoid(x: number): number {
  return 1 / (1 + Math.exp(-x));
}

/**
 * `top_k`: per column of x [n, T] the indices of its k largest values, largest first; equal values
 * keep the lower index first. Returns [k, T].
 */
export function refTopK(x: ArrayLike<number>, n: number, k: number): Float64Array {
  const t = x.length / n;
  const out = new Float64Array(k * t);
  const idx = Array.from({ length: n }, (_, i) => i);
  for (let c = 0; c < t; c++) {
    const order = idx.slice().sort((a, b) => x[c * n + b]! - x[c * n + a]! || a - b);
    for (let j = 0; j < k; j++) out[c * k + j] = order[j]!;
  }
  return out;
}

/** Shapes of a routed-experts op: K (row length), M (rows per expert), E (experts), U (slots), T (tokens). */
export interface RefExpertShape {
  k: number;
  m: number;
  nExpert: number;
  nUsed: number;
  tokens: number;
  /** Columns of x: T (the slots of a token share its input) or U·T. */
  xCols: number;
}

function checkExpertIds(ids: ArrayLike<number>, s: RefExpertShape): void {
  for (let i = 0; i < s.nUsed * s.tokens; i++) {
    const e = ids[i]!;
    if (!Number.isInteger(e) || e < 0 || e >= s.nExpert) {
      throw new RangeError(
        `expert id ${e} at slot ${i % s.nUsed}, token ${Math.floor(i / s.nUsed)} not in 0..${s.nExpert - 1}`,
      );
    }
  }
}

/**
 * `mul_mat_id`: W [K, M, E] (E stacked experts), x [K, xCols], ids [U, T] → [M, U, T],
 * y[:, u, t] = W_{ids[u,t]} · x_c (c = t when xCols = T, else t·U + u).
 * @throws RangeError for an expert id outside 0..E−1.
 */
export function refMulMatId(
  w: Float64Array,
  x: ArrayLike<number>,
  ids: ArrayLike<number>,
  s: RefExpertShape,
): Float64Array {
  checkExpertIds(ids, s);
  const { k, m, nUsed: U, tokens: T } = s;
  const y = new Float64Array(m * U * T);
  for (let t = 0; t < T; t++) {
    for (let u = 0; u < U; u++) {
      const e = ids[t * U + u]!;
      const c = s.xCols === T ? t : t * U + u;
      for (let r = 0; r < m; r++) y[(t * U + u) * m + r] = dot(w, (e * m + r) * k, x, c * k, k);
    }
  }
  return y;
}

/**
 * `moe_sum`: y [D, U, T], probs [n_expert, T], ids [U, T] → [D, T]: Σ_u w[u,t]·y[:,u,t] with
 * w[u,t] = probs[ids[u,t], t], divided by max(Σ_u w[u,t], 2^-14) when `norm`, times `scale`.
 */
export function refMoeSum(
  y: ArrayLike<number>,
  d: number,
  probs: ArrayLike<number>,
  nExpert: number,
  ids: ArrayLike<number>,
  nUsed: number,
  norm: boolean,
  scale: number,
): Float64Array {
  const T = ids.length / nUsed;
  const out = new Float64Array(d * T);
  for (let t = 0; t < T; t++) {
    const w = Array.from({ length: nUsed }, (_, u) => probs[t * nExpert + ids[t * nUsed + u]!]!);
    const sum = w.reduce((a, b) => a + b, 0);
    const div = norm ? Math.max(sum, 2 ** -14) : 1;
    for (let u = 0; u < nUsed; u++) {
      const wu = (w[u]! / div) * scale;
      for (let i = 0; i < d; i++) out[t * d + i]! += wu * y[(t * nUsed + u) * d + i]!;
    }
  }
  return out;
}

/**
 * `moe_scatter`: src [R, U, T] (R = m or 1), ids [U, T] → [m·nExpert, T]: element (e·m + i, t) = src[i (0 when
 * R = 1), u, t] where ids[u,t] = e (a later slot wins), `fill` (rounded to f32) elsewhere.
 */
export function refMoeScatter(
  src: ArrayLike<number>,
  r: number,
  ids: ArrayLike<number>,
  nUsed: number,
  m: number,
  nExpert: number,
  fill: number,
): Float64Array {
  const T = ids.length / nUsed;
  const rows = m * nExpert;
  const out = new Float64Array(rows * T).fill(Math.fround(fill));
  for (let t = 0; t < T; t++) {
    for (let u = 0; u < nUsed; u++) {
      const e = ids[t * nUsed + u]!;
      for (let i = 0; i < m; i++) out[t * rows + e * m + i] = src[(t * nUsed + u) * r + (r === 1 ? 0 : i)]!;
    }
  }
  return out;
}

/** Activity of the sparse expert ops: neuron i of slot u, token t runs when logits[i,u,t] ≥ threshold (always without logits). */
export interface RefExpertSparseArgs {
  logits: ArrayLike<number> | null;
  threshold: number;
}

/**
 * `mul_mat_id_sparse`: as {@link refMulMatId}, but element (i, u, t) is computed only when active and is
 * exactly 0 otherwise. Returns the output and the (neuron, slot, token) triples read.
 */
export function refMulMatIdSparse(
  w: Float64Array,
  x: ArrayLike<number>,
  ids: ArrayLike<number>,
  s: RefExpertShape,
  a: RefExpertSparseArgs,
): { y: Float64Array; rowsRead: number } {
  checkExpertIds(ids, s);
  const { k, m, nUsed: U, tokens: T } = s;
  const y = new Float64Array(m * U * T);
  let read = 0;
  for (let t = 0; t < T; t++) {
    for (let u = 0; u < U; u++) {
      const e = ids[t * U + u]!;
      const c = s.xCols === T ? t : t * U + u;
      for (let r = 0; r < m; r++) {
        const o = (t * U + u) * m + r;
        if (a.logits && !(a.logits[o]! >= a.threshold)) continue;
        y[o] = dot(w, (e * m + r) * k, x, c * k, k);
        read++;
      }
    }
  }
  return { y, rowsRead: read };
}

/**
 * `axpy_id_sparse`: Wt [D, M, E] (expert e's neuron i is row e·M + i of D values), act [M, U, T],
 * ids [U, T] → [D, U, T], y[:, u, t] = Σ over active i of act[i,u,t]·Wt_{ids[u,t]}-row(i).
 * Returns the output and the (neuron, slot, token) triples read.
 */
export function refAxpyIdSparse(
  wt: Float64Array,
  d: number,
  act: ArrayLike<number>,
  ids: ArrayLike<number>,
  s: Omit<RefExpertShape, "k" | "xCols">,
  a: RefExpertSparseArgs,
): { y: Float64Array; rowsRead: number } {
  checkExpertIds(ids, { ...s, k: d, xCols: 0 });
  const { m, nUsed: U, tokens: T } = s;
  const y = new Float64Array(d * U * T);
  let read = 0;
  for (let t = 0; t < T; t++) {
    for (let u = 0; u < U; u++) {
      const e = ids[t * U + u]!;
      const col = t * U + u;
      for (let i = 0; i < m; i++) {
        const o = col * m + i;
        if (a.logits && !(a.logits[o]! >= a.threshold)) continue;
        const sc = act[o]!;
        const r = (e * m + i) * d;
        for (let j = 0; j < d; j++) y[col * d + j]! += sc * wt[r + j]!;
        read++;
      }
    }
  }
  return { y, rowsRead: read };
}

/** Where the interpreter finds the bytes of handle tensors: a map by handle id, or a function. */
export type ReferenceHandleBytes = ReadonlyMap<number, Uint8Array> | ((h: TensorHandle) => Uint8Array);

/** What an op implementation given to {@link referenceCompute} may read. */
export interface ReferenceOpContext {
  readonly graph: Graph;
  /** Float64 values of any tensor (inputs, handles dequantized, intermediates computed so far). */
  value(id: TensorId): Float64Array;
  /** The graph tensor (dtype, shape, kind). */
  tensor(id: TensorId): GraphTensor;
  /** The built-in float64 implementation of this node. */
  reference(node: GraphNode): ReferenceOpResult;
}

export interface ReferenceOpResult {
  /** Values of the node's output tensor (omit for `cpy`, which writes its destination handle). */
  value?: Float64Array;
  /** Weight rows read (sparse ops). */
  rowsRead?: number;
}

/** A replacement implementation of one op (e.g. to emulate a backend's rounding in a test backend). */
export type ReferenceOpImpl = (node: GraphNode, ctx: ReferenceOpContext) => ReferenceOpResult;

export interface ReferenceComputeOptions {
  /** Replacements for built-in ops. */
  ops?: Partial<Record<OpName, ReferenceOpImpl>>;
  /** Round every intermediate to float32, as a backend storing F32 intermediates does. Default false. */
  roundIntermediates?: boolean;
}

export interface ReferenceResult {
  /** Float64 values per tensor id (undefined for tensors never needed). */
  values: (Float64Array | undefined)[];
  /** Per node: weight rows read (sparse ops), 0 for dense ops. */
  rowsRead: Float64Array;
}

function bytesOf(h: TensorHandle, handles: ReferenceHandleBytes): Uint8Array {
  const b = typeof handles === "function" ? handles(h) : handles.get(h.id);
  if (!b) throw new RangeError(`referenceCompute: no bytes for handle ${h.id} (${h.dtype} [${h.ne.join(", ")}])`);
  return b;
}

const nelOf = (ne: readonly number[]) => ne.reduce((a, b) => a * b, 1);

/**
 * Writes `values` (an [n, T] block) into rows rowOffset.. of a float handle of `dtype` (cpy's rule:
 * row = one column of ne[0] values), rounding to the destination type.
 */
export function writeRows(dtype: DType, bytes: Uint8Array, n: number, rowOffset: number, values: ArrayLike<number>) {
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  for (let i = 0; i < values.length; i++) {
    const idx = rowOffset * n + i;
    const v = values[i]!;
    if (dtype === "f32") dv.setFloat32(4 * idx, v, true);
    else if (dtype === "f16") dv.setUint16(2 * idx, numberToHalf(v), true);
    else if (dtype === "bf16") dv.setUint16(2 * idx, numberToBf16(v), true);
    else throw new RangeError(`cpy: destination dtype ${dtype} is not f32, f16 or bf16`);
  }
}

/**
 * Interprets a graph in float64 with the reference ops.
 *
 * Handle tensors are read from `handles` (their bytes, dequantized on use); `cpy` writes into those
 * bytes in place, as a backend writes into its KV cache. The graph's output arrays are not touched
 * (use {@link writeGraphOutputs}).
 * @throws RangeError on a malformed graph or a missing handle.
 */
export function referenceCompute(
  graph: Graph,
  handles: ReferenceHandleBytes,
  options: ReferenceComputeOptions = {},
): ReferenceResult {
  const values: (Float64Array | undefined)[] = new Array(graph.tensors.length);
  const rowsRead = new Float64Array(graph.nodes.length);
  const value = (id: TensorId): Float64Array => {
    const cached = values[id];
    if (cached) return cached;
    const t = graph.tensors[id];
    if (!t) throw new RangeError(`referenceCompute: tensor ${id} does not exist`);
    let v: Float64Array;
    if (t.kind === "input") v = Float64Array.from(t.data as Float32Array | Int32Array);
    else if (t.kind === "handle") v = dequantizeReference(t.dtype, bytesOf(t.handle!, handles), nelOf(t.ne)).values;
    else throw new RangeError(`referenceCompute: tensor ${id} is read before the node that computes it`);
    values[id] = v;
    return v;
  };
  const ctx: ReferenceOpContext = {
    graph,
    value,
    tensor: (id) => graph.tensors[id]!,
    reference: (node) => builtin(node),
  };
  const opt = (id: number | undefined) => (id === undefined || id < 0 ? null : value(id));

  const builtin = (node: GraphNode): ReferenceOpResult => {
    const [s0, s1, s2, s3] = node.src;
    const p = node.params;
    const ne0 = (id: number) => graph.tensors[id]!.ne;
    switch (node.op) {
      case "get_rows":
        return { value: refGetRows(value(s0!), ne0(s0!)[0], value(s1!)) };
      case "mul_mat":
        return { value: refMulMat(value(s0!), ne0(s0!)[0], columns(ne0(s0!)), value(s1!), columns(ne0(s1!))) };
      case "rms_norm":
        return { value: refRmsNorm(value(s0!), ne0(s0!)[0], p[0]!) };
      case "norm":
        return { value: refNorm(value(s0!), ne0(s0!)[0], p[0]!) };
      case "rope":
        return {
          value: refRope(value(s0!), ne0(s0!)[0], value(s1!), {
            nDims: p[0]!,
            mode: p[1]!,
            freqBase: p[2]!,
            freqScale: p[3]!,
            headDim: p[4]!,
          }),
        };
      case "softmax":
        return { value: refSoftmax(value(s0!), ne0(s0!)[0], p[0]!) };
      case "attention":
      case "attention_swa":
        return {
          value: refAttention(value(s0!), value(s1!), value(s2!), columns(ne0(s0!)), {
            nPast: p[0]!,
            nHeadKv: p[1]!,
            scale: p[2]!,
            headDim: p[3]!,
            nHead: p[4]!,
            window: node.op === "attention_swa" ? p[5]! : 0,
          }),
        };
      case "add":
      case "mul":
        return { value: refBinary(value(s0!), value(s1!), node.op) };
      case "scale":
        return { value: value(s0!).map((x) => x * p[0]!) };
      case "silu":
        return { value: value(s0!).map(refSilu) };
      case "relu":
        return { value: value(s0!).map((x) => Math.max(x, 0)) };
      case "gelu":
        return { value: value(s0!).map(refGelu) };
      case "sigmoid":
        return { value: value(s0!).map(refSigmoid) };
      case "reshape":
        return { value: Float64Array.from(value(s0!)) };
      case "top_k":
        return { value: refTopK(value(s0!), ne0(s0!)[0], p[0]!) };
      case "mul_mat_id":
      case "mul_mat_id_sparse": {
        const [k, m, nExpert] = ne0(s0!);
        const [nUsed, tokens] = ne0(s2!);
        const shape = { k, m, nExpert, nUsed, tokens, xCols: columns(ne0(s1!)) };
        if (node.op === "mul_mat_id") return { value: refMulMatId(value(s0!), value(s1!), value(s2!), shape) };
        const r = refMulMatIdSparse(value(s0!), value(s1!), value(s2!), shape, { logits: opt(s3), threshold: p[0]! });
        return { value: r.y, rowsRead: r.rowsRead };
      }
      case "axpy_id_sparse": {
        const [d, m, nExpert] = ne0(s0!);
        const [nUsed, tokens] = ne0(s2!);
        const r = refAxpyIdSparse(
          value(s0!),
          d,
          value(s1!),
          value(s2!),
          { m, nExpert, nUsed, tokens },
          {
            logits: opt(s3),
            threshold: p[0]!,
          },
        );
        return { value: r.y, rowsRead: r.rowsRead };
      }
      case "moe_sum": {
        const [d] = ne0(s0!);
        const [nUsed] = ne0(s2!);
        return {
          value: refMoeSum(value(s0!), d, value(s1!), ne0(s1!)[0], value(s2!), nUsed, p[0] === 1, p[1]!),
        };
      }
      case "moe_scatter": {
        const [r] = ne0(s0!);
        const [nUsed] = ne0(s1!);
        return { value: refMoeScatter(value(s0!), r, value(s1!), nUsed, p[0]!, p[1]!, p[2]!) };
      }
      case "slice": {
        const [n] = ne0(s0!);
        const x = value(s0!);
        const [off, len] = [p[0]!, p[1]!];
        const t = columns(ne0(s0!));
        const y = new Float64Array(len * t);
        for (let c = 0; c < t; c++) y.set(x.subarray(c * n + off, c * n + off + len), c * len);
        return { value: y };
      }
      case "cpy": {
        const dst = graph.tensors[node.dst]!;
        if (dst.kind !== "handle") throw new RangeError("cpy: destination must be a handle");
        writeRows(dst.dtype, bytesOf(dst.handle!, handles), dst.ne[0], p[0]!, value(s0!));
        values[node.dst] = undefined; // re-read (dequantized) when a later node uses it
        return {};
      }
      case "mul_mat_sparse":
      case "axpy_sparse": {
        const w = ne0(s0!);
        const args: RefSparseArgs = { logits: opt(s2), rows: opt(s3), threshold: p[0]!, nOut: p[1]! };
        const f = node.op === "mul_mat_sparse" ? refMulMatSparse : refAxpySparse;
        const r = f(value(s0!), w[0], columns(w), value(s1!), columns(ne0(s1!)), args);
        return { value: r.y, rowsRead: r.rowsRead };
      }
    }
  };

  graph.nodes.forEach((node, i) => {
    const impl = options.ops?.[node.op];
    const r = impl ? impl(node, ctx) : builtin(node);
    if (node.op !== "cpy") {
      if (!r.value) throw new RangeError(`referenceCompute: op ${node.op} produced no value`);
      values[node.dst] = options.roundIntermediates ? r.value.map(Math.fround) : r.value;
    }
    rowsRead[i] = r.rowsRead ?? 0;
  });
  return { values, rowsRead };
}

/**
 * Copies the reference values of every tensor the graph marked as output into its output array
 * (rounded to float32). Handle outputs are read back from `handles`.
 */
export function writeGraphOutputs(graph: Graph, result: ReferenceResult, handles: ReferenceHandleBytes): void {
  graph.tensors.forEach((t, id) => {
    if (!t.output) return;
    let v = result.values[id];
    if (!v && t.kind === "handle") v = dequantizeReference(t.dtype, bytesOf(t.handle!, handles), nelOf(t.ne)).values;
    if (!v && t.kind === "input") v = Float64Array.from(t.data as Float32Array);
    if (!v) throw new RangeError(`writeGraphOutputs: tensor ${id} was never computed`);
    t.output.set(v);
  });
}
