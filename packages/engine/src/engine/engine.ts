/**
 * The engine API the apps use: load a GGUF model onto a backend, open a session (a KV cache),
 * evaluate tokens to logits, or generate text as an async iterator of tokens.
 */
import {
  type ActivationStats,
  assertModelFile,
  type GgufFile,
  type ModelConfig,
  openGgufModel,
  parseModelConfig,
} from "@powerinfer/gguf";
import { DTYPE_LAYOUT, Graph } from "@powerinfer/core";
import type { Backend, DType, OpName, TensorHandle } from "@powerinfer/core";
import { Tokenizer } from "@powerinfer/tokenizer";
import {
  buildLlamaBatchGraph,
  buildLlamaGraph,
  checkSparseMode,
  type LayerCapture,
  type LlamaWeights,
  mapLlamaWeights,
  type SparseMode,
} from "../model/llama.js";
import { isBundled } from "../model/bundle.js";
import { bindNeuronCaches, planRamBudget, type RamPlan } from "../model/ram-budget.js";
import {
  dtypeOfTensor,
  expertDownNeuronMajor,
  transposeDown,
  transposeDownExperts,
  WeightMapper,
} from "../model/weights.js";
import { EngineError } from "../errors.js";
import { checkStatsForModel } from "./profile.js";
import { generateTokens } from "./generate.js";
import type { GeneratedToken, GenerateOptions, Timings } from "./generation.js";
import { KvCache, type KvCacheType } from "../model/kv-cache.js";
import { type DevicePlan, ModelOffload } from "./offload.js";
import { computeScheduled, computeScheduledAsync, type ScheduledResult } from "./scheduler.js";

const SUPPORTED_ARCHS = new Set(["llama", "bamboo", "falcon", "opt", "qwen2", "qwen3", "qwen3moe", "smallthinker"]);

/**
 * Routed experts need the backend's expert ops (an optional capability) for the dtypes of the file's
 * expert tensors.
 * @throws EngineError 'UNSUPPORTED_OP' naming the backend, the op and the dtype.
 */
function checkExpertOps(backend: Backend, file: GgufFile, nLayer: number): void {
  const need: [OpName, DType][] = [
    ["softmax", "f32"],
    ["sigmoid", "f32"],
    ["top_k", "f32"],
    ["moe_sum", "f32"],
  ];
  for (let l = 0; l < nLayer; l++) {
    for (const name of ["gate", "up", "down"]) {
      const t = file.tensorMap.get(`blk.${l}.ffn_${name}_exps.weight`);
      if (t) need.push(["mul_mat_id", dtypeOfTensor(t)]);
    }
    // a PowerInfer-layout down stack (ffn_down_exps_t) is summed row by row, in the dense mode too
    const dt = file.tensorMap.get(`blk.${l}.ffn_down_exps_t.weight`);
    if (dt) need.push(["axpy_id_sparse", dtypeOfTensor(dt)]);
  }
  for (const [op, dtype] of need) {
    if (!backend.supportsOp(op, [dtype])) {
      throw new EngineError(
        "UNSUPPORTED_OP",
        `backend ${backend.name} does not implement ${op} for ${dtype}, which a model with routed experts needs (mixture-of-experts ops are an optional capability; the cpu backend has them)`,
      );
    }
  }
}

/**
 * The ops and weight dtypes the dense forward graph of `config` uses, checked against the backend's claims
 * before anything is loaded, so a backend that lacks one is told so by name instead of failing mid-generation.
 * @throws EngineError 'UNSUPPORTED_OP' listing every missing (op, dtype) pair.
 */
function checkGraphOps(backend: Backend, file: GgufFile, config: ModelConfig): void {
  const need = new Map<string, [OpName, DType]>();
  const add = (op: OpName, dtype: DType) => need.set(`${op}/${dtype}`, [op, dtype]);
  add(config.norm.type === "rms" ? "rms_norm" : "norm", "f32");
  add("mul", "f32");
  add("add", "f32");
  if (config.rope.type !== "none") add("rope", "f32");
  add(config.ffn.activation === "silu" ? "silu" : config.ffn.activation === "gelu" ? "gelu" : "relu", "f32");
  if (config.ffn.up_activation === "relu") add("relu", "f32");
  for (const t of file.tensors) {
    const name = t.name;
    if (!name.endsWith(".weight") || t.shape.length < 2) continue;
    if (name === "token_embd.weight" || name === "position_embd.weight") add("get_rows", dtypeOfTensor(t));
    if (name === "output.weight") add("mul_mat", dtypeOfTensor(t));
    const m = /^blk\.\d+\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down|down_t))\.weight$/.exec(name);
    if (!m) continue;
    if (m[1] === "attn_qkv") add("slice", "f32");
    add(m[1] === "ffn_down_t" ? "axpy_sparse" : "mul_mat", dtypeOfTensor(t));
  }
  if (!file.tensorMap.has("output.weight")) {
    const emb = file.tensorMap.get("token_embd.weight");
    if (emb) add("mul_mat", dtypeOfTensor(emb)); // tied output
  }
  const missing = [...need.values()].filter(([op, dtype]) => !backend.supportsOp(op, [dtype]));
  if (missing.length > 0) {
    throw new EngineError(
      "UNSUPPORTED_OP",
      `backend ${backend.name} does not implement ${missing.map(([op, d]) => `${op} for ${d}`).join(", ")}, which this ${config.arch} model needs`,
    );
  }
}

