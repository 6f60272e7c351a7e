/**
 * Training data for activation predictors: per layer, the FFN input of every token (what the predictor
 * reads: the residual stream after attention, before `ffn_norm`) and which FFN neurons fired for it
 * (`W_gate·h > 0`, i.e. ReLU(gate) ≠ 0; for an ungated FFN `W_up·h > 0`), captured by running the model
 * densely over text.
 */
import type { LayerCapture, Model } from "@powerinfer/engine";

/** One layer's samples. */
export interface LayerActivations {
  /** FFN inputs, float32, token-major: token t is `inputs[t·nEmbd … (t+1)·nEmbd)`. */
  inputs: Float32Array;
  /**
   * Firing masks, bit-packed, `maskStride(nFf)` bytes per token: neuron i of token t fired iff bit
   * `i & 7` of byte `t·stride + (i >> 3)` is set.
   */
  masks: Uint8Array;
}

/** Per-layer (FFN input, firing mask) pairs for `nTokens` token positions. */
export interface ActivationDataset {
  nEmbd: number;
  nFf: number;
  nTokens: number;
  layers: LayerActivations[];
}

/** Bytes per token of a bit-packed firing mask of `nFf` neurons. */
export function maskStride(nFf: number): number {
  return (nFf + 7) >> 3;
}

/** Whether neuron i of token t fired. */
export function fired(ds: ActivationDataset, layer: number, t: number, i: number): boolean {
  const m = ds.layers[layer]!.masks;
  return ((m[t * maskStride(ds.nFf) + (i >> 3)]! >> (i & 7)) & 1) === 1;
}

/** Options of {@link collectActivations}. */
export interface CollectOptions {
  /**
   * Tokens per evaluation window including the BOS that starts it (default: the model's trained context,
   * at most 1024). Windows are `[BOS] + next nCtx−1 tokens` — the `--all-tokens` perplexity protocol —
   * so positions 0…nCtx−1 are all represented; the last window may be shorter.
   */
  nCtx?: number;
  /** Stop after this many token positions (BOS positions included). Default: all of `tokens`. */
  maxTokens?: number;
  /** Called after each window with positions captured so far and the total that will be captured. */
  onProgress?: (done: number, total: number) => void;
  /** Aborts between windows; the promise rejects with the signal's reason. */
  signal?: AbortSignal;
}

/**
 * Runs the model densely over `tokens` (the text tokenized without BOS) and records, per layer and
 * token position, the FFN input and the firing mask. The model must be loaded with `sparse: "off"`
 * (capture needs the dense FFN). Memory: `nTokens · (4·n_embd + n_ff/8)` bytes per layer.
 * @throws Error when the vocabulary has no BOS token or `tokens` is empty
 */
export async function collectActivations(
  model: Model,
  tokens: readonly number[],
  opts: CollectOptions = {},
): Promise<ActivationDataset> {
  const { n_embd: e, n_ff: f, n_layer } = model.config;
  const stride = maskStride(f);
  let layers: LayerActivations[] = [];
  const total = await captureWindows(
    model,
    tokens,
    opts,
    (total) => {
      layers = Array.from({ length: n_layer }, () => ({
        inputs: new Float32Array(total * e),
        masks: new Uint8Array(total * stride),
      }));
    },
    (caps, n, done) => {
      caps.forEach((c, l) => {
        const L = layers[l]!;
        L.inputs.set(c.ffnInput.subarray(0, n * e), done * e);
        const g = c.gate;
        for (let t = 0; t < n; t++) {
          const mo = (done + t) * stride;
          const go = t * f;
          for (let i = 0; i < f; i++) if (g[go + i]! > 0) L.masks[mo + (i >> 3)]! |= 1 << (i & 7);
        }
      });
    },
  );
  return { nEmbd: e, nFf: f, nTokens: total, layers };
}

/**
 * The evaluation windows of {@link collectActivations}: [BOS] + up to nCtx−1 tokens each, positions counted
 * with their BOS, at most `opts.maxTokens` in all.
 * @throws Error when the vocabulary has no BOS token or `tokens` is empty; RangeError for a bad window size
 */
