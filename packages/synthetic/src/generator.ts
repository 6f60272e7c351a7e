/**
 * Synthetic models with the tensor shapes of real LLMs and realistic ReLU activation statistics.
 *
 * How activations are made to look like the published ones (PowerInfer, Song et al. 2023):
 * - The residual stream carries a "massive activation" (Sun et al. 2024): channel c of every token
 *   embedding is a large constant M, the other channels are N(0, 1). After the norm, h_c is a nearly
 *   constant value, so the gate weight W_gate[i][c] acts as neuron i's bias b_i.
 * - Each neuron's firing frequency p_i is drawn from a power law (most active first, randomly permuted
 *   per layer) with mean = the active fraction and a chosen share of neurons covering 80 % of the
 *   activations; b_i = Φ⁻¹(p_i) when the rest of the gate is a unit-variance input-dependent term.
 * - That term is α·u_i·(V·ĥ) + β·N_i·ĥ, where ĥ is the normalized non-massive part of the input,
 *   V (r − 1 rows, each on its own block of channels) a shared low-rank basis, u_i a unit vector on 8 of
 *   its rows (neurons sharing rows co-activate), N_i a dense random row, α² + β² = 1, β² the "predictor
 *   noise".
 * - The predictor fc2·ReLU(fc1·x) (PowerInfer's form, x = the residual before the norm) computes
 *   b_i·x_c/M + α·u_i·(V·x/σ) exactly while the ReLUs stay positive (fc1 adds a K·x_c/M offset that fc2
 *   removes), so it predicts firing up to the β part it cannot see; the threshold is calibrated on
 *   sampled inputs to reach a target recall.
 * - Attention and FFN outputs are scaled to add about 1 % of the residual variance each, so the
 *   statistics hold through the layers of a slice.
 *
 * Every weight is a function of (seed, tensor, element) ({@link gauss}), so generation streams tensor
 * data in chunks straight to the file and the same options always give the same bytes; a GGUF and a
 * PWRI file generated with the same options hold the same weights (ffn_down vs ffn_down_t).
 */
import {
  dequantize,
  GGMLType,
  type GgufMetadataEntry,
  type GgufStreamOptions,
  type GgufStreamSpec,
  type GgufStreamTensor,
  GgufTypes,
  ggufStreamSize,
  writeGgufStreaming,
} from "@powerinfer/gguf";
import { BLOCK, encode, encodedBytes, GGML_TYPE_OF, roundTrip, type SyntheticDType } from "./encode.js";
import { SHAPE_PRESETS, type ShapePreset, type SyntheticArch, type SyntheticShape } from "./presets.js";
import { fillGauss, gauss, hashU32, streamKey } from "./random.js";
import { hotNeuronShare, normalQuantile, powerLawFrequencies, reluSecondMoment } from "./stats-math.js";
import { syntheticVocab, vocabMetadataFromGguf, vocabSize } from "./vocab.js";

/** Options of {@link planSyntheticModel} / {@link generateSyntheticModel}. Every field has a default. */
export interface SyntheticModelOptions {
  /**
   * `llama` (dense SiLU(gate)·up), `relu-llama` (ReLU(gate)·up, ReLU-Llama/ProSparse), `bamboo`
   * (ReLU(gate)·ReLU(up)), `falcon` (parallel attention, ReLU(up), no gate), `opt` (learned positions,
   * LayerNorm, biases, ReLU(fc1) = ReLU(ffn_up); llama.cpp has no OPT). Default: the preset's
   * (`falcon` for 40b, `relu-llama` otherwise).
   */
  arch?: SyntheticArch;
  /** Shape preset or explicit shape. Default "7b". */
  preset?: ShapePreset | SyntheticShape;
  /** Layers to generate (a slice of the full model). Default: all of the preset's. */
  layers?: number;
  /** Weight type of the 2-D weights (norms are F32). Default "F16". */
  dtype?: SyntheticDType;
  /** `GGUF` (llama.cpp layout) or `PWRI` (PowerInfer: ffn_down_t, fc1/fc2, sparse threshold). Default "GGUF". */
  format?: "GGUF" | "PWRI";
  /** Size of the synthetic SPM vocabulary. Default 1024. Ignored with `vocabFrom`. */
  vocabSize?: number;
  /** Copy the vocabulary (`tokenizer.*` metadata) from this GGUF file instead. */
  vocabFrom?: string;
  /** Seed. Default 1. */
  seed?: number;
  /** Mean fraction of FFN neurons that fire per token. Default 0.1. */
  activeFraction?: number;
  /** Share of neurons (the most active) that account for 80 % of activations. Default 0.25. */
  hotShare?: number;
  /** Predictor rank r (fc1 {n_embd, r}, fc2 {r, n_ff}); also sets the low-rank part of the gates. Default 128. */
  predictorRank?: number;
  /** Predictor weight type. Default F16 for float weights, Q8_0 for quantized weights. */
  predictorDType?: SyntheticDType;
  /** Share of each gate's input-dependent variance that the predictor cannot see (β²). Default 0.1. */
  predictorNoise?: number;
  /** PWRI threshold: calibrated on sampled inputs to reach this recall. Default 0.95. */
  targetRecall?: number;
  /** PWRI threshold given explicitly (overrides targetRecall). */
  threshold?: number;
  /** Value of the massive residual channel relative to the other channels' standard deviation. Default 100. */
  massive?: number;
  /**
   * Tokens sampled to measure the statistics of each layer. Default 64. 0 skips the measurement (and
   * the threshold calibration: a PWRI file then gets `threshold`, default 0).
   */
  statsTokens?: number;
  /** At most this many neurons per layer are sampled for the statistics. Default 512. */
  statsNeurons?: number;
}