/**
 * Logits arrays are filled with NaN before a step is computed and checked after it: a backend that leaves
 * any unwritten, or computes NaN, is reported instead of generating from garbage.
 * @throws EngineError 'BACKEND_FAULT'.
 */
function checkLogits(backend: Backend, logits: readonly (Float32Array | undefined)[], nVocab: number): void {
  for (const l of logits) {
    if (!l) continue;
    for (let i = 0; i < l.length; i++) {
      if (Number.isNaN(l[i]!)) {
        throw new EngineError(
          "BACKEND_FAULT",
          `logit ${i % nVocab} of a token is NaN or was not written by backend ${backend.name}: the model file holds NaN or damaged weights, or the backend is broken (check it with the conformance kit)`,
        );
      }
    }
  }
}

const poison = (logits: readonly (Float32Array | undefined)[]) => {
  for (const l of logits) l?.fill(Number.NaN);
};

/** Options of {@link Model.load}. */
export interface ModelLoadOptions {
  /** The loaded backend to run on. */
  backend: Backend;
  /** Called as loading proceeds with a fraction in [0, 1] and what is being done. */
  onProgress?: (fraction: number, what: string) => void;
  /** Aborts loading; the promise rejects with EngineError 'ABORTED'. */
  signal?: AbortSignal;
  /**
   * FFN mode. Default: "predictor" when the file carries predictors, else "off" (dense).
   * "oracle" computes the true firing mask from the gate (testing). See {@link SparseMode}.
   */
  sparse?: SparseMode;
  /** Predictor threshold override (default: the file's `powerinfer.sparse_threshold`, 0 when absent). */
  threshold?: number;
  /**
   * Bytes held for weights plus the neuron caches (default: no limit, every weight mapped). Below the
   * model's size the sparse FFN's up/gate/down rows are read from the file on demand into a neuron
   * cache; see {@link planRamBudget}. The KV cache is not counted.
   */
  ramBudget?: number;
  /** Activation statistics (`powerinfer profile`): with `ramBudget`, the hottest neurons are pinned. */
  ramStats?: ActivationStats;
}

function checkAbort(signal?: AbortSignal): void {
  if (signal?.aborted) throw new EngineError("ABORTED", "model load aborted");
}

/** A model mapped onto a backend. */
export class Model {
  private disposed = false;
  /** F32 [head_dim·n_head, capacity] where a multi-sequence batch gathers its attention outputs. */
  private scratch?: TensorHandle;
  /** The same on the device (layers whose attention runs there). */
  private deviceScratch?: TensorHandle;
  /** The device placement ({@link offload}); undefined: everything on {@link backend}. */
  placement?: ModelOffload;

  private constructor(
    readonly file: GgufFile,
    readonly config: ModelConfig,
    readonly tokenizer: Tokenizer,
    readonly weights: LlamaWeights,
    readonly backend: Backend,
    /** Bytes of weights mapped. */
    readonly weightBytes: number,
    /** Milliseconds the load took. */
    readonly loadMs: number,
    /** The FFN mode every session of this model uses. */
    readonly sparse: SparseMode,
    /** The predictor threshold in use. */
    readonly threshold: number,
    /** How `ramBudget` split the weights (undefined: no budget). */
    readonly ramPlan?: RamPlan,
  ) {}

