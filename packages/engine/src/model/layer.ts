/**
 * The blocks a transformer layer is built from, shared by every architecture's layer recipe (see
 * `archs/`): norms, self-attention with the KV cache (one sequence or a batch of them), and the FFN in its
 * dense, sparse (predictor or oracle) and routed-expert forms. Each architecture file composes them in its
 * own order, as llama.cpp's `src/models/<arch>.cpp` compose `build_norm`, `build_attn` and `build_ffn`.
 */
import type { ModelConfig } from "@powerinfer/gguf";
import type { Graph, TensorHandle, TensorId } from "@powerinfer/core";
import { F32_MIN_POSITIVE, type MoeSparsity, moeFfn, sparseFfn } from "./blocks.js";
import type { BatchForwardOptions, BatchSequence, LayerCapture, LlamaLayerWeights, SparseNodes } from "./llama.js";
import type { ExpertWeights, SparseFfnWeights } from "./blocks.js";

/** Where one layer's FFN runs with a device: all on main, all on the device, or split by neuron. */
export type FfnPlacement = "main" | "device" | "split";

/** How one layer runs with a device (made by the engine's `ModelOffload`). Backend 0 is main, 1 the device. */
export interface LayerOffload {
  /** Where attention, norms, residual adds and the predictor run: the device (1) or main (0). */
  home: 0 | 1;
  ffn: FfnPlacement;
  /**
   * Device copies of what runs on the device at home (attention, norms, predictor, down bias) and, for
   * ffn "device", of every FFN tensor. Undefined when nothing of the layer is on the device but hot rows.
   */
  deviceWeights?: LlamaLayerWeights;
  /** ffn "split": the hot rows (compact copies on the device) and their ids (i32 on the device). */
  hot?: { W: SparseFfnWeights; rows: TensorHandle; n: number };
  /** ffn "split": the cold rows (read in place on main) and their ids (i32 on main). Not for routed experts. */
  cold?: { W: SparseFfnWeights; rows: TensorHandle; n: number };
  /**
   * ffn "split" of routed experts: f32 [n_ff_exp, n_expert] on main, −FLT_MAX at the hot (expert, neuron) pairs
   * and 0 elsewhere; `hot` then holds the hot pairs' rows, ids e·n_ff_exp + i.
   */
  expertMask?: TensorHandle;
}

/** What a layer builder works with: the graph being built and the step's inputs. */
export interface LayerContext {
  g: Graph;
  cfg: ModelConfig;
  /** Positions of the step's columns (i32 [T]). */
  pos: TensorId;
  rope: { headDim: number; nDims: number; mode: number; freqBase: number; freqScale: number };
  /** Several sequences in the step (continuous batching): attention runs per sequence. */
  multi: boolean;
  seqs: readonly BatchSequence[];
  /** Per sequence, the ids of its columns (several sequences only). */
  cols: TensorId[];
  /** Every column's id (several sequences only). */
  allCols: TensorId;
  /** Per sequence, its first column. */
  offsets: number[];
  opts: BatchForwardOptions;
  captures: LayerCapture[];
  sparseNodes: SparseNodes;
  /** Per layer, how it runs with a device (absent: everything on one backend). */
  offload?: readonly LayerOffload[];
  /** Per graph node, the backend it runs on (0 main, 1 device); filled as nodes are built (offload only). */
  nodeBackend?: number[];
  /** The layer being built. */
  layer: number;
  /** Its home backend (see {@link LayerOffload.home}). */
  home: 0 | 1;
  /** Its weights on the main backend (which hold every FFN row). */
  mainLayer?: LlamaLayerWeights;
  /**
   * The next layer's experts when they are served from the file (none after the last layer): the layer
   * runs their router on its own input as a look-ahead, so their reads start a layer early.
   */
  lookAhead?: ExpertWeights;
  /**
   * The layer's router result when it was computed before attention (a router on the layer input,
   * SmallThinker's, in a layer without a device split): see {@link routeExperts}.
   */
  earlyRoute?: { probs: TensorId; ids: TensorId };
  /**
   * The columns whose logits are wanted (i32), when not all: the last layer selects them after attention
   * (llama.cpp's `inp_out_ids`) so its FFN runs on those columns only. See {@link lastLayerRows}.
   */
  outIds?: TensorId;
}