export function evaluationWindows(
  model: Model,
  tokens: readonly number[],
  opts: CollectOptions,
): { windows: number[][]; total: number; nCtx: number } {
  const bos = model.tokenizer.bosId;
  if (bos === undefined) throw new Error("the vocabulary has no BOS token to start each window with");
  if (tokens.length === 0) throw new Error("no tokens to collect activations from");
  const nCtx = opts.nCtx ?? Math.min(model.config.n_ctx_train, 1024);
  if (!Number.isInteger(nCtx) || nCtx < 2) throw new RangeError(`window size ${nCtx} must be an integer ≥ 2`);
  const windows: number[][] = [];
  let total = 0;
  const limit = opts.maxTokens ?? Number.POSITIVE_INFINITY;
  for (let i = 0; i < tokens.length && total < limit; i += nCtx - 1) {
    const w = [bos, ...tokens.slice(i, i + nCtx - 1)];
    if (total + w.length > limit) w.length = limit - total;
    if (w.length < 2) break;
    windows.push(w);
    total += w.length;
  }
  return { windows, total, nCtx };
}

/**
 * Runs the model densely over the evaluation windows of `tokens` ({@link evaluationWindows}), calling
 * `start(total)` once with the positions that will be captured, then `capture(layers, n, done)` for each
 * evaluated chunk of n positions (`done` captured before it); progress and abort as {@link CollectOptions}.
 * @returns the positions captured
 */
export async function captureWindows(
  model: Model,
  tokens: readonly number[],
  opts: CollectOptions,
  start: (total: number) => void,
  capture: (layers: LayerCapture[], n: number, done: number) => void,
): Promise<number> {
  const { windows, total, nCtx } = evaluationWindows(model, tokens, opts);
  start(total);
  const session = model.createSession({ nCtx });
  let done = 0;
  try {
    for (const w of windows) {
      if (opts.signal?.aborted) throw opts.signal.reason ?? new Error("aborted");
      session.reset();
      session.evaluate(w, {
        onCapture: (caps, n) => {
          capture(caps, n, done);
          done += n;
        },
      });
      opts.onProgress?.(done, total);
      // let signal handlers and progress output run between windows
      await new Promise((r) => setImmediate(r));
    }
  } finally {
    session.dispose();
  }
  return done;
}

/** Token positions [from, to) of a dataset as views (no copy). */
export function sliceDataset(ds: ActivationDataset, from: number, to: number): ActivationDataset {
  if (!(0 <= from && from <= to && to <= ds.nTokens)) throw new RangeError(`bad slice ${from}..${to} of ${ds.nTokens}`);
  const s = maskStride(ds.nFf);
  return {
    nEmbd: ds.nEmbd,
    nFf: ds.nFf,
    nTokens: to - from,
    layers: ds.layers.map((L) => ({
      inputs: L.inputs.subarray(from * ds.nEmbd, to * ds.nEmbd),
      masks: L.masks.subarray(from * s, to * s),
    })),
  };
}

/** Per layer, how many of the dataset's tokens each neuron fired on (Int32Array[n_ff]). */
export function activationCounts(ds: ActivationDataset): Int32Array[] {
  const s = maskStride(ds.nFf);
  return ds.layers.map((L) => {
    const c = new Int32Array(ds.nFf);
    for (let t = 0; t < ds.nTokens; t++) {
      const o = t * s;
      for (let i = 0; i < ds.nFf; i++) if ((L.masks[o + (i >> 3)]! >> (i & 7)) & 1) c[i]!++;
    }
    return c;
  });
}

/**
 * Splits a text into a training part and a held-out part of about `holdout` of its characters, at the
 * line break nearest to the cut (else at a space, else exactly), so no line is in both.
 * @returns the two parts and the character offset where the held-out part starts
 */
export function splitText(text: string, holdout: number): { train: string; heldOut: string; splitAt: number } {
  if (!(holdout > 0 && holdout < 1)) throw new RangeError(`holdout fraction ${holdout} must be in (0, 1)`);
  const cut = Math.round(text.length * (1 - holdout));
  const window = Math.max(1, Math.floor(text.length * Math.min(holdout, 1 - holdout) * 0.5));
  const near = (ch: string): number => {
    const after = text.indexOf(ch, cut);
    const before = text.lastIndexOf(ch, cut);
    const c = [after, before].filter((p) => p >= 0 && Math.abs(p - cut) <= window);
    if (!c.length) return -1;
    return c.reduce((a, b) => (Math.abs(a - cut) <= Math.abs(b - cut) ? a : b)) + 1;
  };
  let at = near("\n");
  if (at < 0) at = near(" ");
  if (at < 0) at = cut;
  at = Math.min(Math.max(at, 1), text.length - 1);
  return { train: text.slice(0, at), heldOut: text.slice(at), splitAt: at };
}
