/**
 * Typed, validated model configuration for the architectures powerinfer-ts runs: `llama` (with or without
 * routed experts, Mixtral's layout), `bamboo`, `falcon`, `opt`, `qwen2`, `qwen3`, `qwen3moe` (dense GGUF
 * files from llama.cpp converters, and PowerInfer PWRI files).
 *
 * Keys are llama.cpp's (`{arch}.context_length`, `{arch}.attention.head_count`, …); optional keys take
 * llama.cpp's defaults (head_count_kv = head_count, rope.freq_base = 10000, rope.dimension_count =
 * head_dim, n_vocab = length of `tokenizer.ggml.tokens`). PowerInfer additions: predictor tensors
 * `blk.N.fc1.weight` {n_embd, r} / `blk.N.fc2.weight` {r, n_ff} (routed experts, this project's layout:
 * `blk.N.fc1_exps.weight` {n_embd, r, n_expert} / `blk.N.fc2_exps.weight` {r, n_ff_exp, n_expert}), transposed down projection
 * `blk.N.ffn_down_t.weight` {n_embd, n_ff} (routed experts: `blk.N.ffn_down_exps_t.weight`
 * {n_embd, n_ff_exp, n_expert}, each expert's down projection neuron-major), and `powerinfer.sparse_threshold`
 * (f32, default 0).
 */

import { z } from "zod";
import { GgufError } from "./errors.js";
import { getNumber, getOptionalNumber, getOptionalString, getString } from "./metadata.js";
import type { GgufFile } from "./reader.js";

/** FFN activation functions. */
export type ActivationKind = "silu" | "relu" | "gelu";

const posInt = z.number().int().positive();