/**
 * In the last layer, the wanted columns of each tensor (llama.cpp's `inp_out_ids`: rows nobody reads are
 * dropped before the FFN); elsewhere the tensors as they are.
 */
export function lastLayerRows(ctx: LayerContext, l: number, ts: TensorId[]): TensorId[] {
  if (ctx.outIds === undefined || l !== ctx.cfg.n_layer - 1) return ts;
  return ts.map((t) => ctx.g.getRows(t, ctx.outIds!));
}

/** Records a layer's sparse op nodes, its up projection node(s) and the columns it ran on. */
function recordSparse(ctx: LayerContext, nodes: number[], up: number[], h: TensorId): void {
  ctx.sparseNodes.layers.push(nodes);
  ctx.sparseNodes.up.push(up);
  ctx.sparseNodes.cols.push(ctx.g.shape(h)[1]);
}

/**
 * Builds nodes with `fn` and assigns every one of them not assigned yet to backend `b` (0 main, 1 device).
 * Without an offload it only calls `fn`.
 */
export function onBackend<T>(ctx: LayerContext, b: number, fn: () => T): T {
  const first = ctx.g.nodes.length;
  const r = fn();
  const nb = ctx.nodeBackend;
  if (nb) for (let i = first; i < ctx.g.nodes.length; i++) nb[i] ??= b;
  return r;
}

/** Norm (RMS or layer norm, as the config says) times weight, plus bias when given. */
export function normed(ctx: LayerContext, t: TensorId, wt: TensorHandle, b?: TensorHandle): TensorId {
  const { g, cfg } = ctx;
  const eps = cfg.norm.eps;
  const n = g.mul(cfg.norm.type === "rms" ? g.rmsNorm(t, eps) : g.norm(t, eps), g.handle(wt));
  return b ? g.add(n, g.handle(b)) : n;
}

/** W·t, plus bias when given. */
export function linear(ctx: LayerContext, wt: TensorHandle, t: TensorId, b?: TensorHandle): TensorId {
  const y = ctx.g.mulMat(ctx.g.handle(wt), t);
  return b ? ctx.g.add(y, ctx.g.handle(b)) : y;
}

/**
 * Self-attention of layer `l`: Q, K, V from `h` (or, fused, from `attnIn`), per-head Q/K norms when the
 * layer has them (Qwen3), RoPE unless the layer is NoPE (SmallThinker's layer_attention), K and V written to
 * each sequence's cache at its n_past, causal attention (sliding-window where the layer says), then W_o.
 * @returns W_o·attention (+ bias) [n_embd, T]
 */
