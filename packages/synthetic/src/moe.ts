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
 *
 * With {@link SyntheticMoeOptions.design} (gen-model's default for the expert presets) the weights carry
 * designed routing and firing statistics, built as the dense generator builds its (generator.ts):
 * - a massive activation: channel 0 of every token embedding is M (default 100), channels 1..31 are 0
 *   (its Q4_0/Q8_0 block holds nothing else), the others N(0, 1); no attention or expert output writes
 *   channels 0..31, so x_0 = M in every layer and a weight on channel 0 acts as a bias;
 * - expert popularity: the router's channel-0 weight gives expert e the logit bias −s·ln(r_e) (r_e its
 *   rank 1..n_expert, a seeded permutation per layer) on top of a unit-variance input-dependent term:
 *   under Gumbel noise the top-1 shares would be exactly Zipf, ∝ r^−s; with this Gaussian term they are
 *   Zipf-like. Default s = 1 — an assumption (no published measurement of these models' expert counts
 *   was found); see {@link moeRoutingProbabilities} for the shares the design implies;
 * - power-law firing inside ReLU experts (smallthinker's ReGLU): neuron i of expert e fires with a
 *   designed frequency p_i from {@link powerLawFrequencies} (mean `active`, `hot` of the neurons covering
 *   80 % of firings, permuted per expert), via the gate bias Φ⁻¹(p_i) on channel 0 plus a unit-variance
 *   Gaussian term. Default active fraction 0.4: SmallThinker's report says over 60 % of the neurons of the
 *   activated experts are idle per token (SmallThinker technical report, Shanghai Jiao Tong University
 *   and Zenergize AI, 2025, as summarised at https://ztoog.com/meet-smallthinker-a-family-of-efficient-
 *   large-language-models-llms-natively-trained-for-local-deployment); hot share 0.5 — an assumption (at
 *   a mean of 0.4 at least a third of the neurons must fire to cover 80 %, so the dense generator's 0.25
 *   cannot hold). SiLU experts get no biases (they do not fire sparsely);
 * - the input-dependent term of a ReLU expert's gate is α·(a low-rank part, rank r − 1 per expert) +
 *   β·(a dense random row), α² + β² = 1 (default β² = 0.1, rank 64): per-expert predictors can see the
 *   low-rank part and nothing else ({@link lowRankDesign}); {@link SyntheticMoeOptions.predictors} writes
 *   them (`blk.N.fc1_exps` / `fc2_exps`) with a threshold for a target recall;
 * - attention and expert outputs are scaled to add at most about 1 % of the residual variance each,
 *   so the statistics hold through the layers of a slice.
 */
import { type GgufMetadataEntry, type GgufTensorSpec, GgufTypes, writeGguf } from "@powerinfer/gguf";
import { encode, encodedBytes, GGML_TYPE_OF, type SyntheticDType } from "./encode.js";
import { gauss, hashU32, streamKey } from "./random.js";
import { normalQuantile, powerLawFrequencies, reluSecondMoment } from "./stats-math.js";
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
 * - `smallthinker-21b-a3b` (SJTU-IPADS/SmallThinker README, "Model Summary"): hidden size 2560, 52 layers,
 *   28 attention heads, 4 KV heads, 64 experts of 768 neurons, 6 per token, vocabulary 151,936, context 16K.
 *   head_dim is not in that table (2560 / 28 is no integer); 128, the 4B model's, is assumed.
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
  "smallthinker-21b-a3b": {
    arch: "smallthinker",
    shape: {
      n_embd: 2560,
      n_ff: 768,
      n_ff_exp: 768,
      n_expert: 64,
      n_expert_used: 6,
      n_head: 28,
      n_head_kv: 4,
      head_dim: 128,
      n_layer: 52,
      n_ctx: 16384,
    },
  },
} as const satisfies Record<string, { arch: SyntheticMoeArch; shape: SyntheticMoeShape }>;

export type MoeShapePreset = keyof typeof MOE_SHAPE_PRESETS;

/**
 * Parameters one token reads in a model with routed experts: attention (with qwen2's q/k/v biases and
 * qwen3's q/k norms), the two norms, router and the n_expert_used chosen experts of every layer, plus the
 * output norm and matrix (token_embd is a row lookup and is not counted) — what `inspect` counts from the
 * file. Dense archs: every FFN parameter.
 */