/** zod schema of {@link ModelConfig}. */
export const ModelConfigSchema = z.object({
  /** `general.architecture`. */
  arch: z.enum(["llama", "bamboo", "falcon", "opt", "qwen2", "qwen3", "qwen3moe", "smallthinker"]),
  /** Container: dense GGUF or PowerInfer PWRI. */
  format: z.enum(["GGUF", "PWRI"]),
  /** `general.name`, when present. */
  name: z.string().optional(),
  /** Vocabulary size (`{arch}.vocab_size`, else the length of `tokenizer.ggml.tokens`). */
  n_vocab: posInt,
  /** `{arch}.context_length`: the context the file says the model was trained with. */
  n_ctx_train: posInt,
  /** Context to run with: the requested `nCtx`, else `n_ctx_train`. */
  n_ctx: posInt,
  n_embd: posInt,
  n_layer: posInt,
  /** FFN hidden size (neurons per layer). */
  n_ff: posInt,
  n_head: posInt,
  n_head_kv: posInt,
  /** Per-head dimension (`{arch}.attention.key_length`, else n_embd / n_head). */
  head_dim: posInt,
  /** Rotated dimensions per head (`{arch}.rope.dimension_count`, else head_dim; 0 without RoPE). */
  n_rot: z.number().int().nonnegative(),
  rope: z.object({
    /** `normal`: adjacent pairs (llama, bamboo); `neox`: halves (falcon); `none`: learned positions (opt). */
    type: z.enum(["normal", "neox", "none"]),
    /** θ base (`{arch}.rope.freq_base`, default 10000). */
    freq_base: z.number().positive(),
    /** Position scale, 1 / `{arch}.rope.scaling.factor` (default 1). */
    freq_scale: z.number().positive(),
  }),
  norm: z.object({ type: z.enum(["rms", "layer"]), eps: z.number().positive() }),
  ffn: z.object({
    /** Activation applied to the gate (gated FFN) or to up (ungated). */
    activation: z.enum(["silu", "relu", "gelu"]),
    /** Gated FFN: act(gate·x) ⊙ (up·x); ungated: act(up·x). */
    gated: z.boolean(),
    /**
     * Activation on the up branch too: dReLU, ReLU(gate)·ReLU(up) (Bamboo always; `llama` — dense or with
     * experts, TurboSparse-Mistral/-Mixtral — when the file says `powerinfer.ffn_up_activation = "relu"`).
     */
    up_activation: z.literal("relu").optional(),
  }),
  /** Biases on the q, k and v projections (`blk.N.attn_{q,k,v}.bias`: opt, qwen2). */
  qkv_bias: z.boolean(),
  /** RMS norm of each query and key head before RoPE (`blk.N.attn_{q,k}_norm.weight` [head_dim]: qwen3, qwen3moe). */
  qk_norm: z.boolean(),
  /**
   * Routed experts (mixture of experts) in every layer's FFN, absent for a dense model. llama.cpp's
   * `build_moe_ffn`: router logits W_gate_inp·h, probabilities by the gating function, the n_expert_used
   * largest chosen per token, each chosen expert's FFN (same activation as a dense FFN), outputs summed with
   * the probabilities as weights (renormalised over the chosen ones when `norm_weights`).
   */
  moe: z
    .object({
      /** `{arch}.expert_count`. */
      n_expert: posInt,
      /** `{arch}.expert_used_count`: experts per token (top-k). */
      n_expert_used: posInt,
      /** Neurons per expert (`{arch}.expert_feed_forward_length`, llama: `{arch}.feed_forward_length`). */
      n_ff_exp: posInt,
      /** Router probabilities: softmax over all experts or an independent sigmoid per expert. */
      gating: z.enum(["softmax", "sigmoid"]),
      /** Divide the chosen experts' weights by their sum (llama, qwen3moe: always). */
      norm_weights: z.boolean(),
      /** Multiplies the weights (1 = none). */
      weights_scale: z.number(),
      /**
       * What the router reads: `ffn_input` (the FFN input after ffn_norm: llama, qwen3moe) or
       * `layer_input` (the layer's input before attn_norm: SmallThinker, so the experts a token needs are
       * known while attention runs).
       */
      router_input: z.enum(["ffn_input", "layer_input"]),
    })
    .optional(),
  /**
   * Per layer how attention sees positions, as llama.cpp reads SmallThinker: `rope` false for NoPE layers,
   * `window` > 0 for sliding-window layers (a query at position p sees keys at p − window + 1 .. p).
   * Absent: every layer RoPE with full causal attention.
   */
  layer_attention: z.array(z.object({ rope: z.boolean(), window: z.number().int().nonnegative() })).optional(),
  /** Attention and FFN both read the layer input (falcon). */
  parallel_attn: z.boolean(),
  /**
   * Every layer has predictor tensors `blk.N.fc1.weight` and `blk.N.fc2.weight` (routed experts: per-expert
   * stacks `blk.N.fc1_exps.weight` {n_embd, r, n_expert} and `blk.N.fc2_exps.weight` {r, n_ff_exp, n_expert}).
   */
  has_predictors: z.boolean(),
  /** Predictor rank per layer (fc1 output size); empty without predictors. */
  predictor_ranks: z.array(posInt),
  /** `powerinfer.sparse_threshold` (default 0): a neuron runs when its predictor logit ≥ this. */
  sparse_threshold: z.number(),
  /**
   * Every layer stores its down projection transposed (neuron-major): `blk.N.ffn_down_t.weight` {n_embd, n_ff},
   * or with routed experts `blk.N.ffn_down_exps_t.weight` {n_embd, n_ff_exp, n_expert}.
   */
  down_transposed: z.boolean(),
  /** Things that are allowed but worth telling the user. */
  warnings: z.array(z.string()),
});

/** Validated model hyper-parameters. */
export type ModelConfig = z.infer<typeof ModelConfigSchema>;

const ARCHS = ["llama", "bamboo", "falcon", "opt", "qwen2", "qwen3", "qwen3moe", "smallthinker"] as const;

function bad(file: GgufFile, key: string, msg: string): never {
  throw new GgufError("BAD_VALUE", `"${key}": ${msg}`, { path: file.path });
}