export function selfAttention(
  ctx: LayerContext,
  l: number,
  L: LlamaLayerWeights,
  h: TensorId,
  attnIn: TensorId,
): TensorId {
  const { g, cfg, pos, rope, multi, seqs, cols, allCols, offsets, opts } = ctx;
  const eps = cfg.norm.eps;
  const dH = cfg.head_dim * cfg.n_head;
  const dKv = cfg.head_dim * cfg.n_head_kv;
  const useRope = cfg.rope.type !== "none";
  const attnParams = (nPast: number, window = 0) => ({
    window,
    headDim: cfg.head_dim,
    nHead: cfg.n_head,
    nHeadKv: cfg.n_head_kv,
    nPast,
    scale: Math.fround(1 / Math.fround(Math.sqrt(cfg.head_dim))), // llama.cpp: 1.0f/sqrtf(head_dim)
  });
  let q: TensorId;
  let k: TensorId;
  let v: TensorId;
  if (L.wqkv) {
    const qkv = g.mulMat(g.handle(L.wqkv), attnIn);
    q = g.slice(qkv, 0, dH);
    k = g.slice(qkv, dH, dKv);
    v = g.slice(qkv, dH + dKv, dKv);
  } else {
    q = linear(ctx, L.wq!, h, L.bq);
    k = linear(ctx, L.wk!, h, L.bk);
    v = linear(ctx, L.wv!, h, L.bv);
  }
  if (L.attnQNorm && L.attnKNorm) {
    // Qwen3: each head of q and k RMS-normed, then scaled by its [head_dim] weight, before RoPE
    const headNorm = (t: TensorId, wt: TensorHandle, heads: number) => {
      const [, cols] = g.shape(t);
      const perHead = g.reshape(t, [cfg.head_dim, heads * cols]);
      return g.reshape(g.mul(g.rmsNorm(perHead, eps), g.handle(wt)), [cfg.head_dim * heads, cols]);
    };
    q = headNorm(q, L.attnQNorm, cfg.n_head);
    k = headNorm(k, L.attnKNorm, cfg.n_head_kv);
  }
  // SmallThinker: NoPE layers and sliding-window layers as llama.cpp reads them (config.layer_attention)
  const la = cfg.layer_attention?.[l];
  if (useRope && (la?.rope ?? true)) {
    q = g.rope(q, pos, rope);
    k = g.rope(k, pos, rope);
  }
  let att: TensorId;
  if (!multi) {
    const s = seqs[0]!;
    const kc = g.cpy(k, g.handle(s.kv.k[l]!), s.nPast);
    const vc = g.cpy(v, g.handle(s.kv.v[l]!), s.nPast);
    att = g.attention(q, kc, vc, attnParams(s.nPast, la?.window));
  } else {
    const scratchT = ctx.home === 1 ? opts.deviceScratch! : opts.scratch!;
    const scratch = g.handle(scratchT);
    seqs.forEach((s, i) => {
      const c = cols[i]!;
      const kc = g.cpy(g.getRows(k, c), g.handle(s.kv.k[l]!), s.nPast);
      const vc = g.cpy(g.getRows(v, c), g.handle(s.kv.v[l]!), s.nPast);
      const a = g.attention(g.getRows(q, c), kc, vc, attnParams(s.nPast, la?.window));
      g.cpy(a, scratch, offsets[i]!);
    });
    // the nodes run in order: every copy above is done before this read
    att = g.getRows(g.handle(scratchT), allCols);
  }
  return linear(ctx, L.wo, att, L.bo);
}

/**
 * The FFN of layer `l` on `h` (the normed FFN input): routed experts (the router reads `layerIn` or `h`, as
 * the config says), dense, or sparse (predictor logits from `ffnInp`, or the oracle mask from the gate).
 * Records captures and the sparse nodes of the layer in the context.
 * @returns the down projection (+ bias) [n_embd, T]
 */
export function feedForward(
  ctx: LayerContext,
  L: LlamaLayerWeights,
  h: TensorId,
  ffnInp: TensorId,
  layerIn: TensorId,
): TensorId {
  const off = ctx.offload?.[ctx.layer];
  if (!off) return layerFfn(ctx, L, h, ffnInp, layerIn);
  // profiling captures the dense FFN: a split layer then runs it whole on main
  if (off.ffn === "split" && !ctx.opts.capture) {
    return off.expertMask ? splitExpertFfn(ctx, off, h, ffnInp, layerIn) : splitFfn(ctx, off, L, h, ffnInp);
  }
  const b = off.ffn === "device" ? 1 : 0;
  return onBackend(ctx, b, () => layerFfn(ctx, b === 1 ? off.deviceWeights! : ctx.mainLayer!, h, ffnInp, layerIn));
}

/**
 * A split FFN: the predictor at the layer's home (or the oracle gate on main), the hot rows on the device and
 * the cold rows on main over the same selection, their sums added at home.
 */
