/**
 * Training one layer's predictor (fc1 → ReLU → fc2, no biases; see {@link LayerPredictor}).
 *
 * Loss — binary cross-entropy on the firing mask y ∈ {0, 1}, the positive term weighted by w₊ > 1 so
 * that missing a neuron that fires (which changes the layer's output) costs more than computing one
 * that does not (which only costs time), averaged over tokens and neurons:
 *
 *     ℓ(z, y) = w₊ · y · softplus(−z) + (1 − y) · softplus(z)          (= −w₊·y·log σ(z) − (1−y)·log(1−σ(z)))
 *     ∂ℓ/∂z   = (1 − y) · σ(z) − w₊ · y · (1 − σ(z))
 *
 * Optimiser: AdamW (Loshchilov & Hutter 2019: Adam moments, weight decay applied to the weights
 * directly), learning rate with cosine decay to 10 % over the epoch budget, shuffled mini-batches.
 * Early stopping: after every epoch the predictor is scored on held-out samples by the active fraction it
 * needs to reach the target recall there (threshold calibrated on those samples); the best epoch is
 * kept and training stops after `patience` epochs without improvement.
 *
 * Per step with batch B the products are (row-major, `gemmNT(A, B) = A·Bᵀ` on the given {@link MatMul}):
 * H = ReLU(X·fc1ᵀ) [B×r], Z = H·fc2ᵀ [B×n_ff], ∂fc2 = Gᵀ·H, ∂H = G·fc2 ⊙ [H>0], ∂fc1 = ∂Hᵀ·X —
 * about 6·B·r·(n_embd + n_ff) flops.
 *
 * Training is deterministic for a given seed and backend, and can stop after any step and resume exactly
 * from a {@link LayerTrainState} (the shuffle of each epoch is derived from the seed and the epoch).
 */
import type { ActivationDataset } from "./dataset.js";
import { maskStride } from "./dataset.js";
import { type MatMul, transpose } from "./matmul.js";
import { confusionAt, quality, thresholdForRecall } from "./metrics.js";
import { type LayerPredictor, predictLogits } from "./predictor.js";
import { deriveSeed, Rng } from "./rng.js";

/** Hyper-parameters of {@link trainLayer}. */
export interface TrainOptions {
  /** Maximum epochs over the training samples. Default 8. */
  epochs?: number;
  /** Samples per step. Default 256. */
  batchSize?: number;
  /** Peak learning rate. Default 2e-3. */
  lr?: number;
  /** Decoupled weight decay. Default 1e-4. */
  weightDecay?: number;
  /** Weight w₊ of the positive term of the loss. Default 3. */
  posWeight?: number;
  /** Recall the early-stopping score is measured at. Default 0.95. */
  targetRecall?: number;
  /** Epochs without improvement before stopping. Default 2. */
  patience?: number;
  /** Seed of the shuffles. Default 1. */
  seed?: number;
}

/** What one epoch achieved on the validation samples. */
export interface EpochReport {
  epoch: number;
  /** Mean training loss over the epoch. */
  loss: number;
  /** Threshold that gives the target recall on the validation samples. */
  threshold: number;
  /** Recall at that threshold (≥ target). */
  recall: number;
  precision: number;
  /** Active fraction needed for the target recall: the early-stopping score (lower is better). */
  predictedFraction: number;
  trueFraction: number;
}

/** Everything needed to resume training of a layer exactly. */
export interface LayerTrainState {
  /** Current weights. */
  current: LayerPredictor;
  /** Adam first and second moments of fc1 and fc2. */
  m1: Float32Array;
  v1: Float32Array;
  m2: Float32Array;
  v2: Float32Array;
  /** Adam steps taken. */
  adamStep: number;
  /** Next epoch (0-based) and next step inside it. */
  epoch: number;
  step: number;
  /** Loss summed over the steps of the current epoch so far. */
  lossSum: number;
  /** Best weights so far and their score (+∞ before the first epoch ends). */
  best: LayerPredictor;
  bestScore: number;
  /** Epochs since the best one. */
  staleEpochs: number;
  /** Score of the starting weights (set when training starts). */
  initScore?: Omit<EpochReport, "epoch" | "loss">;
  /** Per finished epoch. */
  history: EpochReport[];
  /** True when training has finished (epochs exhausted or stopped early). */
  done: boolean;
  /** Set when the loss stopped being finite; `best` holds the last good weights. */
  diverged?: boolean;
}