/** Per-layer statistics measured on sampled inputs (token embeddings plus the layer's expected drift). */
export interface SyntheticLayerStats {
  layer: number;
  /** Fraction of sampled (neuron, token) pairs whose gate (falcon: up) pre-activation is > 0. */
  activeFraction: number;
  /** Share of neurons that covers 80 % of activations under the layer's designed frequencies. */
  hotShare: number;
  /** Fraction predicted active (logit ≥ threshold); PWRI only. */
  predictedFraction?: number;
  /** Of the truly active pairs, the share predicted; PWRI only. */
  recall?: number;
  /** Of the predicted pairs, the share truly active; PWRI only. */
  precision?: number;
}

/** What a generated model is and how its activations behave. */
export interface SyntheticModelReport {
  path?: string;
  arch: SyntheticArch;
  /** `general.architecture` written. */
  ggufArch: "llama" | "bamboo" | "falcon" | "opt";
  format: "GGUF" | "PWRI";
  preset: string;
  shape: SyntheticShape;
  layers: number;
  dtype: SyntheticDType;
  predictorDType?: SyntheticDType;
  predictorRank?: number;
  n_vocab: number;
  /** File size in bytes. */
  bytes: number;
  /** Parameters (elements of all tensors). */
  params: number;
  seed: number;
  /** Predictor threshold written (PWRI). */
  threshold?: number;
  design: {
    activeFraction: number;
    hotShare: number;
    predictorNoise: number;
    massiveChannel: number;
    massive: number;
  };
  statsTokens: number;
  statsNeurons: number;
  /** Means over layers (absent when statsTokens is 0). */
  stats?: Omit<SyntheticLayerStats, "layer">;
  perLayer: SyntheticLayerStats[];
  /** Things to know (e.g. which engines can run the file). */
  notes: string[];
  /** Seconds generating and writing took (generateSyntheticModel only). */
  seconds?: number;
}

/** A model ready to be written: metadata, streamed tensors and its report. */
export interface SyntheticModelPlan {
  spec: GgufStreamSpec;
  report: SyntheticModelReport;
}

/** Residual variance each attention block and each FFN adds (relative to the embedding's). */
const ATTN_VAR = 0.01;
const FFN_VAR = 0.01;
/** fc1 offset keeping the predictor's ReLUs in their linear range (in standard deviations). */
const RELU_OFFSET = 4;
/** Components of the low-rank basis each neuron's gate uses. */
const COMPONENTS = 8;
/** Bamboo: P(up > 0) for every neuron. */
const BAMBOO_UP_POSITIVE = 0.9;
const CHUNK_BYTES = 4 << 20;

const FILE_TYPE: Record<SyntheticDType, number> = { F32: 0, F16: 1, Q4_0: 2, Q8_0: 7, Q4_K: 15, BF16: 32 };

/** Stream kinds (part of each weight's hash key). */
const K = {
  embd: 1,
  output: 2,
  q: 3,
  k: 4,
  v: 5,
  o: 6,
  gateNoise: 7,
  up: 8,
  down: 9,
  basis: 10,
  comp: 11,
  perm: 12,
  tokens: 13,
  drift: 14,
  qkv: 15,
  positions: 16,
} as const;

interface Resolved {
  arch: SyntheticArch;
  ggufArch: "llama" | "bamboo" | "falcon" | "opt";
  preset: string;
  shape: SyntheticShape;
  L: number;
  E: number;
  F: number;
  V: number;
  headDim: number;
  nKv: number;
  dtype: SyntheticDType;
  pdtype: SyntheticDType;
  format: "GGUF" | "PWRI";
  seed: number;
  active: number;
  hot: number;
  rank: number;
  rt: number;
  m: number;
  beta: number;
  alpha: number;
  M: number;
  c: number;
  /**
   * Channels [r0, r1): the 32-aligned block holding c. Only c is non-zero there in the embeddings and
   * in every row that reads the residual by channel (gates, ups, fc1), so in a quantized file c's weight
   * is the largest of its block and exactly representable: its error would be multiplied by the massive
   * value and swamp the designed biases.
   */
  r0: number;
  r1: number;
  /** Channels outside [r0, r1). */
  nRest: number;
  falcon: boolean;
  /** OPT: learned positions, biases, sequential attention, ReLU(up) FFN. */
  opt: boolean;
  /** LayerNorm (mean subtracted; falcon, opt) rather than RMSNorm. */
  layerNorm: boolean;
  gated: boolean;
  eps: number;
  vocab: GgufMetadataEntry[];
  statsTokens: number;
  statsNeurons: number;
  targetRecall: number;
  threshold?: number;
}

function bad(msg: string): never {
  throw new RangeError(msg);
}

