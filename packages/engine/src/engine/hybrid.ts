/**
 * Hybrid execution (PowerInfer, Song et al. 2023): each layer's FFN is split between a device backend
 * holding compact copies of the hot neurons' rows and the main (CPU) backend computing the cold
 * neurons from the mmapped file; both run at once and their partial sums are added. Attention,
 * predictors, norms and the LM head run on the main backend; only activations cross between the two.
 *
 * Per layer and batch: main computes x' = x + attention(x), h = ffn_norm(x'), and the predictor logits
 * (or the dense gate for the oracle); then device and main run `sparseFfn` over their own neuron rows
 * concurrently (`computeAsync`), and x ← x' + y_device + y_cpu.
 */
import type { ModelConfig } from "@powerinfer/gguf";
import { Graph, type TensorId } from "@powerinfer/core";
import type { Backend, TensorHandle } from "@powerinfer/core";
import { attentionBlock, F32_MIN_POSITIVE, type SparseFfnWeights, sparseFfn } from "../model/blocks.js";
import { gatherRows, transposeDown } from "../model/weights.js";
import type { Model } from "./engine.js";
import type { GeneratedToken, GenerateOptions, Timings } from "./generation.js";
import { EngineError } from "../errors.js";
import { generateTokens } from "./generate.js";
import { KvCache, type KvCacheType } from "../model/kv-cache.js";

/** Hot neurons per layer (ascending ids), e.g. from `planPlacement` or a GPU index. */
export interface HybridPlan {
  layers: { hot: Int32Array }[];
}

export interface HybridSessionOptions {
  /** The backend that holds the hot neurons (a GPU; in tests a second CPU backend with a memory budget). */
  device: Backend;
  plan: HybridPlan;
  nCtx?: number;
  kvType?: KvCacheType;
}

/** When each side of one layer's FFN ran (ms on the Date.now() clock, derived from the backend's own elapsed time). */
export interface FfnTiming {
  layer: number;
  side: "device" | "cpu";
  start: number;
  end: number;
}

interface LayerSplit {
  /** Absent for a layer without hot neurons: nothing of it is allocated on the device. */
  device?: SparseFfnWeights;
  deviceRows?: TensorHandle;
  cpu: SparseFfnWeights;
  cpuRows: TensorHandle;
  nHot: number;
  nCold: number;
}

/** Device bytes one hot neuron costs in this model's layer l: its gate, up and down_t rows and its id. */
export function hotNeuronBytes(model: Model, l: number): number {
  const L = model.weights.layers[l]!;
  const row = (t?: TensorHandle) => (t ? t.byteLength / t.ne[1]! : 0);
  // without ffn_down_t the hybrid session transposes ffn_down: F16 stays F16, other dtypes become F32
  const down = L.ffnDownT ? row(L.ffnDownT) : (L.ffnDown!.dtype === "f16" ? 2 : 4) * model.config.n_embd;
  return row(L.ffnGate) + row(L.ffnUp) + down + 4;
}

export class HybridSession {
  readonly kv: KvCache;
  readonly nCtx: number;
  nPast = 0;
  /** Per-layer timings of the last evaluate call. */
  timeline: FfnTiming[] = [];
  private readonly splits: LayerSplit[] = [];
  private readonly owned: [Backend, TensorHandle][] = [];
  private readonly device: Backend;

