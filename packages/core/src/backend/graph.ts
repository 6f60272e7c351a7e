/**
 * A compute graph: tensors plus an ordered list of ops, built in TypeScript and handed to a backend
 * in one call as compact typed arrays ({@link Graph.encode}).
 *
 * Every intermediate tensor is contiguous F32 (ids are I32). Shapes follow ggml (ne[0] innermost).
 * `T` below is the number of tokens (columns) in the batch.
 *
 * Op contracts (all outputs F32 unless stated; "any" = any {@link DType} the backend claims). After the
 * semicolon: the node's `params`, in order.
 * - `get_rows(W[K,R] any, ids i32[T])` → [K,T]: column t = row ids[t] of W, dequantized.
 * - `mul_mat(W[K,N] any, x[K,T], gemm i32[T]?)` → [N,T]: y[n,t] = Σ_k W[k,n]·x[k,t]. Backends may round x the way
 *   llama.cpp does for the weight type (F16 for F16/BF16 weights, Q8_0 blocks for Q4/Q5/Q8 weights, Q8_K for K-quants).
 *   `gemm` ({@link Graph.gemmColumns}): per column, 1 where llama.cpp would compute it in its prompt-processing
 *   matrix-product arithmetic (its GEMM path, taken for ≥ 2 columns) rather than its matrix × vector one (0);
 *   the two differ in the last bits only. Backends may ignore it.
 * - `rms_norm(x[n,T]; eps)` → x / sqrt(mean(x²) + eps) per column (Zhang & Sennrich 2019).
 * - `norm(x[n,T]; eps)` → (x − mean) / sqrt(var + eps) per column (layer norm without affine).
 * - `rope(x[d·H,T], pos i32[T]; n_dims, mode, freq_base, freq_scale, head_dim)` → same shape, each head of
 *   head_dim values rotated independently. mode 0 = "normal"
 *   (adjacent pairs (2i, 2i+1) rotate), mode 2 = NeoX (pairs (i, i+n_dims/2)); θ_i = pos·freq_scale·freq_base^(−2i/n_dims)
 *   (Su et al. 2021, RoFormer). Dimensions ≥ n_dims pass through.
 * - `softmax(x[n,R]; scale)` → softmax(scale·x) per column.
 * - `attention(q[d·H,T], k_cache[d·H_kv, C], v_cache[d·H_kv, C]; n_past, n_head_kv, scale, head_dim, n_head)` → [d·H, T]:
 *   query t (absolute position n_past+t) attends cache positions 0..n_past+t (causal), head h reads KV head
 *   h / (H / H_kv) (GQA). Caches are F32 or F16 handles.
 * - `attention_swa(…; n_past, n_head_kv, scale, head_dim, n_head, window)`: as attention, but query t sees only the cache
 *   positions p with (n_past + t) − p < window (a sliding window, llama.cpp's LLAMA_SWA_TYPE_STANDARD).
 * - `add(a[n,T], b[n,T|1])`, `mul(a, b)`: elementwise, b broadcast over columns when b.ne[1] == 1.
 * - `scale(a; s)`, `silu(a)`, `relu(a)`, `gelu(a)` (tanh approximation, as ggml).
 * - `cpy(src[n,T], dst handle [n,R]; row_offset)`: writes src into rows row_offset..row_offset+T−1 of dst,
 *   converting to dst's dtype (F32/F16/BF16). The node's output is dst itself.
 * - `slice(src[N,T]; offset, length)` → [length,T]: rows offset..offset+length−1 of each column.
 * - `reshape(src)` → the same values in the same order under another shape of the same element count
 *   (e.g. [head_dim·n_head, T] → [head_dim, n_head·T] so that a per-head norm is a per-column one).
 * - `mul_mat_sparse(W[K,M] any, x[K,T], logits[n_out,T]?, rows i32[M']?; threshold, n_out)` → [n_out,T]:
 *   output neuron i is computed (= W-row·x) when i is in `rows` (all neurons when absent) and
 *   logits[i,t] ≥ threshold (always when absent); every other output element is exactly 0. When
 *   rows is given and W.ne[1] == rows.length, W is compact: W row j holds neuron rows[j].
 * - `axpy_sparse(Wt[E,M] any, a[n_out,T], logits[n_out,T]?, rows i32[M']?; threshold, n_out)` → [E,T]:
 *   y[:,t] = Σ over active neurons i of a[i,t]·Wt-row(i) (the down projection stored neuron-major,
 *   `blk.N.ffn_down_t.weight`); overwrites its output with this partial sum. Same activity rule and
 *   compact-W rule as mul_mat_sparse.
 * Sparse ops report, per node, how many weight rows they actually read ({@link ComputeResult.rowsRead}),
 * counting a row once per token column it was read for: the (neuron, token) outputs computed as active. (A
 * backend may compute a batch's busy rows in whole tiles and drop the products of inactive pairs; those are
 * not counted.)
 *
 * Routed experts (mixture of experts; the role of ggml's `mul_mat_id`). Stacked expert tensors have one
 * matrix per expert in ne[2]: `ffn_gate_exps`/`ffn_up_exps` ne = [n_embd, n_ff_exp, n_expert],
 * `ffn_down_exps` ne = [n_ff_exp, n_embd, n_expert], the neuron-major down `ffn_down_exps_t` ne =
 * [n_embd, n_ff_exp, n_expert]. `U` is n_expert_used (slots per token). `top_k` is the one op whose output
 * is I32. These ops are an optional capability (`EXPERT_OPS` in types.ts).
 * - `sigmoid(a)` → 1 / (1 + exp(−a)).
 * - `top_k(x[n,T]; k)` → i32 [k,T]: per column the indices of its k largest values, largest first (equal
 *   values: lower index first), as ggml's `argsort_top_k`.
 * - `mul_mat_id(W[K,N,E] any, x[K,T] or [K,U,T], ids i32[U,T])` → [N,U,T]: y[:,u,t] = W_e·x_c with
 *   e = ids[u,t] and x_c column t of x (x has T columns: the slots of a token share its input) or column
 *   t·U+u (x [K,U,T]: one input per slot). Every id must be in 0..E−1. Same activation rounding as mul_mat.
 * - `moe_sum(y[D,U,T], probs[n_expert,T], ids i32[U,T]; norm, scale)` → [D,T]: Σ_u w[u,t]·y[:,u,t], summed in
 *   slot order, with w[u,t] = probs[ids[u,t], t]; when norm = 1 each w is divided by max(Σ_u w[u,t], 2^-14)
 *   (llama.cpp's clamp to the smallest normal F16); then multiplied by scale (1 = none).
 * - `mul_mat_id_sparse(W[K,M,E] any, x[K,T] or [K,U,T], ids i32[U,T], logits[M,U,T]?; threshold)` → [M,U,T]:
 *   element (i,u,t) = row i of W_{ids[u,t]} · x_c when logits[i,u,t] ≥ threshold (always when absent),
 *   otherwise exactly 0 — only the active neurons of the selected experts are read.
 * - `axpy_id_sparse(Wt[D,M,E] any, a[M,U,T], ids i32[U,T], logits[M,U,T]?; threshold)` → [D,U,T]:
 *   y[:,u,t] = Σ over active i of a[i,u,t]·row i of Wt_{ids[u,t]} (the expert's down projection stored
 *   neuron-major). Same activity rule as mul_mat_id_sparse.
 * The two sparse expert ops count, in rowsRead, one row per (active neuron, slot, token).
 * - `moe_scatter(src[R,U,T], ids i32[U,T]; m, n_expert, fill)` → [m·n_expert, T], R = m or 1: the chosen
 *   experts' per-slot values laid out by expert, as a split expert layer numbers its (expert, neuron) pairs
 *   (e·m + i): element (e·m + i, t) = src[i (0 when R = 1), u, t] where ids[u,t] = e, and `fill` for the
 *   experts token t did not choose (a later slot wins if an id repeats; top_k never repeats one).
 * `get_rows` also takes the ids of `top_k` (any shape; one output column per id).
 */