function resolve(o: SyntheticModelOptions): Resolved {
  const presetName = typeof o.preset === "string" ? o.preset : o.preset ? "custom" : "7b";
  const preset = typeof o.preset === "object" ? o.preset : SHAPE_PRESETS[(o.preset ?? "7b") as ShapePreset];
  if (!preset) bad(`unknown shape preset "${String(o.preset)}" (expected ${Object.keys(SHAPE_PRESETS).join(", ")})`);
  const arch = o.arch ?? ("arch" in preset ? (preset.arch as SyntheticArch) : "relu-llama");
  if (!["llama", "relu-llama", "bamboo", "falcon", "opt"].includes(arch)) bad(`unknown architecture "${arch}"`);
  const shape: SyntheticShape = {
    n_embd: preset.n_embd,
    n_ff: preset.n_ff,
    n_head: preset.n_head,
    n_head_kv: preset.n_head_kv,
    n_layer: preset.n_layer,
    n_ctx: preset.n_ctx,
  };
  // OPT has no grouped-query attention: as many K/V heads as query heads
  if (arch === "opt") shape.n_head_kv = shape.n_head;
  const L = o.layers ?? shape.n_layer;
  if (!Number.isInteger(L) || L < 1) bad(`layers must be a positive integer, got ${L}`);
  const dtype = o.dtype ?? "F16";
  if (!(dtype in BLOCK)) bad(`unknown weight type "${dtype}" (expected F32, F16, BF16, Q8_0, Q4_0 or Q4_K)`);
  const format = o.format ?? "GGUF";
  if (format !== "GGUF" && format !== "PWRI") bad(`unknown format "${format}" (expected GGUF or PWRI)`);
  if (format === "PWRI" && arch === "llama") {
    bad("a PWRI file holds a ReLU model (its predictors predict ReLU firing): use relu-llama, bamboo, falcon or opt");
  }
  if (format === "PWRI" && dtype === "BF16")
    bad("PowerInfer's PWRI format has no BF16 type: use F16, F32 or a quantized type");
  const E = shape.n_embd;
  const F = shape.n_ff;
  if (E % shape.n_head !== 0) bad(`n_embd ${E} is not a multiple of n_head ${shape.n_head}`);
  if (shape.n_head % shape.n_head_kv !== 0)
    bad(`n_head ${shape.n_head} is not a multiple of n_head_kv ${shape.n_head_kv}`);
  const [bs] = BLOCK[dtype];
  if (E % bs !== 0 || F % bs !== 0) bad(`${dtype} needs n_embd and n_ff to be multiples of ${bs} (got ${E}, ${F})`);
  const rank = o.predictorRank ?? 128;
  if (!Number.isInteger(rank) || rank < 2 || rank > E - 32) {
    bad(`predictor rank must be an integer in [2, n_embd − 32], got ${rank}`);
  }
  const quantized = dtype !== "F32" && dtype !== "F16" && dtype !== "BF16";
  const pdtype = o.predictorDType ?? (quantized ? "Q8_0" : dtype === "BF16" ? "F16" : dtype);
  if (!(pdtype in BLOCK)) bad(`unknown predictor type "${pdtype}"`);
  if (format === "PWRI" && pdtype === "BF16") bad("PowerInfer's PWRI format has no BF16 type for predictors");
  if (format === "PWRI" && rank % BLOCK[pdtype][0] !== 0) {
    bad(`predictor type ${pdtype} needs the predictor rank to be a multiple of ${BLOCK[pdtype][0]} (got ${rank})`);
  }
  const noise = o.predictorNoise ?? 0.1;
  if (!(noise >= 0 && noise <= 1)) bad(`predictor noise must be in [0, 1], got ${noise}`);
  const M = o.massive ?? 100;
  if (!(M > 0)) bad(`massive must be positive, got ${M}`);
  const seed = o.seed ?? 1;
  if (!Number.isInteger(seed) || seed < 0 || seed > 0xffffffff)
    bad(`seed must be an integer in [0, 2^32), got ${seed}`);
  const vocab = o.vocabFrom ? vocabMetadataFromGguf(o.vocabFrom) : syntheticVocab(o.vocabSize ?? 1024);
  const targetRecall = o.targetRecall ?? 0.95;
  if (!(targetRecall > 0 && targetRecall <= 1)) bad(`target recall must be in (0, 1], got ${targetRecall}`);
  if (o.threshold !== undefined && !Number.isFinite(o.threshold)) bad(`threshold must be a number, got ${o.threshold}`);
  const falcon = arch === "falcon";
  const opt = arch === "opt";
  const c = hashU32(streamKey(seed, 0xc), 0) % E;
  const r0 = Math.floor(c / 32) * 32;
  const r1 = Math.min(E, r0 + 32);
  return {
    arch,
    ggufArch: arch === "bamboo" ? "bamboo" : falcon ? "falcon" : opt ? "opt" : "llama",
    preset: presetName,
    shape,
    L,
    E,
    F,
    V: vocabSize(vocab),
    headDim: E / shape.n_head,
    nKv: (E / shape.n_head) * shape.n_head_kv,
    dtype,
    pdtype,
    format,
    seed,
    active: o.activeFraction ?? 0.1,
    hot: o.hotShare ?? 0.25,
    rank,
    rt: rank - 1,
    m: Math.min(COMPONENTS, rank - 1),
    beta: Math.sqrt(noise),
    alpha: Math.sqrt(1 - noise),
    M,
    c,
    r0,
    r1,
    nRest: E - (r1 - r0),
    falcon,
    opt,
    layerNorm: falcon || opt,
    gated: !falcon && !opt,
    eps: 1e-5,
    vocab,
    statsTokens: o.statsTokens ?? 64,
    statsNeurons: o.statsNeurons ?? 512,
    targetRecall,
    threshold: o.threshold,
  };
}

/** Everything about one layer's FFN that the weights and predictor are built from. */
interface LayerDesign {
  l: number;
  /** Designed firing frequency and gate bias per neuron. */
  p: Float64Array;
  b: Float64Array;
  /** Low-rank components (m per neuron) and their α-scaled unit coefficients. */
  comp: Int32Array;
  coef: Float64Array;
  /**
   * Low-rank basis: row k is non-zero only on the channels of block k ({@link Designer.blocks}); the
   * value per channel is stored once (channel c: 0). Disjoint blocks keep the gate cheap to generate.
   */
  basis: Float32Array;
  /** Residual std of the non-massive channels at the FFN input, RMS of that input, normalized massive value. */
  sigma: number;
  s: number;
  hc: number;
  /** Scale of the down projection's entries. */
  downScale: number;
  /** Biases as a Q4_K file stores them (see {@link Designer.storedBias}). */
  storedB?: Float64Array;
  upBias: number;
}

