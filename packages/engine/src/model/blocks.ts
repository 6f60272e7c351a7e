/**
 * Building blocks of the Llama-family graph shared by the single-backend graph and the hybrid
 * (device + CPU) scheduler.
 */
import type { ModelConfig } from "@powerinfer/gguf";
import { type Graph, ROPE_NEOX, ROPE_NORMAL, type TensorId } from "@powerinfer/core";
import type { TensorHandle } from "@powerinfer/core";

/** Smallest positive float32: "gate ≥ this" is "gate > 0" (the oracle mask). */
export const F32_MIN_POSITIVE = 1.401298464324817e-45;

/** RoPE parameters of a model ({@link Graph.rope}): head_dim, n_rot, mode, θ base and scale. */
export function ropeParams(cfg: ModelConfig) {
  return {
    headDim: cfg.head_dim,
    nDims: cfg.n_rot,
    mode: cfg.rope.type === "neox" ? ROPE_NEOX : ROPE_NORMAL,
    freqBase: cfg.rope.freq_base,
    freqScale: cfg.rope.freq_scale,
  };
}

export interface AttentionWeights {
  attnNorm: TensorHandle;
  wq: TensorHandle;
  wk: TensorHandle;
  wv: TensorHandle;
  wo: TensorHandle;
}

/**
 * x + Wo·attention(rope(Wq·h), rope(Wk·h) → cache, Wv·h → cache) with h = rms_norm(x)·attn_norm:
 * the residual after attention ([n_embd, T]), i.e. the FFN input.
 */
export function attentionBlock(
  g: Graph,
  cfg: ModelConfig,
  L: AttentionWeights,
  x: TensorId,
  pos: TensorId,
  kCache: TensorHandle,
  vCache: TensorHandle,
  nPast: number,
): TensorId {
  const rope = ropeParams(cfg);
  const h = g.mul(g.rmsNorm(x, cfg.norm.eps), g.handle(L.attnNorm));
  const q = g.rope(g.mulMat(g.handle(L.wq), h), pos, rope);
  const k = g.rope(g.mulMat(g.handle(L.wk), h), pos, rope);
  const v = g.mulMat(g.handle(L.wv), h);
  const kc = g.cpy(k, g.handle(kCache), nPast);
  const vc = g.cpy(v, g.handle(vCache), nPast);
  const att = g.attention(q, kc, vc, {
    headDim: cfg.head_dim,
    nHead: cfg.n_head,
    nHeadKv: cfg.n_head_kv,
    nPast,
    scale: Math.fround(1 / Math.fround(Math.sqrt(cfg.head_dim))), // llama.cpp: 1.0f/sqrtf(head_dim)
  });
  return g.add(g.mulMat(g.handle(L.wo), att), x);
}

export interface SparseFfnWeights {
  gate?: TensorHandle;
  up: TensorHandle;
  /** Up bias [n_ff] (opt); added to every row, but rows the ops skip are never read by axpy_sparse. */
  upBias?: TensorHandle;
  /** Neuron-major down projection {n_embd, rows}. */
  downT: TensorHandle;
}

/**
 * The sparse FFN over the neurons that `rows` lists (all when absent) and `logits ≥ threshold` marks
 * (all when absent): y = Σ_i act_i · W_down_t[i] with act = ReLU(gate)·up (ReLU(gate)·ReLU(up) for
 * Bamboo, ReLU(up) without a gate; a non-ReLU activation is applied as given, for dense splits).
 * With compact weights (W.ne[1] == rows.length), W row j holds neuron rows[j]. `sel.gate`, a dense
 * [n_ff, T] gate already computed (oracle mode), replaces the gate projection. With ReLU on a gate and
 * `logits` (predictor mode), the gate is computed first over the marked neurons and up and down read only
 * those whose gate is > 0: ReLU(gate)·up is 0 for the others, so the sum is the same with fewer rows.
 */
