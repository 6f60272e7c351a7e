/**
 * Falcon's parallel layer (llama.cpp's `llm_build_falcon`): attention and FFN both read the normed layer
 * input and their outputs are summed with it. Falcon-7B normalises once (attn_norm); Falcon-40B gives
 * attention its own norm (attn_norm_2) while the FFN reads attn_norm's. Q, K and V come from one fused
 * matrix (attn_qkv). ReLU-Falcon runs sparse like the others; its predictor reads the layer input.
 */
import type { TensorId } from "@powerinfer/core";
import type { LlamaLayerWeights } from "../llama.js";
import { feedForward, type LayerContext, lastLayerRows, normed, selfAttention } from "../layer.js";

/** One parallel layer on x [n_embd, T]; returns the layer's output. */
export function falconLayer(ctx: LayerContext, l: number, L: LlamaLayerWeights, x: TensorId): TensorId {
  const { g } = ctx;
  const h = normed(ctx, x, L.attnNorm, L.attnNormB);
  const attnIn = L.attnNorm2 ? normed(ctx, x, L.attnNorm2, L.attnNorm2B) : h;
  const [attnOut, hr, xr] = lastLayerRows(ctx, l, [selfAttention(ctx, l, L, h, attnIn), h, x]);
  const down = feedForward(ctx, L, hr, xr, xr);
  // llama.cpp's order: (ffn + attn) + x
  return g.add(g.add(down, attnOut), xr);
}
