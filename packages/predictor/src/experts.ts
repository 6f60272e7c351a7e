/**
 * Per-expert predictors for routed ReLU experts (SmallThinker's ReGLU experts, dReLU Mixtral): expert e of
 * layer l gets its own fc2_e·ReLU(fc1_e·x), trained as a dense layer's predictor (pipeline.ts) on the
 * (token, slot) pairs routed to it — x the residual before `ffn_norm`, the label "gate_e·h > 0" per neuron
 * of the expert — with the warm start from expert e's own gate rows. Written as the stacks
 * `blk.N.fc1_exps.weight` {n_embd, r, n_expert} and `blk.N.fc2_exps.weight` {r, n_ff_exp, n_expert}
 * (one rank per layer), the per-expert thresholds folded into fc2 as for dense layers ({@link bakeThresholds}).
 *
 * An expert that received fewer than `minSamples` pairs gets a zero predictor: its logits are 0, at or above
 * the baked threshold (−1), so every one of its neurons is computed (exact, never a wrong skip).
 */
import type { Model } from "@powerinfer/engine";
import { type GgufFile, readTensorF32 } from "@powerinfer/gguf";
import { type ActivationDataset, type CollectOptions, captureWindows, maskStride } from "./dataset.js";
import type { MatMul } from "./matmul.js";
import { type Confusion, confusionAt, type Quality, quality } from "./metrics.js";
import { type PipelineEvent, type PredictorTrainingOptions, trainPredictors } from "./pipeline.js";
import { type LayerPredictor, predictLogits } from "./predictor.js";

/** Per (layer, expert) samples: one-layer datasets over the expert's n_ff_exp neurons. */
export interface ExpertActivationDataset {
  nEmbd: number;
  nFfExp: number;
  nExpert: number;
  /** Token positions run. */
  nTokens: number;
  /** [layer][expert]: the pairs routed to that expert, in token order (`layers` has one entry). */
  experts: ActivationDataset[][];
}

/**
 * Runs the model densely over `tokens` (windows as {@link collectActivations}) and records, per layer and
 * chosen expert, the FFN input of each (token, slot) pair routed to it and its gate's firing mask. The
 * model must be loaded with `sparse: "off"`. Memory: n_expert_used · nTokens · (4·n_embd + n_ff_exp/8)
 * bytes per layer.
 * @throws Error when the model has no routed experts, the vocabulary has no BOS or `tokens` is empty
 */
export async function collectExpertActivations(
  model: Model,
  tokens: readonly number[],
  opts: CollectOptions = {},
): Promise<ExpertActivationDataset> {
  const cfg = model.config;
  const moe = cfg.moe;
  if (!moe) throw new Error("the model has no routed experts");
  const { n_embd: E, n_layer } = cfg;
  const { n_expert: X, n_expert_used: U, n_ff_exp: F } = moe;
  const stride = maskStride(F);
  // growing per (layer, expert) lists of pairs: inputs and masks, concatenated at the end
  const inputs: Float32Array[][][] = Array.from({ length: n_layer }, () => Array.from({ length: X }, () => []));
  const masks: Uint8Array[][][] = Array.from({ length: n_layer }, () => Array.from({ length: X }, () => []));
  const order = Array.from({ length: X }, (_, e) => e);
  const done = await captureWindows(
    model,
    tokens,
    opts,
    () => {},
    (caps, n) => {
      caps.forEach((c, l) => {
        const probs = c.routerProbs!;
        const gate = c.expertGate!;
        for (let t = 0; t < n; t++) {
          // the chosen experts in top_k's order (largest probability first, ties to the lower id): slot u
          const p = probs.subarray(t * X, (t + 1) * X);
          order.sort((a, b) => p[b]! - p[a]! || a - b);
          const x = c.ffnInput.slice(t * E, (t + 1) * E);
          for (let u = 0; u < U; u++) {
            const e = order[u]!;
            const m = new Uint8Array(stride);
            const g = gate.subarray((t * U + u) * F, (t * U + u + 1) * F);
            for (let i = 0; i < F; i++) if (g[i]! > 0) m[i >> 3]! |= 1 << (i & 7);
            inputs[l]![e]!.push(x);
            masks[l]![e]!.push(m);
          }
        }
      });
    },
  );
  const experts = inputs.map((perExpert, l) =>
    perExpert.map((xs, e): ActivationDataset => {
      const n = xs.length;
      const inp = new Float32Array(n * E);
      const msk = new Uint8Array(n * stride);
      xs.forEach((x, j) => {
        inp.set(x, j * E);
      });
      masks[l]![e]!.forEach((m, j) => {
        msk.set(m, j * stride);
      });
      return { nEmbd: E, nFf: F, nTokens: n, layers: [{ inputs: inp, masks: msk }] };
    }),
  );
  return { nEmbd: E, nFfExp: F, nExpert: X, nTokens: done, experts };
}

/** One expert's trained predictor. */
export interface ExpertPredictorResult {
  layer: number;
  expert: number;
  /** Pairs routed to the expert in the training data. */
  samples: number;
  predictor: LayerPredictor;
  /** Threshold for the target recall on the expert's validation pairs (−1 for a zero predictor). */
  threshold: number;
  /** Quality there; undefined for a zero predictor (too few samples: every neuron computed). */
  val?: Quality;
}

