/**
 * How good a predictor is: recall (share of the neurons that fired which the predictor selected — a
 * missed neuron changes the output), precision (share of the selected neurons that fired — a wasted one
 * costs time), and the predicted vs true active fraction (neurons computed vs needed per token).
 */
import { maskStride } from "./dataset.js";

/** Counts over (token, neuron) pairs. */
export interface Confusion {
  /** Selected and fired. */
  tp: number;
  /** Selected, did not fire. */
  fp: number;
  /** Fired, not selected. */
  fn: number;
  tokens: number;
  nFf: number;
}

/** Quality figures of a {@link Confusion}. */
export interface Quality {
  /** tp / (tp + fn); 1 when nothing fired. */
  recall: number;
  /** tp / (tp + fp); 1 when nothing was selected. */
  precision: number;
  /** Mean share of neurons selected per token. */
  predictedFraction: number;
  /** Mean share of neurons that fired per token. */
  trueFraction: number;
}

export function quality(c: Confusion): Quality {
  const all = c.tokens * c.nFf;
  return {
    recall: c.tp + c.fn > 0 ? c.tp / (c.tp + c.fn) : 1,
    precision: c.tp + c.fp > 0 ? c.tp / (c.tp + c.fp) : 1,
    predictedFraction: all > 0 ? (c.tp + c.fp) / all : 0,
    trueFraction: all > 0 ? (c.tp + c.fn) / all : 0,
  };
}

/** Confusion of logits `z` ([n × nFf]) at `threshold` (selected iff z ≥ threshold) against the masks. */
export function confusionAt(z: Float32Array, masks: Uint8Array, n: number, nFf: number, threshold: number): Confusion {
  const s = maskStride(nFf);
  let tp = 0;
  let fp = 0;
  let fn = 0;
  for (let t = 0; t < n; t++) {
    const zo = t * nFf;
    const mo = t * s;
    for (let i = 0; i < nFf; i++) {
      const y = (masks[mo + (i >> 3)]! >> (i & 7)) & 1;
      const p = z[zo + i]! >= threshold;
      if (p) {
        if (y) tp++;
        else fp++;
      } else if (y) fn++;
    }
  }
  return { tp, fp, fn, tokens: n, nFf };
}

/**
 * The largest threshold at which the recall on these samples is at least `targetRecall`: the logits of
 * the neurons that fired, sorted, cut at the (1 − target) quantile. With no firing at all, +∞ is not
 * useful, so the maximum logit is returned.
 */
export function thresholdForRecall(
  z: Float32Array,
  masks: Uint8Array,
  n: number,
  nFf: number,
  targetRecall: number,
): number {
  const s = maskStride(nFf);
  let count = 0;
  for (let t = 0; t < n; t++) {
    for (let b = 0; b < s; b++) {
      let v = masks[t * s + b]!;
      while (v) {
        v &= v - 1;
        count++;
      }
    }
  }
  if (count === 0) return z.reduce((m, v) => Math.max(m, v), Number.NEGATIVE_INFINITY);
  const pos = new Float32Array(count);
  let p = 0;
  for (let t = 0; t < n; t++) {
    const zo = t * nFf;
    const mo = t * s;
    for (let i = 0; i < nFf; i++) if ((masks[mo + (i >> 3)]! >> (i & 7)) & 1) pos[p++] = z[zo + i]!;
  }
  pos.sort();
  // keep at least ceil(target · count) positives: cut below index count − keep
  const keep = Math.min(count, Math.ceil(targetRecall * count - 1e-9));
  return pos[count - keep]!;
}

/**
 * The baseline a predictor must beat: a fixed list of the `size` neurons that fired most often on the
 * training part (`trainCounts`), selected for every token. Its quality on held-out masks.
 */
export function hotListConfusion(trainCounts: Int32Array, size: number, masks: Uint8Array, n: number): Confusion {
  const nFf = trainCounts.length;
  const order = Array.from(trainCounts.keys()).sort((a, b) => trainCounts[b]! - trainCounts[a]! || a - b);
  const hot = new Uint8Array(nFf);
  const k = Math.max(0, Math.min(nFf, Math.round(size)));
  for (let j = 0; j < k; j++) hot[order[j]!] = 1;
  const s = maskStride(nFf);
  let tp = 0;
  let fn = 0;
  for (let t = 0; t < n; t++) {
    const mo = t * s;
    for (let i = 0; i < nFf; i++) {
      if ((masks[mo + (i >> 3)]! >> (i & 7)) & 1) {
        if (hot[i]) tp++;
        else fn++;
      }
    }
  }
  return { tp, fp: k * n - tp, fn, tokens: n, nFf };
}