  /**
   * Opens a GGUF/PowerInfer GGUF file — or the first shard of a split model, whose other shards are
   * found by name — and maps its weights onto the backend (each tensor from the file holding it).
   * @throws GgufError (bad file; `BAD_SPLIT` for a non-first, missing or inconsistent shard;
   *   `NOT_A_MODEL` for a vocabulary-only file, GPU index or activation statistics), EngineError 'UNSUPPORTED_ARCH' / 'MISSING_TENSOR' / 'BAD_SHAPE' /
   *   'UNSUPPORTED_TYPE' / 'ABORTED' / 'STATS_MISMATCH' (`ramStats` of another model), BackendError from the
   *   backend (e.g. 'OUT_OF_MEMORY').
   */
  static async load(path: string, opts: ModelLoadOptions): Promise<Model> {
    const t0 = performance.now();
    checkAbort(opts.signal);
    opts.onProgress?.(0, "reading header");
    const file = openGgufModel(path);
    assertModelFile(file);
    const config = parseModelConfig(file);
    if (!SUPPORTED_ARCHS.has(config.arch)) {
      throw new EngineError(
        "UNSUPPORTED_ARCH",
        `architecture ${config.arch} is not supported yet (supported: ${[...SUPPORTED_ARCHS].join(", ")})`,
      );
    }
    checkGraphOps(opts.backend, file, config);
    if (config.moe) checkExpertOps(opts.backend, file, config.n_layer);
    if (config.layer_attention?.some((a) => a.window > 0) && !opts.backend.supportsOp("attention_swa", ["f16"])) {
      throw new EngineError(
        "UNSUPPORTED_OP",
        `backend ${opts.backend.name} does not implement attention_swa, which the sliding-window layers of ${config.arch} need`,
      );
    }
    if (config.qk_norm && !opts.backend.supportsOp("reshape", ["f32"])) {
      throw new EngineError(
        "UNSUPPORTED_OP",
        `backend ${opts.backend.name} does not implement reshape, which the per-head q/k norms of ${config.arch} need`,
      );
    }
    const tokenizer = Tokenizer.fromGguf(file);
    // the tokenizer's (e.g. a special token id outside the vocabulary) are the model's load warnings too
    config.warnings.push(...(tokenizer.vocab.warnings ?? []));
    // the RAM plan is decided (and a budget that is too small refused) before any weight is mapped
    const sparse0 = opts.sparse ?? (config.has_predictors && config.ffn.activation === "relu" ? "predictor" : "off");
    let ramPlan: RamPlan | undefined;
    if (opts.ramBudget !== undefined || isBundled(file)) {
      if (opts.ramStats) checkStatsForModel(opts.ramStats, config);
      // a bundled file is always read through the neuron cache: without a budget, every record pinned
      ramPlan = planRamBudget(file, config, opts.ramBudget ?? Number.MAX_SAFE_INTEGER, sparse0, opts.ramStats);
      if (ramPlan.tensors.length && !opts.backend.mapTensorCached) {
        throw new EngineError(
          "UNSUPPORTED_OP",
          `backend ${opts.backend.name} cannot serve FFN rows from the model file (no neuron cache); --ram-budget needs the cpu backend`,
        );
      }
    }
    const mapper = new WeightMapper(file, opts.backend);
    const weights = mapLlamaWeights(config, mapper, (l) => {
      opts.onProgress?.((l + 1) / config.n_layer, `layer ${l + 1}/${config.n_layer}`);
    });
    const sparse = opts.sparse ?? (config.has_predictors && config.ffn.activation === "relu" ? "predictor" : "off");
    const threshold = opts.threshold ?? config.sparse_threshold;
    if (!Number.isFinite(threshold))
      throw new EngineError("BAD_INPUT", `sparse threshold ${threshold} is not a number`);
    if (sparse !== "off" && config.ffn.activation === "relu" && config.moe) {
      // sparse experts read an F16/F32 down projection neuron-major; a quantized one stays as stored and
      // runs densely over the sparse activations (expertDownNeuronMajor)
      weights.layers.forEach((L, l) => {
        const x = L.experts!;
        const t = file.tensorMap.get(`blk.${l}.ffn_down_exps.weight`);
        // a down stack served from the file (--ram-budget) is made neuron-major by its cache as each expert
        // is read (bindNeuronCaches), not copied here
        const cached = ramPlan?.tensors.some((c) => c.layer === l && c.role === "down_exps");
        if (x.downExps && t && expertDownNeuronMajor(t.type) && !cached) {
          opts.onProgress?.(
            l / config.n_layer,
            `experts' down projections neuron-major: layer ${l + 1}/${config.n_layer}`,
          );
          x.downExpsT = transposeDownExperts(file, opts.backend, `blk.${l}.ffn_down_exps.weight`);
          opts.backend.freeTensor(x.downExps);
          x.downExps = undefined;
        }
      });
    } else if (sparse !== "off" && config.ffn.activation === "relu") {
      // a plain GGUF stores ffn_down row-per-output; sparse mode reads it neuron-major
      weights.layers.forEach((L, l) => {
        if (!L.ffnDownT && L.ffnDown) {
          opts.onProgress?.(l / config.n_layer, `down projections neuron-major: layer ${l + 1}/${config.n_layer}`);
          L.ffnDownT = transposeDown(file, opts.backend, `blk.${l}.ffn_down.weight`);
          opts.backend.freeTensor(L.ffnDown);
          L.ffnDown = undefined;
        }
      });
    }
    if (ramPlan) bindNeuronCaches(file, weights, opts.backend, ramPlan);
    checkSparseMode(config, weights, sparse);
    // copies the backend deferred (the CPU backend's huge-page copies) are made off the JS thread
    if (opts.backend.settle) {
      opts.onProgress?.(1, "copying weights");
      await opts.backend.settle();
    }
    // yield once so an abort signal raised during mapping is seen
    await new Promise((r) => setImmediate(r));
    checkAbort(opts.signal);
    opts.onProgress?.(1, "done");
    return new Model(
      file,
      config,
      tokenizer,
      weights,
      opts.backend,
      mapper.bytes,
      performance.now() - t0,
      sparse,
      threshold,
      ramPlan,
    );
  }

