/**
 * The decoder graphs: the Llama family (Llama 2 with GQA and SiLU-gated FFN; ReLU-Llama/ProSparse
 * ReLU(gate)·up; Bamboo ReLU(gate)·ReLU(up)), following Touvron et al. 2023 and llama.cpp's
 * `llm_build_llama`; Falcon (Almazrouei et al. 2023; llama.cpp's `llm_build_falcon`); OPT (Zhang et al.
 * 2022, Hugging Face `OPTForCausalLM` with pre-layer-norm). One layer per screenful:
 *
 *   llama:  h = rms_norm(x)·attn_norm;  q,k,v = Wq·h, Wk·h, Wv·h;  q,k = rope(q,k);  cache ← k,v
 *           x = x + Wo·attention(q, cache);  h = rms_norm(x)·ffn_norm;  x = x + W_down·(act(W_gate·h) ⊙ W_up·h)
 *           (with experts: x = x + Σ_chosen p_e·FFN_e(h), see blocks.ts moeFfn)
 *   qwen2/3: llama with NeoX RoPE; qwen2 adds q/k/v biases, qwen3 an RMS norm of every q and k head
 *           (weights attn_q_norm/attn_k_norm [head_dim]) before RoPE; qwen3moe is qwen3 with experts
 *   smallthinker: llama with NeoX RoPE, ReGLU experts routed from the layer input (before attn_norm),
 *           softmax or sigmoid gating, NoPE and sliding-window layers (config.layer_attention), tied output
 *   falcon: h = layer_norm(x)·attn_norm + b;  q,k,v = rows of W_qkv·h₂ with h₂ = attn_norm_2(x) (40B) or h
 *           (7B);  q,k = rope_neox(q,k);  x = (W_down·act(W_up·h) + Wo·attention(…)) + x
 *   opt:    x = tok_embd[t] + pos_embd[p];  h = layer_norm(x)·attn_norm + b;  q,k,v = W·h + b (no RoPE)
 *           x = x + Wo·attention(…) + bo;  h = layer_norm(x)·ffn_norm + b;  x = x + W_down·ReLU(W_up·h + b) + b
 */
import type { ModelConfig } from "@powerinfer/gguf";
import { Graph, type TensorId } from "@powerinfer/core";
import type { TensorHandle } from "@powerinfer/core";
import { EngineError } from "../errors.js";
import type { KvCache } from "./kv-cache.js";
import { LAYER_BUILDERS } from "./archs/index.js";
import { type ExpertWeights, ropeParams } from "./blocks.js";
import { type LayerContext, type LayerOffload, normed, onBackend } from "./layer.js";
import type { WeightMapper } from "./weights.js";

export interface LlamaLayerWeights {
  attnNorm: TensorHandle;
  /** Layer-norm bias (falcon, opt). */
  attnNormB?: TensorHandle;
  /** Falcon-40B: the attention's own norm of the layer input (`attn_norm_2`), weight and bias. */
  attnNorm2?: TensorHandle;
  attnNorm2B?: TensorHandle;
  /** Separate projections (llama, opt) … */
  wq?: TensorHandle;
  wk?: TensorHandle;
  wv?: TensorHandle;
  /** … or one fused {n_embd, n_embd + 2·n_embd_kv} (falcon `attn_qkv`): q rows, then k, then v. */
  wqkv?: TensorHandle;
  /** Per-head RMS-norm weights of queries and keys [head_dim] (qwen3, qwen3moe). */
  attnQNorm?: TensorHandle;
  attnKNorm?: TensorHandle;
  /** Projection biases (opt, qwen2). */
  bq?: TensorHandle;
  bk?: TensorHandle;
  bv?: TensorHandle;
  wo: TensorHandle;
  bo?: TensorHandle;
  /** Absent for falcon (parallel attention and FFN). */
  ffnNorm?: TensorHandle;
  ffnNormB?: TensorHandle;
  ffnGate?: TensorHandle;
  /** Absent when the layer has routed experts. */
  ffnUp?: TensorHandle;
  /** FFN biases (opt: fc1/fc2 biases). */
  bUp?: TensorHandle;
  bDown?: TensorHandle;
  /** ffn_down {n_ff, n_embd}, or undefined when the file stores ffn_down_t. */
  ffnDown?: TensorHandle;
  /** ffn_down_t {n_embd, n_ff}: the down projection stored neuron-major (PowerInfer GGUF). */
  ffnDownT?: TensorHandle;
  /** Predictor fc1 {n_embd, r} and fc2 {r, n_ff} (PowerInfer GGUF or trained here). */
  fc1?: TensorHandle;
  fc2?: TensorHandle;
  /** Routed experts in place of the dense FFN (ffnGate/ffnUp/ffnDown absent). */
  experts?: ExpertWeights;
}