import type { DType, OpName, TensorHandle } from "./types.js";

export const OP_CODES: Readonly<Record<OpName, number>> = {
  get_rows: 1,
  mul_mat: 2,
  rms_norm: 3,
  norm: 4,
  rope: 5,
  softmax: 6,
  attention: 7,
  add: 8,
  mul: 9,
  scale: 10,
  silu: 11,
  relu: 12,
  gelu: 13,
  cpy: 14,
  slice: 15,
  mul_mat_sparse: 16,
  axpy_sparse: 17,
  sigmoid: 18,
  top_k: 19,
  mul_mat_id: 20,
  moe_sum: 21,
  mul_mat_id_sparse: 22,
  axpy_id_sparse: 23,
  reshape: 24,
  attention_swa: 25,
  moe_scatter: 26,
};

export const DTYPE_CODES: Readonly<Record<DType, number>> = {
  f32: 0,
  f16: 1,
  q4_0: 2,
  q4_1: 3,
  q5_0: 6,
  q5_1: 7,
  q8_0: 8,
  q4_K: 12,
  q5_K: 13,
  q6_K: 14,
  i32: 26,
  bf16: 30,
};

/** Tensor kinds in the encoding. */
export const TENSOR_KIND = { intermediate: 0, input: 1, handle: 2 } as const;
/** Int32 words per tensor in {@link EncodedGraph.tensors}: kind, dtype code, ne0..ne3, ref, output index. */
export const TENSOR_STRIDE = 8;
/** Int32 words per node in {@link EncodedGraph.nodes}: op code, dst, src0..src4 (−1 = none), param offset, param count, reserved. */
export const NODE_STRIDE = 10;
export const MAX_SRC = 5;