  /** Opens a session with its own KV cache. */
  createSession(opts: SessionOptions = {}): Session {
    if (this.disposed) throw new EngineError("DISPOSED", "model was disposed");
    return new Session(this, opts);
  }

  /**
   * Places part of the model on a device backend (PowerInfer's hybrid execution): per layer, the hot FFN
   * neurons `plan` lists (compact copies of their rows) and, where `attention` is set, the layer's attention
   * weights, norms and predictor — its KV cache then lives there too. Every later session, batch, perplexity
   * and profile run decodes through the one graph, cut by the scheduler where a node's backend changes
   * (see offload.ts for the calls per token). Sessions opened before must be closed first.
   * With routed experts the hot ids are (expert, neuron) pairs e·n_ff_exp + i (offload.ts placeExpertLayer).
   * @throws EngineError 'UNSUPPORTED_OP' (the device lacks an op the plan needs), 'BAD_INPUT' (a plan of another shape, or a model read through a neuron cache),
   *   'DISPOSED'; BackendError 'OUT_OF_MEMORY' from the device (nothing stays allocated then).
   */
  offload(device: Backend, plan: DevicePlan): ModelOffload {
    if (this.disposed) throw new EngineError("DISPOSED", "model was disposed");
    if (device === this.backend) throw new EngineError("BAD_INPUT", "the device backend is the model's own backend");
    const moe = this.config.moe;
    // routed experts: the hot ids are (expert, neuron) pairs and an expert FFN is never wholly on the device
    const nNeurons = moe ? moe.n_ff_exp * moe.n_expert : this.config.n_ff;
    const needs = plan.layers.some((L) => L.attention || (!moe && L.hot.length === nNeurons));
    if (needs) checkGraphOps(device, this.file, this.config);
    if (plan.layers.some((L) => L.hot.length > 0 && (moe || L.hot.length < nNeurons))) {
      const dt = (t?: TensorHandle) => t?.dtype;
      const L0 = this.weights.layers[0]!;
      const X = L0.experts;
      const ops: [OpName, DType | undefined][] = X
        ? [
            ["mul_mat_sparse", dt(X.gateExps)],
            ["axpy_sparse", dt(X.downExpsT) ?? (dt(X.downExps) === "f16" ? "f16" : "f32")],
            ["top_k", "f32"],
            ["moe_sum", "f32"],
            ["moe_scatter", "f32"],
            ["reshape", "f32"],
            ["mul", "f32"],
          ]
        : [
            ["mul_mat_sparse", dt(L0.ffnUp)],
            ["axpy_sparse", dt(L0.ffnDownT) ?? (dt(L0.ffnDown) === "f16" ? "f16" : "f32")],
          ];
      for (const [op, d] of ops) {
        if (d && !device.supportsOp(op, [d])) {
          throw new EngineError(
            "UNSUPPORTED_OP",
            `device backend ${device.name} does not implement ${op} for ${d}, which hot neurons of this model need there`,
          );
        }
      }
    }
    this.placement?.dispose();
    this.placement = undefined;
    this.placement = new ModelOffload(this, device, plan);
    return this.placement;
  }

  /** The backends a step runs on: [main] or [main, device]. */
  get backends(): Backend[] {
    return this.placement ? [this.backend, this.placement.device] : [this.backend];
  }

  /**
   * Evaluates new tokens of several sessions of this model in one graph (one decode step of continuous
   * batching): each session's tokens are appended to its own cache, and each gets the logits it asked for.
   * A session's logits are the same as from {@link Session.evaluate} with the same tokens, whatever else is
   * in the batch (bit for bit on the dense path; the sparse kernels may sum in another order).
   * @returns per entry: its logits ([n_vocab] for "last", [n_vocab × T] token-major for "all", undefined
   *   for "none"), plus the step's token count, compute time and sparse row counters.
   * @throws EngineError 'BAD_INPUT' (empty batch or entry, a session twice or of another model, a token id
   *   outside the vocabulary), 'CONTEXT_FULL' (nothing is appended then), 'DISPOSED'.
   */
  decodeBatch(entries: readonly BatchEntry[]): BatchResult {
    const step = this.prepareBatch(entries);
    poison(step.logits);
    return this.finishBatch(entries, step, computeScheduled(step.graph, step.nodeBackend, this.backends));
  }

  /**
   * {@link decodeBatch} with the graph computed off the JavaScript thread (`Backend.computeAsync`), so that
   * the event loop stays free while the step runs (the server's decode steps). The sessions' caches and
   * positions must not be touched until the promise settles; nothing is appended when it rejects.
   * @throws the same as {@link decodeBatch} (as a rejection).
   */
  async decodeBatchAsync(entries: readonly BatchEntry[]): Promise<BatchResult> {
    const step = this.prepareBatch(entries);
    poison(step.logits);
    return this.finishBatch(entries, step, await computeScheduledAsync(step.graph, step.nodeBackend, this.backends));
  }

