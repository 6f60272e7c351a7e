/**
 * Training the predictors of every layer of a model: validation split, warm start from the gate,
 * rank choice (fixed or automatic), training with early stopping, threshold calibration, and folding the
 * per-layer thresholds into one model-wide `powerinfer.sparse_threshold`. Interruptible and resumable
 * through {@link PipelineCheckpoint}.
 *
 * Threshold calibration. After training, each layer l gets the threshold t_l at which its predictor
 * reaches the target recall (plus a small margin) on the validation samples. The file format has a
 * single threshold T for all layers and the predictors have no biases, so per-layer thresholds are
 * baked into the weights: with T ≠ 0 of the same sign as t_l, fc2 is multiplied by s_l = T / t_l > 0,
 * and s_l·z ≥ T ⟺ z ≥ t_l. T = −1 when any t_l ≤ 0 (the usual case: recall-favouring thresholds are
 * negative), else +1. A layer whose t_l has the other sign than T (t_l > 0 while T = −1) cannot be
 * represented exactly; it gets the nearest threshold on the recall-safe side (a tiny negative one),
 * which costs precision, not recall, and is reported.
 */
import type { GgufFile } from "@powerinfer/gguf";
import { getTensor, readTensorF32 } from "@powerinfer/gguf";
import { type ActivationDataset, sliceDataset } from "./dataset.js";
import type { MatMul } from "./matmul.js";
import { confusionAt, type Quality, quality, thresholdForRecall } from "./metrics.js";
import {
  fitLogitScale,
  gatePredictor,
  gateSubspace,
  type LayerPredictor,
  predictLogits,
  randomPredictor,
  roundPredictorF16,
} from "./predictor.js";
import { deriveSeed } from "./rng.js";
import {
  type EpochReport,
  initialTrainState,
  type LayerTrainState,
  scorePredictor,
  type StepInfo,
  type TrainOptions,
  trainDefaults,
  trainLayer,
} from "./train.js";

/** Options of {@link trainPredictors}. */
export interface PredictorTrainingOptions {
  /**
   * Predictor rank: one even number for every layer, one per layer, or "auto" (default): per layer, the
   * smallest rank of {@link rankLadder} whose predictor reaches the target recall on the validation
   * samples while selecting at most `maxActiveRatio` × the neurons that truly fire.
   */
  rank?: number | number[] | "auto";
  /** Recall each layer's threshold is calibrated for. Default 0.95. */
  targetRecall?: number;
  /**
   * Added to the target when calibrating on the validation samples, because text the predictor has
   * never seen is predicted slightly worse (0.003–0.008 on the shared ReLU model). Default 0.005.
   */
  recallMargin?: number;
  /** "auto" rank: accept a rank when predicted/true active fraction ≤ this. Default 1.5. */
  maxActiveRatio?: number;
  /** Share of the training samples held back for early stopping and calibration. Default 0.1. */
  valFraction?: number;
  /**
   * Starting weights: "gate" (default when the layer has ffn_gate or ffn_up: the data-aware low-rank
   * approximation of the gate, see {@link gateSubspace}) or "random".
   */
  init?: "gate" | "random";
  /** Storage type of fc1/fc2 in the output; F16 predictors are calibrated with F16 rounding. Default "f16". */
  predictorType?: "f16" | "f32";
  /** Optimiser and early stopping (see {@link TrainOptions}). */
  train?: TrainOptions;
}

/** One rank tried for a layer. */
export interface RankCandidate {
  rank: number;
  /** Predicted/true active fraction of the starting weights at the target recall (validation). */
  initRatio: number;
  /** The same after training; undefined when training was skipped. */
  trainedRatio?: number;
  /** Skipped without training (the start was too far from the goal and a larger rank was left). */
  skipped: boolean;
}