class Designer {
  private cache?: LayerDesign;
  private freqs: Float64Array;

  /** Basis blocks: block k holds channels channel[start[k] .. start[k+1]) (every channel but c, in order). */
  readonly blocks: { start: Int32Array; channel: Int32Array };

  /** Gate bias Φ⁻¹(p) of each designed frequency, and Σ E[ReLU(b + z)²] over neurons. */
  private biases: Float64Array;
  private sumA2: number;
  /** Share of neurons covering 80 % of activations under the designed frequencies (same in every layer). */
  readonly hotShare: number;

  constructor(readonly r: Resolved) {
    this.freqs = powerLawFrequencies(r.F, { mean: r.active, hotShare: r.hot });
    this.hotShare = hotNeuronShare(this.freqs);
    this.biases = this.freqs.map((x) => normalQuantile(x));
    this.sumA2 = this.biases.reduce((a, b) => a + reluSecondMoment(b), 0);
    const n = r.nRest;
    const start = Int32Array.from({ length: r.rt + 1 }, (_, k) => Math.floor((k * n) / r.rt));
    const channel = Int32Array.from({ length: n }, (_, q) => (q < r.r0 ? q : q + (r.r1 - r.r0)));
    this.blocks = { start, channel };
  }

  key(l: number, kind: number): number {
    return streamKey(this.r.seed, l, kind);
  }

  /** Residual variance of the non-massive channels at the FFN input of layer l. */
  ffnInputVar(l: number): number {
    return 1 + l * (ATTN_VAR + FFN_VAR) + (this.r.falcon ? 0 : ATTN_VAR);
  }

  /** Normalized values of a residual with massive value M and other channels of std sigma. */
  normStats(sigma: number): { s: number; hc: number } {
    const { E, M, layerNorm, nRest } = this.r;
    if (layerNorm) {
      const mu = M / E;
      const v = ((M - mu) ** 2 + nRest * (sigma * sigma + mu * mu) + (E - nRest - 1) * mu * mu) / E;
      return { s: sigma / Math.sqrt(v), hc: (M - mu) / Math.sqrt(v) };
    }
    const rms = Math.sqrt((M * M + nRest * sigma * sigma) / E);
    return { s: sigma / rms, hc: M / rms };
  }

  layer(l: number): LayerDesign {
    if (this.cache?.l === l) return this.cache;
    const { F, E, rt, m, alpha } = this.r;
    // frequencies permuted over neurons (Fisher–Yates from the layer's stream)
    const perm = Int32Array.from({ length: F }, (_, i) => i);
    const pk = this.key(l, K.perm);
    for (let i = F - 1; i > 0; i--) {
      const j = hashU32(pk, i) % (i + 1);
      const t = perm[i]!;
      perm[i] = perm[j]!;
      perm[j] = t;
    }
    const p = Float64Array.from(perm, (k) => this.freqs[k]!);
    const b = Float64Array.from(perm, (k) => this.biases[k]!);
    const comp = new Int32Array(F * m);
    const coef = new Float64Array(F * m);
    const ck = this.key(l, K.comp);
    for (let i = 0; i < F; i++) {
      let norm = 0;
      for (let j = 0; j < m; j++) {
        let k = 0;
        for (let tries = 0, dup = true; dup; tries++) {
          k = hashU32(ck, i * 64 + j + 16 * tries) % rt;
          dup = false;
          for (let q = i * m; q < i * m + j; q++) if (comp[q] === k) dup = true;
        }
        comp[i * m + j] = k;
        const v = gauss(ck ^ 0x5bd1e995, i * m + j);
        coef[i * m + j] = v;
        norm += v * v;
      }
      const sc = alpha / Math.sqrt(norm);
      for (let j = 0; j < m; j++) coef[i * m + j]! *= sc;
    }
    // basis row k lives on its own block of channels (c excluded): zero mean, unit norm
    const basis = new Float32Array(E);
    const bk = this.key(l, K.basis);
    fillGauss(basis, 0, E, bk, 0, 1, 1);
    basis.fill(0, this.r.r0, this.r.r1);
    const { start, channel } = this.blocks;
    for (let k = 0; k < rt; k++) {
      const a = start[k]!;
      const z = start[k + 1]!;
      let mu = 0;
      for (let q = a; q < z; q++) mu += basis[channel[q]!]!;
      mu = z - a > 1 ? mu / (z - a) : 0;
      let n2 = 0;
      for (let q = a; q < z; q++) {
        const v = basis[channel[q]!]! - mu;
        basis[channel[q]!] = v;
        n2 += v * v;
      }
      const sc = 1 / Math.sqrt(n2);
      for (let q = a; q < z; q++) basis[channel[q]!]! *= sc;
    }
    const sigma = Math.sqrt(this.ffnInputVar(l));
    const { s, hc } = this.normStats(sigma);
    const upBias = this.r.arch === "bamboo" ? normalQuantile(BAMBOO_UP_POSITIVE) : 0;
    const upMoment = this.r.arch === "bamboo" ? reluSecondMoment(upBias) : 1;
    const downScale = Math.sqrt(FFN_VAR / (this.sumA2 * upMoment));
    this.cache = { l, p, b, comp, coef, basis, sigma, s, hc, downScale, upBias };
    return this.cache;
  }