/**
 * How the FFN runs.
 * - "off": dense.
 * - "predictor": the layer's predictor (fc2·ReLU(fc1·x), x = residual after attention) gives a logit per
 *   neuron; only neurons with logit ≥ threshold are computed (PowerInfer, Song et al. 2023).
 * - "oracle": the true mask: W_gate·h (without a gate: W_up·h + b) is computed densely and a neuron runs
 *   when it is > 0 (exact for ReLU FFNs: every skipped neuron's output is 0). Testing only.
 */
export type SparseMode = "off" | "predictor" | "oracle";

export interface LlamaWeights {
  tokEmbd: TensorHandle;
  /** Learned positions (opt) {n_embd, rows}: position p reads row p + posOffset. */
  posEmbd?: TensorHandle;
  /** 2 when the file keeps OPT's two padding rows in front of the position table, else 0. */
  posOffset: number;
  outputNorm: TensorHandle;
  outputNormB?: TensorHandle;
  output: TensorHandle;
  layers: LlamaLayerWeights[];
  /** The routed experts' stacks are served from the model file through expert caches (`--ram-budget`). */
  expertsFromFile?: boolean;
}

/**
 * Maps the weights of a model (llama with or without routed experts, bamboo, falcon, opt, qwen2, qwen3,
 * qwen3moe; GGUF tensor names as llama.cpp and PowerInfer write them).
 * @throws EngineError 'MISSING_TENSOR' / 'BAD_SHAPE' / 'UNSUPPORTED_TYPE'.
 */
