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

/**
 * A SmallThinker-layout shape for the designed-statistics tests (16 experts of 256 neurons, 4 per token,
 * n_embd 256, 4 layers): enough neurons and experts for firing and routing statistics.
 */
export const DESIGN_MOE_SHAPE: SyntheticMoeShape = {
  n_embd: 256,
  n_ff: 256,
  n_ff_exp: 256,
  n_expert: 16,
  n_expert_used: 4,
  n_head: 4,
  n_head_kv: 2,
  head_dim: 64,
  n_layer: 4,
  n_ctx: 512,
};