  /** Row i of the firing matrix (ffn_gate; falcon: ffn_up): b_i at the massive channel + α·u_i·V + β·N_i. */
  gateRow(d: LayerDesign, i: number, out: Float32Array): void {
    const { E, m, beta, c, r0, r1, nRest } = this.r;
    fillGauss(out, 0, E, this.key(d.l, K.gateNoise), i * E, 1, beta / (d.s * Math.sqrt(nRest)));
    out.fill(0, r0, r1);
    if (this.r.layerNorm) centre(out, r0, r1);
    const inv = 1 / d.s;
    const { start, channel } = this.blocks;
    const B = d.basis;
    for (let j = 0; j < m; j++) {
      const k = d.comp[i * m + j]!;
      const w = d.coef[i * m + j]! * inv;
      for (let q = start[k]!, z = start[k + 1]!; q < z; q++) {
        const e = channel[q]!;
        out[e]! += w * B[e]!;
      }
    }
    out[c] = d.b[i]! / d.hc;
  }

  /** Row i of ffn_up for gated archs: N(0, 1) pre-activations (bamboo: biased to be positive 90 % of the time). */
  upRow(d: LayerDesign, i: number, out: Float32Array): void {
    const { E, c, r0, r1, nRest } = this.r;
    fillGauss(out, 0, E, this.key(d.l, K.up), i * E, 1, 1 / (d.s * Math.sqrt(nRest)));
    out.fill(0, r0, r1);
    out[c] = d.upBias / d.hc;
  }

  /** fc1 row k: V_k/σ with the ReLU offset at the massive channel; the last row reads x_c/M. */
  fc1Row(d: LayerDesign, k: number, out: Float32Array): void {
    const { rt, M, c } = this.r;
    if (k === rt) {
      out.fill(0);
      out[c] = 1 / M;
      return;
    }
    const inv = 1 / d.sigma;
    out.fill(0);
    const { start, channel } = this.blocks;
    for (let q = start[k]!, z = start[k + 1]!; q < z; q++) out[channel[q]!] = d.basis[channel[q]!]! * inv;
    out[c] = RELU_OFFSET / M;
  }

  /** fc2 row i: α·u_i on its components, b_i minus the ReLU offsets on the last. */
  fc2Row(d: LayerDesign, i: number, out: Float32Array): void {
    const { m, rt } = this.r;
    out.fill(0);
    let sum = 0;
    for (let j = 0; j < m; j++) {
      out[d.comp[i * m + j]!] = d.coef[i * m + j]!;
      sum += d.coef[i * m + j]!;
    }
    out[rt] = this.storedBias(d, i) - RELU_OFFSET * sum;
  }

  /**
   * Neuron i's bias as the file stores it. Exact for every type but Q4_K, whose 6-bit sub-block scales
   * (relative to the largest of the 256-value super-block) can miss the bias weight by a few percent of
   * the gate's spread: the predictor is built from the stored value so that it stays exact.
   */
  storedBias(d: LayerDesign, i: number): number {
    if (this.r.dtype !== "Q4_K") return d.b[i]!;
    if (!d.storedB) {
      const { E, F, c } = this.r;
      const row = new Float32Array(E);
      const sb = Math.floor(c / 256) * 256;
      const bytes = new Uint8Array(144);
      d.storedB = new Float64Array(F);
      for (let n = 0; n < F; n++) {
        this.gateRow(d, n, row);
        encode("Q4_K", row.subarray(sb, sb + 256), bytes);
        d.storedB[n] = dequantize(GGMLType.Q4_K, bytes, 256)[c - sb]! * d.hc;
      }
    }
    return d.storedB[i]!;
  }
}

/**
 * Makes the entries outside [r0, r1) sum to zero, so a LayerNorm's mean subtraction does not change the
 * row's dot product with the non-massive channels (and the predictor, which reads the residual before
 * the norm, sees the same value).
 */
function centre(row: Float32Array, r0: number, r1: number): void {
  let s = 0;
  for (let j = 0; j < row.length; j++) if (j < r0 || j >= r1) s += row[j]!;
  const mu = s / (row.length - (r1 - r0));
  for (let j = 0; j < row.length; j++) if (j < r0 || j >= r1) row[j]! -= mu;
}

/** A 2-D (or 1-D) tensor produced row by row, encoded in chunks of about 4 MiB. */
function rowsTensor(
  name: string,
  dtype: SyntheticDType | "F32",
  shape: number[],
  row: (r: number, out: Float32Array) => void,
): GgufStreamTensor {
  const rowLen = shape[0]!;
  const nRows = shape.slice(1).reduce((a, b) => a * b, 1);
  return {
    name,
    type: GGML_TYPE_OF[dtype],
    shape,
    data: function* () {
      const rowBytes = encodedBytes(dtype, rowLen);
      const per = Math.max(1, Math.min(nRows, Math.floor(CHUNK_BYTES / Math.max(rowBytes, rowLen * 4))));
      const f = new Float32Array(per * rowLen);
      const bytes = new Uint8Array(per * rowBytes);
      for (let r0 = 0; r0 < nRows; r0 += per) {
        const n = Math.min(per, nRows - r0);
        for (let r = 0; r < n; r++) row(r0 + r, f.subarray(r * rowLen, (r + 1) * rowLen));
        encode(dtype, f.subarray(0, n * rowLen), bytes.subarray(0, n * rowBytes));
        yield bytes.subarray(0, n * rowBytes);
      }
    },
  };
}

function constTensor(name: string, shape: number[], value: number): GgufStreamTensor {
  return rowsTensor(name, "F32", shape, (_, out) => out.fill(value));
}

function gaussTensor(
  name: string,
  dtype: SyntheticDType,
  shape: [number, number],
  key: number,
  scale: number,
): GgufStreamTensor {
  const n = shape[0];
  return rowsTensor(name, dtype, shape, (r, out) => fillGauss(out, 0, n, key, r * n, 1, scale));
}