/** A trained layer. */
export interface LayerResult {
  layer: number;
  rank: number;
  /** The predictor before threshold baking (fc2 unscaled), F16-rounded when stored as F16. */
  predictor: LayerPredictor;
  /** Threshold reaching the target recall on validation, for `predictor`'s logits. */
  threshold: number;
  /** Quality at that threshold on the validation samples. */
  val: Quality;
  /** Training history of the chosen rank (empty when no epoch ran). */
  history: EpochReport[];
  candidates: RankCandidate[];
  /** Logit scale applied to the gate warm start (1 for random init). */
  logitScale: number;
}

/** Where a layer in progress stands (for checkpoints). */
export interface LayerProgress {
  layer: number;
  candidates: RankCandidate[];
  /** Index in the layer's rank list of the rank being trained. */
  rankIndex: number;
  logitScale: number;
  state: LayerTrainState;
}

/** Resumable state of {@link trainPredictors}. */
export interface PipelineCheckpoint {
  /** Identity of the run (model, data and options); a checkpoint is only used for the same key. */
  key: string;
  done: LayerResult[];
  current?: LayerProgress;
}

/** Progress events. */
export type PipelineEvent =
  | { type: "layer-start"; layer: number; nLayer: number; ranks: number[] }
  | { type: "candidate"; layer: number; candidate: RankCandidate }
  | { type: "train-start"; layer: number; rank: number; epochs: number; stepsPerEpoch: number; resumed: boolean }
  | ({ type: "step"; layer: number; rank: number } & StepInfo)
  | { type: "epoch"; layer: number; rank: number; report: EpochReport }
  | { type: "layer-done"; layer: number; result: LayerResult }
  /** Something the user should know that does not stop training (e.g. a fallback taken). */
  | { type: "note"; layer: number; message: string };

/** Arguments of {@link trainPredictors}. */
export interface TrainPredictorsArgs {
  /** The model file: its gate weights give the warm start (required with `init: "gate"`). */
  file?: GgufFile;
  /** Samples from the training text. */
  data: ActivationDataset;
  mm: MatMul;
  options?: PredictorTrainingOptions;
  /** A checkpoint to continue from (ignored unless its key is `key`). */
  resume?: PipelineCheckpoint;
  /** Identity of this run, stored in checkpoints. */
  key?: string;
  /**
   * The gate weights of layer l for the warm start ([nFf × nEmbd] row-major, and ffn_norm), instead of the
   * file's `blk.l.ffn_gate` (routed experts: one expert's rows of `ffn_gate_exps`).
   */
  gate?: (layer: number) => { gate: Float32Array; norm?: Float32Array } | undefined;
  /** Called after every epoch, finished layer and on interruption with the state to save. */
  onCheckpoint?: (c: PipelineCheckpoint) => void | Promise<void>;
  onEvent?: (e: PipelineEvent) => void;
  signal?: AbortSignal;
}

/** Result of {@link trainPredictors}. */
export interface TrainPredictorsResult {
  /** False when interrupted by the signal (the last checkpoint holds the progress). */
  complete: boolean;
  layers: LayerResult[];
}

/** Ranks tried by "auto": n_embd·{1/8, 1/4, 1/2, 3/4, 1}, even, at most 2·min(n_embd, n_ff). */
export function rankLadder(nEmbd: number, nFf: number): number[] {
  const cap = 2 * Math.min(nEmbd, nFf);
  const out = [1 / 8, 1 / 4, 1 / 2, 3 / 4, 1].map((f) => Math.min(cap, Math.max(2, 2 * Math.round((nEmbd * f) / 2))));
  return [...new Set(out)];
}

/** Resolved options. */
export function pipelineDefaults(o: PredictorTrainingOptions = {}) {
  return {
    rank: o.rank ?? ("auto" as const),
    targetRecall: o.targetRecall ?? 0.95,
    recallMargin: o.recallMargin ?? 0.005,
    maxActiveRatio: o.maxActiveRatio ?? 1.5,
    valFraction: o.valFraction ?? 0.1,
    init: o.init ?? ("gate" as const),
    predictorType: o.predictorType ?? ("f16" as const),
    train: trainDefaults({ targetRecall: o.targetRecall, ...o.train }),
  };
}