export function sparseFfn(
  g: Graph,
  cfg: ModelConfig,
  W: SparseFfnWeights,
  h: TensorId,
  sel: { logits?: TensorId; rows?: TensorId; threshold?: number; gate?: TensorId },
): TensorId {
  const { gate: denseGate, ...selection } = sel;
  const opts = { ...selection, nOut: cfg.n_ff };
  const act = (t: TensorId) =>
    cfg.ffn.activation === "silu" ? g.silu(t) : cfg.ffn.activation === "gelu" ? g.gelu(t) : g.relu(t);
  if (W.gate && cfg.ffn.activation === "relu" && !denseGate && opts.logits !== undefined) {
    // ReLU(gate)·up is 0 wherever gate ≤ 0: the gate runs first over the predicted rows, then up and down
    // read only the rows whose gate is > 0 (a subset of the predicted ones) — the same result, fewer rows
    const gate = g.mulMatSparse(g.handle(W.gate), h, opts);
    const fired = { ...opts, logits: gate, threshold: F32_MIN_POSITIVE };
    let up = g.mulMatSparse(g.handle(W.up), h, fired);
    if (W.upBias) up = g.add(up, g.handle(W.upBias));
    if (cfg.ffn.up_activation === "relu") up = g.relu(up);
    return g.axpySparse(g.handle(W.downT), g.mul(g.relu(gate), up), fired);
  }
  let up = g.mulMatSparse(g.handle(W.up), h, opts);
  if (W.upBias) up = g.add(up, g.handle(W.upBias));
  let a: TensorId;
  if (W.gate) {
    if (cfg.ffn.up_activation === "relu") up = g.relu(up);
    // a gate computed densely already (the oracle's mask) is reused, not recomputed
    a = g.mul(act(denseGate ?? g.mulMatSparse(g.handle(W.gate), h, opts)), up);
  } else {
    a = act(up);
  }
  return g.axpySparse(g.handle(W.downT), a, opts);
}

/** Stacked expert tensors of one layer (GGUF names `blk.N.ffn_gate_inp.weight`, `blk.N.ffn_{gate,up,down}_exps.weight`). */
export interface ExpertWeights {
  /** Router {n_embd, n_expert}. */
  gateInp: TensorHandle;
  /** {n_embd, n_ff_exp, n_expert}. */
  gateExps: TensorHandle;
  /** {n_embd, n_ff_exp, n_expert}. */
  upExps: TensorHandle;
  /** {n_ff_exp, n_embd, n_expert}, as llama.cpp stores it (dense path). */
  downExps?: TensorHandle;
  /** {n_embd, n_ff_exp, n_expert}: each expert's down projection neuron-major (sparse path). */
  downExpsT?: TensorHandle;
  /** Per-expert predictors (`blk.N.fc1_exps.weight` {n_embd, r, n_expert}, `fc2_exps` {r, n_ff_exp, n_expert}). */
  fc1Exps?: TensorHandle;
  fc2Exps?: TensorHandle;
}

/** How {@link moeFfn} chooses the neurons of the chosen experts. */
export type MoeSparsity =
  | { mode: "off" }
  | { mode: "oracle" }
  /** x: the predictors' input (the residual before ffn_norm); a neuron runs when its logit ≥ threshold. */
  | { mode: "predictor"; x: TensorId; threshold: number };

/**
 * The router: p = gating(W_gate_inp·r) over the n_expert experts (softmax, or an independent sigmoid) and
 * the n_expert_used largest per column. r [n_embd, T] → probs [n_expert, T] (f32), ids [n_expert_used, T] (i32).
 * SmallThinker's router reads the layer input, so its graph computes this before attention: a backend
 * that fetches experts from storage starts reading them while attention runs.
 */
export function routeExperts(
  g: Graph,
  cfg: ModelConfig,
  W: ExpertWeights,
  routerInput: TensorId,
): { probs: TensorId; ids: TensorId } {
  const moe = cfg.moe!;
  const logits = g.mulMat(g.handle(W.gateInp), routerInput);
  const probs = moe.gating === "softmax" ? g.softmax(logits) : g.sigmoid(logits);
  return { probs, ids: g.topK(probs, moe.n_expert_used) };
}

