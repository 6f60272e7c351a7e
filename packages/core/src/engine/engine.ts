/**
 * The engine API the apps use: load a GGUF model onto a backend, open a session (a KV cache),
 * evaluate tokens to logits, or generate text as an async iterator of tokens.
 */
import {
  dequantize,
  f32ToF16,
  type GgufFile,
  GGMLType,
  type ModelConfig,
  openGguf,
  parseModelConfig,
  readTensorBytes,
} from "@powerinfer/gguf";
import type { Backend } from "../backend/types.js";
import { Tokenizer, TokenDecoder } from "../tokenizer/index.js";
import {
  buildLlamaGraph,
  checkSparseMode,
  type LayerCapture,
  type LlamaWeights,
  mapLlamaWeights,
  type SparseMode,
} from "../model/llama.js";
import { WeightMapper } from "../model/weights.js";
import { EngineError } from "./errors.js";
import { KvCache, type KvCacheType } from "./kv-cache.js";
import { Sampler, type SamplerOptions } from "./sampler.js";

const SUPPORTED_ARCHS = new Set(["llama", "bamboo"]);

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
}

/**
 * A neuron-major copy of `ffn_down` ({n_ff, n_embd} → {n_embd, n_ff}) for sparse mode on a plain GGUF:
 * F16 stays F16, everything else becomes F32.
 */
function transposeDown(file: GgufFile, backend: Backend, name: string, nFf: number, nEmbd: number) {
  const t = file.tensorMap.get(name)!;
  const w = dequantize(t.type, readTensorBytes(file, t), t.nElements); // row e holds W[e, 0..n_ff)
  const f16 = t.type === GGMLType.F16;
  const out = f16 ? new Uint16Array(nFf * nEmbd) : new Float32Array(nFf * nEmbd);
  for (let e = 0; e < nEmbd; e++) {
    for (let i = 0; i < nFf; i++) {
      const v = w[e * nFf + i]!;
      out[i * nEmbd + e] = f16 ? f32ToF16(v) : v;
    }
  }
  return backend.createTensor(f16 ? "f16" : "f32", [nEmbd, nFf], out);
}

function checkAbort(signal?: AbortSignal): void {
  if (signal?.aborted) throw new EngineError("ABORTED", "model load aborted");
}

/** A model mapped onto a backend. */
export class Model {
  private disposed = false;

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
  ) {}

  /**
   * Opens a GGUF/PowerInfer GGUF file and maps its weights onto the backend.
   * @throws GgufError (bad file), EngineError 'UNSUPPORTED_ARCH' / 'MISSING_TENSOR' / 'BAD_SHAPE' /
   *   'UNSUPPORTED_TYPE' / 'ABORTED', BackendError from the backend (e.g. 'OUT_OF_MEMORY').
   */
  static async load(path: string, opts: ModelLoadOptions): Promise<Model> {
    const t0 = performance.now();
    checkAbort(opts.signal);
    opts.onProgress?.(0, "reading header");
    const file = openGguf(path);
    const config = parseModelConfig(file);
    if (!SUPPORTED_ARCHS.has(config.arch)) {
      throw new EngineError(
        "UNSUPPORTED_ARCH",
        `architecture ${config.arch} is not supported yet (supported: ${[...SUPPORTED_ARCHS].join(", ")})`,
      );
    }
    const tokenizer = Tokenizer.fromGguf(file);
    const mapper = new WeightMapper(file, opts.backend);
    const weights = mapLlamaWeights(config, mapper, (l) => {
      opts.onProgress?.((l + 1) / config.n_layer, `layer ${l + 1}/${config.n_layer}`);
    });
    const sparse = opts.sparse ?? (config.has_predictors && config.ffn.activation === "relu" ? "predictor" : "off");
    const threshold = opts.threshold ?? config.sparse_threshold;
    if (!Number.isFinite(threshold))
      throw new EngineError("BAD_INPUT", `sparse threshold ${threshold} is not a number`);
    if (sparse !== "off" && config.ffn.activation === "relu") {
      // a plain GGUF stores ffn_down row-per-output; sparse mode reads it neuron-major
      weights.layers.forEach((L, l) => {
        if (!L.ffnDownT && L.ffnDown) {
          L.ffnDownT = transposeDown(file, opts.backend, `blk.${l}.ffn_down.weight`, config.n_ff, config.n_embd);
          opts.backend.freeTensor(L.ffnDown);
          L.ffnDown = undefined;
        }
      });
    }
    checkSparseMode(config, weights, sparse);
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
    );
  }

  /** Opens a session with its own KV cache. */
  createSession(opts: SessionOptions = {}): Session {
    if (this.disposed) throw new EngineError("DISPOSED", "model was disposed");
    return new Session(this, opts);
  }

  /** Frees the weights on the backend (the backend itself stays loaded). */
  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
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
    for (const L of w.layers) for (const t of Object.values(L)) free(t);
  }
}

