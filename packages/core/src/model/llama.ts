/**
 * The Llama-family graph (Llama 2 with GQA and SiLU-gated FFN; ReLU-Llama/ProSparse ReLU(gate)·up;
 * Bamboo ReLU(gate)·ReLU(up)), following Touvron et al. 2023 and llama.cpp's `llm_build_llama`.
 * One layer per screenful:
 *
 *   h = rms_norm(x)·attn_norm;  q,k,v = Wq·h, Wk·h, Wv·h;  q,k = rope(q,k);  cache ← k,v
 *   x = x + Wo·attention(q, cache);  h = rms_norm(x)·ffn_norm;  x = x + W_down·(act(W_gate·h) ⊙ W_up·h)
 */
import type { ModelConfig } from "@powerinfer/gguf";
import { Graph, ROPE_NEOX, ROPE_NORMAL, type TensorId } from "../backend/graph.js";
import type { TensorHandle } from "../backend/types.js";
import { EngineError } from "../engine/errors.js";
import type { KvCache } from "../engine/kv-cache.js";
import { F32_MIN_POSITIVE, sparseFfn } from "./blocks.js";
import type { WeightMapper } from "./weights.js";

export interface LlamaLayerWeights {
  attnNorm: TensorHandle;
  wq: TensorHandle;
  wk: TensorHandle;
  wv: TensorHandle;
  wo: TensorHandle;
  ffnNorm: TensorHandle;
  ffnGate?: TensorHandle;
  ffnUp: TensorHandle;
  /** ffn_down {n_ff, n_embd}, or undefined when the file stores ffn_down_t. */
  ffnDown?: TensorHandle;
  /** ffn_down_t {n_embd, n_ff}: the down projection stored neuron-major (PowerInfer GGUF). */
  ffnDownT?: TensorHandle;
  /** Predictor fc1 {n_embd, r} and fc2 {r, n_ff} (PowerInfer GGUF or trained here). */
  fc1?: TensorHandle;
  fc2?: TensorHandle;
}

/**
 * How the FFN runs.
 * - "off": dense.
 * - "predictor": the layer's predictor (fc2·ReLU(fc1·x), x = residual after attention) gives a logit per
 *   neuron; only neurons with logit ≥ threshold are computed (PowerInfer, Song et al. 2023).
 * - "oracle": the true mask: W_gate·h is computed densely and a neuron runs when its gate is > 0 (for
 *   ReLU(gate)·up this is exact: every skipped neuron's output is 0). Testing only.
 */
export type SparseMode = "off" | "predictor" | "oracle";

export interface LlamaWeights {
  tokEmbd: TensorHandle;
  outputNorm: TensorHandle;
  output: TensorHandle;
  layers: LlamaLayerWeights[];
}

/**
 * Maps the weights of a Llama-family model.
 * @throws EngineError 'MISSING_TENSOR' / 'BAD_SHAPE' / 'UNSUPPORTED_TYPE'.
 */
