/**
 * Small synthetic models with routed experts (and the dense Qwen layouts that share their blocks), in
 * llama.cpp's GGUF layout, for verifying the graphs against llama.cpp and for slices of real shapes.
 *
 * Weights are seeded Gaussians ({@link gauss}): projections scaled by 1/√fan_in, norms 1 + 0.1·N(0,1),
 * biases 0.1·N(0,1). The router `ffn_gate_inp` is always F32 (llama.cpp's quantizer keeps it F32); the
 * other 2-D and 3-D weights take `dtype`. Tensor names and shapes are llama.cpp's:
 * `blk.N.ffn_gate_inp.weight` {n_embd, n_expert}, `blk.N.ffn_{gate,up}_exps.weight`
 * {n_embd, n_ff_exp, n_expert}, `blk.N.ffn_down_exps.weight` {n_ff_exp, n_embd, n_expert}; Qwen adds
 * `attn_{q,k,v}.bias` (qwen2) or `attn_{q,k}_norm.weight` {head_dim} (qwen3, qwen3moe).
 */
import { type GgufMetadataEntry, type GgufTensorSpec, GgufTypes, writeGguf } from "@powerinfer/gguf";
import { encode, encodedBytes, GGML_TYPE_OF, type SyntheticDType } from "./encode.js";
import { gauss, streamKey } from "./random.js";
import { syntheticVocab, vocabMetadataFromGguf } from "./vocab.js";

/** Architectures {@link generateSyntheticMoeModel} writes. `llama-moe` is `llama` with experts (Mixtral's layout). */
export type SyntheticMoeArch = "llama-moe" | "qwen3moe" | "qwen2" | "qwen3" | "smallthinker";

export const SYNTHETIC_MOE_ARCHS: readonly SyntheticMoeArch[] = [
  "llama-moe",
  "qwen3moe",
  "qwen2",
  "qwen3",
  "smallthinker",
];

/** Shape of a model with routed experts (dense archs ignore the expert fields). */
export interface SyntheticMoeShape {
  n_embd: number;
  /** Dense FFN size (qwen2/qwen3), or `{arch}.feed_forward_length` written for qwen3moe. */
  n_ff: number;
  /** Neurons per expert. */
  n_ff_exp: number;
  n_expert: number;
  n_expert_used: number;
  n_head: number;
  n_head_kv: number;
  /** Per-head dimension; default n_embd / n_head. */
  head_dim?: number;
  n_layer: number;
  n_ctx: number;
}

/**
 * Real shapes, from each model's published configuration (Hugging Face `config.json`):
 * - `qwen3-30b-a3b` (Qwen/Qwen3-30B-A3B): hidden_size 2048, intermediate_size 6144, moe_intermediate_size
 *   768, num_experts 128, num_experts_per_tok 8, num_attention_heads 32, num_key_value_heads 4, head_dim
 *   128, num_hidden_layers 48, max_position_embeddings 40960.
 * - `mixtral-8x7b` (mistralai/Mixtral-8x7B-v0.1): hidden_size 4096, intermediate_size 14336,
 *   num_local_experts 8, num_experts_per_tok 2, num_attention_heads 32, num_key_value_heads 8,
 *   num_hidden_layers 32, max_position_embeddings 32768.
 * - `smallthinker-4b-a0.6b` (PowerInfer/SmallThinker-4BA0.6B-Instruct, config.json at b51db6d): hidden_size
 *   1536, moe_ffn_hidden_size 768, moe_num_primary_experts 32, moe_num_active_primary_experts 4,
 *   num_attention_heads 12, num_key_value_heads 2, head_dim 128, num_hidden_layers 32,
 *   max_position_embeddings 32768, sliding_window_size 4096.
 */
export const MOE_SHAPE_PRESETS = {
  "qwen3-30b-a3b": {
    arch: "qwen3moe",
    shape: {
      n_embd: 2048,
      n_ff: 6144,
      n_ff_exp: 768,
      n_expert: 128,
      n_expert_used: 8,
      n_head: 32,
      n_head_kv: 4,
      head_dim: 128,
      n_layer: 48,
      n_ctx: 40960,
    },
  },
  "mixtral-8x7b": {
    arch: "llama-moe",
    shape: {
      n_embd: 4096,
      n_ff: 14336,
      n_ff_exp: 14336,
      n_expert: 8,
      n_expert_used: 2,
      n_head: 32,
      n_head_kv: 8,
      n_layer: 32,
      n_ctx: 32768,
    },
  },
  "smallthinker-4b-a0.6b": {
    arch: "smallthinker",
    shape: {
      n_embd: 1536,
      n_ff: 768,
      n_ff_exp: 768,
      n_expert: 32,
      n_expert_used: 4,
      n_head: 12,
      n_head_kv: 2,
      head_dim: 128,
      n_layer: 32,
      n_ctx: 32768,
    },
  },
} as const satisfies Record<string, { arch: SyntheticMoeArch; shape: SyntheticMoeShape }>;