export function activeParametersPerToken(arch: SyntheticMoeArch, s: SyntheticMoeShape, n_vocab: number): number {
  const hd = s.head_dim ?? s.n_embd / s.n_head;
  const attn = s.n_embd * hd * (2 * s.n_head + 2 * s.n_head_kv);
  const extra =
    arch === "qwen2" ? hd * (s.n_head + 2 * s.n_head_kv) : arch === "qwen3" || arch === "qwen3moe" ? 2 * hd : 0;
  const moe = arch === "llama-moe" || arch === "qwen3moe" || arch === "smallthinker";
  const ffn = moe ? s.n_embd * s.n_expert + s.n_expert_used * 3 * s.n_embd * s.n_ff_exp : 3 * s.n_embd * s.n_ff;
  return s.n_layer * (attn + extra + 2 * s.n_embd + ffn) + s.n_embd + s.n_embd * n_vocab;
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
  /** Designed routing and firing statistics (see the module comment); absent: plain Gaussian weights. */
  design?: MoeActivityDesign;
  /**
   * llama-moe only: "relu" makes the experts dReLU, ReLU(gate)·ReLU(up) (TurboSparse-Mixtral), written as
   * `powerinfer.ffn_up_activation = "relu"` (llama.cpp cannot run such a file). With a design the gates
   * fire at the designed frequencies; ReLU(up), whose input term is unbiased, passes half of those.
   */
  upActivation?: "relu";
  /**
   * Write per-expert predictors ({@link MoePredictorOptions}); needs `design` and ReLU experts
   * (smallthinker, or llama-moe with upActivation "relu"). The weights are the same with or without them
   * (the predictor tensors come last and use their own random streams).
   */
  predictors?: MoePredictorOptions;
  /**
   * "PWRI": a PowerInfer-format file (PWRI magic) whose experts' down projections are stored neuron-major,
   * `blk.N.ffn_down_exps_t.weight` {n_embd, n_ff_exp, n_expert} (row i of expert e: neuron i's output
   * weights, quantized along n_embd), the layout sparse experts read row by row in any dtype. The values
   * are those of the GGUF's `ffn_down_exps` before quantization. ReLU experts only (smallthinker, or
   * llama-moe with upActivation "relu": a PWRI llama file is read as ReLU). Default "GGUF".
   */
  format?: "GGUF" | "PWRI";
}

/** Designed statistics of a model with routed experts (see the module comment). Every field optional. */
export interface MoeActivityDesign {
  /** Zipf exponent s of expert popularity (router bias −s·ln(rank)). Default 1 (an assumption). */
  zipf?: number;
  /** Mean fraction of a chosen ReLU expert's neurons firing per token. Default 0.4 (SmallThinker's report). */
  active?: number;
  /** Share of an expert's neurons covering 80 % of its firings. Default 0.5 (an assumption). */
  hot?: number;
  /** The massive channel's value M. Default 100. */
  massive?: number;
  /**
   * ReLU experts: rank r of the low-rank part of every gate (and of the predictors written with
   * {@link SyntheticMoeOptions.predictors}): r − 1 basis rows per (layer, expert) plus a bias row. Default 64 (n_embd − 32 when smaller)
   * (an assumption: no published predictor for these models; at n_embd 1536–2560 and 768 neurons per expert
   * an F16 predictor is about 4 % of an F16 expert's bytes).
   */
  predictorRank?: number;
  /** ReLU experts: share β² of each gate's input-dependent variance outside the low-rank part. Default 0.1. */
  predictorNoise?: number;
}

/**
 * Per-expert predictors written beside the experts (this project's layout; llama.cpp refuses a GGUF with
 * them): `blk.N.fc1_exps.weight` {n_embd, r, n_expert} and `blk.N.fc2_exps.weight` {r, n_ff_exp, n_expert},
 * each expert's fc2·ReLU(fc1·x) as PowerInfer's dense predictors (x = the residual before ffn_norm), and
 * `powerinfer.sparse_threshold`.
 */
export interface MoePredictorOptions {
  /** Weight type. Default F32 for F32 experts, Q8_0 for quantized ones, F16 otherwise. */
  dtype?: SyntheticDType;
  /** Threshold calibrated (on the design's distribution) to this recall of firing neurons. Default 0.95. */
  targetRecall?: number;
  /** Threshold given explicitly (overrides targetRecall). */
  threshold?: number;
}