function normalizeAct(file: GgufFile, key: string, v: string): ActivationKind {
  const s = v.toLowerCase();
  if (s === "relu") return "relu";
  if (s === "silu" || s === "swish" || s === "swiglu") return "silu";
  if (s === "gelu" || s === "gelu_new" || s === "gelu_pytorch_tanh" || s === "gelu_fast") return "gelu";
  return bad(file, key, `unsupported activation "${v}" (expected relu, silu or gelu)`);
}

/**
 * Build and validate the model configuration of a parsed file.
 * @param opts.nCtx context length to run with; larger than the trained context is allowed with a warning
 * @throws GgufError `MISSING_KEY` naming a required key that is absent, `BAD_VALUE` naming a key whose
 *   value is invalid or contradicts another key or the tensor shapes (e.g. an unsupported architecture,
 *   n_embd not divisible by n_head, token_embd shape ≠ [n_embd, n_vocab])
 */
export function parseModelConfig(file: GgufFile, opts: { nCtx?: number } = {}): ModelConfig {
  const warnings: string[] = [];
  const archName = getString(file, "general.architecture");
  if (!(ARCHS as readonly string[]).includes(archName)) {
    bad(file, "general.architecture", `unsupported architecture "${archName}" (supported: ${ARCHS.join(", ")})`);
  }
  const arch = archName as (typeof ARCHS)[number];
  const k = (s: string) => `${arch}.${s}`;
  const tensors = file.tensorMap;

  /** A positive integer, also accepting a per-layer array whose entries are all equal. */
  const int = (key: string, required: boolean, allowZero = false): number | undefined => {
    const raw = file.metadata.get(key);
    if (raw === undefined) {
      if (required)
        throw new GgufError("MISSING_KEY", `required metadata key "${key}" is missing`, { path: file.path });
      return undefined;
    }
    let v: number;
    if (ArrayBuffer.isView(raw) && !(raw instanceof DataView)) {
      const arr = Array.from(raw as ArrayLike<number | bigint>, Number);
      if (arr.length === 0 || arr.some((x) => x !== arr[0]))
        bad(file, key, "per-layer values that differ are not supported");
      v = arr[0];
    } else {
      v = getNumber(file, key);
    }
    if (!Number.isSafeInteger(v) || v < (allowZero ? 0 : 1)) bad(file, key, `expected a positive integer, found ${v}`);
    return v;
  };

  const n_ctx_train = int(k("context_length"), true)!;
  const n_embd = int(k("embedding_length"), true)!;
  const n_layer = int(k("block_count"), true)!;
  const n_ff = int(k("feed_forward_length"), true)!;
  const n_head = int(k("attention.head_count"), true)!;
  const n_head_kv = int(k("attention.head_count_kv"), false) ?? n_head;
  if (n_head % n_head_kv !== 0) {
    bad(file, k("attention.head_count_kv"), `${n_head_kv} does not divide the head count ${n_head}`);
  }
  let head_dim = int(k("attention.key_length"), false);
  if (head_dim === undefined) {
    if (n_embd % n_head !== 0)
      bad(file, k("attention.head_count"), `${n_head} does not divide the embedding length ${n_embd}`);
    head_dim = n_embd / n_head;
  }
  const valueLength = int(k("attention.value_length"), false);
  if (valueLength !== undefined && valueLength !== head_dim) {
    bad(file, k("attention.value_length"), `${valueLength} differs from the key length ${head_dim} (not supported)`);
  }

  // Vocabulary size.
  const tokens = file.metadata.get("tokenizer.ggml.tokens");
  if (tokens !== undefined && !Array.isArray(tokens))
    bad(file, "tokenizer.ggml.tokens", "expected an array of strings");
  const vocabKey = int(k("vocab_size"), false);
  let n_vocab: number;
  if (vocabKey !== undefined) {
    if (tokens !== undefined && tokens.length !== vocabKey) {
      bad(file, k("vocab_size"), `${vocabKey} contradicts the ${tokens.length} entries of "tokenizer.ggml.tokens"`);
    }
    n_vocab = vocabKey;
  } else if (tokens !== undefined) {
    n_vocab = tokens.length;
  } else {
    throw new GgufError(
      "MISSING_KEY",
      `required metadata key "tokenizer.ggml.tokens" (or "${k("vocab_size")}") is missing`,
      {
        path: file.path,
      },
    );
  }
  if (n_vocab === 0) bad(file, "tokenizer.ggml.tokens", "the vocabulary is empty");

  // RoPE.
  // NeoX pairs: falcon and the Qwen family (llama.cpp's llama_model_rope_type)
  const qwen = arch === "qwen2" || arch === "qwen3" || arch === "qwen3moe" || arch === "smallthinker";
  const ropeType = arch === "falcon" || qwen ? "neox" : arch === "opt" ? "none" : "normal";
  let n_rot = int(k("rope.dimension_count"), false, true) ?? (ropeType === "none" ? 0 : head_dim);
  if (ropeType !== "none" && (n_rot > head_dim || n_rot % 2 !== 0 || n_rot === 0)) {
    bad(file, k("rope.dimension_count"), `${n_rot} must be even, non-zero and at most the head dimension ${head_dim}`);
  }
  if (ropeType === "none") n_rot = 0;
  const freq_base = getOptionalNumber(file, k("rope.freq_base")) ?? 10000;
  if (!(freq_base > 0)) bad(file, k("rope.freq_base"), `expected a positive number, found ${freq_base}`);
  const scalingType = getOptionalString(file, k("rope.scaling.type"));
  if (scalingType !== undefined && scalingType !== "none" && scalingType !== "linear") {
    bad(file, k("rope.scaling.type"), `unsupported RoPE scaling "${scalingType}" (only none and linear)`);
  }
  const factorKey = file.metadata.has(k("rope.scaling.factor")) ? k("rope.scaling.factor") : k("rope.scale_linear");
  const factor = getOptionalNumber(file, factorKey) ?? 0;
  if (factor < 0 || !Number.isFinite(factor)) bad(file, factorKey, `expected a non-negative number, found ${factor}`);
  const freq_scale = factor === 0 || scalingType === "none" ? 1 : 1 / factor;

  // Normalization.
  const rms = arch === "llama" || arch === "bamboo" || qwen;
  const epsKey = rms ? k("attention.layer_norm_rms_epsilon") : k("attention.layer_norm_epsilon");
  const eps = getNumber(file, epsKey);
  if (!(eps > 0)) bad(file, epsKey, `expected a positive epsilon, found ${eps}`);

  // FFN.
  const actKey = k("hidden_act");
  const actRaw = getOptionalString(file, actKey);
  const act = actRaw === undefined ? undefined : normalizeAct(file, actKey, actRaw);
  const pwri = file.format === "PWRI";
  // dReLU (TurboSparse, Song et al. 2024: ReLU(gate)·ReLU(up)), which llama.cpp cannot run: this project's key
  // `powerinfer.ffn_up_activation` = "relu" on a llama file (dense FFN or routed experts)
  const upKey = "powerinfer.ffn_up_activation";
  const upAct = getOptionalString(file, upKey);
  if (upAct !== undefined && upAct !== "relu")
    bad(file, upKey, `"${upAct}" is not "relu" (the only up activation read)`);
  if (upAct !== undefined && arch !== "llama" && arch !== "bamboo") bad(file, upKey, `not read for ${arch}`);
  let ffn: ModelConfig["ffn"];
  if (qwen) {
    // SmallThinker's experts are ReGLU: ReLU(gate)·up (llama.cpp's LLM_FFN_RELU with a gate)
    const a0 = arch === "smallthinker" ? "relu" : "silu";
    if (act !== undefined && act !== a0) bad(file, actKey, `"${actRaw}" contradicts ${arch}'s ${a0}(gate)·up FFN`);
    ffn = { activation: a0, gated: true };
  } else if (arch === "llama") {
    if (pwri && act !== undefined && act !== "relu") {
      bad(file, actKey, `"${actRaw}" contradicts the PWRI format, whose llama FFN is ReLU(gate)·up`);
    }
    if (upAct && act !== undefined && act !== "relu") bad(file, actKey, `"${actRaw}" contradicts ${upKey}'s dReLU FFN`);
    ffn = upAct
      ? { activation: "relu", gated: true, up_activation: "relu" }
      : { activation: act ?? (pwri ? "relu" : "silu"), gated: true };
  } else if (arch === "bamboo") {
    if (act !== undefined && act !== "relu")
      bad(file, actKey, `"${actRaw}" contradicts bamboo's ReLU(gate)·ReLU(up) FFN`);
    ffn = { activation: "relu", gated: true, up_activation: "relu" };
  } else if (arch === "falcon") {
    ffn = { activation: act ?? (pwri ? "relu" : "gelu"), gated: false };
  } else {
    ffn = { activation: act ?? "relu", gated: false };
  }

  // Tensor-shape consistency (skipped for vocab-only files without tensors).
  const embd = tensors.get("token_embd.weight");
  if (embd) {
    if (embd.shape[0] !== n_embd)
      bad(file, k("embedding_length"), `${n_embd} contradicts token_embd.weight [${embd.shape}]`);
    if (embd.shape[1] !== n_vocab) {
      bad(
        file,
        vocabKey !== undefined ? k("vocab_size") : "tokenizer.ggml.tokens",
        `n_vocab ${n_vocab} contradicts token_embd.weight [${embd.shape}]`,
      );
    }
  }
  // Routed experts: {arch}.expert_count > 0 (llama, qwen3moe) with ffn_gate_inp / ffn_*_exps tensors.
  let moe: ModelConfig["moe"];
  const nExpert = int(k("expert_count"), arch === "qwen3moe" || arch === "smallthinker", true) ?? 0;
  if (nExpert > 0) {
    if (arch !== "llama" && arch !== "qwen3moe" && arch !== "smallthinker") {
      bad(file, k("expert_count"), `${arch} has no routed experts`);
    }
    const nUsed = int(k("expert_used_count"), true)!;
    if (nUsed > nExpert) bad(file, k("expert_used_count"), `${nUsed} exceeds the expert count ${nExpert}`);
    const nFfExp = int(k("expert_feed_forward_length"), false) ?? (arch === "llama" ? n_ff : Math.floor(n_ff / nUsed));
    // llama.cpp's gating per arch: softmax for llama and qwen3moe; SmallThinker's expert_gating_func
    // (1 softmax, 2 sigmoid; llama.cpp has no default), weights renormalised over the chosen in all three
    let gating: "softmax" | "sigmoid" = "softmax";
    if (arch === "smallthinker") {
      const gf = int(k("expert_gating_func"), true)!;
      if (gf !== 1 && gf !== 2) bad(file, k("expert_gating_func"), `${gf} is not 1 (softmax) or 2 (sigmoid)`);
      gating = gf === 1 ? "softmax" : "sigmoid";
    }
    moe = {
      n_expert: nExpert,
      n_expert_used: nUsed,
      n_ff_exp: nFfExp,
      gating,
      norm_weights: true,
      weights_scale: 1,
      router_input: arch === "smallthinker" ? "layer_input" : "ffn_input",
    };
    const exp0 = tensors.get("blk.0.ffn_up_exps.weight");
    if (exp0 && (exp0.shape[0] !== n_embd || exp0.shape[1] !== nFfExp || exp0.shape[2] !== nExpert)) {
      bad(
        file,
        arch === "llama" ? k("feed_forward_length") : k("expert_feed_forward_length"),
        `n_ff_exp ${nFfExp}, n_expert ${nExpert} contradict blk.0.ffn_up_exps.weight [${exp0.shape}]`,
      );
    }
    if (tensors.size > 0 && !exp0)
      bad(file, k("expert_count"), `${nExpert} experts, but blk.0.ffn_up_exps.weight is absent`);
  } else if (arch === "qwen3moe" || arch === "smallthinker") {
    bad(file, k("expert_count"), `${arch} needs at least one expert`);
  }

  // SmallThinker (llama.cpp's reading): with {arch}.attention.sliding_window > 0, layers il % n_pattern != 0
  // (n_pattern = {arch}.attention.sliding_window_pattern, default 4) use a sliding window that llama.cpp
  // fixes at 4096 whatever the key says, and layers il % 4 == 0 use no RoPE — unless the model has exactly
  // 4 layers (llama.cpp's rule: RoPE when n_no_rope_layer_step, 4, equals n_layer); without the key every
  // layer uses RoPE and full attention.
  let layer_attention: ModelConfig["layer_attention"];
  if (arch === "smallthinker") {
    const swa = int(k("attention.sliding_window"), false, true) ?? 0;
    const pattern = int(k("attention.sliding_window_pattern"), false, true) ?? 4;
    layer_attention = Array.from({ length: n_layer }, (_, il) =>
      swa > 0
        ? { rope: n_layer === 4 || il % 4 !== 0, window: pattern === 0 || il % pattern !== 0 ? 4096 : 0 }
        : { rope: true, window: 0 },
    );
  }
  const up0 = tensors.get("blk.0.ffn_up.weight");
  if (up0 && (up0.shape[0] !== n_embd || up0.shape[1] !== n_ff)) {
    bad(file, k("feed_forward_length"), `${n_ff} contradicts blk.0.ffn_up.weight [${up0.shape}]`);
  }
  if (tensors.size > 0) {
    if (!tensors.has(`blk.${n_layer - 1}.attn_norm.weight`) || tensors.has(`blk.${n_layer}.attn_norm.weight`)) {
      bad(file, k("block_count"), `${n_layer} does not match the blk.N tensors in the file`);
    }
    const hasGate = tensors.has("blk.0.ffn_gate.weight");
    if (up0 && hasGate !== ffn.gated) {
      bad(
        file,
        "general.architecture",
        `${arch} expects ${ffn.gated ? "a gated" : "an ungated"} FFN but blk.0.ffn_gate.weight is ${hasGate ? "present" : "absent"}`,
      );
    }
  }

  // PowerInfer extras.
  const predictor_ranks: number[] = [];
  let withPredictor = 0;
  let withDownT = 0;
  // routed experts: per-expert predictors fc1_exps {n_embd, r, n_expert}, fc2_exps {r, n_ff_exp, n_expert}
  const sfx = moe ? "_exps" : "";
  for (let l = 0; l < n_layer; l++) {
    const fc1 = tensors.get(`blk.${l}.fc1${sfx}.weight`);
    const fc2 = tensors.get(`blk.${l}.fc2${sfx}.weight`);
    if (tensors.has(`blk.${l}.ffn_down_t.weight`)) withDownT++;
    const downXT = tensors.get(`blk.${l}.ffn_down_exps_t.weight`);
    if (downXT && moe) {
      // routed experts' down projections neuron-major: one {n_embd, n_ff_exp} matrix per expert
      if (
        downXT.shape[0] !== n_embd ||
        downXT.shape[1] !== moe.n_ff_exp ||
        (downXT.shape[2] ?? 1) !== moe.n_expert ||
        downXT.shape.length > 3
      ) {
        bad(
          file,
          downXT.name,
          `shape [${downXT.shape}] does not fit n_embd ${n_embd}, n_ff_exp ${moe.n_ff_exp}, n_expert ${moe.n_expert}`,
        );
      }
      if (tensors.has(`blk.${l}.ffn_down_exps.weight`)) {
        bad(
          file,
          downXT.name,
          `layer ${l} stores its experts' down projections twice (ffn_down_exps and ffn_down_exps_t)`,
        );
      }
      withDownT++;
    }
    if (!fc1 && !fc2) continue;
    if (!fc1 || !fc2)
      bad(file, `blk.${l}.${fc1 ? "fc2" : "fc1"}${sfx}.weight`, `layer ${l} has only half of its predictor`);
    const r = fc1.shape[1];
    const [nf, e3] = moe ? [moe.n_ff_exp, moe.n_expert] : [n_ff, 1];
    if (
      fc1.shape[0] !== n_embd ||
      fc2.shape[0] !== r ||
      fc2.shape[1] !== nf ||
      (fc1.shape[2] ?? 1) !== e3 ||
      (fc2.shape[2] ?? 1) !== e3 ||
      fc1.shape.length > 3 ||
      fc2.shape.length > 3
    ) {
      bad(
        file,
        `blk.${l}.fc2${sfx}.weight`,
        `predictor shapes fc1 [${fc1.shape}], fc2 [${fc2.shape}] do not fit n_embd ${n_embd}, ${moe ? `n_ff_exp ${nf}, n_expert ${e3}` : `n_ff ${n_ff}`}`,
      );
    }
    predictor_ranks.push(r);
    withPredictor++;
  }
  const has_predictors = withPredictor === n_layer;
  if (withPredictor > 0 && !has_predictors) {
    warnings.push(`only ${withPredictor} of ${n_layer} layers have predictors; the model will run dense`);
  }
  if (withDownT > 0 && withDownT < n_layer) {
    bad(
      file,
      moe ? "blk.0.ffn_down_exps_t.weight" : "blk.0.ffn_down_t.weight",
      `only ${withDownT} of ${n_layer} layers store ${moe ? "ffn_down_exps_t" : "ffn_down_t"}`,
    );
  }
  const sparse_threshold = getOptionalNumber(file, "powerinfer.sparse_threshold") ?? 0;
  if (!Number.isFinite(sparse_threshold)) {
    throw new GgufError(
      "BAD_VALUE",
      `"powerinfer.sparse_threshold" must be a finite number, found ${sparse_threshold}`,
      {
        path: file.path,
      },
    );
  }
  if (has_predictors && ffn.activation !== "relu") {
    warnings.push(`the file has predictors but its FFN activation is ${ffn.activation}, not ReLU`);
  }

  const n_ctx = opts.nCtx ?? n_ctx_train;
  if (!Number.isSafeInteger(n_ctx) || n_ctx <= 0) {
    throw new GgufError("BAD_VALUE", `requested context length ${n_ctx} must be a positive integer`, {
      path: file.path,
    });
  }
  if (n_ctx > n_ctx_train) {
    warnings.push(
      `requested context ${n_ctx} is larger than the trained context ${n_ctx_train} (${k("context_length")})`,
    );
  }

  const cfg = {
    arch,
    format: file.format,
    name: getOptionalString(file, "general.name"),
    n_vocab,
    n_ctx_train,
    n_ctx,
    n_embd,
    n_layer,
    n_ff,
    n_head,
    n_head_kv,
    head_dim,
    n_rot,
    rope: { type: ropeType, freq_base, freq_scale },
    norm: { type: rms ? "rms" : "layer", eps },
    ffn,
    qkv_bias: arch === "opt" || arch === "qwen2",
    qk_norm: arch === "qwen3" || arch === "qwen3moe",
    moe,
    layer_attention,
    parallel_attn: arch === "falcon",
    has_predictors,
    predictor_ranks: has_predictors ? predictor_ranks : [],
    sparse_threshold,
    down_transposed: withDownT === n_layer,
    warnings,
  };
  if (cfg.name === undefined) delete cfg.name;
  if (cfg.moe === undefined) delete cfg.moe;
  if (cfg.layer_attention === undefined) delete cfg.layer_attention;
  const parsed = ModelConfigSchema.safeParse(cfg);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    throw new GgufError("BAD_VALUE", `model config field ${issue.path.join(".")}: ${issue.message}`, {
      path: file.path,
    });
  }
  return parsed.data;
}