export const ROPE_NORMAL = 0;
export const ROPE_NEOX = 2;

/** A graph tensor: an index into {@link Graph.tensors}. */
export type TensorId = number;

export interface GraphTensor {
  dtype: DType;
  ne: [number, number, number, number];
  kind: "intermediate" | "input" | "handle";
  handle?: TensorHandle;
  data?: ArrayBufferView;
  output?: Float32Array;
}

export interface GraphNode {
  op: OpName;
  dst: TensorId;
  src: TensorId[];
  params: number[];
}

/** The wire form handed to native code. `ref` of a tensor is the handle id (handles) or input index (inputs). */
export interface EncodedGraph {
  tensors: Int32Array;
  nodes: Int32Array;
  params: Float64Array;
  inputs: ArrayBufferView[];
  outputs: Float32Array[];
}

function shape4(ne: readonly number[]): [number, number, number, number] {
  if (ne.length < 1 || ne.length > 4) throw new RangeError(`tensor rank ${ne.length} not in 1..4`);
  for (const n of ne) {
    if (!Number.isInteger(n) || n < 1) throw new RangeError(`bad dimension ${n} in [${ne.join(", ")}]`);
  }
  return [ne[0]!, ne[1] ?? 1, ne[2] ?? 1, ne[3] ?? 1];
}

const nel = (ne: readonly number[]) => ne.reduce((a, b) => a * b, 1);

/** Builds a graph op by op; each method returns the id of its output tensor. Shapes are checked here. */
export class Graph {
  readonly tensors: GraphTensor[] = [];
  readonly nodes: GraphNode[] = [];
  /**
   * Optional labels of tensors (llama.cpp's node names: `Qcur-0`, `ffn_out-3`, …), for debugging dumps
   * ({@link Graph.name}). Never part of the wire form: backends do not see them.
   */
  readonly names = new Map<TensorId, string>();

  /**
   * Every node param that holds a sequence position, recorded as the graph is built: `cpy`'s row_offset
   * (param 0) and `attention`/`attention_swa`'s n_past (param 0). A caller that runs a built graph again at
   * another position (the engine's decode-graph reuse) moves them with {@link setParam}; that is only right
   * for a graph whose every such param is its one sequence's n_past, which the caller checks.
   */
  readonly positionParams: { node: number; param: number }[] = [];

  /** The last {@link encode} result and the tensor and node counts it was made at. */
  private encoded?: { e: EncodedGraph; nTensors: number; nNodes: number };