/** Token embedding row t: the massive channel M, 0 in the rest of its block, N(0, 1) elsewhere. */
function embeddingRow(r: Resolved, t: number, out: Float32Array): void {
  fillGauss(out, 0, r.E, streamKey(r.seed, 0, K.embd), t * r.E, 1, 1);
  out.fill(0, r.r0, r.r1);
  out[r.c] = r.M;
}

function buildTensors(r: Resolved, des: Designer): GgufStreamTensor[] {
  const { E, F, V, L, dtype, pdtype, nKv, falcon, opt, format } = r;
  const pwri = format === "PWRI";
  const ts: GgufStreamTensor[] = [];
  // Q4_K: the massive value would set the 6-bit sub-block scales of its whole 256-value super-block and
  // wipe out the other 224 values of every embedding row; Q8_0 keeps it in a 32-value block of its own.
  const embdType = dtype === "Q4_K" ? "Q8_0" : dtype;
  ts.push(rowsTensor("token_embd.weight", embdType, [E, V], (t, out) => embeddingRow(r, t, out)));
  if (opt) {
    // learned positions with OPT's two padding rows in front; small, and 0 on the massive channel's block
    const pk = streamKey(r.seed, 0, K.positions);
    const posType = dtype === "F32" ? "F32" : "F16";
    ts.push(
      rowsTensor("position_embd.weight", posType, [E, r.shape.n_ctx + 2], (p, out) => {
        fillGauss(out, 0, E, pk, p * E, 1, 0.1);
        out.fill(0, r.r0, r.r1);
      }),
    );
  }
  const inv = 1 / Math.sqrt(E);
  for (let l = 0; l < L; l++) {
    const p = `blk.${l}.`;
    const key = (kind: number) => des.key(l, kind);
    ts.push(constTensor(`${p}attn_norm.weight`, [E], 1));
    if (opt) ts.push(constTensor(`${p}attn_norm.bias`, [E], 0));
    if (falcon) {
      ts.push(constTensor(`${p}attn_norm.bias`, [E], 0));
      if (r.shape.n_head_kv > 1) {
        // Falcon-40B's second layer norm (attention input; the FFN reads attn_norm)
        ts.push(constTensor(`${p}attn_norm_2.weight`, [E], 1));
        ts.push(constTensor(`${p}attn_norm_2.bias`, [E], 0));
      }
      ts.push(gaussTensor(`${p}attn_qkv.weight`, dtype, [E, E + 2 * nKv], key(K.qkv), inv));
    } else {
      ts.push(gaussTensor(`${p}attn_q.weight`, dtype, [E, E], key(K.q), inv));
      ts.push(gaussTensor(`${p}attn_k.weight`, dtype, [E, nKv], key(K.k), inv));
      ts.push(gaussTensor(`${p}attn_v.weight`, dtype, [E, nKv], key(K.v), inv));
      if (opt) {
        ts.push(constTensor(`${p}attn_q.bias`, [E], 0));
        ts.push(constTensor(`${p}attn_k.bias`, [nKv], 0));
        ts.push(constTensor(`${p}attn_v.bias`, [nKv], 0));
      }
    }
    ts.push(gaussTensor(`${p}attn_output.weight`, dtype, [E, E], key(K.o), Math.sqrt(ATTN_VAR) * inv));
    if (opt) {
      // OPT: LayerNorm before the FFN (weights 1, biases 0), fc1 = ffn_up fires as the design says, biases 0
      ts.push(constTensor(`${p}attn_output.bias`, [E], 0));
      ts.push(constTensor(`${p}ffn_norm.weight`, [E], 1));
      ts.push(constTensor(`${p}ffn_norm.bias`, [E], 0));
      ts.push(rowsTensor(`${p}ffn_up.weight`, dtype, [E, F], (i, out) => des.gateRow(des.layer(l), i, out)));
      ts.push(constTensor(`${p}ffn_up.bias`, [F], 0));
      ts.push(constTensor(`${p}ffn_down.bias`, [E], 0));
    } else if (!falcon) {
      ts.push(constTensor(`${p}ffn_norm.weight`, [E], 1));
      ts.push(rowsTensor(`${p}ffn_gate.weight`, dtype, [E, F], (i, out) => des.gateRow(des.layer(l), i, out)));
      ts.push(rowsTensor(`${p}ffn_up.weight`, dtype, [E, F], (i, out) => des.upRow(des.layer(l), i, out)));
    } else {
      ts.push(rowsTensor(`${p}ffn_up.weight`, dtype, [E, F], (i, out) => des.gateRow(des.layer(l), i, out)));
    }
    const dk = key(K.down);
    if (pwri) {
      // neuron-major: row i holds neuron i's output weights
      ts.push(
        rowsTensor(`${p}ffn_down_t.weight`, dtype, [E, F], (i, out) =>
          fillGauss(out, 0, E, dk, i * E, 1, des.layer(l).downScale),
        ),
      );
      ts.push(rowsTensor(`${p}fc1.weight`, pdtype, [E, r.rank], (k, out) => des.fc1Row(des.layer(l), k, out)));
      ts.push(rowsTensor(`${p}fc2.weight`, pdtype, [r.rank, F], (i, out) => des.fc2Row(des.layer(l), i, out)));
    } else {
      // the same values as ffn_down_t, stored transposed: row e holds output channel e of every neuron
      ts.push(
        rowsTensor(`${p}ffn_down.weight`, dtype, [F, E], (e, out) =>
          fillGauss(out, 0, F, dk, e, E, des.layer(l).downScale),
        ),
      );
    }
  }
  ts.push(constTensor("output_norm.weight", [E], 1));
  if (falcon || opt) ts.push(constTensor("output_norm.bias", [E], 0));
  ts.push(gaussTensor("output.weight", dtype, [E, V], streamKey(r.seed, 0, K.output), inv));
  return ts;
}

