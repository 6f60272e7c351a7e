/**
 * A model's device placement (PowerInfer, Song et al. 2023, §4–5): which layers' attention (weights and
 * KV cache) and which FFN neurons live on a device backend, the rest on the main (CPU) backend. The graph
 * builder reads it to assign every node a backend, and the scheduler (scheduler.ts) cuts the graph where
 * ownership changes — so every command decodes through the one path, with or without a device.
 *
 * Per layer, the FFN is one of:
 * - "main": every neuron on the main backend (the layer's FFN as without a device);
 * - "device": every neuron on the device (whole copies of the FFN tensors: llama.cpp's `-ngl` for a layer);
 * - "split": the hot neurons' gate/up/down rows copied compactly to the device, the cold ones read on the
 *   main backend through a row list; both halves run at once and their sums are added.
 * A layer of routed experts is "main" or "split" by (expert, neuron) pair, e·n_ff_exp + i: the hot pairs' rows on
 * the device, main keeping the whole stacks and a mask that makes it skip them (see placeExpertLayer and
 * layer.ts splitExpertFfn); its router and predictors stay on main whatever its home, so a split expert layer
 * whose attention is on the device costs 3 calls more than a dense one.
 * The layer's "home" — where its norms, residual adds, attention and predictor run — is the device when
 * its attention is offloaded, else the main backend. An oracle gate (testing) is computed on the main
 * backend, which holds the whole gate matrix.
 *
 * Host round trips per decoded token (backend compute calls, one sequence or one batch): pieces are cut
 * where a node reads what another backend made. With L_s split layers whose home is main, L_d split layers
 * whose home is the device, and layers without a split merging with their neighbours on the same backend:
 *   calls = 3·L_s + 3·L_d + (runs of consecutive unsplit layers whose backend differs from the previous
 *   piece's) + 1 (the output head on main, merged when the last piece is on main).
 * For a plan that splits every layer with attention on main, calls = 3·n_layer + 1; with attention on the
 * device, 3·n_layer + 2 (the last layer's sum returns to main for the head). `Session.stats.calls` counts
 * them.
 */
import { type Backend, Graph, type TensorHandle } from "@powerinfer/core";
import { EngineError } from "../errors.js";
import type { FfnPlacement, LayerOffload } from "../model/layer.js";
import type { LlamaLayerWeights } from "../model/llama.js";
import { expertDownRows, type FileRows, gatherRows, transposeDown } from "../model/weights.js";

/** The largest finite f32: the mask value that keeps a hot pair out of main's selection. */
const F32_MAX = 3.4028234663852886e38;
import type { Model } from "./engine.js";

export type { FfnPlacement, LayerOffload };

/** Per layer: the hot neurons (ascending ids) and whether attention and its KV cache live on the device. */
export interface DevicePlan {
  layers: { hot: Int32Array; attention?: boolean }[];
}

/**
 * Device bytes one hot neuron costs in layer l: its gate, up and down_t rows and its id. With routed experts,
 * one (expert, neuron) pair: its rows of the expert stacks (`ffn_{gate,up,down}_exps`, down by its share of the
 * stack: n_embd values in the stack's dtype) and its id.
 */
export function hotNeuronBytes(model: Model, l: number): number {
  const L = model.weights.layers[l]!;
  if (L.experts) {
    const X = L.experts;
    const pairs = X.gateExps.ne[1]! * X.gateExps.ne[2]!;
    // the device's down rows are neuron-major: F16 stays F16, other dtypes become F32 (expertDownRows)
    const down = X.downExpsT
      ? X.downExpsT.byteLength / pairs
      : (X.downExps!.dtype === "f16" ? 2 : 4) * model.config.n_embd;
    return (X.gateExps.byteLength + X.upExps.byteLength) / pairs + down + 4;
  }
  const row = (t?: TensorHandle) => (t ? t.byteLength / t.ne[1]! : 0);
  // without ffn_down_t the split transposes ffn_down: F16 stays F16, other dtypes become F32
  const down = L.ffnDownT ? row(L.ffnDownT) : (L.ffnDown!.dtype === "f16" ? 2 : 4) * model.config.n_embd;
  return row(L.ffnGate) + row(L.ffnUp) + down + 4;
}

/**
 * Device bytes a split layer costs beside its hot neurons: the whole up bias (OPT), which the hot rows' op
 * output is indexed by neuron id for. 0 for layers without one.
 */