  /** Checks a batch and builds its graph. */
  private prepareBatch(entries: readonly BatchEntry[]) {
    if (this.disposed) throw new EngineError("DISPOSED", "model was disposed");
    if (entries.length === 0) throw new EngineError("BAD_INPUT", "empty batch");
    const seen = new Set<Session>();
    const nv = this.config.n_vocab;
    let total = 0;
    for (const e of entries) {
      if (e.session.model !== this) throw new EngineError("BAD_INPUT", "a session of another model is in the batch");
      if (seen.has(e.session)) throw new EngineError("BAD_INPUT", "a session appears twice in the batch");
      e.session.checkPlacement();
      seen.add(e.session);
      if (e.tokens.length === 0) throw new EngineError("BAD_INPUT", "no tokens to evaluate");
      for (const t of e.tokens) {
        if (!Number.isInteger(t) || t < 0 || t >= nv)
          throw new EngineError("BAD_INPUT", `token id ${t} outside [0, ${nv})`);
      }
      if (e.session.nPast + e.tokens.length > e.session.nCtx) {
        throw new EngineError(
          "CONTEXT_FULL",
          `context full: ${e.session.nPast} + ${e.tokens.length} tokens > n_ctx ${e.session.nCtx}`,
        );
      }
      total += e.tokens.length;
    }
    // one sequence, one token (a server's lone request): the session's kept decode graph (Session.graphFor)
    const only = entries[0]!;
    if (entries.length === 1 && total === 1 && (only.logits ?? "last") === "last" && !this.placement) {
      const b = only.session.graphFor(Int32Array.from(only.tokens), false, false);
      return { ...b, logits: [b.logits], total };
    }
    const built = buildLlamaBatchGraph(
      this.config,
      this.weights,
      entries.map((e) => ({
        kv: e.session.kv,
        tokens: Int32Array.from(e.tokens),
        nPast: e.session.nPast,
        logits: e.logits ?? "last",
      })),
      {
        sparse: this.sparse,
        threshold: this.threshold,
        scratch: entries.length > 1 ? this.batchScratch(total) : undefined,
        deviceScratch:
          entries.length > 1 && this.placement?.attentionLayers
            ? this.batchScratch(total, this.placement.device)
            : undefined,
        offload: this.placement?.layers,
      },
    );
    return { ...built, total };
  }

  /** Advances the sessions past a computed batch and collects its result. */
  private finishBatch(
    entries: readonly BatchEntry[],
    step: ReturnType<typeof buildLlamaBatchGraph> & { total: number },
    r: ScheduledResult,
  ): BatchResult {
    const { logits, sparseNodes, total } = step;
    checkLogits(this.backend, logits, this.config.n_vocab);
    for (const e of entries) e.session.nPast += e.tokens.length;
    const result: BatchResult = { logits, tokens: total, computeMs: r.elapsedMs, calls: r.calls };
    if (sparseNodes.layers.length) {
      result.sparse = {
        activeRows: sparseNodes.up.map((nodes) => nodes.reduce((a, n) => a + r.rowsRead[n]!, 0)),
        layerTokens: sparseNodes.cols,
        rowsRead: sparseNodes.layers.reduce((s, nodes) => s + nodes.reduce((a, n) => a + r.rowsRead[n]!, 0), 0),
      };
    }
    return result;
  }

  /** The batch scratch tensor on `b` (main or the device), grown to hold at least `columns` columns. */
  private batchScratch(columns: number, b: Backend = this.backend): TensorHandle {
    const rows = this.config.head_dim * this.config.n_head;
    const dev = b !== this.backend;
    const cur = dev ? this.deviceScratch : this.scratch;
    const have = cur?.ne[1] ?? 0;
    if (cur && have >= columns) return cur;
    if (cur) b.freeTensor(cur);
    if (dev) this.deviceScratch = undefined;
    else this.scratch = undefined;
    // main grows by doubling; the device exactly (its bytes are set aside in the plan's budget)
    const t = b.createTensor("f32", [rows, dev ? Math.max(columns, 16) : Math.max(columns, 2 * have, 16)]);
    if (dev) this.deviceScratch = t;
    else this.scratch = t;
    return t;
  }

  /** Frees the weights on the backend (the backend itself stays loaded). */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    if (this.scratch) this.backend.freeTensor(this.scratch);
    this.scratch = undefined;
    if (this.deviceScratch) this.placement?.device.freeTensor(this.deviceScratch);
    this.deviceScratch = undefined;
    this.placement?.dispose();
    this.placement = undefined;
    const seen = new Set<number>();
    const free = (t?: { id: number }) => {
      if (t && !seen.has(t.id)) {
        seen.add(t.id);
        this.backend.freeTensor(t as never);
      }
    };
    const w = this.weights;
    free(w.tokEmbd);
    free(w.output);
    free(w.outputNorm);
    for (const L of w.layers) {
      const { experts, ...rest } = L;
      for (const t of Object.values(rest)) free(t);
      if (experts) for (const t of Object.values(experts)) free(t);
    }
  }
}