/** Progress of a step. */
export interface StepInfo {
  epoch: number;
  step: number;
  stepsPerEpoch: number;
  /** Running mean loss of this epoch. */
  loss: number;
}

/** Fills defaults. */
export function trainDefaults(o: TrainOptions = {}): Required<TrainOptions> {
  return {
    epochs: o.epochs ?? 8,
    batchSize: o.batchSize ?? 256,
    lr: o.lr ?? 2e-3,
    weightDecay: o.weightDecay ?? 1e-4,
    posWeight: o.posWeight ?? 3,
    targetRecall: o.targetRecall ?? 0.95,
    patience: o.patience ?? 2,
    seed: o.seed ?? 1,
  };
}

function clonePredictor(p: LayerPredictor): LayerPredictor {
  return { ...p, fc1: p.fc1.slice(), fc2: p.fc2.slice() };
}

/** A fresh training state starting from `init`. */
export function initialTrainState(init: LayerPredictor): LayerTrainState {
  return {
    current: clonePredictor(init),
    m1: new Float32Array(init.fc1.length),
    v1: new Float32Array(init.fc1.length),
    m2: new Float32Array(init.fc2.length),
    v2: new Float32Array(init.fc2.length),
    adamStep: 0,
    epoch: 0,
    step: 0,
    lossSum: 0,
    best: clonePredictor(init),
    bestScore: Number.POSITIVE_INFINITY,
    staleEpochs: 0,
    history: [],
    done: false,
  };
}

/**
 * Scores a predictor on samples: calibrates the threshold for `targetRecall` and reports the quality
 * there (the early-stopping score is `predictedFraction`).
 */
export function scorePredictor(
  p: LayerPredictor,
  data: ActivationDataset,
  layer: number,
  targetRecall: number,
  mm: MatMul,
): Omit<EpochReport, "epoch" | "loss"> {
  const L = data.layers[layer]!;
  const z = predictLogits(p, L.inputs, data.nTokens, mm);
  const threshold = thresholdForRecall(z, L.masks, data.nTokens, data.nFf, targetRecall);
  return { threshold, ...quality(confusionAt(z, L.masks, data.nTokens, data.nFf, threshold)) };
}

/** Scratch buffers of one step. */
class StepBuffers {
  x: Float32Array;
  xt: Float32Array;
  h: Float32Array;
  ht: Float32Array;
  z: Float32Array;
  g: Float32Array;
  gt: Float32Array;
  fc2t: Float32Array;
  dh: Float32Array;
  dht: Float32Array;
  d1: Float32Array;
  d2: Float32Array;
  constructor(b: number, e: number, r: number, f: number) {
    this.x = new Float32Array(b * e);
    this.xt = new Float32Array(b * e);
    this.h = new Float32Array(b * r);
    this.ht = new Float32Array(b * r);
    this.z = new Float32Array(b * f);
    this.g = new Float32Array(b * f);
    this.gt = new Float32Array(b * f);
    this.fc2t = new Float32Array(f * r);
    this.dh = new Float32Array(b * r);
    this.dht = new Float32Array(b * r);
    this.d1 = new Float32Array(r * e);
    this.d2 = new Float32Array(f * r);
  }
}

/**
 * One forward/backward pass on the samples `idx` of `layer`: returns the loss (estimated on every 4th
 * sample) and leaves the gradients of the mean loss over all B·n_ff (sample, neuron) pairs in `buf.d1`
 * (fc1) and `buf.d2` (fc2).
 */