/** Channels 0..31: the massive channel (0) and its quantization block, which nothing else uses. */
const RESERVED = 32;
/** Residual variance each attention or FFN output adds, relative to the layer input's (at most). */
const OUT_VAR = 0.01;
/** Low-rank components each ReLU expert neuron's gate uses (as the dense generator's). */
const COMPONENTS = 8;
/** fc1 offset keeping the predictor's ReLUs in their linear range (in standard deviations). */
const RELU_OFFSET = 4;

/** The resolved design of one model (same for the writer and for tests that check the statistics). */
export interface MoeDesignPlan {
  zipf: number;
  active: number;
  hot: number;
  massive: number;
  /** Whether the experts are ReLU-gated (designed firing). */
  relu: boolean;
  /** Low-rank design of ReLU gates: rank r (r − 1 basis rows and a bias row), m components per neuron, α² + β² = 1. */
  rank: number;
  components: number;
  alpha: number;
  beta: number;
  /** Router logit bias per (layer, expert): [layer · n_expert + e] = −zipf·ln(rank). */
  routerBias(l: number): Float64Array;
  /** Designed firing frequency per (layer, expert, neuron): [e · n_ff_exp + i]; all 0.5 (no bias) for SiLU experts. */
  firing(l: number): Float64Array;
}

/**
 * Resolves {@link MoeActivityDesign} for a shape (`drelu`: llama-moe with dReLU experts, whose gates fire by
 * design). @throws RangeError for out-of-range values.
 */
export function planMoeDesign(
  arch: SyntheticMoeArch,
  s: SyntheticMoeShape,
  seed: number,
  d: MoeActivityDesign = {},
  drelu = false,
): MoeDesignPlan {
  const zipf = d.zipf ?? 1;
  const active = d.active ?? 0.4;
  const hot = d.hot ?? 0.5;
  const massive = d.massive ?? 100;
  const rank = d.predictorRank ?? Math.min(64, s.n_embd - RESERVED);
  const noise = d.predictorNoise ?? 0.1;
  if (!Number.isInteger(rank) || rank < 2 || rank > s.n_embd - RESERVED) {
    throw new RangeError(
      `predictor rank ${rank} must be an integer in [2, ${s.n_embd - RESERVED}] (n_embd − ${RESERVED})`,
    );
  }
  if (!(noise >= 0 && noise <= 1)) throw new RangeError(`predictor noise ${noise} must be in [0, 1]`);
  if (!(zipf >= 0)) throw new RangeError(`zipf exponent ${zipf} must be ≥ 0`);
  if (!(massive > 0)) throw new RangeError(`massive value ${massive} must be positive`);
  if (s.n_embd < 2 * RESERVED)
    throw new RangeError(`n_embd ${s.n_embd} too small for a designed model (≥ ${2 * RESERVED})`);
  const relu = arch === "smallthinker" || drelu;
  const freqs = relu ? powerLawFrequencies(s.n_ff_exp, { mean: active, hotShare: hot }) : null;
  const X = s.n_expert;
  const F = s.n_ff_exp;
  /** A seeded permutation of 0..n−1 (Fisher–Yates on a hash stream). */
  const perm = (n: number, key: number) => {
    const p = Int32Array.from({ length: n }, (_, i) => i);
    for (let i = n - 1; i > 0; i--) {
      const j = hashU32(key, i) % (i + 1);
      const t = p[i]!;
      p[i] = p[j]!;
      p[j] = t;
    }
    return p;
  };
  return {
    zipf,
    active,
    hot,
    massive,
    relu,
    rank,
    components: Math.min(COMPONENTS, rank - 1),
    alpha: Math.sqrt(1 - noise),
    beta: Math.sqrt(noise),
    routerBias(l) {
      const rank = perm(X, streamKey(seed, l, 0x7a1f));
      return Float64Array.from(rank, (r) => -zipf * Math.log(r + 1));
    },
    firing(l) {
      const out = new Float64Array(X * F).fill(0.5);
      if (!freqs) return out;
      for (let e = 0; e < X; e++) {
        const p = perm(F, streamKey(seed, l, e, 0x3f1b));
        for (let i = 0; i < F; i++) out[e * F + i] = freqs[p[i]!]!;
      }
      return out;
    },
  };
}

/**
 * Probability that each expert is among the n_used chosen for a token, under the design: logits
 * bias_e + N(0, 1) independently per expert, top n_used (Monte Carlo with `samples` draws, seeded).
 */
