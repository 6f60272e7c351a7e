/**
 * Activation profiling: run a ReLU model over text and count, per layer and neuron, the tokens on
 * which the neuron fired (ReLU(gate) > 0; ReLU(up) > 0 without a gate). Chunking follows
 * `shared/models/README-relu.md`: consecutive chunks of n_ctx − 1 tokens, each evaluated as
 * [BOS] + chunk, every position (BOS included) counted.
 */
import type { ActivationStats } from "@powerinfer/gguf";
import type { Session } from "./engine.js";
import { EngineError } from "../errors.js";

export interface ProfileResult {
  /** Per layer, [n_ff] firing counts. */
  counts: Int32Array[];
  /** Positions evaluated (BOS positions included). */
  tokens: number;
  /** Per layer, per position: fraction of n_ff that fired. */
  activeFraction: Float32Array[];
}

/**
 * @param tokens the corpus tokenized once, without BOS
 * @param opts.maxTokens stop after this many positions (BOS included): the last chunk is shortened to
 *   fit, so a limit below n_ctx evaluates that many positions, not a whole context
 * @throws EngineError 'BAD_INPUT' for a model whose FFN is not ReLU (nothing fires "exactly 0"), a model with
 *   routed experts (not supported yet), or an empty corpus.
 */
export function profileActivations(
  session: Session,
  tokens: readonly number[],
  opts: { bosId: number | undefined; maxTokens?: number; onChunk?: (done: number, total: number) => void },
): ProfileResult {
  const cfg = session.model.config;
  if (cfg.moe) {
    throw new EngineError(
      "BAD_INPUT",
      "profiling routed experts (firings per layer, expert and neuron) is not supported yet; --sparse oracle runs such a model sparse without statistics",
    );
  }
  if (cfg.ffn.activation !== "relu") {
    throw new EngineError(
      "BAD_INPUT",
      `this model's FFN uses ${cfg.ffn.activation}: its neurons are almost never exactly zero, so there is no activation sparsity to profile — a dense model gains nothing from sparse inference`,
    );
  }
  const bos = opts.bosId;
  const chunkLen = bos === undefined ? session.nCtx : session.nCtx - 1;
  const limit = opts.maxTokens ?? Number.POSITIVE_INFINITY;
  let nChunks = Math.floor(tokens.length / chunkLen);
  if (nChunks < 1 && tokens.length > 0) nChunks = 1; // a short corpus: one partial chunk
  nChunks = Math.min(nChunks, Math.max(1, Math.ceil(limit / session.nCtx)));
  if (nChunks < 1) throw new EngineError("BAD_INPUT", "the corpus is empty");
  const nFf = cfg.n_ff;
  const counts = Array.from({ length: cfg.n_layer }, () => new Int32Array(nFf));
  const fractions: number[][] = Array.from({ length: cfg.n_layer }, () => []);
  let positions = 0;
  for (let c = 0; c < nChunks; c++) {
    // the last chunk stops at `maxTokens` positions in all (a short limit need not fill a whole context)
    const room = limit - positions - (bos === undefined ? 0 : 1);
    const chunk = tokens.slice(c * chunkLen, c * chunkLen + Math.max(1, Math.min(chunkLen, room)));
    session.reset();
    session.evaluate(bos === undefined ? chunk : [bos, ...chunk], {
      onCapture: (layers, nTok) => {
        layers.forEach((L, l) => {
          const cnt = counts[l]!;
          for (let t = 0; t < nTok; t++) {
            let n = 0;
            const o = t * nFf;
            for (let i = 0; i < nFf; i++) {
              if (L.gate[o + i]! > 0) {
                cnt[i]!++;
                n++;
              }
            }
            fractions[l]!.push(n / nFf);
          }
        });
        positions += nTok;
      },
    });
    opts.onChunk?.(c + 1, nChunks);
  }
  return { counts, tokens: positions, activeFraction: fractions.map((f) => Float32Array.from(f)) };
}

/** Per-layer summary of a profile. */
export interface LayerSparsity {
  mean: number;
  p50: number;
  p90: number;
  /** Smallest fraction of the layer's neurons that accounts for 80 % of its activations. */
  hot80: number;
  /** Neurons that never fired. */
  dead: number;
}

function quantile(sorted: Float32Array, q: number): number {
  if (sorted.length === 0) return 0;
  const pos = q * (sorted.length - 1);
  const lo = Math.floor(pos);
  const hi = Math.ceil(pos);
  return sorted[lo]! + (sorted[hi]! - sorted[lo]!) * (pos - lo);
}

/** Smallest share of neurons (sorted by count, descending) covering `share` of all activations. */
export function hotShare(counts: Int32Array, share: number): number {
  const sorted = Array.from(counts).sort((a, b) => b - a);
  const total = sorted.reduce((a, b) => a + b, 0);
  if (total === 0) return 0;
  let acc = 0;
  for (let i = 0; i < sorted.length; i++) {
    acc += sorted[i]!;
    if (acc >= share * total) return (i + 1) / sorted.length;
  }
  return 1;
}

/** Mean/p50/p90 active fraction, hot80 share and dead neurons per layer. */
export function summarizeSparsity(p: {
  counts: Int32Array[];
  activeFraction?: Float32Array[];
  tokens: number;
}): LayerSparsity[] {
  return p.counts.map((c, l) => {
    const fr = p.activeFraction?.[l];
    const sorted = fr ? Float32Array.from(fr).sort() : new Float32Array(0);
    const mean = c.reduce((a, b) => a + b, 0) / (p.tokens * c.length);
    return {
      mean,
      p50: fr ? quantile(sorted, 0.5) : Number.NaN,
      p90: fr ? quantile(sorted, 0.9) : Number.NaN,
      hot80: hotShare(c, 0.8),
      dead: c.reduce((n, v) => n + (v === 0 ? 1 : 0), 0),
    };
  });
}

/**
 * Checks that statistics were measured on this model.
 * @throws EngineError 'BAD_INPUT' naming the mismatch (layer count, n_ff, or model fingerprint).
 */
export function checkStatsForModel(
  stats: ActivationStats,
  model: { n_layer: number; n_ff: number },
  fingerprint?: string,
): void {
  if (stats.counts.length !== model.n_layer) {
    throw new EngineError(
      "BAD_INPUT",
      `activation statistics are for a model with ${stats.counts.length} layers, this model has ${model.n_layer}`,
    );
  }
  if (stats.nFf !== model.n_ff) {
    throw new EngineError(
      "BAD_INPUT",
      `activation statistics are for n_ff ${stats.nFf}, this model has n_ff ${model.n_ff}`,
    );
  }
  if (fingerprint && stats.modelSha256 && stats.modelSha256 !== fingerprint) {
    throw new EngineError(
      "BAD_INPUT",
      `activation statistics were measured on another model file (fingerprint ${stats.modelSha256.slice(0, 12)}…, this file ${fingerprint.slice(0, 12)}…)`,
    );
  }
}