/**
 * Routed experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; llama.cpp's `build_moe_ffn`):
 * p = gating(W_gate_inp·r) over the n_expert experts (softmax, or an independent sigmoid), the
 * n_expert_used largest chosen per token, each chosen expert's FFN act(W_gate_e·h) ⊙ (W_up_e·h) (dReLU:
 * ReLU(W_gate_e·h) ⊙ ReLU(W_up_e·h), TurboSparse) then
 * W_down_e, summed with weights p_e (divided by their sum over the chosen when `norm_weights`).
 * `routerInput` r is h (the FFN input after ffn_norm) for llama and qwen3moe, the layer input before
 * attn_norm for SmallThinker.
 *
 * Sparse ("oracle", ReLU experts only): the gate W_gate_e·h is computed densely for the chosen experts,
 * and up reads only the neurons whose gate is > 0 (exact for ReLU: every skipped neuron's output is 0);
 * down does too when stored neuron-major (`downExpsT`), else (`downExps`, a quantized stack: see
 * expertDownNeuronMajor) it runs densely over the activations, whose skipped entries are 0.
 * Sparse ("predictor"): each chosen expert's predictor fc2_e·ReLU(fc1_e·x) (PowerInfer's form, per expert)
 * gives a logit per neuron [n_ff_exp, n_expert_used, T]; the gate reads only the neurons whose logit is
 * ≥ the threshold (the others' activations are 0), then up and down only those of them whose gate is > 0,
 * as in oracle mode.
 * `routed`: the router's result when already computed ({@link routeExperts}; SmallThinker computes it
 * before attention).
 * @returns the FFN output [n_embd, T], the router probabilities [n_expert, T], the chosen experts' gate
 *   pre-activations [n_ff_exp, n_expert_used, T] (predictor mode: only predicted rows are computed, the
 *   others are 0) and the graph node indices of the sparse expert ops (empty when dense; up first — in
 *   predictor mode gate, then up — then down when it is sparse).
 */
export function moeFfn(
  g: Graph,
  cfg: ModelConfig,
  W: ExpertWeights,
  h: TensorId,
  routerInput: TensorId,
  sparsity: MoeSparsity,
  routed?: { probs: TensorId; ids: TensorId },
): { out: TensorId; probs: TensorId; gate: TensorId; sparseNodes: number[] } {
  const moe = cfg.moe!;
  const { probs, ids } = routed ?? routeExperts(g, cfg, W, routerInput);
  const act = (t: TensorId) =>
    cfg.ffn.activation === "silu" ? g.silu(t) : cfg.ffn.activation === "gelu" ? g.gelu(t) : g.relu(t);
  let down: TensorId;
  const sparseNodes: number[] = [];
  // dReLU experts (TurboSparse-Mixtral): ReLU on the up branch too
  const upAct = (t: TensorId) => (cfg.ffn.up_activation === "relu" ? g.relu(t) : t);
  let gate: TensorId;
  if (sparsity.mode === "off") {
    gate = g.mulMatId(g.handle(W.gateExps), h, ids);
    const up = upAct(g.mulMatId(g.handle(W.upExps), h, ids));
    const a = g.mul(act(gate), up);
    down = W.downExps ? g.mulMatId(g.handle(W.downExps), a, ids) : g.axpyIdSparse(g.handle(W.downExpsT!), a, ids, {});
  } else {
    // which neurons run: the predictors' logits ≥ the threshold, or (oracle) the dense gate > 0
    if (sparsity.mode === "predictor") {
      const hid = g.relu(g.mulMatId(g.handle(W.fc1Exps!), sparsity.x, ids));
      const predicted = { logits: g.mulMatId(g.handle(W.fc2Exps!), hid, ids), threshold: sparsity.threshold };
      gate = g.mulMatIdSparse(g.handle(W.gateExps), h, ids, predicted);
      sparseNodes.push(g.nodes.length - 1);
    } else {
      gate = g.mulMatId(g.handle(W.gateExps), h, ids);
    }
    // up and down: only the rows whose gate is > 0 (in predictor mode a subset of the predicted ones)
    const sel = { logits: gate, threshold: F32_MIN_POSITIVE };
    const up = g.mulMatIdSparse(g.handle(W.upExps), h, ids, sel);
    sparseNodes.push(g.nodes.length - 1);
    const a = g.mul(g.relu(gate), upAct(up));
    if (W.downExpsT) {
      down = g.axpyIdSparse(g.handle(W.downExpsT), a, ids, sel);
      sparseNodes.push(g.nodes.length - 1);
    } else {
      down = g.mulMatId(g.handle(W.downExps!), a, ids);
    }
  }
  const out = g.moeSum(down, probs, ids, { norm: moe.norm_weights, scale: moe.weights_scale });
  return { out, probs, gate, sparseNodes };
}