  /**
   * Labels tensor `t` (e.g. `attn_norm-2`) and returns `t`, so a builder can name a node where it makes it.
   * A tensor has one label; naming it again replaces the label.
   * @throws RangeError when `t` is not a tensor of this graph or the label is empty.
   */
  name(t: TensorId, label: string): TensorId {
    if (!Number.isInteger(t) || t < 0 || t >= this.tensors.length) throw new RangeError(`name: no tensor ${t}`);
    if (label === "") throw new RangeError("name: empty label");
    this.names.set(t, label);
    return t;
  }

  /** A host array copied in at compute time (F32 or I32). */
  input(dtype: "f32" | "i32", ne: readonly number[], data: Float32Array | Int32Array): TensorId {
    const s = shape4(ne);
    if (data.length !== nel(s)) throw new RangeError(`input data has ${data.length} elements, shape needs ${nel(s)}`);
    this.tensors.push({ dtype, ne: s, kind: "input", data });
    return this.tensors.length - 1;
  }

  /** A backend tensor (weights, KV cache). */
  handle(h: TensorHandle): TensorId {
    this.tensors.push({ dtype: h.dtype, ne: shape4(h.ne), kind: "handle", handle: h });
    return this.tensors.length - 1;
  }

  /** Marks `t` (an F32 tensor) as an output: after compute its values are in `dest` (length = element count). */
  output(t: TensorId, dest?: Float32Array): Float32Array {
    const tt = this.tensors[t]!;
    const n = nel(tt.ne);
    const out = dest ?? new Float32Array(n);
    if (out.length !== n) throw new RangeError(`output array has ${out.length} elements, tensor has ${n}`);
    tt.output = out;
    const c = this.cached();
    if (c) {
      const k = c.tensors[t * TENSOR_STRIDE + 7]!;
      if (k >= 0) c.outputs[k] = out;
      else this.encoded = undefined;
    }
    return out;
  }

  /**
   * Replaces the values of input `t` (same dtype and element count), for a graph computed again.
   * @throws RangeError when `t` is not an input of this graph or `data` does not fit it.
   */
  setInput(t: TensorId, data: Float32Array | Int32Array): void {
    const tt = this.tensors[t];
    if (tt?.kind !== "input") throw new RangeError(`setInput: tensor ${t} is not an input`);
    const want = tt.dtype === "i32" ? Int32Array : Float32Array;
    if (!(data instanceof want) || data.length !== nel(tt.ne))
      throw new RangeError(`setInput: input ${t} needs ${nel(tt.ne)} ${tt.dtype} values`);
    tt.data = data;
    const c = this.cached();
    if (c) c.inputs[c.tensors[t * TENSOR_STRIDE + 6]!] = data;
  }

  /**
   * Sets param `i` of node `n` to `v`, for a graph computed again (a position, see {@link positionParams}).
   * Shapes are not checked again: the caller keeps the value within what the graph was built for.
   * @throws RangeError when node `n` has no param `i` or `v` is not finite.
   */
  setParam(n: number, i: number, v: number): void {
    const node = this.nodes[n];
    if (!node || !Number.isInteger(i) || i < 0 || i >= node.params.length || !Number.isFinite(v))
      throw new RangeError(`setParam: node ${n} has no param ${i} (or ${v} is not finite)`);
    node.params[i] = v;
    const c = this.cached();
    if (c) c.params[c.nodes[n * NODE_STRIDE + 7]! + i] = v;
  }

  /** The cached encoding when it still describes this graph (nothing was added since). */
  private cached(): EncodedGraph | undefined {
    const c = this.encoded;
    return c && c.nTensors === this.tensors.length && c.nNodes === this.nodes.length ? c.e : undefined;
  }

  shape(t: TensorId): [number, number, number, number] {
    return this.tensors[t]!.ne;
  }

  private node(
    op: OpName,
    ne: readonly number[],
    src: TensorId[],
    params: number[] = [],
    dtype: DType = "f32",
  ): TensorId {
    this.tensors.push({ dtype, ne: shape4(ne), kind: "intermediate" });
    const dst = this.tensors.length - 1;
    this.nodes.push({ op, dst, src, params });
    return dst;
  }

  private check(cond: boolean, msg: string): void {
    if (!cond) throw new RangeError(msg);
  }

