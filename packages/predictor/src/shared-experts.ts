/**
 * The alternative to per-expert predictors the MoE issue asks to measure: one predictor per layer shared by
 * all its experts, with the expert as input. For the pair (x, e) — x the residual before `ffn_norm`, e the
 * chosen expert — the logits over the expert's n_ff_exp neurons are
 *   z = fc2 · ReLU(fc1 · [x; s·onehot(e)])
 * i.e. a per-expert bias column of fc1 (fc1 is r × (n_embd + n_expert)) and one fc2 (n_ff_exp × r) for every
 * expert. It is trained exactly as a dense layer's predictor (pipeline.ts, random start: no single gate to
 * start from) on every routed pair of the layer, the experts' pairs interleaved in token order so the
 * validation split (the last pairs) covers every expert.
 *
 * Bytes: per-expert predictors of rank r hold n_expert · r · (n_embd + n_ff_exp) weights; a shared one of
 * rank r_s holds r_s · (n_embd + n_expert + n_ff_exp). {@link sharedRankForBytes} gives the r_s of equal
 * storage. What a token reads differs: per-expert reads its n_expert_used experts' predictors
 * (n_expert_used / n_expert of the stack), a shared one reads all of fc1 once and fc2 once per chosen expert.
 * The engine runs per-expert predictors only; `scripts/compare-expert-predictors.mjs` (apps/cli) measures
 * both on the same pairs.
 */
import type { ActivationDataset } from "./dataset.js";
import { maskStride } from "./dataset.js";
import type { ExpertActivationDataset, ExpertLayerReport } from "./experts.js";
import type { MatMul } from "./matmul.js";
import { type Confusion, confusionAt, quality } from "./metrics.js";
import { type PipelineEvent, type PredictorTrainingOptions, trainPredictors } from "./pipeline.js";
import { type LayerPredictor, predictLogits } from "./predictor.js";

/**
 * The rank of a shared predictor holding as many weights as per-expert predictors of rank `rank`
 * (even, ≥ 2): round(n_expert · rank · (n_embd + n_ff_exp) / (n_embd + n_expert + n_ff_exp)).
 */
export function sharedRankForBytes(nEmbd: number, nFfExp: number, nExpert: number, rank: number): number {
  const r = (nExpert * rank * (nEmbd + nFfExp)) / (nEmbd + nExpert + nFfExp);
  return Math.max(2, 2 * Math.round(r / 2));
}

/**
 * Layer `layer`'s routed pairs as one dataset over n_ff_exp neurons whose input is [x; scale·onehot(e)]
 * (n_embd + n_expert values), the experts' pairs interleaved in token order (each expert's list is in token
 * order; pair j of an expert with n pairs sorts at (j + 0.5) / n).
 * @param scale the one-hot's value (default: the root mean square of the inputs, so it weighs like one
 *   coordinate of x)
 * @returns the dataset, per pair its expert, and the one-hot's value used
 */
export function sharedExpertDataset(
  data: ExpertActivationDataset,
  layer: number,
  scale?: number,
): { ds: ActivationDataset; experts: Int32Array; scale: number } {
  const { nEmbd: E, nFfExp: F, nExpert: X } = data;
  const per = data.experts[layer];
  if (!per) throw new RangeError(`no layer ${layer} (the data has ${data.experts.length})`);
  const keys: { e: number; j: number; at: number }[] = [];
  let sq = 0;
  let cnt = 0;
  per.forEach((ds, e) => {
    const inp = ds.layers[0]!.inputs;
    for (let j = 0; j < ds.nTokens; j++) keys.push({ e, j, at: (j + 0.5) / ds.nTokens });
    for (let i = 0; i < inp.length; i++) sq += inp[i]! * inp[i]!;
    cnt += inp.length;
  });
  keys.sort((a, b) => a.at - b.at || a.e - b.e);
  const s = scale ?? (cnt > 0 ? Math.sqrt(sq / cnt) : 1);
  const D = E + X;
  const stride = maskStride(F);
  const n = keys.length;
  const inputs = new Float32Array(n * D);
  const masks = new Uint8Array(n * stride);
  const experts = new Int32Array(n);
  keys.forEach((k, p) => {
    const L = per[k.e]!.layers[0]!;
    inputs.set(L.inputs.subarray(k.j * E, (k.j + 1) * E), p * D);
    inputs[p * D + E + k.e] = s;
    masks.set(L.masks.subarray(k.j * stride, (k.j + 1) * stride), p * stride);
    experts[p] = k.e;
  });
  return { ds: { nEmbd: D, nFf: F, nTokens: n, layers: [{ inputs, masks }] }, experts, scale: s };
}

/** One layer's shared predictor. */
export interface SharedExpertPredictor {
  layer: number;
  /** fc1 is rank × (n_embd + n_expert): the last n_expert columns are the experts' biases (times `scale`). */
  predictor: LayerPredictor;
  /** The one-hot's value the predictor was trained with. */
  scale: number;
  /** Threshold for the target recall on the validation pairs. */
  threshold: number;
  /** Pairs trained on. */
  samples: number;
}

/**
 * Trains a shared predictor per layer (see the module comment) at rank `options.rank`.
 * @returns `complete` false when interrupted (the layers finished so far)
 */
export async function trainSharedExpertPredictors(a: {
  data: ExpertActivationDataset;
  mm: MatMul;
  options: PredictorTrainingOptions & { rank: number };
  onEvent?: (e: PipelineEvent) => void;
  signal?: AbortSignal;
}): Promise<{ complete: boolean; layers: SharedExpertPredictor[] }> {
  const out: SharedExpertPredictor[] = [];
  for (let l = 0; l < a.data.experts.length; l++) {
    const { ds, scale } = sharedExpertDataset(a.data, l);
    const res = await trainPredictors({
      data: ds,
      mm: a.mm,
      options: { ...a.options, init: "random" },
      onEvent: a.onEvent,
      signal: a.signal,
    });
    if (!res.complete) return { complete: false, layers: out };
    const r = res.layers[0]!;
    out.push({ layer: l, predictor: r.predictor, scale, threshold: r.threshold, samples: ds.nTokens });
  }
  return { complete: true, layers: out };
}

/**
 * Held-out recall and precision of shared predictors at their thresholds, per layer, over every routed pair
 * (as {@link evaluateExpertPredictors} reports per-expert ones; `zeroExperts` is 0: no expert is computed
 * densely).
 */
export function evaluateSharedExpertPredictors(
  predictors: readonly SharedExpertPredictor[],
  data: ExpertActivationDataset,
  mm: MatMul,
  f16Activations: boolean,
): ExpertLayerReport[] {
  return predictors.map((p) => {
    const { ds } = sharedExpertDataset(data, p.layer, p.scale);
    const c: Confusion = { tp: 0, fp: 0, fn: 0, tokens: 0, nFf: data.nFfExp };
    if (ds.nTokens > 0) {
      const L = ds.layers[0]!;
      const z = predictLogits(p.predictor, L.inputs, ds.nTokens, mm, { f16Activations });
      Object.assign(c, confusionAt(z, L.masks, ds.nTokens, ds.nFf, p.threshold));
      c.nFf = data.nFfExp;
    }
    return { layer: p.layer, pairs: c.tokens, zeroExperts: 0, ...quality(c) };
  });
}
