/**
 * Building blocks of the Llama-family graph shared by the single-backend graph and the hybrid
 * (device + CPU) scheduler.
 */
import type { ModelConfig } from "@powerinfer/gguf";
import { type Graph, ROPE_NEOX, ROPE_NORMAL, type TensorId } from "../backend/graph.js";
import type { TensorHandle } from "../backend/types.js";

/** Smallest positive float32: "gate ≥ this" is "gate > 0" (the oracle mask). */
export const F32_MIN_POSITIVE = 1.401298464324817e-45;

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
  const rope = {
    headDim: cfg.head_dim,
    nDims: cfg.n_rot,
    mode: cfg.rope.type === "neox" ? ROPE_NEOX : ROPE_NORMAL,
    freqBase: cfg.rope.freq_base,
    freqScale: cfg.rope.freq_scale,
  };
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
 * [n_ff, T] gate already computed (oracle mode), replaces the gate projection.
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