  /** Rows of w by id: ids i32 of any shape (an input, a backend tensor or top_k's output) → [K, nel(ids)]. */
  getRows(w: TensorId, ids: TensorId): TensorId {
    const [k] = this.shape(w);
    const t = nel(this.shape(ids));
    this.check(this.tensors[ids]!.dtype === "i32", "get_rows: ids must be i32");
    return this.node("get_rows", [k, t], [w, ids]);
  }

  mulMat(w: TensorId, x: TensorId): TensorId {
    const [k, n] = this.shape(w);
    const [kx, t, t2, t3] = this.shape(x);
    this.check(k === kx, `mul_mat: W row length ${k} != x length ${kx}`);
    // a product over the batch's columns reads the batch's GEMM flags (see gemmColumns)
    const gemm = this.gemm && this.gemm.cols === t && t2 * t3 === 1 ? [this.gemm.flags] : [];
    return this.node("mul_mat", [n, t], [w, x, ...gemm]);
  }

  private gemm?: { flags: TensorId; cols: number };

  /**
   * Says, for the T columns (tokens) of this graph's batch, which ones llama.cpp would compute with its
   * prompt-processing matrix-product arithmetic: flag 1 where the column's sequence has ≥ 2 tokens in the
   * step (ggml takes its GEMM path — llamafile's tinyBLAS on x86 — for a product of ≥ 2 columns), 0 where it
   * has one (matrix × vector). Every `mul_mat` built afterwards over exactly T columns reads the flags as its
   * optional third source; products over other column counts (the last token's logits) do not. Backends may
   * ignore the flags: the two arithmetics differ in the last bits only. Call it before building the layers.
   * @throws RangeError when flags are not 0/1, or gemmColumns was already called.
   */
  gemmColumns(flags: Int32Array): void {
    this.check(this.gemm === undefined, "gemmColumns: already set");
    this.check(
      flags.length > 0 && flags.every((f) => f === 0 || f === 1),
      "gemmColumns: flags must be 0 or 1, one per column",
    );
    this.gemm = { flags: this.input("i32", [flags.length], flags), cols: flags.length };
  }

  rmsNorm(x: TensorId, eps: number): TensorId {
    return this.node("rms_norm", this.shape(x), [x], [eps]);
  }

  norm(x: TensorId, eps: number): TensorId {
    return this.node("norm", this.shape(x), [x], [eps]);
  }

  /** x is [head_dim·n_head, T]; each head rotated independently. */
  rope(
    x: TensorId,
    pos: TensorId,
    p: { headDim: number; nDims: number; mode: number; freqBase: number; freqScale: number },
  ): TensorId {
    const [n, t] = this.shape(x);
    this.check(n % p.headDim === 0, `rope: ${n} not a multiple of head_dim ${p.headDim}`);
    this.check(this.shape(pos)[0] === t, "rope: positions must have one entry per token");
    this.check(p.nDims <= p.headDim && p.nDims % 2 === 0, `rope: n_dims ${p.nDims} must be even and ≤ head_dim`);
    return this.node("rope", [n, t], [x, pos], [p.nDims, p.mode, p.freqBase, p.freqScale, p.headDim]);
  }

  softmax(x: TensorId, scale = 1): TensorId {
    return this.node("softmax", this.shape(x), [x], [scale]);
  }

  /** q is [head_dim·n_head, T]; `window` > 0 emits attention_swa. */
  attention(
    q: TensorId,
    kCache: TensorId,
    vCache: TensorId,
    p: { headDim: number; nHead: number; nHeadKv: number; nPast: number; scale: number; window?: number },
  ): TensorId {
    const [qd, t] = this.shape(q);
    const w = p.window ?? 0;
    this.check(Number.isInteger(w) && w >= 0, `attention: window ${w} must be a non-negative integer`);
    this.check(qd === p.headDim * p.nHead, `attention: q row ${qd} != head_dim·n_head`);
    const [kd, ctx] = this.shape(kCache);
    this.check(kd === p.headDim * p.nHeadKv, `attention: k cache row ${kd} != head_dim·n_head_kv`);
    this.check(p.nHead % p.nHeadKv === 0, "attention: n_head must be a multiple of n_head_kv");
    this.check(p.nPast + t <= ctx, `attention: ${p.nPast + t} positions exceed the cache size ${ctx}`);
    const params = [p.nPast, p.nHeadKv, p.scale, p.headDim, p.nHead];
    const out =
      w > 0
        ? this.node("attention_swa", [p.headDim * p.nHead, t], [q, kCache, vCache], [...params, w])
        : this.node("attention", [p.headDim * p.nHead, t], [q, kCache, vCache], params);
    this.positionParams.push({ node: this.nodes.length - 1, param: 0 });
    return out;
  }