function splitFfn(ctx: LayerContext, off: LayerOffload, L: LlamaLayerWeights, h: TensorId, ffnInp: TensorId): TensorId {
  const { g, cfg, opts } = ctx;
  const mode = opts.sparse ?? "off";
  const M = ctx.mainLayer!;
  let logits: TensorId | undefined;
  let gate: TensorId | undefined;
  let threshold: number | undefined;
  if (mode === "predictor") {
    logits = g.mulMat(g.handle(L.fc2!), g.relu(g.mulMat(g.handle(L.fc1!), ffnInp)));
    threshold = opts.threshold ?? cfg.sparse_threshold;
  } else if (mode === "oracle") {
    // the whole gate is on main
    onBackend(ctx, 0, () => {
      if (M.ffnGate) {
        gate = g.mulMat(g.handle(M.ffnGate), h);
        logits = gate;
      } else {
        logits = linear(ctx, M.ffnUp!, h, M.bUp);
      }
    });
    threshold = F32_MIN_POSITIVE;
  }
  const sel = { logits, threshold, gate };
  const half = (b: 0 | 1) => {
    const part = b === 1 ? off.hot! : off.cold!;
    const from = g.nodes.length;
    const y = onBackend(ctx, b, () => sparseFfn(g, cfg, part.W, h, { ...sel, rows: g.handle(part.rows) }));
    const ops = g.nodes
      .map((n, i) => (i >= from && (n.op === "mul_mat_sparse" || n.op === "axpy_sparse") ? i : -1))
      .filter((i) => i >= 0);
    return { y, ops };
  };
  // the half away from home first: its reading of h closes the home piece, so the home half starts a piece
  // of its own and both run at once (built the other way round, the home half would join the piece that
  // makes h and the other half would wait for it)
  const away = half(ctx.home === 1 ? 0 : 1);
  const home = half(ctx.home);
  const [hot, cold] = ctx.home === 1 ? [home, away] : [away, home];
  if (mode !== "off") recordSparse(ctx, [...hot.ops, ...cold.ops], [hot.ops[0]!, cold.ops[0]!], h);
  // in the same order whatever the home: y_hot + y_cold
  let down = g.add(hot.y, cold.y);
  if (L.bDown) down = g.add(down, g.handle(L.bDown));
  return down;
}

/** The largest finite f32: the selection value of the (expert, neuron) pairs a half must skip. */
const F32_MAX = 3.4028234663852886e38;

/**
 * A split layer of routed experts (PowerInfer's hybrid split, per (expert, neuron) pair): the router, the chosen
 * experts and their selection (predictor logits, or the oracle's gate) on main, per slot [n_ff_exp, U, T];
 * then at once
 * - the device: the hot pairs' compact rows, with the selection and the router weights laid out by expert
 *   (`moe_scatter`, [n_ff_exp·n_expert, T], unchosen experts' pairs never selected) — y_hot = Σ over the
 *   selected hot pairs of w_e · act_p · down_p (the top-k is recomputed there from the router's
 *   probabilities: expert ids do not cross backends);
 * - main: the whole stacks per slot, as without a device, its selection plus the layer's mask (−FLT_MAX at
 *   the hot pairs: `get_rows` of it by expert id), so it computes the cold pairs only, then `moe_sum`;
 * and y = y_hot + y_cold at home. Dense experts (`--sparse off`) select every pair of a chosen expert. Both
 * halves take top-k of the router's probabilities again (i32 tensors do not cross graph pieces; the same
 * probabilities give the same ids).
 */