/** One session's part of a {@link Model.decodeBatch} step. */
export interface BatchEntry {
  session: Session;
  /** New tokens (at least one), appended at the session's nPast. */
  tokens: readonly number[] | Int32Array;
  /** Logits wanted: after the last token ("last", default), after every token ("all"), or none. */
  logits?: "last" | "all" | "none";
}

/** What {@link Model.decodeBatch} returns. */
export interface BatchResult {
  /** Per entry, in order: its logits, or undefined when it asked for none. */
  logits: (Float32Array | undefined)[];
  /** Tokens (graph columns) evaluated in the step. */
  tokens: number;
  /** Milliseconds the backend computed. */
  computeMs: number;
  /** Backend compute calls the step made (host round trips; 1 without a device). */
  calls: number;
  /**
   * Sparse mode only: per layer the neurons computed summed over the tokens its FFN ran on (`layerTokens`:
   * the step's tokens, in the last layer those whose logits are wanted), and all rows read.
   */
  sparse?: { activeRows: number[]; layerTokens: number[]; rowsRead: number };
}

/**
 * The warning for a context beyond the one the model was trained on (a session's warnings say it; commands
 * that size a context without a session, such as plan, print it too); undefined within the trained context.
 */
export function trainedContextWarning(cfg: Pick<ModelConfig, "n_ctx_train">, nCtx: number): string | undefined {
  return nCtx > cfg.n_ctx_train
    ? `n_ctx ${nCtx} is larger than the model's trained context ${cfg.n_ctx_train}`
    : undefined;
}

/**
 * The context size a session of this model gets for a requested n_ctx: absent, the trained context at most
 * 4096; 0, the whole trained context (llama.cpp's n_ctx = 0); any other value as given (checked by the
 * session).
 */
export function contextSize(cfg: Pick<ModelConfig, "n_ctx_train">, nCtx?: number): number {
  return nCtx === 0 ? cfg.n_ctx_train : (nCtx ?? Math.min(cfg.n_ctx_train, 4096));
}

/** Options of a {@link Session}. */
export interface SessionOptions {
  /**
   * Context size in tokens. Default: the model's n_ctx_train, at most 4096; 0: n_ctx_train (llama.cpp's
   * n_ctx = 0). A value above n_ctx_train is allowed (warned).
   */
  nCtx?: number;
  /** KV cache element type. Default "f16" (as llama.cpp). */
  kvType?: KvCacheType;
  /** Largest number of prompt tokens evaluated in one graph. Default 512. */
  nBatch?: number;
}

/** Bytes of one row (ne[0] elements) of the weight node `n` of `g` reads (its first source). */
function rowBytes(g: Graph, n: number): number {
  const t = g.tensors[g.nodes[n]!.src[0]!]!;
  const { blockSize, typeSize } = DTYPE_LAYOUT[t.dtype];
  return (t.ne[0] / blockSize) * typeSize;
}

/** A KV cache plus the position in it. */
export class Session {
  readonly kv: KvCache;
  readonly nCtx: number;
  readonly nBatch: number;
  nPast = 0;
  readonly warnings: string[] = [];
  timings: Timings = { promptTokens: 0, promptMs: 0, generatedTokens: 0, generateMs: 0 };
  /** Sparse-mode counters since the session opened (from the kernels' row counters). */
  readonly stats = {
    /** Tokens evaluated in sparse mode. */
    tokens: 0,
    /**
     * Per layer: neurons computed, summed over tokens: the rows its first sparse projection read (W_gate in
     * predictor mode where the FFN has a gate — the predicted neurons; up and down then read only those of
     * them whose gate is > 0 — else W_up).
     */
    activeRows: [] as number[],
    /** Per layer: weight bytes the sparse ops read (each op's rows read × its weight's row bytes), summed over tokens. */
    sparseBytes: [] as number[],
    /**
     * Per layer: the tokens its FFN ran on (the last layer of a prompt runs only the tokens whose logits are
     * wanted, as llama.cpp does): neurons per token of layer l = activeRows[l] / layerTokens[l].
     */
    layerTokens: [] as number[],
    /** Weight rows read by every sparse op together. */
    rowsRead: 0,
    /** Backend compute calls (host round trips) and graphs evaluated: calls per decoded token = calls / steps. */
    calls: 0,
    steps: 0,
  };
  /** The device placement the KV cache was laid out for. */
  private readonly placement?: ModelOffload;
  /** The last one-token step's graph, computed again for the next one (see graphFor). */
  private decodeGraph?: ReturnType<typeof buildLlamaGraph>;

