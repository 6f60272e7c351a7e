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
}

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
): { graph: Graph; logits: Float32Array } {
  const T = tokens.length;
  if (nPast + T > kv.nCtx) {
    throw new EngineError("CONTEXT_FULL", `context full: ${nPast} tokens in the cache + ${T} new > n_ctx ${kv.nCtx}`);
  }
  const g = new Graph();
  const eps = cfg.norm.eps;
  const rope = {
    headDim: cfg.head_dim,
    nDims: cfg.n_rot,
    mode: cfg.rope.type === "neox" ? ROPE_NEOX : ROPE_NORMAL,
    freqBase: cfg.rope.freq_base,
    freqScale: cfg.rope.freq_scale,
  };
  const pos = g.input(
    "i32",
    [T],
    Int32Array.from({ length: T }, (_, i) => nPast + i),
  );
  const ids = g.input("i32", [T], tokens);
  let x: TensorId = g.getRows(g.handle(w.tokEmbd), ids);
  const act = cfg.ffn.activation;
  if (act !== "silu" && act !== "relu" && act !== "gelu") {
    throw new EngineError("UNSUPPORTED_ARCH", `FFN activation ${act} is not supported`);
  }
  for (let l = 0; l < w.layers.length; l++) {
    const L = w.layers[l]!;
    let h = g.mul(g.rmsNorm(x, eps), g.handle(L.attnNorm));
    const q = g.rope(g.mulMat(g.handle(L.wq), h), pos, rope);
    const k = g.rope(g.mulMat(g.handle(L.wk), h), pos, rope);
    const v = g.mulMat(g.handle(L.wv), h);
    const kc = g.cpy(k, g.handle(kv.k[l]!), nPast);
    const vc = g.cpy(v, g.handle(kv.v[l]!), nPast);
    const att = g.attention(q, kc, vc, {
      headDim: cfg.head_dim,
      nHead: cfg.n_head,
      nHeadKv: cfg.n_head_kv,
      nPast,
      scale: 1 / Math.sqrt(cfg.head_dim),
    });
    const ffnInp = g.add(g.mulMat(g.handle(L.wo), att), x);
    h = g.mul(g.rmsNorm(ffnInp, eps), g.handle(L.ffnNorm));
    let up = g.mulMat(g.handle(L.ffnUp), h);
    if (cfg.ffn.up_activation === "relu") up = g.relu(up);
    let a: TensorId;
    if (L.ffnGate) {
      const gate = g.mulMat(g.handle(L.ffnGate), h);
      const ga = act === "silu" ? g.silu(gate) : act === "relu" ? g.relu(gate) : g.gelu(gate);
      a = g.mul(ga, up);
    } else {
      a = act === "silu" ? g.silu(up) : act === "relu" ? g.relu(up) : g.gelu(up);
    }
    const down = L.ffnDownT ? g.axpySparse(g.handle(L.ffnDownT), a, {}) : g.mulMat(g.handle(L.ffnDown!), a);
    x = g.add(down, ffnInp);
  }
  if (!opts.allLogits && T > 1) x = g.getRows(x, g.input("i32", [1], Int32Array.of(T - 1)));
  const out = g.mul(g.rmsNorm(x, eps), g.handle(w.outputNorm));
  const logitsT = g.mulMat(g.handle(w.output), out);
  const logits = g.output(logitsT);
  return { graph: g, logits };
}