  constructor(
    readonly model: Model,
    opts: HybridSessionOptions,
  ) {
    const cfg = model.config;
    const main = model.backend;
    this.device = opts.device;
    if ((cfg.arch !== "llama" && cfg.arch !== "bamboo") || cfg.moe) {
      throw new EngineError(
        "UNSUPPORTED_ARCH",
        `hybrid GPU/CPU execution supports dense llama-family models (llama, bamboo); ${cfg.moe ? `${cfg.arch} with routed experts` : cfg.arch} runs on one backend`,
      );
    }
    if (opts.plan.layers.length !== cfg.n_layer) {
      throw new EngineError("BAD_INPUT", `plan has ${opts.plan.layers.length} layers, the model has ${cfg.n_layer}`);
    }
    this.nCtx = opts.nCtx ?? Math.min(cfg.n_ctx_train, 4096);
    this.kv = new KvCache(main, cfg.n_layer, cfg.head_dim * cfg.n_head_kv, this.nCtx, opts.kvType ?? "f16");
    try {
      model.weights.layers.forEach((L, l) => {
        const hot = opts.plan.layers[l]!.hot;
        const isHot = new Uint8Array(cfg.n_ff);
        for (const n of hot) {
          if (n < 0 || n >= cfg.n_ff)
            throw new EngineError("BAD_INPUT", `plan layer ${l}: neuron ${n} outside n_ff ${cfg.n_ff}`);
          isHot[n] = 1;
        }
        const cold = Int32Array.from({ length: cfg.n_ff - hot.length }, () => 0);
        for (let i = 0, j = 0; i < cfg.n_ff; i++) if (!isHot[i]) cold[j++] = i;
        let downT = L.ffnDownT;
        if (!downT) {
          downT = transposeDown(model.file, main, `blk.${l}.ffn_down.weight`);
          this.owned.push([main, downT]);
        }
        const keep = (t: TensorHandle, b: Backend = this.device) => {
          this.owned.push([b, t]);
          return t;
        };
        const ids = (b: Backend, a: Int32Array) =>
          b.createTensor("i32", [Math.max(1, a.length)], a.length ? a : Int32Array.of(-1));
        const onDevice = hot.length > 0;
        this.splits.push({
          device: onDevice
            ? {
                gate: L.ffnGate && keep(gatherRows(main, L.ffnGate, hot, this.device)),
                up: keep(gatherRows(main, L.ffnUp!, hot, this.device)),
                downT: keep(gatherRows(main, downT, hot, this.device)),
              }
            : undefined,
          deviceRows: onDevice ? keep(ids(this.device, hot)) : undefined,
          cpu: { gate: L.ffnGate, up: L.ffnUp!, downT },
          cpuRows: keep(ids(main, cold), main),
          nHot: hot.length,
          nCold: cold.length,
        });
      });
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  reset(): void {
    this.nPast = 0;
  }

  /**
   * Appends tokens and returns the logits after the last one ([n_vocab]).
   * @throws EngineError 'CONTEXT_FULL' / 'BAD_INPUT'.
   */
  async evaluate(tokens: readonly number[]): Promise<Float32Array> {
    const cfg: ModelConfig = this.model.config;
    const main = this.model.backend;
    const w = this.model.weights;
    const T = tokens.length;
    if (T === 0) throw new EngineError("BAD_INPUT", "no tokens to evaluate");
    if (this.nPast + T > this.nCtx) {
      throw new EngineError("CONTEXT_FULL", `context full: ${this.nPast} + ${T} tokens > n_ctx ${this.nCtx}`);
    }
    const mode = this.model.sparse;
    const E = cfg.n_embd;
    this.timeline = [];
    let x: Float32Array | undefined;
    for (let l = 0; l < cfg.n_layer; l++) {
      const L = w.layers[l]!;
      // 1. main: attention, ffn_norm, predictor/oracle logits
      const g = new Graph();
      const pos = g.input(
        "i32",
        [T],
        Int32Array.from({ length: T }, (_, i) => this.nPast + i),
      );
      const xin: TensorId = x
        ? g.input("f32", [E, T], x)
        : g.getRows(g.handle(w.tokEmbd), g.input("i32", [T], Int32Array.from(tokens)));
      // llama-family layers (checked in the constructor): separate q/k/v and an ffn_norm
      const aw = { attnNorm: L.attnNorm, wq: L.wq!, wk: L.wk!, wv: L.wv!, wo: L.wo };
      const ffnInp = attentionBlock(g, cfg, aw, xin, pos, this.kv.k[l]!, this.kv.v[l]!, this.nPast);
      const h = g.mul(g.rmsNorm(ffnInp, cfg.norm.eps), g.handle(L.ffnNorm!));
      let logitsT: TensorId | undefined;
      if (mode === "predictor") logitsT = g.mulMat(g.handle(L.fc2!), g.relu(g.mulMat(g.handle(L.fc1!), ffnInp)));
      else if (mode === "oracle") logitsT = g.mulMat(g.handle(L.ffnGate!), h);
      const ffnInpOut = g.output(ffnInp);
      const hOut = g.output(h);
      const logitsOut = logitsT === undefined ? undefined : g.output(logitsT);
      main.compute(g);
      const threshold = mode === "oracle" ? F32_MIN_POSITIVE : this.model.threshold;

      // 2. device (hot rows) and main (cold rows) at once
      const split = this.splits[l]!;
      const side = (
        b: Backend,
        W: SparseFfnWeights | undefined,
        rows: TensorHandle | undefined,
        n: number,
        name: "device" | "cpu",
      ) => {
        if (n === 0 || !W || !rows) return Promise.resolve(new Float32Array(E * T));
        const gs = new Graph();
        const hh = gs.input("f32", [E, T], hOut);
        const lg = logitsOut ? gs.input("f32", [cfg.n_ff, T], logitsOut) : undefined;
        const y = sparseFfn(gs, cfg, W, hh, {
          logits: lg,
          rows: gs.handle(rows),
          threshold,
          gate: mode === "oracle" ? lg : undefined,
        });
        const out = gs.output(y);
        return b.computeAsync(gs).then((r) => {
          const end = Date.now();
          this.timeline.push({ layer: l, side: name, start: end - r.elapsedMs, end });
          return out;
        });
      };
      const [yDev, yCpu] = await Promise.all([
        side(this.device, split.device, split.deviceRows, split.nHot, "device"),
        side(main, split.cpu, split.cpuRows, split.nCold, "cpu"),
      ]);
      x = ffnInpOut;
      // in float32, as the single-backend graph adds: x' + (y_hot + y_cold)
      for (let i = 0; i < x.length; i++) x[i] = Math.fround(yDev[i]! + yCpu[i]!) + x[i]!;
    }
    // 3. main: output norm and LM head on the last token
    const g = new Graph();
    let xl: TensorId = g.input("f32", [E, T], x!);
    if (T > 1) xl = g.getRows(xl, g.input("i32", [1], Int32Array.of(T - 1)));
    const logits = g.output(g.mulMat(g.handle(w.output), g.mul(g.rmsNorm(xl, cfg.norm.eps), g.handle(w.outputNorm))));
    main.compute(g);
    this.nPast += T;
    return logits;
  }

  timings: Timings = { promptTokens: 0, promptMs: 0, generatedTokens: 0, generateMs: 0 };

  /** Tokenizes `prompt` (when text), evaluates it, then samples until a stop condition (as Session.generate). */
  generate(prompt: string | readonly number[], opts: GenerateOptions = {}): AsyncGenerator<GeneratedToken> {
    this.timings = { promptTokens: 0, promptMs: 0, generatedTokens: 0, generateMs: 0 };
    return generateTokens(this, this.model.tokenizer, prompt, opts, this.timings);
  }

  /** Device bytes this session allocated for hot neurons. */
  deviceBytes(): number {
    return this.device.allocatedBytes();
  }

  dispose(): void {
    for (const [b, t] of this.owned) b.freeTensor(t);
    this.owned.length = 0;
    this.kv.dispose();
  }
}