export function mapLlamaWeights(cfg: ModelConfig, m: WeightMapper, onLayer?: (l: number) => void): LlamaWeights {
  const { n_embd: e, n_ff: f, n_vocab: v, n_layer } = cfg;
  const ekv = cfg.head_dim * cfg.n_head_kv;
  const dH = cfg.head_dim * cfg.n_head;
  const falcon = cfg.arch === "falcon";
  const opt = cfg.arch === "opt";
  const tokEmbd = m.map("token_embd.weight", [e, v]);
  let posEmbd: TensorHandle | undefined;
  let posOffset = 0;
  if (opt) {
    const info = m.file.tensorMap.get("position_embd.weight");
    if (!info) throw new EngineError("MISSING_TENSOR", "model file lacks tensor position_embd.weight");
    // OPT's table has two padding rows in front (Hugging Face offset 2); a converter may drop them
    const rows = info.shape[1] ?? 0;
    posOffset = rows === cfg.n_ctx_train + 2 ? 2 : 0;
    posEmbd = m.map("position_embd.weight", [e, rows]);
  }
  const opt1 = (name: string, ne: number[]) => m.mapOptional(name, ne);
  /** q/k/v biases (qwen2) and per-head q/k norms (qwen3, qwen3moe). */
  const qkExtras = (p: string): Partial<LlamaLayerWeights> => ({
    bq: cfg.qkv_bias && !opt ? m.map(`${p}attn_q.bias`, [dH]) : undefined,
    bk: cfg.qkv_bias && !opt ? m.map(`${p}attn_k.bias`, [ekv]) : undefined,
    bv: cfg.qkv_bias && !opt ? m.map(`${p}attn_v.bias`, [ekv]) : undefined,
    attnQNorm: cfg.qk_norm ? m.map(`${p}attn_q_norm.weight`, [cfg.head_dim]) : undefined,
    attnKNorm: cfg.qk_norm ? m.map(`${p}attn_k_norm.weight`, [cfg.head_dim]) : undefined,
  });
  const layers: LlamaLayerWeights[] = [];
  for (let l = 0; l < n_layer; l++) {
    const p = `blk.${l}.`;
    const hasDownT = m.has(`${p}ffn_down_t.weight`);
    // bundled layout: up/gate/down_t live in blk.N.ffn_bundle.weight, bound later through a neuron cache
    const bundled = m.has(`${p}ffn_bundle.weight`);
    if (cfg.moe) {
      const { n_expert: nx, n_ff_exp: fx } = cfg.moe;
      layers.push({
        attnNorm: m.map(`${p}attn_norm.weight`, [e]),
        wq: m.map(`${p}attn_q.weight`, [e, dH]),
        wk: m.map(`${p}attn_k.weight`, [e, ekv]),
        wv: m.map(`${p}attn_v.weight`, [e, ekv]),
        ...qkExtras(p),
        wo: m.map(`${p}attn_output.weight`, [dH, e]),
        ffnNorm: m.map(`${p}ffn_norm.weight`, [e]),
        experts: {
          gateInp: m.map(`${p}ffn_gate_inp.weight`, [e, nx]),
          gateExps: m.map(`${p}ffn_gate_exps.weight`, [e, fx, nx]),
          upExps: m.map(`${p}ffn_up_exps.weight`, [e, fx, nx]),
          // a PowerInfer-layout file stores each expert's down projection neuron-major (ffn_down_exps_t)
          ...(m.has(`${p}ffn_down_exps_t.weight`)
            ? { downExpsT: m.map(`${p}ffn_down_exps_t.weight`, [e, fx, nx]) }
            : { downExps: m.map(`${p}ffn_down_exps.weight`, [fx, e, nx]) }),
          fc1Exps: cfg.has_predictors ? m.map(`${p}fc1_exps.weight`, [e, cfg.predictor_ranks[l]!, nx]) : undefined,
          fc2Exps: cfg.has_predictors ? m.map(`${p}fc2_exps.weight`, [cfg.predictor_ranks[l]!, fx, nx]) : undefined,
        },
      });
      onLayer?.(l);
      continue;
    }
    const L: LlamaLayerWeights = {
      attnNorm: m.map(`${p}attn_norm.weight`, [e]),
      attnNormB: falcon || opt ? m.map(`${p}attn_norm.bias`, [e]) : undefined,
      wo: m.map(`${p}attn_output.weight`, [dH, e]),
      bo: opt ? m.map(`${p}attn_output.bias`, [e]) : undefined,
      ffnNorm: falcon ? undefined : m.map(`${p}ffn_norm.weight`, [e]),
      ffnNormB: opt ? m.map(`${p}ffn_norm.bias`, [e]) : undefined,
      ffnGate: cfg.ffn.gated && !bundled ? m.map(`${p}ffn_gate.weight`, [e, f]) : undefined,
      ffnUp: bundled ? undefined : m.map(`${p}ffn_up.weight`, [e, f]),
      bUp: opt ? m.map(`${p}ffn_up.bias`, [f]) : undefined,
      ffnDown: hasDownT || bundled ? undefined : m.map(`${p}ffn_down.weight`, [f, e]),
      bDown: opt ? m.map(`${p}ffn_down.bias`, [e]) : undefined,
      ffnDownT: hasDownT ? m.map(`${p}ffn_down_t.weight`, [e, f]) : undefined,
      fc1: cfg.has_predictors ? m.map(`${p}fc1.weight`, [e, cfg.predictor_ranks[l]!]) : undefined,
      fc2: cfg.has_predictors ? m.map(`${p}fc2.weight`, [cfg.predictor_ranks[l]!, f]) : undefined,
    };
    if (falcon && m.has(`${p}attn_qkv.weight`)) {
      L.wqkv = m.map(`${p}attn_qkv.weight`, [e, dH + 2 * ekv]);
      L.attnNorm2 = opt1(`${p}attn_norm_2.weight`, [e]);
      if (L.attnNorm2) L.attnNorm2B = m.map(`${p}attn_norm_2.bias`, [e]);
    } else {
      L.wq = m.map(`${p}attn_q.weight`, [e, dH]);
      L.wk = m.map(`${p}attn_k.weight`, [e, ekv]);
      L.wv = m.map(`${p}attn_v.weight`, [e, ekv]);
      if (opt) {
        L.bq = m.map(`${p}attn_q.bias`, [dH]);
        L.bk = m.map(`${p}attn_k.bias`, [ekv]);
        L.bv = m.map(`${p}attn_v.bias`, [ekv]);
      } else {
        Object.assign(L, qkExtras(p));
      }
    }
    layers.push(L);
    onLayer?.(l);
  }
  const outputNorm = m.map("output_norm.weight", [e]);
  const outputNormB = falcon || opt ? m.map("output_norm.bias", [e]) : undefined;
  // Tied embeddings: llama.cpp falls back to token_embd when output.weight is absent.
  const output = m.mapOptional("output.weight", [e, v]) ?? tokEmbd;
  return { tokEmbd, posEmbd, posOffset, outputNorm, outputNormB, output, layers };
}