export function moeRoutingProbabilities(bias: Float64Array, nUsed: number, samples = 20000, seed = 7): Float64Array {
  const n = bias.length;
  const count = new Float64Array(n);
  const v = new Float64Array(n);
  const idx = Array.from({ length: n }, (_, i) => i);
  const key = streamKey(seed, 0x5a17);
  for (let s = 0; s < samples; s++) {
    for (let e = 0; e < n; e++) v[e] = bias[e]! + gauss(key, s * n + e);
    idx.sort((a, b) => v[b]! - v[a]!);
    for (let u = 0; u < nUsed; u++) count[idx[u]!]! += 1;
  }
  return count.map((c) => c / samples);
}

/** What was written. */
export interface SyntheticMoeReport {
  path: string;
  ggufArch: "llama" | "qwen3moe" | "qwen2" | "qwen3" | "smallthinker";
  n_vocab: number;
  layers: number;
  bytes: number;
  /** With {@link SyntheticMoeOptions.predictors}: what was written (noise: β²). */
  predictors?: { rank: number; dtype: SyntheticDType; threshold: number; noise: number };
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
  if (o.upActivation !== undefined && (o.arch !== "llama-moe" || o.upActivation !== "relu")) {
    throw new RangeError(`upActivation "${o.upActivation}": only "relu" on llama-moe (dReLU experts)`);
  }
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
  if (o.upActivation) meta.push({ key: "powerinfer.ffn_up_activation", type: GgufTypes.string, value: "relu" });
  meta.push(...vocab);