function splitExpertFfn(
  ctx: LayerContext,
  off: LayerOffload,
  h: TensorId,
  ffnInp: TensorId,
  layerIn: TensorId,
): TensorId {
  const { g, cfg, opts } = ctx;
  const moe = cfg.moe!;
  const X = ctx.mainLayer!.experts!;
  const mode = opts.sparse ?? "off";
  const [m, nExpert, nUsed] = [moe.n_ff_exp, moe.n_expert, moe.n_expert_used];
  const act = (t: TensorId) =>
    cfg.ffn.activation === "silu" ? g.silu(t) : cfg.ffn.activation === "gelu" ? g.gelu(t) : g.relu(t);
  const upAct = (t: TensorId) => (cfg.ffn.up_activation === "relu" ? g.relu(t) : t);
  const T = g.shape(h)[1];
  const routed = onBackend(ctx, 0, () => {
    const routerIn = moe.router_input === "layer_input" ? layerIn : h;
    const lg = g.mulMat(g.handle(X.gateInp), routerIn);
    const probs = moe.gating === "softmax" ? g.softmax(lg) : g.sigmoid(lg);
    const ids = g.topK(probs, nUsed);
    let slot: TensorId | undefined;
    let threshold = F32_MIN_POSITIVE;
    if (mode === "predictor") {
      slot = g.mulMatId(g.handle(X.fc2Exps!), g.relu(g.mulMatId(g.handle(X.fc1Exps!), ffnInp, ids)), ids);
      threshold = opts.threshold ?? cfg.sparse_threshold;
    } else if (mode === "oracle") {
      slot = g.mulMatId(g.handle(X.gateExps), h, ids);
    }
    return { probs, ids, slot, threshold };
  });
  const sparseOps: number[] = [];
  const upOps: number[] = [];
  const mark = (from: number) => {
    g.nodes.forEach((n, i) => {
      if (i >= from && /^(mul_mat_sparse|axpy_sparse|mul_mat_id_sparse|axpy_id_sparse)$/.test(n.op)) sparseOps.push(i);
    });
  };
  // the device half first: its reading of the router's outputs closes main's piece, so main's half starts a
  // piece of its own and both run at once
  let from = g.nodes.length;
  const hot = off.hot!;
  const yHot = onBackend(ctx, 1, () => {
    const ids = g.topK(routed.probs, nUsed);
    const eye = new Float32Array(nUsed * nUsed * T);
    for (let t = 0; t < T; t++) for (let u = 0; u < nUsed; u++) eye[(t * nUsed + u) * nUsed + u] = 1;
    // the router weights per slot (moe_sum of one-hot rows), then per pair
    const wSlot = g.moeSum(g.input("f32", [nUsed, nUsed, T], eye), routed.probs, ids, {
      norm: moe.norm_weights,
      scale: moe.weights_scale,
    });
    const w = g.moeScatter(g.reshape(wSlot, [1, nUsed, T]), ids, { m, nExpert, fill: 0 });
    const logits = routed.slot ? g.moeScatter(routed.slot, ids, { m, nExpert, fill: -F32_MAX }) : w;
    const o = {
      logits,
      rows: g.handle(hot.rows),
      threshold: routed.slot ? routed.threshold : F32_MIN_POSITIVE,
      nOut: m * nExpert,
    };
    if (mode === "predictor") {
      // the gate over the predicted pairs first; up and down then only over those whose gate is > 0
      const gate = g.mulMatSparse(g.handle(hot.W.gate!), h, o);
      upOps.push(g.nodes.length - 1);
      const fired = { ...o, logits: gate, threshold: F32_MIN_POSITIVE };
      const up = g.mulMatSparse(g.handle(hot.W.up), h, fired);
      return g.axpySparse(g.handle(hot.W.downT), g.mul(g.mul(act(gate), upAct(up)), w), fired);
    }
    const up = g.mulMatSparse(g.handle(hot.W.up), h, o);
    upOps.push(g.nodes.length - 1);
    // oracle: the chosen experts' gate, laid out by expert, is the selection itself
    const gate = mode === "oracle" ? logits : g.mulMatSparse(g.handle(hot.W.gate!), h, o);
    const a = g.mul(g.mul(act(gate), upAct(up)), w);
    return g.axpySparse(g.handle(hot.W.downT), a, o);
  });
  mark(from);
  from = g.nodes.length;
  const yCold = onBackend(ctx, 0, () => {
    const { probs, slot } = routed;
    // this half is a piece of its own (see above): expert ids do not cross pieces, so top-k again
    const ids = g.topK(probs, nUsed);
    const mask = g.getRows(g.handle(off.expertMask!), ids);
    // without a selection (dense experts) every cold pair of a chosen expert runs: mask ≥ −1
    const sel = { logits: slot ? g.add(slot, mask) : mask, threshold: slot ? routed.threshold : -1 };
    const gate = mode === "oracle" ? slot! : g.mulMatIdSparse(g.handle(X.gateExps), h, ids, sel);
    if (mode === "predictor") upOps.push(g.nodes.length - 1);
    // predictor mode: up and down only over the predicted pairs whose gate is > 0
    const fired = mode === "predictor" ? { logits: gate, threshold: F32_MIN_POSITIVE } : sel;
    const up = g.mulMatIdSparse(g.handle(X.upExps), h, ids, fired);
    if (mode !== "predictor") upOps.push(g.nodes.length - 1);
    const a = g.mul(act(gate), upAct(up));
    const down = X.downExpsT
      ? g.axpyIdSparse(g.handle(X.downExpsT), a, ids, fired)
      : g.mulMatId(g.handle(X.downExps!), a, ids);
    return g.moeSum(down, probs, ids, { norm: moe.norm_weights, scale: moe.weights_scale });
  });
  mark(from);
  if (mode !== "off") recordSparse(ctx, sparseOps, upOps, h);
  return g.add(yHot, yCold);
}