/** Sampled inputs → per-layer activation statistics, and the (logit, active) pairs for calibration. */
function measure(r: Resolved, des: Designer) {
  const { E, F, rt, m } = r;
  const T = r.statsTokens;
  const stride = Math.max(1, Math.ceil(F / r.statsNeurons));
  const neurons: number[] = [];
  for (let i = 0; i < F; i += stride) neurons.push(i);
  const pwri = r.format === "PWRI";
  const perLayer: Array<{ active: number; logits: Float64Array; truth: Uint8Array; hot: number }> = [];
  const x = new Float32Array(E);
  const h = new Float64Array(T * E);
  const y = new Float64Array(T * (rt + 1));
  const row = new Float32Array(E);
  const fc2 = new Float32Array(rt + 1);
  const tokKey = streamKey(r.seed, 0, K.tokens);
  for (let l = 0; l < r.L; l++) {
    const d = des.layer(l);
    const drift = Math.sqrt(Math.max(0, d.sigma * d.sigma - 1));
    const dk = des.key(l, K.drift);
    for (let t = 0; t < T; t++) {
      const id = hashU32(tokKey, t) % r.V;
      embeddingRow(r, id, x);
      for (let e = 0; e < E; e++) if (e < r.r0 || e >= r.r1) x[e]! += drift * gauss(dk, t * E + e);
      // the FFN's input norm (weights 1, biases 0)
      let mu = 0;
      if (r.layerNorm) {
        for (let e = 0; e < E; e++) mu += x[e]!;
        mu /= E;
      }
      let ss = 0;
      for (let e = 0; e < E; e++) ss += (x[e]! - mu) ** 2;
      const inv = 1 / Math.sqrt(ss / E + r.eps);
      for (let e = 0; e < E; e++) h[t * E + e] = (x[e]! - mu) * inv;
      if (pwri) {
        // predictor hidden layer ReLU(fc1·x), x = the residual before the norm
        for (let k = 0; k <= rt; k++) {
          des.fc1Row(d, k, row);
          roundTrip(r.pdtype, row);
          let s = 0;
          for (let e = 0; e < E; e++) s += row[e]! * x[e]!;
          y[t * (rt + 1) + k] = Math.max(0, s);
        }
      }
    }
    const logits = new Float64Array(neurons.length * T);
    const truth = new Uint8Array(neurons.length * T);
    let active = 0;
    neurons.forEach((i, n) => {
      des.gateRow(d, i, row);
      roundTrip(r.dtype, row);
      if (pwri) {
        des.fc2Row(d, i, fc2);
        roundTrip(r.pdtype, fc2);
      }
      for (let t = 0; t < T; t++) {
        let g = 0;
        const ht = t * E;
        for (let e = 0; e < E; e++) g += row[e]! * h[ht + e]!;
        const on = g > 0 ? 1 : 0;
        truth[n * T + t] = on;
        active += on;
        if (pwri) {
          let z = fc2[rt]! * y[t * (rt + 1) + rt]!;
          for (let j = 0; j < m; j++) {
            const k = d.comp[i * m + j]!;
            z += fc2[k]! * y[t * (rt + 1) + k]!;
          }
          logits[n * T + t] = z;
        }
      }
    });
    perLayer.push({ active: active / (neurons.length * T), logits, truth, hot: des.hotShare });
  }
  return { perLayer, nNeurons: neurons.length };
}

/** Threshold whose recall over all sampled pairs is at least `target`. */
function calibrate(pairs: Array<{ logits: Float64Array; truth: Uint8Array }>, target: number): number {
  const pos: number[] = [];
  for (const { logits, truth } of pairs) for (let i = 0; i < truth.length; i++) if (truth[i]) pos.push(logits[i]!);
  if (pos.length === 0) return 0;
  pos.sort((a, b) => a - b);
  const miss = Math.floor((1 - target) * pos.length); // positives allowed below the threshold
  return Math.fround(pos[miss]!);
}

/**
 * Plans a synthetic model: resolves options, measures its activation statistics on sampled inputs,
 * calibrates the predictor threshold (PWRI) and returns the metadata and streamed tensors to write.
 * @throws RangeError for invalid options
 */