/**
 * Splits samples into training and validation parts: the last `fraction` of the token positions (the
 * end of the training text) is validation. Contiguous rather than interleaved, so that validation
 * text — like the held-out text the predictor will meet — comes from passages the training never saw;
 * interleaved blocks share stories with the training blocks and overstate recall on new text.
 * The parts are views (no copy).
 */
export function splitDataset(
  ds: ActivationDataset,
  fraction: number,
): { train: ActivationDataset; val: ActivationDataset } {
  if (!(fraction > 0 && fraction < 1)) throw new RangeError(`validation fraction ${fraction} must be in (0, 1)`);
  if (ds.nTokens < 2) throw new RangeError(`${ds.nTokens} token positions cannot be split for validation`);
  const nVal = Math.min(ds.nTokens - 1, Math.max(1, Math.round(ds.nTokens * fraction)));
  return { train: sliceDataset(ds, 0, ds.nTokens - nVal), val: sliceDataset(ds, ds.nTokens - nVal, ds.nTokens) };
}

/** The weight whose sign the predictor learns: ffn_gate, else ffn_up; with ffn_norm when present. */
function gateWeights(file: GgufFile, layer: number): { gate: Float32Array; norm?: Float32Array } | undefined {
  const p = `blk.${layer}.`;
  const name = file.tensorMap.has(`${p}ffn_gate.weight`) ? `${p}ffn_gate.weight` : `${p}ffn_up.weight`;
  if (!file.tensorMap.has(name)) return undefined;
  const gate = readTensorF32(file, getTensor(file, name));
  const norm = file.tensorMap.has(`${p}ffn_norm.weight`) ? readTensorF32(file, `${p}ffn_norm.weight`) : undefined;
  return { gate, norm };
}

/**
 * Calibrates a layer's final threshold: the largest one that gives `targetRecall` on the samples, with
 * the predictor as it will be stored (F16-rounded weights and activations for F16).
 */
function calibrate(
  p: LayerPredictor,
  val: ActivationDataset,
  layer: number,
  targetRecall: number,
  f16: boolean,
  mm: MatMul,
): { threshold: number; val: Quality } {
  const L = val.layers[layer]!;
  const z = predictLogits(p, L.inputs, val.nTokens, mm, { f16Activations: f16 });
  const threshold = thresholdForRecall(z, L.masks, val.nTokens, val.nFf, targetRecall);
  return { threshold, val: quality(confusionAt(z, L.masks, val.nTokens, val.nFf, threshold)) };
}

/**
 * Trains every layer's predictor on `data` (see the module comment for the method). Layers already in
 * `resume` are kept; a layer in progress continues from its saved step.
 * @throws RangeError for bad options (odd or too large rank, target recall outside (0, 1])
 */