function forwardBackward(
  p: LayerPredictor,
  data: ActivationDataset,
  layer: number,
  idx: Uint32Array,
  posWeight: number,
  mm: MatMul,
  buf: StepBuffers,
): number {
  const { nEmbd: e, nFf: f } = data;
  const r = p.rank;
  const B = idx.length;
  const L = data.layers[layer]!;
  const s = maskStride(f);
  const x = buf.x.subarray(0, B * e);
  for (let b = 0; b < B; b++) x.set(L.inputs.subarray(idx[b]! * e, (idx[b]! + 1) * e), b * e);
  const h = buf.h.subarray(0, B * r);
  mm.gemmNT(x, p.fc1, B, r, e, h);
  for (let i = 0; i < h.length; i++) if (!(h[i]! > 0)) h[i] = 0;
  const z = buf.z.subarray(0, B * f);
  mm.gemmNT(h, p.fc2, B, f, r, z);
  // ∂ℓ/∂z scaled by 1/(B·f), written both token-major (g) and neuron-major (gt, for ∂fc2). The loss
  // value itself (only reported) is summed over every 4th sample of the batch to spare a log1p per
  // element.
  const g = buf.g.subarray(0, B * f);
  const gt = buf.gt.subarray(0, B * f);
  const inv = 1 / (B * f);
  const wPos = posWeight * inv;
  let loss = 0;
  let lossCount = 0;
  for (let b = 0; b < B; b++) {
    const mo = idx[b]! * s;
    const zo = b * f;
    const withLoss = (b & 3) === 0;
    for (let i0 = 0; i0 < f; i0 += 8) {
      const bits = L.masks[mo + (i0 >> 3)]!;
      const i1 = Math.min(f, i0 + 8);
      for (let i = i0; i < i1; i++) {
        const zi = z[zo + i]!;
        const sig = 1 / (1 + Math.exp(-zi));
        const gi = (bits >> (i - i0)) & 1 ? -wPos * (1 - sig) : sig * inv;
        g[zo + i] = gi;
        gt[i * B + b] = gi;
      }
      if (withLoss) {
        for (let i = i0; i < i1; i++) {
          const zi = z[zo + i]!;
          const sp = Math.max(zi, 0) + Math.log1p(Math.exp(-Math.abs(zi))); // softplus(z)
          loss += (bits >> (i - i0)) & 1 ? posWeight * (sp - zi) : sp; // softplus(−z) = softplus(z) − z
        }
        lossCount += i1 - i0;
      }
    }
  }
  // ∂fc2 [f×r] = Gᵀ·H: operands with the batch contiguous
  const ht = transpose(h, B, r, buf.ht.subarray(0, B * r));
  mm.gemmNT(gt, ht, f, r, B, buf.d2);
  // ∂H [B×r] = G·fc2, through the ReLU
  const fc2t = transpose(p.fc2, f, r, buf.fc2t);
  const dh = buf.dh.subarray(0, B * r);
  mm.gemmNT(g, fc2t, B, r, f, dh);
  for (let i = 0; i < dh.length; i++) if (!(h[i]! > 0)) dh[i] = 0;
  // ∂fc1 [r×e] = ∂Hᵀ·X
  const dht = transpose(dh, B, r, buf.dht.subarray(0, B * r));
  const xt = transpose(x, B, e, buf.xt.subarray(0, B * e));
  mm.gemmNT(dht, xt, r, e, B, buf.d1);
  return loss / lossCount;
}

/**
 * The loss and its gradients for one batch (what a training step computes), for tests and tools:
 * `d1` [rank × nEmbd] = ∂L/∂fc1, `d2` [nFf × rank] = ∂L/∂fc2 of the mean loss over the batch's
 * (sample, neuron) pairs; `loss` is estimated on every 4th sample.
 */
export function batchLossAndGradients(
  p: LayerPredictor,
  data: ActivationDataset,
  layer: number,
  idx: Uint32Array,
  posWeight: number,
  mm: MatMul,
): { loss: number; d1: Float32Array; d2: Float32Array } {
  const buf = new StepBuffers(idx.length, data.nEmbd, p.rank, data.nFf);
  const loss = forwardBackward(p, data, layer, idx, posWeight, mm, buf);
  return { loss, d1: buf.d1, d2: buf.d2 };
}