export function mapLlamaWeights(cfg: ModelConfig, m: WeightMapper, onLayer?: (l: number) => void): LlamaWeights {
  const { n_embd: e, n_ff: f, n_vocab: v, n_layer } = cfg;
  const ekv = cfg.head_dim * cfg.n_head_kv;
  const tokEmbd = m.map("token_embd.weight", [e, v]);
  const layers: LlamaLayerWeights[] = [];
  for (let l = 0; l < n_layer; l++) {
    const p = `blk.${l}.`;
    const hasDownT = m.has(`${p}ffn_down_t.weight`);
    layers.push({
      attnNorm: m.map(`${p}attn_norm.weight`, [e]),
      wq: m.map(`${p}attn_q.weight`, [e, cfg.head_dim * cfg.n_head]),
      wk: m.map(`${p}attn_k.weight`, [e, ekv]),
      wv: m.map(`${p}attn_v.weight`, [e, ekv]),
      wo: m.map(`${p}attn_output.weight`, [cfg.head_dim * cfg.n_head, e]),
      ffnNorm: m.map(`${p}ffn_norm.weight`, [e]),
      ffnGate: cfg.ffn.gated ? m.map(`${p}ffn_gate.weight`, [e, f]) : undefined,
      ffnUp: m.map(`${p}ffn_up.weight`, [e, f]),
      ffnDown: hasDownT ? undefined : m.map(`${p}ffn_down.weight`, [f, e]),
      ffnDownT: hasDownT ? m.map(`${p}ffn_down_t.weight`, [e, f]) : undefined,
      fc1: cfg.has_predictors ? m.map(`${p}fc1.weight`, [e, cfg.predictor_ranks[l]!]) : undefined,
      fc2: cfg.has_predictors ? m.map(`${p}fc2.weight`, [cfg.predictor_ranks[l]!, f]) : undefined,
    });
    onLayer?.(l);
  }
  const outputNorm = m.map("output_norm.weight", [e]);
  // Tied embeddings: llama.cpp falls back to token_embd when output.weight is absent.
  const output = m.mapOptional("output.weight", [e, v]) ?? tokEmbd;
  return { tokEmbd, outputNorm, output, layers };
}

export interface ForwardOptions {
  /** Return logits for every token of the batch (perplexity) instead of only the last one. */
  allLogits?: boolean;
  /** Default "off". "predictor" needs fc1/fc2 and a ReLU FFN; "oracle" a ReLU-gated FFN. */
  sparse?: SparseMode;
  /** Predictor threshold; default the model's `powerinfer.sparse_threshold`. */
  threshold?: number;
  /**
   * Capture, per layer, the FFN input x (residual after attention, [n_embd × T]) and the pre-activation
   * gate W_gate·h ([n_ff × T], or W_up·h without gate) — what profiling and predictor training read.
   */
  capture?: boolean;
}

/** What {@link ForwardOptions.capture} returns, per layer, token-major. */
export interface LayerCapture {
  ffnInput: Float32Array;
  gate: Float32Array;
}

/** Per-layer graph nodes of the sparse FFN, so callers can read their row counters. */
export interface SparseNodes {
  /** Node indices of mul_mat_sparse/axpy_sparse per layer. */
  layers: number[][];
}

/**
 * Checks that a sparse mode can run on this model.
 * @throws EngineError 'BAD_INPUT' naming what is missing.
 */
export function checkSparseMode(cfg: ModelConfig, w: LlamaWeights, mode: SparseMode): void {
  if (mode === "off") return;
  if (cfg.ffn.activation !== "relu") {
    throw new EngineError(
      "BAD_INPUT",
      `sparse mode "${mode}" needs a ReLU FFN; this model's FFN uses ${cfg.ffn.activation}, whose outputs are rarely exactly zero — a dense model gains nothing from sparse inference`,
    );
  }
  if (mode === "predictor" && !w.layers.every((L) => L.fc1 && L.fc2)) {
    throw new EngineError(
      "BAD_INPUT",
      'sparse mode "predictor" needs predictors (blk.N.fc1/fc2); train them with `powerinfer train-predictor` or use --sparse oracle',
    );
  }
  if (mode === "oracle" && !w.layers.every((L) => L.ffnGate)) {
    throw new EngineError("BAD_INPUT", 'sparse mode "oracle" needs a gated FFN (ffn_gate)');
  }
  if (!w.layers.every((L) => L.ffnDownT)) {
    throw new EngineError(
      "BAD_INPUT",
      `sparse mode "${mode}" needs the down projection stored neuron-major (ffn_down_t); load the model with transposeDown`,
    );
  }
}