  constructor(
    readonly model: Model,
    opts: SessionOptions = {},
  ) {
    const cfg = model.config;
    this.nCtx = contextSize(cfg, opts.nCtx);
    if (!Number.isInteger(this.nCtx) || this.nCtx < 1) throw new EngineError("BAD_INPUT", `bad n_ctx ${opts.nCtx}`);
    const pe = model.weights.posEmbd;
    const learned = pe ? (pe.ne[1] ?? 1) - model.weights.posOffset : Number.POSITIVE_INFINITY;
    if (this.nCtx > learned) {
      // learned positions (opt): no position past the table exists, so the context ends there
      this.warnings.push(`n_ctx ${this.nCtx} capped to the ${learned} positions this model learned`);
      this.nCtx = learned;
    } else {
      const w = trainedContextWarning(cfg, this.nCtx);
      if (w) this.warnings.push(w);
    }
    this.nBatch = opts.nBatch ?? 512;
    const place = model.placement;
    this.placement = place;
    this.kv = new KvCache(
      model.backend,
      cfg.n_layer,
      cfg.head_dim * cfg.n_head_kv,
      this.nCtx,
      opts.kvType ?? "f16",
      place ? (l) => (place.layers[l]!.home === 1 ? place.device : model.backend) : undefined,
    );
  }

  /**
   * @throws EngineError 'BAD_INPUT' when the model's device placement changed since this session opened
   *   (its KV cache is laid out for the old one).
   */
  checkPlacement(): void {
    if (this.placement !== this.model.placement) {
      throw new EngineError(
        "BAD_INPUT",
        "the model's device placement changed after this session was opened; open a new session",
      );
    }
  }

  /** Forgets everything in the cache. */
  reset(): void {
    this.nPast = 0;
  }

  /**
   * Appends tokens to the context and returns the logits after the last one ([n_vocab]), or after
   * every token ([n_vocab × T], token-major) with `allLogits`.
   * @throws EngineError 'CONTEXT_FULL' (nothing is appended then), 'BAD_INPUT' for an id outside the vocabulary,
   *   'BACKEND_FAULT' when the backend leaves logits unwritten or NaN.
   */
  evaluate(
    tokens: readonly number[] | Int32Array,
    opts: { allLogits?: boolean; onCapture?: (layers: LayerCapture[], nTokens: number) => void } = {},
  ): Float32Array {
    const steps = this.steps(tokens, opts);
    for (const st of steps.chunks) st.finish(computeScheduled(st.graph, st.nodeBackend, this.model.backends));
    return steps.result();
  }

  /**
   * {@link evaluate} with each graph computed off the JavaScript thread, the device's and the CPU's pieces of
   * a step at the same time (the hybrid decode path). The cache must not be touched until it settles.
   * @throws the same as {@link evaluate} (as a rejection).
   */
  async evaluateAsync(
    tokens: readonly number[] | Int32Array,
    opts: { allLogits?: boolean; onCapture?: (layers: LayerCapture[], nTokens: number) => void } = {},
  ): Promise<Float32Array> {
    const steps = this.steps(tokens, opts);
    for (const st of steps.chunks)
      st.finish(await computeScheduledAsync(st.graph, st.nodeBackend, this.model.backends));
    return steps.result();
  }

  /** Checks the tokens and prepares one graph per n_batch chunk; each is built when its turn comes. */
  private steps(
    tokens: readonly number[] | Int32Array,
    opts: { allLogits?: boolean; onCapture?: (layers: LayerCapture[], nTokens: number) => void },
  ) {
    const n = tokens.length;
    if (n === 0) throw new EngineError("BAD_INPUT", "no tokens to evaluate");
    const nv = this.model.config.n_vocab;
    for (const t of tokens) {
      if (!Number.isInteger(t) || t < 0 || t >= nv)
        throw new EngineError("BAD_INPUT", `token id ${t} outside [0, ${nv})`);
    }
    if (this.nPast + n > this.nCtx) {
      throw new EngineError("CONTEXT_FULL", `context full: ${this.nPast} + ${n} tokens > n_ctx ${this.nCtx}`);
    }
    this.checkPlacement();
    const all = opts.allLogits ? new Float32Array(n * nv) : undefined;
    let last: Float32Array | undefined;
    const self = this;
    function* chunks() {
      for (let i = 0; i < n; i += self.nBatch) {
        const chunk = Int32Array.from(tokens.slice(i, i + self.nBatch));
        const built = self.graphFor(chunk, !!all, !!opts.onCapture);
        poison([built.logits]);
        yield {
          graph: built.graph,
          nodeBackend: built.nodeBackend,
          finish(r: ScheduledResult) {
            checkLogits(self.model.backend, [built.logits], nv);
            const st = self.stats;
            st.calls += r.calls;
            st.steps++;
            if (built.sparseNodes.layers.length) {
              st.tokens += chunk.length;
              built.sparseNodes.up.forEach((nodes, l) => {
                // the up projection's rows read = neurons computed, summed over tokens (hot + cold when split)
                st.activeRows[l] = (st.activeRows[l] ?? 0) + nodes.reduce((a, x) => a + r.rowsRead[x]!, 0);
                st.layerTokens[l] = (st.layerTokens[l] ?? 0) + built.sparseNodes.cols[l]!;
              });
              st.rowsRead += built.sparseNodes.layers.reduce(
                (s, ns) => s + ns.reduce((a, x) => a + r.rowsRead[x]!, 0),
                0,
              );
              built.sparseNodes.layers.forEach((nodes, l) => {
                st.sparseBytes[l] =
                  (st.sparseBytes[l] ?? 0) + nodes.reduce((a, x) => a + r.rowsRead[x]! * rowBytes(built.graph, x), 0);
              });
            }
            opts.onCapture?.(built.captures, chunk.length);
            self.nPast += chunk.length;
            if (all) all.set(built.logits, i * nv);
            last = built.logits;
          },
        };
      }
    }
    return { chunks: chunks(), result: () => all ?? last! };
  }