/** Options of a {@link Session}. */
export interface SessionOptions {
  /** Context size in tokens. Default: the model's n_ctx_train, at most 4096. A value above n_ctx_train is allowed (warned). */
  nCtx?: number;
  /** KV cache element type. Default "f16" (as llama.cpp). */
  kvType?: KvCacheType;
  /** Largest number of prompt tokens evaluated in one graph. Default 512. */
  nBatch?: number;
}

/** Options of {@link Session.generate}. */
export interface GenerateOptions extends SamplerOptions {
  /** Tokens to generate; −1 = until EOS or the context is full. Default −1. */
  maxTokens?: number;
  /** Generation stops when the text ends with one of these; the stop string is not emitted. */
  stop?: string[];
  /** Keep generating after an end-of-generation token. Default false. */
  ignoreEos?: boolean;
  /** Add BOS etc. when tokenizing a text prompt. Default true. */
  addSpecial?: boolean;
  /** Parse special-token text (e.g. "<s>") in the prompt. Default false. */
  parseSpecial?: boolean;
  signal?: AbortSignal;
}

export interface GeneratedToken {
  id: number;
  /** Text completed by this token (may be "" while a UTF-8 character is incomplete). */
  text: string;
}

export type StopReason = "eos" | "length" | "stop" | "context" | "aborted";

