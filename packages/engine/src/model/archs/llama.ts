/**
 * The sequential pre-norm layer (llama.cpp's `llm_build_llama` and kin): x → norm → self-attention →
 * + x → norm → FFN → + residual. Used by `llama` (Llama 2, ReLU-Llama, ProSparse, Mixtral's routed experts),
 * `bamboo` (ReLU(gate)·ReLU(up)), `opt` (layer norms with biases; learned positions are added before the
 * first layer), `qwen2` (Q/K/V biases), `qwen3` and `qwen3moe` (per-head Q/K norms) and `smallthinker`
 * (router on the layer input, NoPE and sliding-window layers): those differences live in the weights and
 * the configuration the shared blocks read.
 */
import type { TensorId } from "@powerinfer/core";
import type { LlamaLayerWeights } from "../llama.js";
import { routeExperts } from "../blocks.js";
import { feedForward, type LayerContext, lastLayerRows, normed, selfAttention } from "../layer.js";

/** One sequential layer on x [n_embd, T]; returns the layer's output. */
export function llamaLayer(ctx: LayerContext, l: number, L: LlamaLayerWeights, x: TensorId): TensorId {
  const { g, cfg } = ctx;
  // a router on the layer input (SmallThinker) runs first, so a backend that reads experts from storage
  // has their reads in flight during attention; a layer split with a device routes in its own pieces
  ctx.earlyRoute =
    L.experts && cfg.moe?.router_input === "layer_input" && !ctx.offload?.[l]
      ? routeExperts(g, cfg, L.experts, lastLayerRows(ctx, l, [x])[0]!)
      : undefined;
  // look-ahead: the next layer's router on this layer's input guesses its experts; the CPU backend queues
  // their reads now (this top_k routes nothing and is never read), a layer ahead of the router that decides
  if (ctx.lookAhead && ctx.earlyRoute && !ctx.offload?.[l + 1]) routeExperts(g, cfg, ctx.lookAhead, x);
  const h = normed(ctx, x, L.attnNorm, L.attnNormB);
  const [attnOut, xr] = lastLayerRows(ctx, l, [selfAttention(ctx, l, L, h, h), x]);
  const ffnInp = g.add(attnOut, xr);
  const down = feedForward(ctx, L, normed(ctx, ffnInp, L.ffnNorm!, L.ffnNormB), ffnInp, xr);
  // llama.cpp's order: ffn + (attn + x)
  return g.add(down, ffnInp);
}
