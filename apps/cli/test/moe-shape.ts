/** The small routed-expert shape the CLI tests generate models of (8 experts of 64 neurons, 2 per token). */
import type { SyntheticMoeShape } from "@powerinfer/synthetic";

export const TINY_MOE_SHAPE: SyntheticMoeShape = {
  n_embd: 64,
  n_ff: 96,
  n_ff_exp: 64,
  n_expert: 8,
  n_expert_used: 2,
  n_head: 4,
  n_head_kv: 2,
  n_layer: 2,
  n_ctx: 256,
};