/** Timings in the units llama.cpp prints. */
export interface Timings {
  promptTokens: number;
  promptMs: number;
  generatedTokens: number;
  generateMs: number;
  stopReason?: StopReason;
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
    /** Per layer: neurons computed, summed over tokens (rows of W_up read). */
    activeRows: [] as number[],
    /** Weight rows read by every sparse op together. */
    rowsRead: 0,
  };

  constructor(
    readonly model: Model,
    opts: SessionOptions = {},
  ) {
    const cfg = model.config;
    this.nCtx = opts.nCtx ?? Math.min(cfg.n_ctx_train, 4096);
    if (!Number.isInteger(this.nCtx) || this.nCtx < 1) throw new EngineError("BAD_INPUT", `bad n_ctx ${opts.nCtx}`);
    if (this.nCtx > cfg.n_ctx_train) {
      this.warnings.push(`n_ctx ${this.nCtx} is larger than the model's trained context ${cfg.n_ctx_train}`);
    }
    this.nBatch = opts.nBatch ?? 512;
    this.kv = new KvCache(model.backend, cfg.n_layer, cfg.head_dim * cfg.n_head_kv, this.nCtx, opts.kvType ?? "f16");
  }

  /** Forgets everything in the cache. */
  reset(): void {
    this.nPast = 0;
  }

  /**
   * Appends tokens to the context and returns the logits after the last one ([n_vocab]), or after
   * every token ([n_vocab × T], token-major) with `allLogits`.
   * @throws EngineError 'CONTEXT_FULL' (nothing is appended then), 'BAD_INPUT' for an id outside the vocabulary.
   */
  evaluate(
    tokens: readonly number[] | Int32Array,
    opts: { allLogits?: boolean; onCapture?: (layers: LayerCapture[], nTokens: number) => void } = {},
  ): Float32Array {
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
    const all = opts.allLogits ? new Float32Array(n * nv) : undefined;
    let last: Float32Array | undefined;
    for (let i = 0; i < n; i += this.nBatch) {
      const chunk = Int32Array.from(tokens.slice(i, i + this.nBatch));
      const { graph, logits, sparseNodes, captures } = buildLlamaGraph(
        this.model.config,
        this.model.weights,
        this.kv,
        chunk,
        this.nPast,
        {
          allLogits: !!all,
          sparse: opts.onCapture ? "off" : this.model.sparse,
          threshold: this.model.threshold,
          capture: !!opts.onCapture,
        },
      );
      const r = this.model.backend.compute(graph);
      if (sparseNodes.layers.length) {
        const st = this.stats;
        st.tokens += chunk.length;
        sparseNodes.layers.forEach((nodes, l) => {
          // nodes[0] is the up projection: its rows read = neurons computed, summed over tokens
          st.activeRows[l] = (st.activeRows[l] ?? 0) + r.rowsRead[nodes[0]!]!;
          st.rowsRead += nodes.reduce((s, n) => s + r.rowsRead[n]!, 0);
        });
      }
      opts.onCapture?.(captures, chunk.length);
      this.nPast += chunk.length;
      if (all) all.set(logits, i * nv);
      last = logits;
    }
    return all ?? last!;
  }

  /** Tokenizes `prompt` (when text), evaluates it, then samples until a stop condition. */
  async *generate(prompt: string | readonly number[], opts: GenerateOptions = {}): AsyncGenerator<GeneratedToken> {
    const tok = this.model.tokenizer;
    const ids =
      typeof prompt === "string"
        ? tok.tokenize(prompt, { addSpecial: opts.addSpecial ?? true, parseSpecial: opts.parseSpecial ?? false })
        : [...prompt];
    if (ids.length === 0) throw new EngineError("BAD_INPUT", "empty prompt");
    if (this.nPast + ids.length > this.nCtx) {
      throw new EngineError(
        "PROMPT_TOO_LONG",
        `prompt has ${ids.length} tokens, context has room for ${this.nCtx - this.nPast} (n_ctx ${this.nCtx})`,
      );
    }
    const sampler = new Sampler(opts);
    for (const t of ids) sampler.accept(t);
    const timings: Timings = { promptTokens: ids.length, promptMs: 0, generatedTokens: 0, generateMs: 0 };
    this.timings = timings;
    let t0 = performance.now();
    let logits = this.evaluate(ids);
    timings.promptMs = performance.now() - t0;
    const max = opts.maxTokens ?? -1;
    const stops = (opts.stop ?? []).filter((s) => s.length > 0);
    const decoder = new TokenDecoder(tok);
    let text = "";
    let emitted = 0;
    let reason: StopReason;
    t0 = performance.now();
    for (;;) {
      if (opts.signal?.aborted) {
        reason = "aborted";
        break;
      }
      if (max >= 0 && timings.generatedTokens >= max) {
        reason = "length";
        break;
      }
      const id = sampler.sample(logits);
      sampler.accept(id);
      timings.generatedTokens++;
      if (!opts.ignoreEos && tok.isEog(id)) {
        reason = "eos";
        break;
      }
      text += decoder.push(id);
      if (stops.length) {
        const hits = stops.map((s) => text.indexOf(s, Math.max(0, emitted - s.length))).filter((i) => i >= 0);
        if (hits.length) {
          const hit = Math.min(...hits);
          if (hit > emitted) yield { id, text: text.slice(emitted, hit) };
          emitted = text.length;
          reason = "stop";
          break;
        }
        // hold back a tail that could be the start of a stop string
        const hold = Math.max(...stops.map((s) => s.length - 1));
        const safe = Math.max(emitted, text.length - hold);
        yield { id, text: text.slice(emitted, safe) };
        emitted = safe;
      } else {
        yield { id, text: text.slice(emitted) };
        emitted = text.length;
      }
      if (this.nPast >= this.nCtx) {
        reason = "context";
        break;
      }
      logits = this.evaluate([id]);
      timings.generateMs = performance.now() - t0;
      // let the event loop breathe between tokens (abort signals, streaming consumers)
      await new Promise((r) => setImmediate(r));
    }
    timings.generateMs = performance.now() - t0;
    timings.stopReason = reason;
    const tail = text.slice(emitted) + decoder.flush();
    if (tail) yield { id: -1, text: tail };
  }

  dispose(): void {
    this.kv.dispose();
  }
}