function adamw(
  w: Float32Array,
  grad: Float32Array,
  m: Float32Array,
  v: Float32Array,
  t: number,
  lr: number,
  wd: number,
): void {
  const b1 = 0.9;
  const b2 = 0.999;
  const eps = 1e-8;
  const c1 = 1 / (1 - b1 ** t);
  const c2 = 1 / (1 - b2 ** t);
  const decay = 1 - lr * wd;
  for (let i = 0; i < w.length; i++) {
    const gi = grad[i]!;
    const mi = b1 * m[i]! + (1 - b1) * gi;
    const vi = b2 * v[i]! + (1 - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    w[i] = w[i]! * decay - (lr * (mi * c1)) / (Math.sqrt(vi * c2) + eps);
  }
}

/** Arguments of {@link trainLayer}. */
export interface TrainLayerArgs {
  /** Training samples. */
  train: ActivationDataset;
  /** Validation samples for early stopping (disjoint from `train`). */
  val: ActivationDataset;
  layer: number;
  /** Where to start: a fresh {@link initialTrainState} or a state saved earlier. */
  state: LayerTrainState;
  options?: TrainOptions;
  mm: MatMul;
  /** After every step. */
  onStep?: (s: StepInfo) => void;
  /** After every epoch, with the state to checkpoint. */
  onEpoch?: (r: EpochReport, state: LayerTrainState) => void | Promise<void>;
  /** Checked before every step; when aborted, returns the state as it is (resumable). */
  signal?: AbortSignal;
  /** Yield to the event loop every this many ms (signal handlers, progress output). Default 200. */
  yieldMs?: number;
}

/**
 * Trains (or continues training) one layer's predictor. Mutates and returns `state`; `state.done`
 * tells whether training finished or was interrupted by the signal. The predictor to use is
 * `state.best`.
 */
export async function trainLayer(a: TrainLayerArgs): Promise<LayerTrainState> {
  const o = trainDefaults(a.options);
  const st = a.state;
  const { train, layer, mm } = a;
  const n = train.nTokens;
  if (n < 1) throw new RangeError("no training samples");
  const B = Math.min(o.batchSize, n);
  const stepsPerEpoch = Math.ceil(n / B);
  const totalSteps = stepsPerEpoch * o.epochs;
  const p = st.current;
  const buf = new StepBuffers(B, train.nEmbd, p.rank, train.nFf);
  let lastYield = performance.now();
  if (!st.initScore) {
    // the starting point competes with the epochs (a warm start may already be the best)
    st.initScore = scorePredictor(p, a.val, layer, o.targetRecall, mm);
    st.bestScore = st.initScore.predictedFraction;
    st.best = clonePredictor(p);
  }
  while (!st.done) {
    if (st.epoch >= o.epochs) {
      st.done = true;
      break;
    }
    const perm = new Rng(deriveSeed(o.seed, layer, st.epoch)).permutation(n);
    while (st.step < stepsPerEpoch) {
      if (a.signal?.aborted) return st;
      const idx = perm.subarray(st.step * B, Math.min(n, (st.step + 1) * B));
      const loss = forwardBackward(p, train, layer, idx, o.posWeight, mm, buf);
      if (!Number.isFinite(loss)) {
        // diverged: keep the best weights so far and stop
        st.diverged = true;
        st.done = true;
        return st;
      }
      const progress = (st.epoch * stepsPerEpoch + st.step) / totalSteps;
      const lr = o.lr * (0.1 + 0.45 * (1 + Math.cos(Math.PI * progress)));
      st.adamStep++;
      adamw(p.fc1, buf.d1, st.m1, st.v1, st.adamStep, lr, o.weightDecay);
      adamw(p.fc2, buf.d2, st.m2, st.v2, st.adamStep, lr, o.weightDecay);
      st.lossSum += loss;
      st.step++;
      a.onStep?.({ epoch: st.epoch, step: st.step, stepsPerEpoch, loss: st.lossSum / st.step });
      if (performance.now() - lastYield > (a.yieldMs ?? 200)) {
        await new Promise((r) => setImmediate(r));
        lastYield = performance.now();
      }
    }
    const score = scorePredictor(p, a.val, layer, o.targetRecall, mm);
    const report: EpochReport = { epoch: st.epoch, loss: st.lossSum / stepsPerEpoch, ...score };
    st.history.push(report);
    if (report.predictedFraction < st.bestScore) {
      st.bestScore = report.predictedFraction;
      st.best = clonePredictor(p);
      st.staleEpochs = 0;
    } else {
      st.staleEpochs++;
    }
    st.epoch++;
    st.step = 0;
    st.lossSum = 0;
    if (st.staleEpochs >= o.patience || st.epoch >= o.epochs) st.done = true;
    await a.onEpoch?.(report, st);
    // every epoch also ends with a turn of the event loop: an epoch (steps and scoring) can be shorter than
    // yieldMs, and a Ctrl-C must not wait for the whole training to finish
    await new Promise((r) => setImmediate(r));
    lastYield = performance.now();
    if (a.signal?.aborted) return st;
  }
  return st;
}