export async function trainPredictors(a: TrainPredictorsArgs): Promise<TrainPredictorsResult> {
  const o = pipelineDefaults(a.options);
  const { data, mm, file } = a;
  const nLayer = data.layers.length;
  const { nEmbd: e, nFf: f } = data;
  if (!(o.targetRecall > 0 && o.targetRecall <= 1))
    throw new RangeError(`target recall ${o.targetRecall} not in (0, 1]`);
  const calibTarget = Math.min(1, o.targetRecall + o.recallMargin);
  const ranksOf = (l: number): number[] => {
    if (o.rank === "auto") return rankLadder(e, f);
    const r = typeof o.rank === "number" ? o.rank : o.rank[l];
    if (r === undefined) throw new RangeError(`no rank given for layer ${l}`);
    return [r];
  };
  for (let l = 0; l < nLayer; l++) {
    for (const r of ranksOf(l)) {
      if (!Number.isInteger(r) || r < 2 || r % 2 !== 0 || r > 2 * Math.min(e, f)) {
        throw new RangeError(`rank ${r} must be an even integer in [2, ${2 * Math.min(e, f)}]`);
      }
    }
  }
  const key = a.key ?? "";
  const resume = a.resume && a.resume.key === key ? a.resume : undefined;
  const done: LayerResult[] = resume ? [...resume.done] : [];
  let current = resume?.current;
  const { train, val } = splitDataset(data, o.valFraction);
  const save = async (cur?: LayerProgress) => a.onCheckpoint?.({ key, done: [...done], current: cur });

  for (let l = done.length; l < nLayer; l++) {
    const ranks = ranksOf(l);
    a.onEvent?.({ type: "layer-start", layer: l, nLayer, ranks });
    if (o.init === "gate" && !file && !a.gate) throw new RangeError('init "gate" needs the model file');
    const gw = o.init === "gate" ? (a.gate ? a.gate(l) : gateWeights(file!, l)) : undefined;
    let sub: ReturnType<typeof gateSubspace> | null | undefined;
    // The gate's subspace, or null when the gate gives no direction at all (then the start is random).
    const subspace = () => {
      if (sub !== undefined) return sub;
      const want = Math.max(...ranks) / 2;
      try {
        sub = gateSubspace(gw!.gate, gw!.norm, train.layers[l]!.inputs, train.nTokens, e, f, want, mm);
      } catch (err) {
        if (!(err instanceof RangeError)) throw err;
        sub = null;
        a.onEvent?.({
          type: "note",
          layer: l,
          message: `layer ${l}: ${err.message}; starting from random weights instead`,
        });
        return sub;
      }
      if (sub.k < want) {
        a.onEvent?.({
          type: "note",
          layer: l,
          message: `layer ${l}: the gate spans ${sub.k} independent directions on ${train.nTokens} training positions, not the ${want} rank ${2 * want} needs; ${2 * sub.k} hidden units start from the gate, the rest random`,
        });
      }
      return sub;
    };
    // Start: ranks in increasing order; a resumed layer continues where it stopped.
    let progress: LayerProgress | undefined = current?.layer === l ? current : undefined;
    current = undefined;
    let chosen: { state: LayerTrainState; rank: number; logitScale: number } | undefined;
    const candidates: RankCandidate[] = progress ? progress.candidates : [];
    for (let ri = progress ? progress.rankIndex : 0; ri < ranks.length && !chosen; ri++) {
      const rank = ranks[ri]!;
      const last = ri === ranks.length - 1;
      let state: LayerTrainState;
      let logitScale = 1;
      const resumed = !!progress;
      if (progress) {
        state = progress.state;
        logitScale = progress.logitScale;
        progress = undefined;
      } else {
        let init: LayerPredictor;
        const s = gw ? subspace() : null;
        if (s) {
          const seed = deriveSeed(o.train.seed, l, rank);
          const sample = Math.min(train.nTokens, 256);
          const z = predictLogits(gatePredictor(s, rank, 1, seed), train.layers[l]!.inputs, sample, mm);
          logitScale = fitLogitScale(z, train.layers[l]!.masks, sample, f, o.train.posWeight);
          init = gatePredictor(s, rank, logitScale, seed);
        } else {
          init = randomPredictor(rank, e, f, deriveSeed(o.train.seed, l, rank));
        }
        state = initialTrainState(init);
        state.initScore = scorePredictor(init, val, l, o.targetRecall, mm);
        state.bestScore = state.initScore.predictedFraction;
        const c: RankCandidate = {
          rank,
          initRatio: ratio(state.initScore.predictedFraction, state.initScore.trueFraction),
          skipped: false,
        };
        // far from the goal with a larger rank left: training will not close the gap, skip it
        if (o.rank === "auto" && !last && c.initRatio > o.maxActiveRatio * 1.25) {
          c.skipped = true;
          candidates.push(c);
          a.onEvent?.({ type: "candidate", layer: l, candidate: c });
          continue;
        }
        candidates.push(c);
        a.onEvent?.({ type: "candidate", layer: l, candidate: c });
      }
      const stepsPerEpoch = Math.ceil(train.nTokens / Math.min(o.train.batchSize, train.nTokens));
      a.onEvent?.({ type: "train-start", layer: l, rank, epochs: o.train.epochs, stepsPerEpoch, resumed });
      const progressOf = (st: LayerTrainState): LayerProgress => ({
        layer: l,
        candidates: [...candidates],
        rankIndex: ri,
        logitScale,
        state: st,
      });
      await trainLayer({
        train,
        val,
        layer: l,
        state,
        options: o.train,
        mm,
        signal: a.signal,
        onStep: (s) => a.onEvent?.({ type: "step", layer: l, rank, ...s }),
        onEpoch: async (report, st) => {
          a.onEvent?.({ type: "epoch", layer: l, rank, report });
          await save(progressOf(st));
        },
      });
      if (!state.done) {
        await save(progressOf(state));
        return { complete: false, layers: done };
      }
      const c = candidates[candidates.length - 1]!;
      c.trainedRatio = state.bestScore / (state.initScore?.trueFraction || 1);
      if (o.rank !== "auto" || last || c.trainedRatio <= o.maxActiveRatio) chosen = { state, rank, logitScale };
    }
    const { state, rank, logitScale } = chosen!;
    const f16 = o.predictorType === "f16";
    const predictor = f16 ? roundPredictorF16(state.best) : state.best;
    const cal = calibrate(predictor, val, l, calibTarget, f16, mm);
    if (!Number.isFinite(cal.threshold)) {
      // a file with this threshold would select no neuron (or every one): refuse it rather than write it
      throw new RangeError(
        `layer ${l}: the predictor's logits are not finite${f16 ? " in float16 (they overflow 65504)" : ""}, so no threshold gives recall ${calibTarget}${f16 ? "; train with --predictor-type f32" : ""}`,
      );
    }
    const result: LayerResult = {
      layer: l,
      rank,
      predictor,
      threshold: cal.threshold,
      val: cal.val,
      history: state.history,
      candidates,
      logitScale,
    };
    done.push(result);
    a.onEvent?.({ type: "layer-done", layer: l, result });
    await save();
  }
  return { complete: true, layers: done };
}