  const tensors: GgufTensorSpec[] = [];
  /** Per-expert predictors, written after every other tensor (so the weights do not depend on them). */
  const predictorTensors: GgufTensorSpec[] = [];
  let ti = 0;
  /**
   * A tensor of values base + scale·N(0,1), seeded by (seed, tensor index); with `row`, each row (of
   * shape[0] values) starts as N(0,1) draws and row(r, v, o) rewrites v[o .. o + shape[0]) in place.
   */
  const add = (
    name: string,
    shape: number[],
    scale: number,
    type: SyntheticDType,
    base = 0,
    row?: (r: number, v: Float32Array, o: number) => void,
    neuronMajor = false,
  ) => {
    const key = streamKey(seed, ti++);
    const n = shape.reduce((a, b) => a * b, 1);
    // neuronMajor (a down stack [F, E, X]): the same values, each expert's matrix transposed to [E, F],
    // written as name with "_t" (…_exps_t.weight)
    const stored = neuronMajor ? [shape[1]!, shape[0]!, ...shape.slice(2)] : shape;
    if (n % GGML_BLOCK[type] !== 0 || stored[0]! % GGML_BLOCK[type] !== 0) {
      throw new RangeError(`${name}: row length ${stored[0]} is not a multiple of the ${type} block size`);
    }
    tensors.push({
      name: neuronMajor ? name.replace(/\.weight$/, "_t.weight") : name,
      type: GGML_TYPE_OF[type],
      shape: stored,
      data: () => {
        let v = new Float32Array(n);
        if (row) {
          for (let i = 0; i < n; i++) v[i] = gauss(key, i);
          const len = shape[0]!;
          for (let r = 0, o = 0; o < n; r++, o += len) row(r, v, o);
        } else for (let i = 0; i < n; i++) v[i] = base + scale * gauss(key, i);
        if (neuronMajor) {
          const [a, b] = [shape[0]!, shape[1]!];
          const t = new Float32Array(n);
          for (let x = 0; x < n / (a * b); x++) {
            const o = x * a * b;
            for (let r = 0; r < b; r++) for (let c = 0; c < a; c++) t[o + c * b + r] = v[o + r * a + c]!;
          }
          v = t;
        }
        const out = new Uint8Array(encodedBytes(type, n));
        encode(type, v, out);
        return out;
      },
    });
  };
  // ---- the design (see the module comment); plan undefined: plain Gaussian weights ----
  const plan = o.design ? planMoeDesign(o.arch, s, seed, o.design, o.upActivation === "relu") : undefined;
  const nRest = E - RESERVED;
  if (o.predictors && !plan?.relu) {
    throw new RangeError("predictors: needs a design and ReLU experts (smallthinker, or llama-moe with dReLU)");
  }
  const pwri = (o.format ?? "GGUF") === "PWRI";
  if (pwri && !(o.arch === "smallthinker" || o.upActivation === "relu")) {
    throw new RangeError(
      `format PWRI: ${o.arch}'s experts are SiLU, and a PWRI file is read as ReLU; PWRI is written for ReLU experts (smallthinker, or llama-moe with dReLU)`,
    );
  }
  const lr = plan?.relu ? lowRankDesign(plan, E, seed) : undefined;
  const pdtype: SyntheticDType =
    o.predictors?.dtype ?? (dtype === "F32" ? "F32" : dtype === "F16" || dtype === "BF16" ? "F16" : "Q8_0");
  if (o.predictors && plan && plan.rank % GGML_BLOCK[pdtype] !== 0) {
    throw new RangeError(
      `predictor type ${pdtype} needs the predictor rank to be a multiple of ${GGML_BLOCK[pdtype]} (got ${plan.rank})`,
    );
  }
  const M = plan?.massive ?? 0;
  /** Residual std of channels ≥ 32 at layer l's input, the RMS of that residual, normalized std and massive value. */
  const stats = (l: number) => {
    const sigma = Math.sqrt(1 + 2 * OUT_VAR * l);
    const rms = Math.sqrt((M * M + nRest * sigma * sigma) / E);
    return { sigma, rms, s: sigma / rms, hc: M / rms };
  };
  /** Row rewrite: channel 0 = first (undefined: 0), channels 1..31 = 0, the others ×scale. */
  const channels = (v: Float32Array, o: number, len: number, scale: number, first?: number) => {
    v[o] = first ?? 0;
    v.fill(0, o + 1, o + RESERVED);
    for (let j = o + RESERVED; j < o + len; j++) v[j]! *= scale;
  };
  /** Rows of a matrix with rows of n_embd (an input-channel row): channels 0..31 unused. */
  const proj = plan ? (_r: number, v: Float32Array, o: number) => channels(v, o, E, 1 / Math.sqrt(E)) : undefined;
  /** Rows of a matrix writing output channel r: channels 0..31 are never written. */
  const outRows = (len: number, scale: (r: number) => number) => (r: number, v: Float32Array, o: number) => {
    if (r % E < RESERVED) v.fill(0, o, o + len);
    else for (let j = o; j < o + len; j++) v[j]! *= scale(r);
  };
  const norm = plan
    ? (_r: number, v: Float32Array, o: number) => {
        for (let j = o; j < o + E; j++) v[j] = 1 + 0.1 * v[j]!;
        v[o] = 1; // the massive channel passes the norm as it is
      }
    : undefined;
  const embd = plan ? (_r: number, v: Float32Array, o: number) => channels(v, o, E, 1, M) : undefined;
  add("token_embd.weight", [E, V], 1, dtype, 0, embd);
  for (let l = 0; l < layers; l++) {
    const p = `blk.${l}.`;
    const st = stats(l);
    add(`${p}attn_norm.weight`, [E], 0.1, "F32", 1, norm);
    add(`${p}attn_q.weight`, [E, dH], 1 / Math.sqrt(E), dtype, 0, proj);
    add(`${p}attn_k.weight`, [E, dKv], 1 / Math.sqrt(E), dtype, 0, proj);
    add(`${p}attn_v.weight`, [E, dKv], 1 / Math.sqrt(E), dtype, 0, proj);
    if (o.arch === "qwen2") {
      add(`${p}attn_q.bias`, [dH], 0.1, "F32");
      add(`${p}attn_k.bias`, [dKv], 0.1, "F32");
      add(`${p}attn_v.bias`, [dKv], 0.1, "F32");
    }
    if (o.arch === "qwen3" || o.arch === "qwen3moe") {
      add(`${p}attn_q_norm.weight`, [hd], 0.1, "F32", 1);
      add(`${p}attn_k_norm.weight`, [hd], 0.1, "F32", 1);
    }
    // designed: v has std ≈ s per element, so 0.1·rms/√dH adds OUT_VAR·σ² (less when attention averages)
    const oScale = (Math.sqrt(OUT_VAR) * st.rms) / Math.sqrt(dH);
    add(`${p}attn_output.weight`, [dH, E], 1 / Math.sqrt(dH), dtype, 0, plan ? outRows(dH, () => oScale) : undefined);
    const normKey = streamKey(seed, ti);
    add(`${p}ffn_norm.weight`, [E], 0.1, "F32", 1, norm);
    if (moe) {
      const { n_expert: X, n_ff_exp: F } = s;
      if (plan) {
        // the router reads the raw layer input (smallthinker: x_0 = M, std σ) or the normed FFN input (h_0 = hc, std s)
        const raw = o.arch === "smallthinker";
        const x0 = raw ? M : st.hc;
        const sd = raw ? st.sigma : st.s;
        const bias = plan.routerBias(l);
        const rScale = 1 / (sd * Math.sqrt(nRest));
        add(`${p}ffn_gate_inp.weight`, [E, X], 0, "F32", 0, (r, v, o) => channels(v, o, E, rScale, bias[r]! / x0));
        const b = plan.firing(l).map((q) => (plan.relu ? normalQuantile(q) : 0));
        const noise = 1 / (st.s * Math.sqrt(nRest));
        // ReLU experts: β·(dense random row) + α·(low-rank part the predictor sees) + bias (see lowRankDesign)
        const gateRow = lr
          ? (r: number, v: Float32Array, o: number) => {
              channels(v, o, E, plan.beta * noise, b[r]! / st.hc);
              lr.addGate(l, Math.floor(r / F), r % F, v, o, 1 / st.s);
            }
          : (r: number, v: Float32Array, o: number) => channels(v, o, E, noise, b[r]! / st.hc);
        add(`${p}ffn_gate_exps.weight`, [E, F, X], 0, dtype, 0, gateRow);
        if (o.predictors && lr) {
          // ffn_norm's weights (the norm callback: 1 + 0.1·N(0, 1), channel 0 = 1): the predictor reads x, the gate x·w/rms
          const w = Float64Array.from({ length: E }, (_, j) =>
            j === 0 ? 1 : Math.fround(1 + 0.1 * gauss(normKey, j)),
          );
          const r = plan.rank;
          predictorTensors.push(
            rowsSpec(`${p}fc1_exps.weight`, [E, r, X], pdtype, (row, out) =>
              lr.fc1Row(l, Math.floor(row / r), row % r, out, w, st.sigma, M),
            ),
            rowsSpec(`${p}fc2_exps.weight`, [r, F, X], pdtype, (row, out) =>
              lr.fc2Row(l, Math.floor(row / F), row % F, out, b[row]!),
            ),
          );
        }
        add(`${p}ffn_up_exps.weight`, [E, F, X], 0, dtype, 0, (_r, v, o) => channels(v, o, E, noise));
        // each expert's output adds at most OUT_VAR·σ²: E[a_i²] = E[ReLU(b_i + z)²] (SiLU: bounded by b = 0's 0.5)
        const downScale = Float64Array.from({ length: X }, (_, e) => {
          let m2 = 0;
          for (let i = 0; i < F; i++) m2 += reluSecondMoment(b[e * F + i]!);
          return Math.sqrt((OUT_VAR * st.sigma * st.sigma) / m2);
        });
        // rows of ffn_down_exps: r = expert · n_embd + output channel
        add(
          `${p}ffn_down_exps.weight`,
          [F, E, X],
          0,
          dtype,
          0,
          outRows(F, (r) => downScale[Math.floor(r / E)]!),
          pwri,
        );
      } else {
        add(`${p}ffn_gate_inp.weight`, [E, X], 1 / Math.sqrt(E), "F32");
        add(`${p}ffn_gate_exps.weight`, [E, F, X], 1 / Math.sqrt(E), dtype);
        add(`${p}ffn_up_exps.weight`, [E, F, X], 1 / Math.sqrt(E), dtype);
        add(`${p}ffn_down_exps.weight`, [F, E, X], 1 / Math.sqrt(F), dtype, 0, undefined, pwri);
      }
    } else {
      add(`${p}ffn_gate.weight`, [E, s.n_ff], 1 / Math.sqrt(E), dtype, 0, proj);
      add(`${p}ffn_up.weight`, [E, s.n_ff], 1 / Math.sqrt(E), dtype, 0, proj);
      const dScale = Math.sqrt((OUT_VAR * st.sigma * st.sigma) / (0.5 * s.n_ff));
      add(
        `${p}ffn_down.weight`,
        [s.n_ff, E],
        1 / Math.sqrt(s.n_ff),
        dtype,
        0,
        plan ? outRows(s.n_ff, () => dScale) : undefined,
      );
    }
  }
  add("output_norm.weight", [E], 0.1, "F32", 1, norm);
  if (o.untiedOutput ?? true) add("output.weight", [E, V], 1 / Math.sqrt(E), dtype, 0, proj);
  let threshold: number | undefined;
  if (o.predictors && plan) {
    const target = o.predictors.targetRecall ?? 0.95;
    if (!(target > 0 && target <= 1)) throw new RangeError(`target recall ${target} must be in (0, 1]`);
    threshold = o.predictors.threshold ?? calibrateExpertThreshold(plan, s.n_ff_exp, target, seed);
    tensors.push(...predictorTensors);
    meta.push(
      { key: "powerinfer.sparse_threshold", type: GgufTypes.f32, value: threshold },
      { key: "powerinfer.synthetic.predictor_rank", type: GgufTypes.u32, value: plan.rank },
      { key: "powerinfer.synthetic.predictor_noise", type: GgufTypes.f32, value: plan.beta * plan.beta },
    );
  }
  writeGguf(path, { metadata: meta, tensors, format: pwri ? "PWRI" : "GGUF" });
  let bytes = 0;
  for (const t of tensors)
    bytes += encodedBytes(
      typeOfGgml(t.type),
      t.shape.reduce((a, b) => a * b, 1),
    );
  return {
    path,
    ggufArch: arch,
    n_vocab: V,
    layers,
    bytes,
    ...(threshold !== undefined && plan
      ? { predictors: { rank: plan.rank, dtype: pdtype, threshold, noise: plan.beta * plan.beta } }
      : {}),
  };
}