export function planSyntheticModel(opts: SyntheticModelOptions = {}): SyntheticModelPlan {
  const r = resolve(opts);
  const des = new Designer(r);
  const pwri = r.format === "PWRI";
  const measured = r.statsTokens > 0;
  const { perLayer, nNeurons } = measured ? measure(r, des) : { perLayer: [], nNeurons: 0 };
  const threshold = pwri ? (r.threshold ?? (measured ? calibrate(perLayer, r.targetRecall) : 0)) : undefined;
  const layerStats: SyntheticLayerStats[] = perLayer.map((s, l) => {
    const out: SyntheticLayerStats = { layer: l, activeFraction: s.active, hotShare: s.hot };
    if (threshold !== undefined) {
      let tp = 0;
      let pred = 0;
      let pos = 0;
      for (let i = 0; i < s.truth.length; i++) {
        const p = s.logits[i]! >= threshold;
        pred += p ? 1 : 0;
        pos += s.truth[i]!;
        if (p && s.truth[i]) tp++;
      }
      out.predictedFraction = pred / s.truth.length;
      out.recall = pos ? tp / pos : 1;
      out.precision = pred ? tp / pred : 1;
    }
    return out;
  });
  const avg = (k: keyof SyntheticLayerStats) => {
    const v = layerStats.map((s) => s[k]).filter((x): x is number => x !== undefined);
    return v.length ? v.reduce((a, b) => a + b, 0) / v.length : undefined;
  };
  const stats: SyntheticModelReport["stats"] = measured
    ? { activeFraction: avg("activeFraction")!, hotShare: avg("hotShare")! }
    : undefined;
  if (pwri && stats) {
    stats.predictedFraction = avg("predictedFraction");
    stats.recall = avg("recall");
    stats.precision = avg("precision");
  }

  const a = r.ggufArch;
  const u32 = (key: string, value: number): GgufMetadataEntry => ({ key, type: GgufTypes.u32, value });
  const f32 = (key: string, value: number): GgufMetadataEntry => ({ key, type: GgufTypes.f32, value });
  const str = (key: string, value: string): GgufMetadataEntry => ({ key, type: GgufTypes.string, value });
  const metadata: GgufMetadataEntry[] = [
    str("general.architecture", a),
    str(
      "general.name",
      `synthetic ${r.arch} ${r.preset}${r.L < r.shape.n_layer ? ` (${r.L} of ${r.shape.n_layer} layers)` : ""} ${r.dtype}`,
    ),
    u32("general.file_type", FILE_TYPE[r.dtype]),
    u32(`${a}.context_length`, r.shape.n_ctx),
    u32(`${a}.embedding_length`, r.E),
    u32(`${a}.block_count`, r.L),
    u32(`${a}.feed_forward_length`, r.F),
    u32(`${a}.attention.head_count`, r.shape.n_head),
    u32(`${a}.attention.head_count_kv`, r.shape.n_head_kv),
    r.layerNorm ? f32(`${a}.attention.layer_norm_epsilon`, r.eps) : f32(`${a}.attention.layer_norm_rms_epsilon`, r.eps),
  ];
  if (!r.layerNorm) metadata.push(u32(`${a}.rope.dimension_count`, r.headDim));
  if (r.arch === "relu-llama" || r.arch === "falcon") metadata.push(str(`${a}.hidden_act`, "relu"));
  metadata.push(...r.vocab);
  if (threshold !== undefined) metadata.push(f32("powerinfer.sparse_threshold", threshold));
  metadata.push(
    str("powerinfer.synthetic.generator", "powerinfer-ts gen-model 1"),
    str("powerinfer.synthetic.arch", r.arch),
    str("powerinfer.synthetic.preset", r.preset),
    u32("powerinfer.synthetic.full_block_count", r.shape.n_layer),
    u32("powerinfer.synthetic.seed", r.seed),
    f32("powerinfer.synthetic.active_fraction", r.active),
    f32("powerinfer.synthetic.hot_share", r.hot),
    f32("powerinfer.synthetic.predictor_noise", r.beta * r.beta),
    u32("powerinfer.synthetic.predictor_rank", r.rank),
    u32("powerinfer.synthetic.massive_channel", r.c),
    f32("powerinfer.synthetic.massive_value", r.M),
  );
  if (stats) metadata.push(f32("powerinfer.synthetic.sampled_active_fraction", stats.activeFraction));
  if (pwri && stats) {
    metadata.push(
      f32("powerinfer.synthetic.sampled_recall", stats.recall!),
      f32("powerinfer.synthetic.sampled_precision", stats.precision!),
      f32("powerinfer.synthetic.sampled_predicted_fraction", stats.predictedFraction!),
    );
  }
  const tensors = buildTensors(r, des);
  const spec: GgufStreamSpec = { format: r.format, metadata, tensors };
  const params = tensors.reduce((s, t) => s + t.shape.reduce((x, y) => x * y, 1), 0);
  const notes: string[] = [];
  if (r.arch === "bamboo") notes.push("llama.cpp has no bamboo architecture; only powerinfer-ts runs this file");
  if (r.opt) notes.push("llama.cpp has no opt architecture; only powerinfer-ts runs this file");
  if (!pwri && (r.arch === "relu-llama" || r.arch === "falcon")) {
    notes.push(
      `llama.cpp ignores ${a}.hidden_act and runs this file with its default activation (same bytes and speed)`,
    );
  }
  if (pwri) notes.push("llama.cpp cannot load PWRI files; generate the same model with --format gguf for it");
  if (r.dtype === "Q4_K") notes.push("token_embd is Q8_0 (a Q4_K block cannot hold the massive channel)");
  const report: SyntheticModelReport = {
    arch: r.arch,
    ggufArch: r.ggufArch,
    format: r.format,
    preset: r.preset,
    shape: r.shape,
    layers: r.L,
    dtype: r.dtype,
    n_vocab: r.V,
    bytes: ggufStreamSize(spec),
    params,
    seed: r.seed,
    design: {
      activeFraction: r.active,
      hotShare: r.hot,
      predictorNoise: r.beta * r.beta,
      massiveChannel: r.c,
      massive: r.M,
    },
    statsTokens: r.statsTokens,
    statsNeurons: nNeurons,
    stats,
    perLayer: layerStats,
    notes,
  };
  if (pwri) {
    report.predictorDType = r.pdtype;
    report.predictorRank = r.rank;
    report.threshold = threshold;
  }
  return { spec, report };
}

/** Options of {@link generateSyntheticModel} besides the model's: those of the streaming writer. */
export type GenerateOptions = GgufStreamOptions;

/**
 * Generates a synthetic model into `path` (streamed, temp file + rename; refuses when the disk lacks room).
 * @throws RangeError for invalid options, GgufError 'IO' for disk problems (nothing is left behind)
 */
export async function generateSyntheticModel(
  path: string,
  opts: SyntheticModelOptions = {},
  gen: GenerateOptions = {},
): Promise<SyntheticModelReport> {
  const t0 = performance.now();
  const { spec, report } = planSyntheticModel(opts);
  await writeGgufStreaming(path, spec, gen);
  return { ...report, path, seconds: (performance.now() - t0) / 1000 };
}