export function splitLayerFixedBytes(model: Model, l: number): number {
  return model.weights.layers[l]!.bUp?.byteLength ?? 0;
}

/** The tensors of a layer that run at its home: attention, norms, predictor, down bias. */
const HOME_FIELDS = [
  "attnNorm",
  "attnNormB",
  "attnNorm2",
  "attnNorm2B",
  "wq",
  "wk",
  "wv",
  "wqkv",
  "attnQNorm",
  "attnKNorm",
  "bq",
  "bk",
  "bv",
  "wo",
  "bo",
  "ffnNorm",
  "ffnNormB",
  "fc1",
  "fc2",
  "bDown",
] as const satisfies readonly (keyof LlamaLayerWeights)[];
/** What a layer's FFN reads when all of it runs on the device (the predictor and down bias included). */
const FFN_FIELDS = [
  "ffnGate",
  "ffnUp",
  "bUp",
  "ffnDown",
  "ffnDownT",
  "fc1",
  "fc2",
  "bDown",
] as const satisfies readonly (keyof LlamaLayerWeights)[];

/** Device bytes of a layer's attention weights and norms (what {@link DevicePlan} `attention` moves), KV cache not included. */
export function attentionWeightBytes(model: Model, l: number): number {
  const L = model.weights.layers[l]!;
  return HOME_FIELDS.reduce((s, f) => s + (L[f]?.byteLength ?? 0), 0);
}

/** A model's device placement: the device copies it made and how each layer runs. */
export class ModelOffload {
  readonly layers: LayerOffload[] = [];
  private readonly owned: [Backend, TensorHandle][] = [];