  add(a: TensorId, b: TensorId): TensorId {
    this.checkBroadcast("add", a, b);
    return this.node("add", this.shape(a), [a, b]);
  }

  mul(a: TensorId, b: TensorId): TensorId {
    this.checkBroadcast("mul", a, b);
    return this.node("mul", this.shape(a), [a, b]);
  }

  private checkBroadcast(op: string, a: TensorId, b: TensorId): void {
    const sa = this.shape(a);
    const sb = this.shape(b);
    const na = nel(sa);
    const nb = nel(sb);
    this.check(nb === na || nb === sa[0], `${op}: shapes [${sa}] and [${sb}] do not broadcast`);
  }

  scale(a: TensorId, s: number): TensorId {
    return this.node("scale", this.shape(a), [a], [s]);
  }

  silu(a: TensorId): TensorId {
    return this.node("silu", this.shape(a), [a]);
  }

  relu(a: TensorId): TensorId {
    return this.node("relu", this.shape(a), [a]);
  }

  gelu(a: TensorId): TensorId {
    return this.node("gelu", this.shape(a), [a]);
  }

  /** The same F32 values under shape `ne` (same element count). */
  reshape(src: TensorId, ne: readonly number[]): TensorId {
    const n = nel(this.shape(src));
    this.check(nel(ne) === n, `reshape: [${ne}] has ${nel(ne)} elements, source has ${n}`);
    return this.node("reshape", ne, [src]);
  }

  sigmoid(a: TensorId): TensorId {
    return this.node("sigmoid", this.shape(a), [a]);
  }

  /** Indices of the k largest values of each column of x [n, T] → i32 [k, T], largest first. */
  topK(x: TensorId, k: number): TensorId {
    const [n, t, t2, t3] = this.shape(x);
    this.check(t2 === 1 && t3 === 1, "top_k: x must be 2-D");
    this.check(Number.isInteger(k) && k >= 1 && k <= n, `top_k: k ${k} must be an integer in 1..${n}`);
    return this.node("top_k", [k, t], [x], [k], "i32");
  }

  /** Slots U and tokens T of an ids tensor [U, T] (i32). */
  private idsShape(op: string, ids: TensorId): [number, number] {
    const [u, t, a, b] = this.shape(ids);
    this.check(this.tensors[ids]!.dtype === "i32", `${op}: ids must be i32`);
    this.check(a === 1 && b === 1, `${op}: ids must be 2-D [n_expert_used, T]`);
    return [u, t];
  }

  /** Checks an expert input x [K, T] or [K, U, T] against ids [U, T]. */
  private checkExpertInput(op: string, x: TensorId, k: number, u: number, t: number): void {
    const [kx, c1, c2, c3] = this.shape(x);
    this.check(kx === k, `${op}: row length ${k} != x length ${kx}`);
    const cols = c1 * c2 * c3;
    this.check(
      cols === t || cols === u * t,
      `${op}: x has ${cols} columns; expected ${t} (one per token) or ${u * t} (one per slot and token)`,
    );
  }

  /** Routed experts' matrix product: W [K, N, E] stacked experts, x [K, T] or [K, U, T], ids i32 [U, T] → [N, U, T]. */
  mulMatId(w: TensorId, x: TensorId, ids: TensorId): TensorId {
    const [k, n, , e3] = this.shape(w);
    this.check(e3 === 1, "mul_mat_id: W must be 3-D [K, N, n_expert]");
    const [u, t] = this.idsShape("mul_mat_id", ids);
    this.checkExpertInput("mul_mat_id", x, k, u, t);
    return this.node("mul_mat_id", [n, u, t], [w, x, ids]);
  }