/** Arguments of {@link trainExpertPredictors}. */
export interface TrainExpertPredictorsArgs {
  /** The model file: expert gates for the warm start (`blk.N.ffn_gate_exps`, `blk.N.ffn_norm`). */
  file: GgufFile;
  data: ExpertActivationDataset;
  mm: MatMul;
  /** As for dense layers; `rank` must be one even number (the stacks hold one rank per layer). */
  options: PredictorTrainingOptions & { rank: number };
  /** Experts with fewer pairs get a zero predictor (every neuron computed). Default 32. */
  minSamples?: number;
  /** Before each expert; and the training pipeline's events, with `layer` its index among experts trained. */
  onExpert?: (layer: number, expert: number, samples: number) => void;
  onEvent?: (e: PipelineEvent) => void;
  signal?: AbortSignal;
  /** Experts finished by an earlier run of the same training (a checkpoint): kept as they are, not retrained. */
  resume?: readonly ExpertPredictorResult[];
  /** After each expert (trained, zero or resumed), with every expert finished so far (for checkpoints). */
  onExpertDone?: (r: ExpertPredictorResult, done: readonly ExpertPredictorResult[]) => void;
}

/**
 * Trains a predictor per (layer, expert) (see the module comment). Resumable by expert: `resume` skips the
 * experts an interrupted run finished (`onExpertDone` reports them for a checkpoint).
 * @returns `complete` false when interrupted by the signal (`experts` then holds the whole layers finished;
 *   `onExpertDone` has seen every finished expert)
 */
export async function trainExpertPredictors(
  a: TrainExpertPredictorsArgs,
): Promise<{ complete: boolean; experts: ExpertPredictorResult[][] }> {
  const { data, file, mm } = a;
  const { nEmbd: E, nFfExp: F, nExpert: X } = data;
  const rank = a.options.rank;
  const minSamples = a.minSamples ?? 32;
  const out: ExpertPredictorResult[][] = [];
  const resumed = new Map((a.resume ?? []).map((r) => [`${r.layer}.${r.expert}`, r]));
  const finished: ExpertPredictorResult[] = [];
  const finish = (layer: ExpertPredictorResult[], r: ExpertPredictorResult) => {
    layer.push(r);
    finished.push(r);
    a.onExpertDone?.(r, finished);
  };
  for (let l = 0; l < data.experts.length; l++) {
    // the layer's expert gates {n_embd, n_ff_exp, n_expert}: expert e's rows are [e·F, (e+1)·F)
    const init = a.options.init ?? "gate";
    const gates = init === "gate" ? readTensorF32(file, `blk.${l}.ffn_gate_exps.weight`) : undefined;
    const norm = file.tensorMap.has(`blk.${l}.ffn_norm.weight`)
      ? readTensorF32(file, `blk.${l}.ffn_norm.weight`)
      : undefined;
    const layer: ExpertPredictorResult[] = [];
    for (let e = 0; e < X; e++) {
      const ds = data.experts[l]![e]!;
      const prior = resumed.get(`${l}.${e}`);
      if (prior) {
        if (prior.predictor.rank !== rank || prior.predictor.nEmbd !== E || prior.predictor.nFf !== F) {
          throw new RangeError(`resumed predictor of layer ${l} expert ${e} has another shape`);
        }
        finish(layer, prior);
        continue;
      }
      a.onExpert?.(l, e, ds.nTokens);
      if (ds.nTokens < minSamples) {
        const predictor: LayerPredictor = {
          rank,
          nEmbd: E,
          nFf: F,
          fc1: new Float32Array(rank * E),
          fc2: new Float32Array(F * rank),
        };
        finish(layer, { layer: l, expert: e, samples: ds.nTokens, predictor, threshold: -1 });
        continue;
      }
      const res = await trainPredictors({
        data: ds,
        mm,
        options: { ...a.options, rank },
        gate: gates ? () => ({ gate: gates.subarray(e * F * E, (e + 1) * F * E), norm }) : undefined,
        onEvent: a.onEvent,
        signal: a.signal,
      });
      if (!res.complete) return { complete: false, experts: out };
      const r = res.layers[0]!;
      finish(layer, {
        layer: l,
        expert: e,
        samples: ds.nTokens,
        predictor: r.predictor,
        threshold: r.threshold,
        val: r.val,
      });
    }
    out.push(layer);
  }
  return { complete: true, experts: out };
}

/** Held-out quality of one layer's expert predictors, over every (token, slot) pair of the layer. */
export interface ExpertLayerReport extends Quality {
  layer: number;
  /** Pairs evaluated. */
  pairs: number;
  /** Experts whose predictor is zero (every neuron computed). */
  zeroExperts: number;
}

/**
 * Recall and precision of (baked) expert predictors at `threshold` on other samples, per layer, with the
 * predictor as stored (`f16Activations` for F16 predictors).
 */
export function evaluateExpertPredictors(
  predictors: LayerPredictor[][],
  threshold: number,
  data: ExpertActivationDataset,
  mm: MatMul,
  f16Activations: boolean,
): ExpertLayerReport[] {
  return predictors.map((ps, l) => {
    const c: Confusion = { tp: 0, fp: 0, fn: 0, tokens: 0, nFf: data.nFfExp };
    let zero = 0;
    ps.forEach((p, e) => {
      if (p.fc2.every((v) => v === 0)) zero++;
      const ds = data.experts[l]![e]!;
      if (ds.nTokens === 0) return;
      const L = ds.layers[0]!;
      const z = predictLogits(p, L.inputs, ds.nTokens, mm, { f16Activations });
      const k = confusionAt(z, L.masks, ds.nTokens, ds.nFf, threshold);
      c.tp += k.tp;
      c.fp += k.fp;
      c.fn += k.fn;
      c.tokens += k.tokens;
    });
    return { layer: l, pairs: c.tokens, zeroExperts: zero, ...quality(c) };
  });
}