/** A tensor whose rows (of shape[0] values, zeroed first) `row(index, out)` writes. */
function rowsSpec(
  name: string,
  shape: number[],
  type: SyntheticDType,
  row: (r: number, out: Float32Array) => void,
): GgufTensorSpec {
  const n = shape.reduce((a, b) => a * b, 1);
  if (shape[0]! % GGML_BLOCK[type] !== 0) {
    throw new RangeError(`${name}: row length ${shape[0]} is not a multiple of the ${type} block size`);
  }
  return {
    name,
    type: GGML_TYPE_OF[type],
    shape,
    data: () => {
      const len = shape[0]!;
      const v = new Float32Array(n);
      for (let r = 0, o = 0; o < n; r++, o += len) row(r, v.subarray(o, o + len));
      const out = new Uint8Array(encodedBytes(type, n));
      encode(type, v, out);
      return out;
    },
  };
}

/**
 * The low-rank part of ReLU expert gates and the predictors that see it, as the dense generator builds
 * them (generator.ts), per (layer, expert): r − 1 unit-norm basis rows V_k, each on its own block of the
 * channels 32.., and for neuron i, m = min(8, r − 1) of them with Gaussian coefficients c_ij scaled to
 * Σ c² = α². Gate row i gets Σ_j c_ij·V_kj/s (s: the normed input's std), so its input-dependent part is
 * α·(low-rank, unit variance) + β·(dense random row). The predictor fc2·ReLU(fc1·x) reads the residual x
 * before ffn_norm (weights w): fc1 row k = V_k ⊙ w/σ plus an offset K·x_0/M keeping the ReLU linear, the
 * last row x_0/M = 1; fc2 row i = c_i on its components and b_i − K·Σ_j c_ij on the last. So its logit is
 * b_i + α·(the low-rank term) exactly up to the norm's per-token scale: it misses only the β part.
 */