/** The FFN of a layer on one backend (see {@link feedForward}). */
function layerFfn(ctx: LayerContext, L: LlamaLayerWeights, h: TensorId, ffnInp: TensorId, layerIn: TensorId): TensorId {
  const { g, cfg, opts, captures } = ctx;
  const act = cfg.ffn.activation;
  const mode = opts.sparse ?? "off";
  let down: TensorId;
  if (L.experts) {
    // the router reads the FFN input (llama, qwen3moe) or the layer input (SmallThinker)
    const routerIn = cfg.moe!.router_input === "layer_input" ? layerIn : h;
    // per-expert predictors read the residual before ffn_norm, as PowerInfer's dense ones
    const sparsity: MoeSparsity =
      mode === "predictor"
        ? { mode, x: ffnInp, threshold: opts.threshold ?? cfg.sparse_threshold }
        : { mode: mode === "oracle" ? "oracle" : "off" };
    const r = moeFfn(g, cfg, L.experts, h, routerIn, sparsity, ctx.earlyRoute);
    down = r.out;
    if (opts.capture) {
      captures.push({
        ffnInput: g.output(ffnInp),
        gate: new Float32Array(0),
        routerProbs: g.output(r.probs),
        expertGate: g.output(r.gate),
      });
    }
    if (mode !== "off") recordSparse(ctx, r.sparseNodes, [r.sparseNodes[0]!], h);
  } else if (mode === "off") {
    let up = linear(ctx, L.ffnUp!, h, L.bUp);
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
      // predictor input: the residual after attention, before ffn_norm (PowerInfer; falcon: the layer input)
      logits = g.mulMat(g.handle(L.fc2!), g.relu(g.mulMat(g.handle(L.fc1!), ffnInp)));
      threshold = opts.threshold ?? cfg.sparse_threshold;
    } else if (L.ffnGate) {
      gate = g.mulMat(g.handle(L.ffnGate), h);
      logits = gate;
      threshold = F32_MIN_POSITIVE;
    } else {
      // no gate: a neuron fires when its up pre-activation (with bias) is > 0
      logits = linear(ctx, L.ffnUp!, h, L.bUp);
      threshold = F32_MIN_POSITIVE;
    }
    down = sparseFfn(g, cfg, { gate: L.ffnGate, up: L.ffnUp!, upBias: L.bUp, downT: L.ffnDownT! }, h, {
      logits,
      threshold,
      gate,
    });
    const nodes = g.nodes
      .map((n, i) => (i >= first && (n.op === "mul_mat_sparse" || n.op === "axpy_sparse") ? i : -1))
      .filter((i) => i >= 0);
    recordSparse(ctx, nodes, [nodes[0]!], h);
  }
  if (L.bDown) down = g.add(down, g.handle(L.bDown));
  return down;
}