/** One sequence of a batched forward pass ({@link buildLlamaBatchGraph}). */
export interface BatchSequence {
  /** The sequence's own KV cache. */
  kv: KvCache;
  /** New tokens (at least one), at positions nPast, nPast+1, … of this sequence. */
  tokens: Int32Array;
  /** Tokens already in this sequence's cache. */
  nPast: number;
  /** Logits wanted: after the last new token ("last", default), after every new token ("all"), or none. */
  logits?: "last" | "all" | "none";
}

/** Options of {@link buildLlamaBatchGraph}. */
export interface BatchForwardOptions extends Omit<ForwardOptions, "allLogits"> {
  /**
   * An F32 backend tensor [head_dim·n_head, ≥ total new tokens] in which the per-sequence attention outputs
   * are gathered before W_o. Needed when the batch holds more than one sequence; its contents are scratch.
   */
  scratch?: TensorHandle;
}

/** What {@link buildLlamaBatchGraph} returns. */
export interface BatchGraph {
  graph: Graph;
  /**
   * Per sequence: its logits ([n_vocab] for "last", [n_vocab × T_s] token-major for "all") or undefined
   * for "none"; views into one output array, filled by the compute.
   */
  logits: (Float32Array | undefined)[];
  sparseNodes: SparseNodes;
  captures: LayerCapture[];
}

/**
 * Builds the forward graph for `tokens` at positions nPast.. and the array its logits land in
 * ([n_vocab] or [n_vocab × T] column-major by token).
 * @throws EngineError 'CONTEXT_FULL' when nPast + T exceeds the cache.
 */
export function buildLlamaGraph(
  cfg: ModelConfig,
  w: LlamaWeights,
  kv: KvCache,
  tokens: Int32Array,
  nPast: number,
  opts: ForwardOptions = {},
): { graph: Graph; logits: Float32Array; sparseNodes: SparseNodes; captures: LayerCapture[] } {
  const r = buildLlamaBatchGraph(cfg, w, [{ kv, tokens, nPast, logits: opts.allLogits ? "all" : "last" }], opts);
  return { graph: r.graph, logits: r.logits[0]!, sparseNodes: r.sparseNodes, captures: r.captures };
}

/**
 * Builds one forward graph for several sequences (continuous batching). The batch's columns are the new
 * tokens of every sequence, sequence after sequence; every matrix product runs once over all columns, each
 * column roped at its own position. Attention is per sequence: its columns of Q, K and V are selected with
 * get_rows, K and V written into its own cache at its n_past, and its attention output copied into the
 * scratch tensor at its column offset, from which W_o reads all columns again. Every column's result
 * depends only on its token, its position and its own cache, so a sequence gets the same logits in any
 * batch as alone (bit for bit on the dense path). With one sequence the graph is the plain single-sequence
 * graph (no selection, no scratch).
 * @throws EngineError 'CONTEXT_FULL' when a sequence's nPast + T exceeds its cache, 'BAD_INPUT' for an empty
 *   batch or sequence, a missing or too small scratch, or capture with several sequences.
 */