export type MoeShapePreset = keyof typeof MOE_SHAPE_PRESETS;

/**
 * Parameters one token reads in a model with routed experts: attention, router and the n_expert_used
 * chosen experts of every layer, plus the output matrix (token_embd is a row lookup and is not counted).
 * Dense archs: every FFN parameter.
 */
export function activeParametersPerToken(arch: SyntheticMoeArch, s: SyntheticMoeShape, n_vocab: number): number {
  const hd = s.head_dim ?? s.n_embd / s.n_head;
  const attn = s.n_embd * hd * (2 * s.n_head + 2 * s.n_head_kv);
  const moe = arch === "llama-moe" || arch === "qwen3moe" || arch === "smallthinker";
  const ffn = moe ? s.n_embd * s.n_expert + s.n_expert_used * 3 * s.n_embd * s.n_ff_exp : 3 * s.n_embd * s.n_ff;
  return s.n_layer * (attn + ffn) + s.n_embd * n_vocab;
}

/** Options of {@link generateSyntheticMoeModel}. */
export interface SyntheticMoeOptions {
  arch: SyntheticMoeArch;
  shape: SyntheticMoeShape;
  /** Layers to write (a slice). Default shape.n_layer. */
  layers?: number;
  /** Weight type of projections and experts. Default "F32". */
  dtype?: SyntheticDType;
  /** Synthetic SPM vocabulary size (default 512), or a GGUF to copy the vocabulary from. */
  vocabSize?: number;
  vocabFrom?: string;
  /** Write output.weight (default true); false ties the output to token_embd. */
  untiedOutput?: boolean;
  seed?: number;
  /** smallthinker: `expert_gating_func` written (1 softmax, 2 sigmoid). Default "softmax". */
  gating?: "softmax" | "sigmoid";
  /** smallthinker: `attention.sliding_window` written (llama.cpp then uses 4096 on 3 layers of 4). Default 0 (none). */
  slidingWindow?: number;
}

/** What was written. */
export interface SyntheticMoeReport {
  path: string;
  ggufArch: "llama" | "qwen3moe" | "qwen2" | "qwen3" | "smallthinker";
  n_vocab: number;
  layers: number;
  bytes: number;
}

/**
 * Writes a synthetic model (see the module comment).
 * @throws RangeError for a shape that does not fit the arch or the dtype's block size.
 */