  /** Weighted sum of the experts' outputs y [D, U, T] with router probabilities probs [n_expert, T] → [D, T]. */
  moeSum(y: TensorId, probs: TensorId, ids: TensorId, opts: { norm: boolean; scale?: number }): TensorId {
    const [d, uy, ty, y3] = this.shape(y);
    const [u, t] = this.idsShape("moe_sum", ids);
    this.check(uy === u && ty === t && y3 === 1, `moe_sum: y [${this.shape(y)}] must be [D, ${u}, ${t}]`);
    const [, tp, p2, p3] = this.shape(probs);
    this.check(tp === t && p2 === 1 && p3 === 1, `moe_sum: probs must be [n_expert, ${t}]`);
    return this.node("moe_sum", [d, t], [y, probs, ids], [opts.norm ? 1 : 0, opts.scale ?? 1]);
  }

  /** Sparse routed experts: only active neurons of each selected expert (see the contract above). */
  mulMatIdSparse(w: TensorId, x: TensorId, ids: TensorId, opts: { logits?: TensorId; threshold?: number }): TensorId {
    const [k, m, , e3] = this.shape(w);
    this.check(e3 === 1, "mul_mat_id_sparse: W must be 3-D [K, M, n_expert]");
    const [u, t] = this.idsShape("mul_mat_id_sparse", ids);
    this.checkExpertInput("mul_mat_id_sparse", x, k, u, t);
    if (opts.logits !== undefined) this.checkExpertLogits("mul_mat_id_sparse", opts.logits, m, u, t);
    return this.node("mul_mat_id_sparse", [m, u, t], [w, x, ids, opts.logits ?? -1], [opts.threshold ?? 0]);
  }

  /** Sparse routed experts' down projection, stored neuron-major: Wt [D, M, E], a [M, U, T] → [D, U, T]. */
  axpyIdSparse(wt: TensorId, a: TensorId, ids: TensorId, opts: { logits?: TensorId; threshold?: number }): TensorId {
    const [d, m, , e3] = this.shape(wt);
    this.check(e3 === 1, "axpy_id_sparse: Wt must be 3-D [D, M, n_expert]");
    const [u, t] = this.idsShape("axpy_id_sparse", ids);
    const [ma, ua, ta, a3] = this.shape(a);
    this.check(
      ma === m && ua === u && ta === t && a3 === 1,
      `axpy_id_sparse: a [${this.shape(a)}] must be [${m}, ${u}, ${t}]`,
    );
    if (opts.logits !== undefined) this.checkExpertLogits("axpy_id_sparse", opts.logits, m, u, t);
    return this.node("axpy_id_sparse", [d, u, t], [wt, a, ids, opts.logits ?? -1], [opts.threshold ?? 0]);
  }

  private checkExpertLogits(op: string, l: TensorId, m: number, u: number, t: number): void {
    const [a, b, c, d] = this.shape(l);
    this.check(a === m && b * c * d === u * t, `${op}: logits [${this.shape(l)}] must be [${m}, ${u}, ${t}]`);
  }

  /**
   * The chosen experts' per-slot values laid out by expert (see the contract above): src [m, U, T] or
   * [1, U, T] (one value per slot, repeated over the expert's m rows), ids [U, T] → [m·nExpert, T].
   */
  moeScatter(src: TensorId, ids: TensorId, opts: { m: number; nExpert: number; fill: number }): TensorId {
    const [u, t] = this.idsShape("moe_scatter", ids);
    const [r, su, st, s3] = this.shape(src);
    const { m, nExpert, fill } = opts;
    this.check(Number.isInteger(m) && m >= 1, `moe_scatter: m must be an integer ≥ 1, got ${m}`);
    this.check(
      Number.isInteger(nExpert) && nExpert >= 1,
      `moe_scatter: nExpert must be an integer ≥ 1, got ${nExpert}`,
    );
    this.check(
      (r === m || r === 1) && su === u && st === t && s3 === 1,
      `moe_scatter: src [${this.shape(src)}] must be [${m}, ${u}, ${t}] or [1, ${u}, ${t}]`,
    );
    this.check(Math.abs(fill) <= 3.4028234663852886e38, `moe_scatter: fill must be a finite f32 value, got ${fill}`);
    return this.node("moe_scatter", [m * nExpert, t], [src, ids], [m, nExpert, fill]);
  }

