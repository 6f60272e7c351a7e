/**
 * One layer recipe per architecture, over the shared blocks of `../layer.ts`. A new architecture adds its
 * file here and its entry below.
 */
import type { TensorId } from "@powerinfer/core";
import type { LlamaLayerWeights } from "../llama.js";
import type { LayerContext } from "../layer.js";
import { falconLayer } from "./falcon.js";
import { llamaLayer } from "./llama.js";

export type LayerBuilder = (ctx: LayerContext, l: number, L: LlamaLayerWeights, x: TensorId) => TensorId;

/** The layer builder of each architecture the engine runs (the names of `general.architecture`). */
export const LAYER_BUILDERS: Readonly<Record<string, LayerBuilder>> = {
  llama: llamaLayer,
  bamboo: llamaLayer,
  opt: llamaLayer,
  qwen2: llamaLayer,
  qwen3: llamaLayer,
  qwen3moe: llamaLayer,
  smallthinker: llamaLayer,
  falcon: falconLayer,
};