export interface ForwardOptions {
  /** Per layer, how it runs with a device (see {@link BatchForwardOptions.offload}). */
  offload?: readonly LayerOffload[];
  /** Return logits for every token of the batch (perplexity) instead of only the last one. */
  allLogits?: boolean;
  /** Default "off". "predictor" needs fc1/fc2 and a ReLU FFN; "oracle" a ReLU-gated FFN. */
  sparse?: SparseMode;
  /** Predictor threshold; default the model's `powerinfer.sparse_threshold`. */
  threshold?: number;
  /**
   * Capture, per layer, the FFN input x (residual after attention, [n_embd × T]) and the pre-activation
   * gate W_gate·h ([n_ff × T], or W_up·h without gate) — what profiling and predictor training read.
   */
  capture?: boolean;
}

/** What {@link ForwardOptions.capture} returns, per layer, token-major. */
export interface LayerCapture {
  ffnInput: Float32Array;
  /** Empty for a layer with routed experts. */
  gate: Float32Array;
  /** Layers with routed experts: the router probabilities [n_expert × T]. */
  routerProbs?: Float32Array;
  /** Layers with routed experts: the chosen experts' gate pre-activations [n_ff_exp × n_expert_used × T]. */
  expertGate?: Float32Array;
}

/** Per-layer graph nodes of the sparse FFN, so callers can read their row counters. */
export interface SparseNodes {
  /** Node indices of mul_mat_sparse/axpy_sparse per layer. */
  layers: number[][];
  /**
   * Per layer, the node(s) of the up projection, whose rows read are the neurons computed: one, or two
   * when the layer is split between a device and main (hot and cold rows).
   */
  up: number[][];
  /** Per layer, the columns (tokens) its FFN ran on: the last layer runs only the columns whose logits are wanted. */
  cols: number[];
}

/**
 * Checks that a sparse mode can run on this model.
 * @throws EngineError 'BAD_INPUT' naming what is missing.
 */
export function checkSparseMode(cfg: ModelConfig, w: LlamaWeights, mode: SparseMode): void {
  if (mode === "off") return;
  // the FFN's activation first: no predictor or oracle helps a SiLU model
  if (cfg.ffn.activation !== "relu") {
    throw new EngineError(
      "BAD_INPUT",
      `sparse mode "${mode}" needs a ReLU FFN; this model's FFN uses ${cfg.ffn.activation}, whose outputs are rarely exactly zero — a dense model gains nothing from sparse inference`,
    );
  }
  if (cfg.moe && mode === "predictor" && !w.layers.every((L) => L.experts?.fc1Exps && L.experts.fc2Exps)) {
    throw new EngineError(
      "BAD_INPUT",
      'sparse mode "predictor" needs per-expert predictors (blk.N.fc1_exps/fc2_exps): train them with `powerinfer train-predictor` (gen-model --predictors writes designed ones for generated models), or use --sparse oracle',
    );
  }
  if (cfg.moe && cfg.ffn.activation === "relu" && !w.layers.every((L) => L.experts?.downExpsT || L.experts?.downExps)) {
    throw new EngineError("BAD_INPUT", `sparse mode "${mode}" needs every layer's expert down projections`);
  }
  if (mode === "predictor" && !cfg.moe && !w.layers.every((L) => L.fc1 && L.fc2)) {
    throw new EngineError(
      "BAD_INPUT",
      'sparse mode "predictor" needs predictors (blk.N.fc1/fc2); train them with `powerinfer train-predictor` or use --sparse oracle',
    );
  }
  if (!cfg.moe && !w.layers.every((L) => L.ffnDownT)) {
    throw new EngineError(
      "BAD_INPUT",
      `sparse mode "${mode}" needs the down projection stored neuron-major (ffn_down_t); load the model with transposeDown`,
    );
  }
}