  /**
   * Copies what `plan` puts on the device. Nothing is left allocated when it throws.
   * With routed experts a layer's hot ids are (expert, neuron) pairs e·n_ff_exp + i (see placeExpertLayer).
   * @throws EngineError 'BAD_INPUT' (plan of another shape, a neuron outside n_ff (n_ff_exp · n_expert), a
   *   model read through a neuron cache), BackendError 'OUT_OF_MEMORY' from the device.
   */
  constructor(
    model: Model,
    readonly device: Backend,
    plan: DevicePlan,
  ) {
    const cfg = model.config;
    if (plan.layers.length !== cfg.n_layer) {
      throw new EngineError("BAD_INPUT", `plan has ${plan.layers.length} layers, the model has ${cfg.n_layer}`);
    }
    try {
      plan.layers.forEach((p, l) => {
        this.layers.push(this.placeLayer(model, l, p.hot, !!p.attention));
      });
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  private keep(b: Backend, t: TensorHandle): TensorHandle {
    this.owned.push([b, t]);
    return t;
  }

  private copy(main: Backend, t: TensorHandle): TensorHandle {
    return this.keep(this.device, this.device.createTensor(t.dtype, t.ne, main.readTensor(t)));
  }

  private placeLayer(model: Model, l: number, hot: Int32Array, attention: boolean): LayerOffload {
    const cfg = model.config;
    const main = model.backend;
    const L = model.weights.layers[l]!;
    const nNeurons = cfg.moe ? cfg.moe.n_ff_exp * cfg.moe.n_expert : cfg.n_ff;
    const isHot = new Uint8Array(nNeurons);
    let prev = -1;
    for (const n of hot) {
      if (!Number.isInteger(n) || n < 0 || n >= nNeurons)
        throw new EngineError(
          "BAD_INPUT",
          `plan layer ${l}: neuron ${n} outside ${cfg.moe ? `n_ff_exp × n_expert = ${nNeurons}` : `n_ff ${cfg.n_ff}`}`,
        );
      if (n <= prev) throw new EngineError("BAD_INPUT", `plan layer ${l}: hot neuron ids must ascend (${prev}, ${n})`);
      prev = n;
      isHot[n] = 1;
    }
    const home: 0 | 1 = attention ? 1 : 0;
    if (L.experts) return this.placeExpertLayer(model, l, hot, isHot, home);
    const ffn: FfnPlacement = hot.length === 0 ? "main" : hot.length === cfg.n_ff ? "device" : "split";
    if (ffn !== "main" && !L.ffnUp) {
      throw new EngineError(
        "BAD_INPUT",
        `layer ${l}'s FFN is read through a neuron cache (bundled file or --ram-budget); hot neurons on a device need its rows resident`,
      );
    }
    let deviceWeights: LlamaLayerWeights | undefined;
    if (home === 1 || ffn === "device") {
      const w = { ...L } as unknown as Record<string, TensorHandle | undefined>;
      const fields = new Set<keyof LlamaLayerWeights>([
        ...(home === 1 ? HOME_FIELDS : []),
        ...(ffn === "device" ? FFN_FIELDS : []),
      ]);
      for (const f of fields) {
        const t = L[f] as TensorHandle | undefined;
        if (t) w[f] = this.copy(main, t);
      }
      deviceWeights = w as unknown as LlamaLayerWeights;
    }
    if (ffn !== "split") return { home, ffn, deviceWeights };
    let downT = L.ffnDownT;
    if (!downT) downT = this.keep(main, transposeDown(model.file, main, `blk.${l}.ffn_down.weight`));
    const cold = Int32Array.from({ length: cfg.n_ff - hot.length });
    for (let i = 0, j = 0; i < cfg.n_ff; i++) if (!isHot[i]) cold[j++] = i;
    const ids = (b: Backend, a: Int32Array) => this.keep(b, b.createTensor("i32", [a.length], a));
    return {
      home,
      ffn,
      deviceWeights,
      hot: {
        W: {
          gate:
            L.ffnGate &&
            this.keep(this.device, gatherRows(main, L.ffnGate, hot, this.device, fileRows(model, l, "gate"))),
          up: this.keep(this.device, gatherRows(main, L.ffnUp!, hot, this.device, fileRows(model, l, "up"))),
          // the up bias is indexed by neuron id (the op's output is [n_ff]): the whole vector
          upBias: L.bUp && this.copy(main, L.bUp),
          downT: this.keep(this.device, gatherRows(main, downT, hot, this.device, fileRows(model, l, "down_t"))),
        },
        rows: ids(this.device, hot),
        n: hot.length,
      },
      cold: { W: { gate: L.ffnGate, up: L.ffnUp!, upBias: L.bUp, downT }, rows: ids(main, cold), n: cold.length },
    };
  }

  /** The attention (home) copies of layer l when `home` is the device, else undefined. */
  private homeCopies(model: Model, l: number, home: 0 | 1): LlamaLayerWeights | undefined {
    if (home === 0) return undefined;
    const L = model.weights.layers[l]!;
    const w = { ...L } as unknown as Record<string, TensorHandle | undefined>;
    for (const f of HOME_FIELDS) {
      const t = L[f] as TensorHandle | undefined;
      if (t) w[f] = this.copy(model.backend, t);
    }
    return w as unknown as LlamaLayerWeights;
  }

  /**
   * A layer of routed experts: its hot (expert, neuron) pairs, e·n_ff_exp + i, go to the device as compact
   * gate/up rows and neuron-major down rows (F16 stays F16, a quantized down stack becomes F32 rows:
   * expertDownRows), with their pair ids; main keeps the whole stacks and a mask [n_ff_exp, n_expert] that is
   * −FLT_MAX at the hot pairs, which its per-slot selection adds so it skips them (layer.ts splitExpertFfn).
   * The router, the predictors and every cold pair stay on main. No pair hot: the experts stay on main.
   */
  private placeExpertLayer(model: Model, l: number, hot: Int32Array, isHot: Uint8Array, home: 0 | 1): LayerOffload {
    const main = model.backend;
    const X = model.weights.layers[l]!.experts!;
    const deviceWeights = this.homeCopies(model, l, home);
    if (hot.length === 0) return { home, ffn: "main", deviceWeights };
    const mask = new Float32Array(isHot.length);
    for (let i = 0; i < isHot.length; i++) if (isHot[i]) mask[i] = -F32_MAX;
    const cfg = model.config;
    return {
      home,
      ffn: "split",
      deviceWeights,
      hot: {
        W: {
          gate: this.keep(this.device, gatherRows(main, X.gateExps, hot, this.device, fileRows(model, l, "gate_exps"))),
          up: this.keep(this.device, gatherRows(main, X.upExps, hot, this.device, fileRows(model, l, "up_exps"))),
          // a down stack served from the file is read from it: its rows as they are when the file stores it
          // neuron-major (ffn_down_exps_t), else expert by expert and transposed (expertDownRows)
          downT: this.keep(
            this.device,
            X.downExpsT &&
              (!model.weights.expertsFromFile || model.file.tensorMap.has(`blk.${l}.ffn_down_exps_t.weight`))
              ? gatherRows(main, X.downExpsT, hot, this.device, fileRows(model, l, "down_exps_t"))
              : expertDownRows(model.file, this.device, `blk.${l}.ffn_down_exps.weight`, hot),
          ),
        },
        rows: this.keep(this.device, this.device.createTensor("i32", [hot.length], hot)),
        n: hot.length,
      },
      expertMask: this.keep(main, main.createTensor("f32", [cfg.moe!.n_ff_exp, cfg.moe!.n_expert], mask)),
    };
  }

  /** Hot neurons on the device, over all layers. */
  get hotNeurons(): number {
    return this.layers.reduce(
      (s, L) => s + (L.ffn === "device" ? (L.deviceWeights?.ffnUp?.ne[1] ?? 0) : (L.hot?.n ?? 0)),
      0,
    );
  }

  /** Layers whose attention and KV cache are on the device. */
  get attentionLayers(): number {
    return this.layers.filter((L) => L.home === 1).length;
  }

  /** Device bytes of the weights this placement copied there (KV caches are the sessions'). */
  deviceBytes(): number {
    return this.owned.reduce((s, [b, t]) => s + (b === this.device ? t.byteLength : 0), 0);
  }

  dispose(): void {
    for (const [b, t] of this.owned) b.freeTensor(t);
    this.owned.length = 0;
  }
}

/**
 * Bytes per second a backend reads weights at in a matrix × vector product (memory-bound decoding,
 * PowerInfer §2): a short calibration, the median of `reps` products over an F16 weight of about `bytes`
 * bytes (zeros; the kernels' speed does not depend on the values). It allocates and frees the weight; on a
 * backend whose memory budget cannot hold it, a smaller one is tried, down to 1 MiB.
 * @returns bytes/s, or undefined when nothing could be allocated or computed.
 */
export function measureReadThroughput(b: Backend, bytes = 64 * 2 ** 20, reps = 5): number | undefined {
  const k = 4096;
  for (let size = bytes; size >= 2 ** 20; size /= 4) {
    const rows = Math.max(1, Math.floor(size / (2 * k)));
    let w: TensorHandle | undefined;
    try {
      w = b.createTensor("f16", [k, rows]);
      const times: number[] = [];
      for (let i = 0; i <= reps; i++) {
        const g = new Graph();
        g.output(g.mulMat(g.handle(w), g.input("f32", [k, 1], new Float32Array(k))));
        const t0 = performance.now();
        b.compute(g);
        if (i > 0) times.push(performance.now() - t0); // the first warms caches and threads
      }
      times.sort((x, y) => x - y);
      const ms = times[times.length >> 1]!;
      return ms > 0 ? (w.byteLength * 1000) / ms : undefined;
    } catch {
      // too large for the backend's budget: try a quarter of it
    } finally {
      if (w) b.freeTensor(w);
    }
  }
  return undefined;
}

/**
 * Where a layer's FFN matrix lies in the model file when `--ram-budget` serves it from there (its hot rows
 * for a device are then read from the file alone, not through the whole tensor); undefined when it is
 * resident.
 */
function fileRows(
  model: Model,
  l: number,
  role: "up" | "gate" | "down_t" | "gate_exps" | "up_exps" | "down_exps_t",
): FileRows | undefined {
  const t = model.ramPlan?.tensors.find((c) => c.layer === l && (c.role === role || c.role === "bundle"));
  if (!t) return undefined;
  const info = model.file.tensorMap.get(t.name);
  if (!info) return undefined;
  const path = info.path ?? model.file.path;
  const b = t.bundle;
  if (b) {
    // bundled layout: part j of neuron r's record
    const j = b.parts.indexOf(role === "up" ? "ffn_up" : role === "gate" ? "ffn_gate" : "ffn_down_t");
    if (j < 0) return undefined;
    return {
      path,
      offset: (r) =>
        info.fileOffset +
        Math.floor(r / b.bucketRows) * b.bucketStride +
        (r % b.bucketRows) * b.recordBytes +
        j * b.rowBytes,
    };
  }
  // rows (experts' stacks: (expert, neuron) pairs) back to back
  const rowBytes = info.byteLength / info.shape.slice(1).reduce((a, d) => a * d, 1);
  return { path, offset: (r) => info.fileOffset + r * rowBytes };
}
