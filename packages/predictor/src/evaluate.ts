/** Held-out report: trained predictors against the truth and against a fixed hot-neuron list. */
import type { ActivationDataset } from "./dataset.js";
import type { MatMul } from "./matmul.js";
import { confusionAt, hotListConfusion, type Quality, quality } from "./metrics.js";
import { type LayerPredictor, predictLogits, predictorCost } from "./predictor.js";

/** One layer of the report. */
export interface LayerReport extends Quality {
  layer: number;
  rank: number;
  /**
   * The baseline: the same number of neurons per token as the predictor selects on average, as a fixed
   * list of the neurons that fired most often on the training part.
   */
  hot: Quality;
  /** Multiply-adds of the predictor per token as a share of the dense FFN's. */
  predictorCost: number;
}

/** Arguments of {@link evaluatePredictors}. */
export interface EvaluateArgs {
  predictors: LayerPredictor[];
  /** The model-wide threshold (neuron selected iff logit ≥ threshold). */
  threshold: number;
  /** Held-out samples (from text disjoint from the training text). */
  data: ActivationDataset;
  /** Per layer, how often each neuron fired on the training part (for the hot-list baseline). */
  trainCounts: Int32Array[];
  mm: MatMul;
  /** Round activations to F16 as the CPU backend does for F16 predictor weights. */
  f16Activations?: boolean;
  /** Weight matrices of the dense FFN (3 for a gated FFN, 2 without gate). Default 3. */
  ffnMatrices?: number;
}

/** Per layer: recall, precision, predicted vs true active fraction, and the hot-list baseline. */
export function evaluatePredictors(a: EvaluateArgs): LayerReport[] {
  const { data } = a;
  return a.predictors.map((p, l) => {
    const L = data.layers[l]!;
    const z = predictLogits(p, L.inputs, data.nTokens, a.mm, { f16Activations: a.f16Activations });
    const q = quality(confusionAt(z, L.masks, data.nTokens, data.nFf, a.threshold));
    const hot = quality(hotListConfusion(a.trainCounts[l]!, q.predictedFraction * data.nFf, L.masks, data.nTokens));
    const cost = predictorCost(p.rank, p.nEmbd, p.nFf) / ((a.ffnMatrices ?? 3) * p.nEmbd * p.nFf);
    return { layer: l, rank: p.rank, ...q, hot, predictorCost: cost };
  });
}

/** Means over layers (recall and precision unweighted; fractions are per-token means). */
export function summarizeReport(r: LayerReport[]): {
  recall: number;
  precision: number;
  predictedFraction: number;
  trueFraction: number;
  hotRecall: number;
} {
  const mean = (f: (x: LayerReport) => number) => r.reduce((s, x) => s + f(x), 0) / Math.max(1, r.length);
  return {
    recall: mean((x) => x.recall),
    precision: mean((x) => x.precision),
    predictedFraction: mean((x) => x.predictedFraction),
    trueFraction: mean((x) => x.trueFraction),
    hotRecall: mean((x) => x.hot.recall),
  };
}