  /** Writes src into rows rowOffset.. of the handle tensor dst; returns dst. */
  cpy(src: TensorId, dst: TensorId, rowOffset: number): TensorId {
    const [n, t] = this.shape(src);
    const [nd, rows] = this.shape(dst);
    this.check(this.tensors[dst]!.kind === "handle", "cpy: destination must be a backend tensor");
    this.check(n === nd, `cpy: row length ${n} != destination row length ${nd}`);
    this.check(rowOffset + t <= rows, `cpy: rows ${rowOffset}..${rowOffset + t} exceed ${rows}`);
    this.nodes.push({ op: "cpy", dst, src: [src], params: [rowOffset] });
    this.positionParams.push({ node: this.nodes.length - 1, param: 0 });
    return dst;
  }

  slice(src: TensorId, offset: number, length: number): TensorId {
    const [n, t] = this.shape(src);
    this.check(offset + length <= n, `slice: ${offset}+${length} exceeds ${n}`);
    return this.node("slice", [length, t], [src], [offset, length]);
  }

  mulMatSparse(
    w: TensorId,
    x: TensorId,
    opts: { logits?: TensorId; rows?: TensorId; threshold?: number; nOut?: number },
  ): TensorId {
    const [k, m] = this.shape(w);
    const [kx, t] = this.shape(x);
    this.check(k === kx, `mul_mat_sparse: W row length ${k} != x length ${kx}`);
    const nOut = opts.nOut ?? m;
    return this.node(
      "mul_mat_sparse",
      [nOut, t],
      [w, x, opts.logits ?? -1, opts.rows ?? -1],
      [opts.threshold ?? 0, nOut],
    );
  }

  axpySparse(
    wt: TensorId,
    a: TensorId,
    opts: { logits?: TensorId; rows?: TensorId; threshold?: number; nOut?: number },
  ): TensorId {
    const [e, m] = this.shape(wt);
    const [na, t] = this.shape(a);
    const nOut = opts.nOut ?? m;
    this.check(na === nOut, `axpy_sparse: activations length ${na} != n_out ${nOut}`);
    return this.node("axpy_sparse", [e, t], [wt, a, opts.logits ?? -1, opts.rows ?? -1], [opts.threshold ?? 0, nOut]);
  }

  /**
   * The compact wire form (see {@link EncodedGraph}). Made once and kept while no tensor or node is added;
   * {@link setInput}, {@link setParam} and {@link output} update it in place. Change a built graph only
   * through those.
   */
  encode(): EncodedGraph {
    const c = this.cached();
    if (c) return c;
    const tensors = new Int32Array(this.tensors.length * TENSOR_STRIDE);
    const inputs: ArrayBufferView[] = [];
    const outputs: Float32Array[] = [];
    this.tensors.forEach((t, i) => {
      const o = i * TENSOR_STRIDE;
      tensors[o] = TENSOR_KIND[t.kind];
      tensors[o + 1] = DTYPE_CODES[t.dtype];
      tensors.set(t.ne, o + 2);
      tensors[o + 6] = t.kind === "handle" ? t.handle!.id : t.kind === "input" ? inputs.push(t.data!) - 1 : -1;
      tensors[o + 7] = t.output ? outputs.push(t.output) - 1 : -1;
    });
    const nodes = new Int32Array(this.nodes.length * NODE_STRIDE);
    const params: number[] = [];
    this.nodes.forEach((n, i) => {
      const o = i * NODE_STRIDE;
      nodes[o] = OP_CODES[n.op];
      nodes[o + 1] = n.dst;
      for (let s = 0; s < MAX_SRC; s++) nodes[o + 2 + s] = n.src[s] ?? -1;
      nodes[o + 7] = params.length;
      nodes[o + 8] = n.params.length;
      params.push(...n.params);
    });
    const e = { tensors, nodes, params: Float64Array.from(params), inputs, outputs };
    this.encoded = { e, nTensors: this.tensors.length, nNodes: this.nodes.length };
    return e;
  }
}