export function generateSyntheticMoeModel(path: string, o: SyntheticMoeOptions): SyntheticMoeReport {
  const s = o.shape;
  const dtype = o.dtype ?? "F32";
  const seed = o.seed ?? 1;
  const layers = o.layers ?? s.n_layer;
  const hd = s.head_dim ?? s.n_embd / s.n_head;
  if (!Number.isInteger(hd)) throw new RangeError(`n_head ${s.n_head} does not divide n_embd ${s.n_embd}`);
  if (s.n_head % s.n_head_kv !== 0) throw new RangeError(`n_head_kv ${s.n_head_kv} does not divide n_head ${s.n_head}`);
  const moe = o.arch === "llama-moe" || o.arch === "qwen3moe" || o.arch === "smallthinker";
  if (moe && !(s.n_expert_used >= 1 && s.n_expert_used <= s.n_expert)) {
    throw new RangeError(`n_expert_used ${s.n_expert_used} must be in 1..n_expert ${s.n_expert}`);
  }
  const arch = o.arch === "llama-moe" ? "llama" : o.arch;
  const vocab = o.vocabFrom ? vocabMetadataFromGguf(o.vocabFrom) : syntheticVocab(o.vocabSize ?? 512);
  const tokens = vocab.find((e) => e.key === "tokenizer.ggml.tokens")!.value as string[];
  const V = tokens.length;
  const E = s.n_embd;
  const dH = hd * s.n_head;
  const dKv = hd * s.n_head_kv;
  const u32 = (key: string, value: number): GgufMetadataEntry => ({
    key: `${arch}.${key}`,
    type: GgufTypes.u32,
    value,
  });
  const meta: GgufMetadataEntry[] = [
    { key: "general.architecture", type: GgufTypes.string, value: arch },
    { key: "general.name", type: GgufTypes.string, value: `synthetic ${o.arch}` },
    u32("context_length", s.n_ctx),
    u32("embedding_length", E),
    u32("block_count", layers),
    u32("feed_forward_length", o.arch === "llama-moe" ? s.n_ff_exp : s.n_ff),
    u32("attention.head_count", s.n_head),
    u32("attention.head_count_kv", s.n_head_kv),
    u32("attention.key_length", hd),
    u32("attention.value_length", hd),
    u32("rope.dimension_count", hd),
    { key: `${arch}.rope.freq_base`, type: GgufTypes.f32, value: arch === "llama" ? 10000 : 1000000 },
    { key: `${arch}.attention.layer_norm_rms_epsilon`, type: GgufTypes.f32, value: 1e-6 },
  ];
  if (moe) {
    meta.push(u32("expert_count", s.n_expert), u32("expert_used_count", s.n_expert_used));
    if (o.arch !== "llama-moe") meta.push(u32("expert_feed_forward_length", s.n_ff_exp));
    if (o.arch === "smallthinker") {
      meta.push(u32("expert_gating_func", o.gating === "sigmoid" ? 2 : 1));
      if (o.slidingWindow) meta.push(u32("attention.sliding_window", o.slidingWindow));
    }
  }
  meta.push(...vocab);

  const tensors: GgufTensorSpec[] = [];
  let ti = 0;
  /** A tensor of values base + scale·N(0,1), seeded by (seed, tensor index). */
  const add = (name: string, shape: number[], scale: number, type: SyntheticDType, base = 0) => {
    const key = streamKey(seed, ti++);
    const n = shape.reduce((a, b) => a * b, 1);
    if (n % GGML_BLOCK[type] !== 0 || shape[0]! % GGML_BLOCK[type] !== 0) {
      throw new RangeError(`${name}: row length ${shape[0]} is not a multiple of the ${type} block size`);
    }
    tensors.push({
      name,
      type: GGML_TYPE_OF[type],
      shape,
      data: () => {
        const v = new Float32Array(n);
        for (let i = 0; i < n; i++) v[i] = base + scale * gauss(key, i);
        const out = new Uint8Array(encodedBytes(type, n));
        encode(type, v, out);
        return out;
      },
    });
  };
  add("token_embd.weight", [E, V], 1, dtype);
  for (let l = 0; l < layers; l++) {
    const p = `blk.${l}.`;
    add(`${p}attn_norm.weight`, [E], 0.1, "F32", 1);
    add(`${p}attn_q.weight`, [E, dH], 1 / Math.sqrt(E), dtype);
    add(`${p}attn_k.weight`, [E, dKv], 1 / Math.sqrt(E), dtype);
    add(`${p}attn_v.weight`, [E, dKv], 1 / Math.sqrt(E), dtype);
    if (o.arch === "qwen2") {
      add(`${p}attn_q.bias`, [dH], 0.1, "F32");
      add(`${p}attn_k.bias`, [dKv], 0.1, "F32");
      add(`${p}attn_v.bias`, [dKv], 0.1, "F32");
    }
    if (o.arch === "qwen3" || o.arch === "qwen3moe") {
      add(`${p}attn_q_norm.weight`, [hd], 0.1, "F32", 1);
      add(`${p}attn_k_norm.weight`, [hd], 0.1, "F32", 1);
    }
    add(`${p}attn_output.weight`, [dH, E], 1 / Math.sqrt(dH), dtype);
    add(`${p}ffn_norm.weight`, [E], 0.1, "F32", 1);
    if (moe) {
      const { n_expert: X, n_ff_exp: F } = s;
      add(`${p}ffn_gate_inp.weight`, [E, X], 1 / Math.sqrt(E), "F32");
      add(`${p}ffn_gate_exps.weight`, [E, F, X], 1 / Math.sqrt(E), dtype);
      add(`${p}ffn_up_exps.weight`, [E, F, X], 1 / Math.sqrt(E), dtype);
      add(`${p}ffn_down_exps.weight`, [F, E, X], 1 / Math.sqrt(F), dtype);
    } else {
      add(`${p}ffn_gate.weight`, [E, s.n_ff], 1 / Math.sqrt(E), dtype);
      add(`${p}ffn_up.weight`, [E, s.n_ff], 1 / Math.sqrt(E), dtype);
      add(`${p}ffn_down.weight`, [s.n_ff, E], 1 / Math.sqrt(s.n_ff), dtype);
    }
  }
  add("output_norm.weight", [E], 0.1, "F32", 1);
  if (o.untiedOutput ?? true) add("output.weight", [E, V], 1 / Math.sqrt(E), dtype);
  writeGguf(path, { metadata: meta, tensors });
  let bytes = 0;
  for (const t of tensors)
    bytes += encodedBytes(
      typeOfGgml(t.type),
      t.shape.reduce((a, b) => a * b, 1),
    );
  return { path, ggufArch: arch, n_vocab: V, layers, bytes };
}

const GGML_BLOCK: Record<SyntheticDType, number> = { F32: 1, F16: 1, BF16: 1, Q8_0: 32, Q4_0: 32, Q4_K: 256 };

function typeOfGgml(t: number): SyntheticDType {
  return (Object.keys(GGML_TYPE_OF) as SyntheticDType[]).find((d) => GGML_TYPE_OF[d] === t)!;
}