function lowRankDesign(plan: MoeDesignPlan, E: number, seed: number) {
  const rt = plan.rank - 1;
  const m = plan.components;
  const nRest = E - RESERVED;
  const start = Int32Array.from({ length: rt + 1 }, (_, k) => RESERVED + Math.floor((k * nRest) / rt));
  let cached = -1;
  const bases = new Map<number, Float32Array>();
  /** Basis of (l, e): block k = channels start[k]..start[k+1], zero mean and unit norm. */
  const basis = (l: number, e: number): Float32Array => {
    if (cached !== l) {
      bases.clear();
      cached = l;
    }
    let v = bases.get(e);
    if (v) return v;
    v = new Float32Array(E);
    const key = streamKey(seed, l, e, 0x6b1a);
    for (let k = 0; k < rt; k++) {
      const a = start[k]!;
      const z = start[k + 1]!;
      let mu = 0;
      for (let c = a; c < z; c++) mu += v[c] = gauss(key, c);
      mu = z - a > 1 ? mu / (z - a) : 0;
      let n2 = 0;
      for (let c = a; c < z; c++) {
        v[c]! -= mu;
        n2 += v[c]! * v[c]!;
      }
      const sc = n2 > 0 ? 1 / Math.sqrt(n2) : 0;
      for (let c = a; c < z; c++) v[c]! *= sc;
    }
    bases.set(e, v);
    return v;
  };
  const comp = new Int32Array(m);
  const coef = new Float64Array(m);
  /** Components and coefficients of neuron i of expert e in layer l (into comp/coef). */
  const components = (l: number, e: number, i: number) => {
    const ck = streamKey(seed, l, e, 0x2c3d);
    let norm = 0;
    for (let j = 0; j < m; j++) {
      let k = 0;
      for (let tries = 0, dup = true; dup; tries++) {
        k = hashU32(ck, i * 64 + j + 16 * tries) % rt;
        dup = false;
        for (let q = 0; q < j; q++) if (comp[q] === k) dup = true;
      }
      comp[j] = k;
      coef[j] = gauss(ck ^ 0x5bd1e995, i * m + j);
      norm += coef[j]! * coef[j]!;
    }
    const sc = plan.alpha / Math.sqrt(norm);
    for (let j = 0; j < m; j++) coef[j]! *= sc;
  };
  return {
    /** Adds neuron i's low-rank part, scaled by `scale` (1/s), to the gate row at v[o..o+E). */
    addGate(l: number, e: number, i: number, v: Float32Array, o: number, scale: number): void {
      const B = basis(l, e);
      components(l, e, i);
      for (let j = 0; j < m; j++) {
        const k = comp[j]!;
        const w = coef[j]! * scale;
        for (let c = start[k]!, z = start[k + 1]!; c < z; c++) v[o + c]! += w * B[c]!;
      }
    },
    /** fc1 row k of expert e: V_k ⊙ w/σ with the ReLU offset on channel 0; row r − 1 reads x_0/M. */
    fc1Row(l: number, e: number, k: number, out: Float32Array, w: Float64Array, sigma: number, M: number): void {
      if (k === rt) {
        out[0] = 1 / M;
        return;
      }
      const B = basis(l, e);
      for (let c = start[k]!, z = start[k + 1]!; c < z; c++) out[c] = (B[c]! * w[c]!) / sigma;
      out[0] = RELU_OFFSET / M;
    },
    /** fc2 row i of expert e: its coefficients, and b_i minus the ReLU offsets on the last entry. */
    fc2Row(l: number, e: number, i: number, out: Float32Array, b: number): void {
      components(l, e, i);
      let sum = 0;
      for (let j = 0; j < m; j++) {
        out[comp[j]!] = coef[j]!;
        sum += coef[j]!;
      }
      out[rt] = b - RELU_OFFSET * sum;
    },
  };
}