/** One sequence of a batched forward pass ({@link buildLlamaBatchGraph}). */
export interface BatchSequence {
  /** The sequence's own KV cache. */
  kv: KvCache;
  /** New tokens (at least one), at positions nPast, nPast+1, … of this sequence. */
  tokens: Int32Array;
  /** Tokens already in this sequence's cache. */
  nPast: number;
  /** Logits wanted: after the last new token ("last", default), after every new token ("all"), or none. */
  logits?: "last" | "all" | "none";
}

/** Options of {@link buildLlamaBatchGraph}. */
export interface BatchForwardOptions extends Omit<ForwardOptions, "allLogits"> {
  /**
   * An F32 backend tensor [head_dim·n_head, ≥ total new tokens] in which the per-sequence attention outputs
   * are gathered before W_o. Needed when the batch holds more than one sequence; its contents are scratch.
   */
  scratch?: TensorHandle;
  /** The same on the device, for layers whose attention runs there (several sequences only). */
  deviceScratch?: TensorHandle;
  /**
   * Per layer, how it runs with a device (engine `ModelOffload.layers`): the graph's nodes are then
   * assigned to backends ({@link BatchGraph.nodeBackend}) for the scheduler, and the sessions' KV caches of
   * layers whose home is the device must live there.
   */
  offload?: readonly LayerOffload[];
}

/** What {@link buildLlamaBatchGraph} returns. */
export interface BatchGraph {
  graph: Graph;
  /**
   * Per sequence: its logits ([n_vocab] for "last", [n_vocab × T_s] token-major for "all") or undefined
   * for "none"; views into one output array, filled by the compute.
   */
  logits: (Float32Array | undefined)[];
  sparseNodes: SparseNodes;
  captures: LayerCapture[];
  /** With an offload: per node, the backend it runs on (0 main, 1 device). */
  nodeBackend?: number[];
  /**
   * The tensors a caller changes to compute the graph again for other tokens at other positions (the
   * session's decode-graph reuse): the token ids and positions (i32 inputs [T]), the learned-position rows
   * (position + the table's offset; models with `position_embd` only) and the logits tensor (undefined when no
   * logits are wanted).
   */
  io: { ids: TensorId; pos: TensorId; posRows?: TensorId; logits?: TensorId };
}

/**
 * Builds the forward graph for `tokens` at positions nPast.. and the array its logits land in
 * ([n_vocab] or [n_vocab × T] column-major by token).
 * @throws EngineError 'CONTEXT_FULL' when nPast + T exceeds the cache.
 */
export function buildLlamaGraph(
  cfg: ModelConfig,
  w: LlamaWeights,
  kv: KvCache,
  tokens: Int32Array,
  nPast: number,
  opts: ForwardOptions = {},
): Omit<BatchGraph, "logits"> & { logits: Float32Array } {
  const r = buildLlamaBatchGraph(cfg, w, [{ kv, tokens, nPast, logits: opts.allLogits ? "all" : "last" }], opts);
  return { ...r, logits: r.logits[0]! };
}

/**
 * Builds one forward graph for several sequences (continuous batching). The batch's columns are the new
 * tokens of every sequence, sequence after sequence; every matrix product runs once over all columns, each
 * column roped at its own position. Attention is per sequence: its columns of Q, K and V are selected with
 * get_rows, K and V written into its own cache at its n_past, and its attention output copied into the
 * scratch tensor at its column offset, from which W_o reads all columns again. Every column's result
 * depends only on its token, its position and its own cache, so a sequence gets the same logits in any
 * batch as alone (bit for bit on the dense path). With one sequence the graph is the plain single-sequence
 * graph (no selection, no scratch).
 * @throws EngineError 'CONTEXT_FULL' when a sequence's nPast + T exceeds its cache, 'BAD_INPUT' for an empty
 *   batch or sequence, a missing or too small scratch, or capture with several sequences.
 */
