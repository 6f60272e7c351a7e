/** Shapes of the models the synthetic generator imitates (tensor shapes of the published checkpoints). */

/** Hyper-parameters that fix every tensor shape. */
export interface SyntheticShape {
  n_embd: number;
  n_ff: number;
  n_head: number;
  n_head_kv: number;
  /** Layers of the full model (a generated slice may have fewer). */
  n_layer: number;
  /** Trained context written to the file. */
  n_ctx: number;
}

export type SyntheticArch = "llama" | "relu-llama" | "bamboo" | "falcon" | "opt";

export const SYNTHETIC_ARCHS: readonly SyntheticArch[] = ["llama", "relu-llama", "bamboo", "falcon", "opt"];

export type ShapePreset = "tiny" | "7b" | "13b" | "40b" | "70b";

/**
 * - `7b`: Llama-2-7B / ReLU-Llama-7B (no GQA); `13b`: Llama-2-13B; `70b`: Llama-2-70B (GQA, 8 KV heads);
 * - `40b`: Falcon-40B / ReluFalcon-40B (GQA, 8 KV heads, n_ff = 4·n_embd, parallel attention, no gate);
 * - `tiny`: a few-MiB model for tests and smoke runs.
 */
export const SHAPE_PRESETS: Record<ShapePreset, SyntheticShape & { arch: SyntheticArch }> = {
  tiny: { n_embd: 256, n_ff: 1024, n_head: 4, n_head_kv: 2, n_layer: 2, n_ctx: 512, arch: "relu-llama" },
  "7b": { n_embd: 4096, n_ff: 11008, n_head: 32, n_head_kv: 32, n_layer: 32, n_ctx: 4096, arch: "relu-llama" },
  "13b": { n_embd: 5120, n_ff: 13824, n_head: 40, n_head_kv: 40, n_layer: 40, n_ctx: 4096, arch: "relu-llama" },
  "40b": { n_embd: 8192, n_ff: 32768, n_head: 128, n_head_kv: 8, n_layer: 60, n_ctx: 2048, arch: "falcon" },
  "70b": { n_embd: 8192, n_ff: 28672, n_head: 64, n_head_kv: 8, n_layer: 80, n_ctx: 4096, arch: "relu-llama" },
};

export const SHAPE_PRESET_NAMES = Object.keys(SHAPE_PRESETS) as ShapePreset[];