/**
 * The threshold at which the designed predictor logit b_i + α·z₁ reaches `target` recall of firing
 * (b_i + α·z₁ + β·z₂ > 0; z₁, z₂ independent N(0, 1)), over one expert's designed frequencies (every
 * expert has the same ones, permuted) and 64 seeded draws per neuron — the design's distribution, not
 * measured on the written weights (`profile` on the model measures those).
 */
export function calibrateExpertThreshold(plan: MoeDesignPlan, nFfExp: number, target: number, seed: number): number {
  const p = plan.firing(0).subarray(0, nFfExp);
  const key = streamKey(seed, 0x7c11);
  const S = 64;
  const pos: number[] = [];
  for (let i = 0; i < nFfExp; i++) {
    const b = normalQuantile(p[i]!);
    for (let t = 0; t < S; t++) {
      const z1 = gauss(key, 2 * (i * S + t));
      const z2 = gauss(key, 2 * (i * S + t) + 1);
      if (b + plan.alpha * z1 + plan.beta * z2 > 0) pos.push(b + plan.alpha * z1);
    }
  }
  if (pos.length === 0) return 0;
  pos.sort((a, b) => a - b);
  return Math.fround(pos[Math.floor((1 - target) * pos.length)]!);
}

const GGML_BLOCK: Record<SyntheticDType, number> = { F32: 1, F16: 1, BF16: 1, Q8_0: 32, Q4_0: 32, Q4_K: 256 };

function typeOfGgml(t: number): SyntheticDType {
  return (Object.keys(GGML_TYPE_OF) as SyntheticDType[]).find((d) => GGML_TYPE_OF[d] === t)!;
}