export function buildLlamaBatchGraph(
  cfg: ModelConfig,
  w: LlamaWeights,
  seqs: readonly BatchSequence[],
  opts: BatchForwardOptions = {},
): BatchGraph {
  if (seqs.length === 0) throw new EngineError("BAD_INPUT", "empty batch");
  const multi = seqs.length > 1;
  const offsets: number[] = [];
  let T = 0;
  for (const s of seqs) {
    const n = s.tokens.length;
    if (n === 0) throw new EngineError("BAD_INPUT", "a sequence of the batch has no tokens");
    if (s.nPast + n > s.kv.nCtx) {
      throw new EngineError(
        "CONTEXT_FULL",
        `context full: ${s.nPast} tokens in the cache + ${n} new > n_ctx ${s.kv.nCtx}`,
      );
    }
    offsets.push(T);
    T += n;
  }
  const dH = cfg.head_dim * cfg.n_head;
  if (multi) {
    const sc = opts.scratch;
    if (sc?.dtype !== "f32" || sc.ne[0] !== dH || (sc.ne[1] ?? 1) < T) {
      throw new EngineError(
        "BAD_INPUT",
        `a batch of ${seqs.length} sequences needs an f32 scratch tensor of [${dH}, ≥ ${T}]${sc ? `, got ${sc.dtype} [${sc.ne.join(", ")}]` : ""}`,
      );
    }
    if (opts.capture) throw new EngineError("BAD_INPUT", "capture works on one sequence only");
    const dsc = opts.deviceScratch;
    if (opts.offload?.some((L) => L.home === 1) && (dsc?.dtype !== "f32" || dsc.ne[0] !== dH || (dsc.ne[1] ?? 1) < T)) {
      throw new EngineError(
        "BAD_INPUT",
        `a batch of ${seqs.length} sequences with attention on the device needs an f32 device scratch tensor of [${dH}, ≥ ${T}]`,
      );
    }
  }
  if (opts.offload && opts.offload.length !== w.layers.length) {
    throw new EngineError("BAD_INPUT", `offload has ${opts.offload.length} layers, the model has ${w.layers.length}`);
  }
  const g = new Graph();
  // llama.cpp computes the matrix products of a sequence's ≥ 2 tokens with its GEMM arithmetic
  if (seqs.some((s) => s.tokens.length > 1))
    g.gemmColumns(Int32Array.from(seqs.flatMap((s) => Array.from(s.tokens, () => (s.tokens.length > 1 ? 1 : 0)))));
  const sparseNodes: SparseNodes = { layers: [], up: [], cols: [] };
  const captures: LayerCapture[] = [];
  if (opts.capture && (opts.sparse ?? "off") !== "off")
    throw new EngineError("BAD_INPUT", "capture needs the dense FFN");
  const rope = ropeParams(cfg);
  const posData = new Int32Array(T);
  const idsData = new Int32Array(T);
  seqs.forEach((s, i) => {
    for (let j = 0; j < s.tokens.length; j++) posData[offsets[i]! + j] = s.nPast + j;
    idsData.set(s.tokens, offsets[i]!);
  });
  const pos = g.input("i32", [T], posData);
  const ids = g.input("i32", [T], idsData);
  const iota = (from: number, n: number) => Int32Array.from({ length: n }, (_, i) => from + i);
  // per sequence: the ids of its columns (several sequences only)
  const cols = multi ? seqs.map((s, i) => g.input("i32", [s.tokens.length], iota(offsets[i]!, s.tokens.length))) : [];
  const allCols = multi ? g.input("i32", [T], iota(0, T)) : -1;
  let x: TensorId = g.getRows(g.handle(w.tokEmbd), ids);
  let posRows: TensorId | undefined;
  if (w.posEmbd) {
    // learned positions (opt): row p + offset of the table
    const rows = w.posEmbd.ne[1] ?? 1;
    const last = seqs.reduce((m, s) => Math.max(m, s.nPast + s.tokens.length - 1), 0);
    if (last + w.posOffset >= rows) {
      throw new EngineError(
        "CONTEXT_FULL",
        `position ${last} is beyond the ${rows - w.posOffset} positions this model learned (position_embd)`,
      );
    }
    posRows = g.input(
      "i32",
      [T],
      posData.map((p) => p + w.posOffset),
    );
    x = g.add(x, g.getRows(g.handle(w.posEmbd), posRows));
  }
  const act = cfg.ffn.activation;
  if (act !== "silu" && act !== "relu" && act !== "gelu") {
    throw new EngineError("UNSUPPORTED_ARCH", `FFN activation ${act} is not supported`);
  }
  // the columns whose logits are wanted, in sequence order
  const outCols: number[] = [];
  const outStart: number[] = [];
  seqs.forEach((s, i) => {
    outStart.push(outCols.length);
    const mode = s.logits ?? "last";
    if (mode === "all") for (let j = 0; j < s.tokens.length; j++) outCols.push(offsets[i]! + j);
    else if (mode === "last") outCols.push(offsets[i]! + s.tokens.length - 1);
  });
  // llama.cpp's inp_out_ids: the last layer runs its FFN on the wanted columns only (not while capturing,
  // which reads every column)
  const identity = outCols.length === T; // every column, in order
  const outIds =
    outCols.length > 0 && !identity ? g.input("i32", [outCols.length], Int32Array.from(outCols)) : undefined;
  const nodeBackend: number[] | undefined = opts.offload ? [] : undefined;
  const ctx: LayerContext = {
    g,
    cfg,
    pos,
    rope,
    multi,
    seqs,
    cols,
    allCols,
    offsets,
    opts,
    captures,
    sparseNodes,
    offload: opts.offload,
    nodeBackend,
    layer: 0,
    home: 0,
    outIds: opts.capture ? undefined : outIds,
  };
  const layer = LAYER_BUILDERS[cfg.arch];
  if (!layer) throw new EngineError("UNSUPPORTED_ARCH", `no layer builder for architecture ${cfg.arch}`);
  // the embedding (and learned positions) on main
  if (nodeBackend) for (let i = 0; i < g.nodes.length; i++) nodeBackend[i] = 0;
  for (let l = 0; l < w.layers.length; l++) {
    const off = opts.offload?.[l];
    ctx.layer = l;
    ctx.home = off?.home ?? 0;
    ctx.mainLayer = w.layers[l]!;
    ctx.lookAhead = w.expertsFromFile ? w.layers[l + 1]?.experts : undefined;
    const L = off?.home === 1 ? off.deviceWeights! : w.layers[l]!;
    const xin = x;
    x = onBackend(ctx, ctx.home, () => layer(ctx, l, L, xin));
  }
  ctx.home = 0;
  const nv = cfg.n_vocab;
  const result: (Float32Array | undefined)[] = seqs.map(() => undefined);
  let logitsTensor: TensorId | undefined;
  if (outCols.length > 0) {
    // (selected in the last layer unless capturing)
    if (!identity && ctx.outIds === undefined) x = g.getRows(x, outIds!);
    const out = normed(ctx, x, w.outputNorm, w.outputNormB);
    logitsTensor = g.mulMat(g.handle(w.output), out);
    const all = g.output(logitsTensor);
    seqs.forEach((s, i) => {
      const mode = s.logits ?? "last";
      if (mode === "none") return;
      const n = mode === "all" ? s.tokens.length : 1;
      result[i] = all.subarray(outStart[i]! * nv, (outStart[i]! + n) * nv);
    });
  }
  // the output norm and head on main
  if (nodeBackend) for (let i = 0; i < g.nodes.length; i++) nodeBackend[i] ??= 0;
  return {
    graph: g,
    logits: result,
    sparseNodes,
    captures,
    nodeBackend,
    io: { ids, pos, posRows, logits: logitsTensor },
  };
}