  /**
   * The graph of one step at position nPast. A one-token step (no capture, no device placement) reuses the
   * previous such step's graph: the token id, the position (its inputs and every position param,
   * {@link Graph.positionParams}) and a fresh logits array are written into it, which gives the graph the
   * builder would make at this position. Building and encoding a decode graph costs ~0.15–0.3 ms of JavaScript
   * per token (measured on a 2-layer 7B-shaped slice: 5–9 % of a sparse Q4_0 token).
   * @internal (Model.decodeBatch uses it for a batch of one sequence and one token)
   */
  graphFor(chunk: Int32Array, allLogits: boolean, capture: boolean) {
    const m = this.model;
    const reusable = chunk.length === 1 && !capture && !this.placement;
    const c = this.decodeGraph;
    if (reusable && c && c.io.logits !== undefined) {
      const g = c.graph;
      g.setInput(c.io.ids, chunk);
      g.setInput(c.io.pos, Int32Array.of(this.nPast));
      if (c.io.posRows !== undefined) g.setInput(c.io.posRows, Int32Array.of(this.nPast + m.weights.posOffset));
      for (const { node, param } of g.positionParams) g.setParam(node, param, this.nPast);
      return { ...c, logits: g.output(c.io.logits) };
    }
    const built = buildLlamaGraph(m.config, m.weights, this.kv, chunk, this.nPast, {
      allLogits,
      sparse: capture ? "off" : m.sparse,
      threshold: m.threshold,
      capture,
      offload: m.placement?.layers,
    });
    // kept only when every position param is this step's n_past (so moving them all is moving the step)
    const g = built.graph;
    if (reusable && g.positionParams.every(({ node, param }) => g.nodes[node]!.params[param] === this.nPast))
      this.decodeGraph = built;
    return built;
  }

  /**
   * Makes this session's cache hold the first `nTokens` positions of `src`'s cache (llama.cpp's
   * `seq_cp`): a prompt evaluated once can be continued by several sessions. Values are copied exactly.
   * @throws EngineError 'BAD_INPUT' when `src` is of another model or cache layout, or `nTokens` does not
   *   fit in either session.
   */
  copyFrom(src: Session, nTokens: number = src.nPast): void {
    if (src === this) return;
    if (src.model !== this.model || src.kv.nEmbdKv !== this.kv.nEmbdKv)
      throw new EngineError("BAD_INPUT", "copyFrom: the sessions belong to different models");
    if (!Number.isInteger(nTokens) || nTokens < 0 || nTokens > src.nPast || nTokens > this.nCtx) {
      throw new EngineError(
        "BAD_INPUT",
        `copyFrom: cannot copy ${nTokens} positions (source holds ${src.nPast}, this context has ${this.nCtx})`,
      );
    }
    if (nTokens > 0) {
      const g = new Graph();
      const ids = g.input(
        "i32",
        [nTokens],
        Int32Array.from({ length: nTokens }, (_, i) => i),
      );
      // get_rows reads (and widens) the source rows, cpy stores them in this cache's type, on the backend
      // that holds the layer's cache
      src.checkPlacement();
      this.checkPlacement();
      const nodeBackend: number[] = [];
      src.kv.k.forEach((k, l) => {
        g.cpy(g.getRows(g.handle(k), ids), g.handle(this.kv.k[l]!), 0);
        g.cpy(g.getRows(g.handle(src.kv.v[l]!), ids), g.handle(this.kv.v[l]!), 0);
        const b = this.kv.owners[l] === this.model.backend ? 0 : 1;
        while (nodeBackend.length < g.nodes.length) nodeBackend.push(b);
      });
      computeScheduled(g, this.placement ? nodeBackend : undefined, this.model.backends);
    }
    this.nPast = nTokens;
  }

  /** Tokenizes `prompt` (when text), evaluates it, then samples until a stop condition. */
  generate(prompt: string | readonly number[], opts: GenerateOptions = {}): AsyncGenerator<GeneratedToken> {
    this.timings = { promptTokens: 0, promptMs: 0, generatedTokens: 0, generateMs: 0 };
    // with a device, each step's pieces run off the JavaScript thread, the device and the CPU at once
    const self = this;
    const ev = this.model.placement
      ? {
          nCtx: this.nCtx,
          get nPast() {
            return self.nPast;
          },
          evaluate: (t: readonly number[]) => this.evaluateAsync(t),
        }
      : this;
    return generateTokens(ev, this.model.tokenizer, prompt, opts, this.timings);
  }

  dispose(): void {
    this.kv.dispose();
  }
}