export function buildLlamaBatchGraph(
  cfg: ModelConfig,
  w: LlamaWeights,
  seqs: readonly BatchSequence[],
  opts: BatchForwardOptions = {},
): BatchGraph {
  if (seqs.length === 0) throw new EngineError("BAD_INPUT", "empty batch");
  const multi = seqs.length > 1;
  const offsets: number[] = [];
  let T = 0;
  for (const s of seqs) {
    const n = s.tokens.length;
    if (n === 0) throw new EngineError("BAD_INPUT", "a sequence of the batch has no tokens");
    if (s.nPast + n > s.kv.nCtx) {
      throw new EngineError(
        "CONTEXT_FULL",
        `context full: ${s.nPast} tokens in the cache + ${n} new > n_ctx ${s.kv.nCtx}`,
      );
    }
    offsets.push(T);
    T += n;
  }
  const dH = cfg.head_dim * cfg.n_head;
  if (multi) {
    const sc = opts.scratch;
    if (sc?.dtype !== "f32" || sc.ne[0] !== dH || (sc.ne[1] ?? 1) < T) {
      throw new EngineError(
        "BAD_INPUT",
        `a batch of ${seqs.length} sequences needs an f32 scratch tensor of [${dH}, ≥ ${T}]${sc ? `, got ${sc.dtype} [${sc.ne.join(", ")}]` : ""}`,
      );
    }
    if (opts.capture) throw new EngineError("BAD_INPUT", "capture works on one sequence only");
  }
  const g = new Graph();
  const sparseNodes: SparseNodes = { layers: [] };
  const captures: LayerCapture[] = [];
  if (opts.capture && (opts.sparse ?? "off") !== "off")
    throw new EngineError("BAD_INPUT", "capture needs the dense FFN");
  const eps = cfg.norm.eps;
  const rope = {
    headDim: cfg.head_dim,
    nDims: cfg.n_rot,
    mode: cfg.rope.type === "neox" ? ROPE_NEOX : ROPE_NORMAL,
    freqBase: cfg.rope.freq_base,
    freqScale: cfg.rope.freq_scale,
  };
  const posData = new Int32Array(T);
  const idsData = new Int32Array(T);
  seqs.forEach((s, i) => {
    for (let j = 0; j < s.tokens.length; j++) posData[offsets[i]! + j] = s.nPast + j;
    idsData.set(s.tokens, offsets[i]!);
  });
  const pos = g.input("i32", [T], posData);
  const ids = g.input("i32", [T], idsData);
  const iota = (from: number, n: number) => Int32Array.from({ length: n }, (_, i) => from + i);
  // per sequence: the ids of its columns (several sequences only)
  const cols = multi ? seqs.map((s, i) => g.input("i32", [s.tokens.length], iota(offsets[i]!, s.tokens.length))) : [];
  const allCols = multi ? g.input("i32", [T], iota(0, T)) : -1;
  let x: TensorId = g.getRows(g.handle(w.tokEmbd), ids);
  const act = cfg.ffn.activation;
  if (act !== "silu" && act !== "relu" && act !== "gelu") {
    throw new EngineError("UNSUPPORTED_ARCH", `FFN activation ${act} is not supported`);
  }
  const attnParams = (nPast: number) => ({
    headDim: cfg.head_dim,
    nHead: cfg.n_head,
    nHeadKv: cfg.n_head_kv,
    nPast,
    scale: Math.fround(1 / Math.fround(Math.sqrt(cfg.head_dim))), // llama.cpp: 1.0f/sqrtf(head_dim)
  });
  for (let l = 0; l < w.layers.length; l++) {
    const L = w.layers[l]!;
    let h = g.mul(g.rmsNorm(x, eps), g.handle(L.attnNorm));
    const q = g.rope(g.mulMat(g.handle(L.wq), h), pos, rope);
    const k = g.rope(g.mulMat(g.handle(L.wk), h), pos, rope);
    const v = g.mulMat(g.handle(L.wv), h);
    let att: TensorId;
    if (!multi) {
      const s = seqs[0]!;
      const kc = g.cpy(k, g.handle(s.kv.k[l]!), s.nPast);
      const vc = g.cpy(v, g.handle(s.kv.v[l]!), s.nPast);
      att = g.attention(q, kc, vc, attnParams(s.nPast));
    } else {
      const scratch = g.handle(opts.scratch!);
      seqs.forEach((s, i) => {
        const c = cols[i]!;
        const kc = g.cpy(g.getRows(k, c), g.handle(s.kv.k[l]!), s.nPast);
        const vc = g.cpy(g.getRows(v, c), g.handle(s.kv.v[l]!), s.nPast);
        const a = g.attention(g.getRows(q, c), kc, vc, attnParams(s.nPast));
        g.cpy(a, scratch, offsets[i]!);
      });
      // the nodes run in order: every copy above is done before this read
      att = g.getRows(g.handle(opts.scratch!), allCols);
    }
    const ffnInp = g.add(g.mulMat(g.handle(L.wo), att), x);
    h = g.mul(g.rmsNorm(ffnInp, eps), g.handle(L.ffnNorm));
    const mode = opts.sparse ?? "off";
    let down: TensorId;
    if (mode === "off") {
      let up = g.mulMat(g.handle(L.ffnUp), h);
      const upRaw = up;
      if (cfg.ffn.up_activation === "relu") up = g.relu(up);
      let a: TensorId;
      if (opts.capture)
        captures.push({ ffnInput: g.output(ffnInp), gate: L.ffnGate ? new Float32Array(0) : g.output(upRaw) });
      if (L.ffnGate) {
        const gate = g.mulMat(g.handle(L.ffnGate), h);
        if (opts.capture) captures[captures.length - 1]!.gate = g.output(gate);
        const ga = act === "silu" ? g.silu(gate) : act === "relu" ? g.relu(gate) : g.gelu(gate);
        a = g.mul(ga, up);
      } else {
        a = act === "silu" ? g.silu(up) : act === "relu" ? g.relu(up) : g.gelu(up);
      }
      down = L.ffnDownT ? g.axpySparse(g.handle(L.ffnDownT), a, {}) : g.mulMat(g.handle(L.ffnDown!), a);
    } else {
      // Sparse FFN: which neurons run is decided by `logits ≥ threshold` (predictor) or gate > 0 (oracle),
      // per column, so every sequence of a batch keeps its own active set.
      const first = g.nodes.length;
      let logits: TensorId;
      let threshold: number;
      let gate: TensorId | undefined;
      if (mode === "predictor") {
        // predictor input: the residual after attention, before ffn_norm (PowerInfer)
        logits = g.mulMat(g.handle(L.fc2!), g.relu(g.mulMat(g.handle(L.fc1!), ffnInp)));
        threshold = opts.threshold ?? cfg.sparse_threshold;
      } else {
        gate = g.mulMat(g.handle(L.ffnGate!), h);
        logits = gate;
        threshold = F32_MIN_POSITIVE;
      }
      down = sparseFfn(g, cfg, { gate: L.ffnGate, up: L.ffnUp, downT: L.ffnDownT! }, h, { logits, threshold, gate });
      sparseNodes.layers.push(
        g.nodes
          .map((n, i) => (i >= first && (n.op === "mul_mat_sparse" || n.op === "axpy_sparse") ? i : -1))
          .filter((i) => i >= 0),
      );
    }
    x = g.add(down, ffnInp);
  }
  // the columns whose logits are wanted, in sequence order
  const outCols: number[] = [];
  const outStart: number[] = [];
  seqs.forEach((s, i) => {
    outStart.push(outCols.length);
    const mode = s.logits ?? "last";
    if (mode === "all") for (let j = 0; j < s.tokens.length; j++) outCols.push(offsets[i]! + j);
    else if (mode === "last") outCols.push(offsets[i]! + s.tokens.length - 1);
  });
  const nv = cfg.n_vocab;
  const result: (Float32Array | undefined)[] = seqs.map(() => undefined);
  if (outCols.length > 0) {
    const identity = outCols.length === T; // every column, in order
    if (!identity) x = g.getRows(x, g.input("i32", [outCols.length], Int32Array.from(outCols)));
    const out = g.mul(g.rmsNorm(x, eps), g.handle(w.outputNorm));
    const all = g.output(g.mulMat(g.handle(w.output), out));
    seqs.forEach((s, i) => {
      const mode = s.logits ?? "last";
      if (mode === "none") return;
      const n = mode === "all" ? s.tokens.length : 1;
      result[i] = all.subarray(outStart[i]! * nv, (outStart[i]! + n) * nv);
    });
  }
  return { graph: g, logits: result, sparseNodes, captures };
}