function ratio(pred: number, truth: number): number {
  return truth > 0 ? pred / truth : pred > 0 ? Number.POSITIVE_INFINITY : 1;
}

/** Predictors with the per-layer thresholds folded into fc2, and the model-wide threshold. */
export interface BakedPredictors {
  /** `powerinfer.sparse_threshold`. */
  threshold: number;
  /** Per layer, fc2 multiplied by `scales[l]` (and re-rounded to F16 when F16). */
  predictors: LayerPredictor[];
  scales: number[];
  /** Layers whose threshold could not be represented exactly (recall-safe substitute used). */
  inexact: number[];
}

/**
 * Folds per-layer thresholds into one model-wide threshold by scaling each layer's fc2 (see the module
 * comment). `f16` re-rounds the scaled fc2.
 */
export function bakeThresholds(
  layers: { predictor: LayerPredictor; threshold: number }[],
  f16: boolean,
): BakedPredictors {
  const ts = layers.map((l) => l.threshold);
  const threshold = ts.some((t) => t <= 0) ? -1 : 1;
  const mags = ts.map(Math.abs).filter((t) => t > 0);
  const tiny = mags.length ? Math.min(...mags) * 1e-3 : 1e-3;
  const inexact: number[] = [];
  const scales = ts.map((t, l) => {
    if (t !== 0 && Math.sign(t) === Math.sign(threshold)) return threshold / t;
    inexact.push(l);
    // t ≥ 0 with T = −1: use −tiny (selects a superset: recall kept). Capped where F16 would overflow
    // (±65504; an infinite fc2 gives NaN logits that select nothing): the cut then sits a little further
    // below 0, still a superset.
    const sc = threshold / -tiny;
    const big = f16 ? layers[l]!.predictor.fc2.reduce((m, v) => Math.max(m, Math.abs(v)), 0) : 0;
    return big > 0 ? Math.min(sc, 6e4 / big) : sc;
  });
  const predictors = layers.map(({ predictor: p }, l) => {
    const fc2 = p.fc2.map((v) => v * scales[l]!);
    const q: LayerPredictor = { ...p, fc2 };
    return f16 ? roundPredictorF16(q) : q;
  });
  return { threshold, predictors, scales, inexact };
}
