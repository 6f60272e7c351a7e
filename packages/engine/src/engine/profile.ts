/**
 * Activation profiling: run a ReLU model over text and count, per layer and neuron, the tokens on
 * which the neuron fired (ReLU(gate) > 0; ReLU(up) > 0 without a gate). Chunking follows
 * `shared/models/README-relu.md`: consecutive chunks of n_ctx − 1 tokens, each evaluated as
 * [BOS] + chunk, every position (BOS included) counted. Routed ReLU experts (SmallThinker): per layer the
 * tokens routed to each expert and, per (expert, neuron), the routed tokens on which the neuron fired.
 */
import type { ActivationStats } from "@powerinfer/gguf";
import type { LayerCapture } from "../model/llama.js";
import type { Session } from "./engine.js";
import { EngineError } from "../errors.js";

export interface ProfileResult {
  /** Per layer, [n_ff] firing counts; with experts [n_ff_exp · n_expert], expert e's neuron i at e·n_ff_exp + i. */
  counts: Int32Array[];
  /** Positions evaluated (BOS positions included). */
  tokens: number;
  /** Per layer, per position: fraction of n_ff that fired (with experts: of the chosen experts' neurons). */
  activeFraction: Float32Array[];
  /** Models with routed experts: n_expert. */
  nExpert?: number;
  /** Models with routed experts: per layer, [n_expert] tokens routed to each expert. */
  selections?: Int32Array[];
}

/**
 * The n_expert_used experts a token was routed to, in the router's order (the backends' `top_k`: larger
 * probability first, equal values lower index first).
 */
export function chosenExperts(probs: Float32Array, offset: number, nExpert: number, nUsed: number): number[] {
  const idx = Array.from({ length: nExpert }, (_, e) => e);
  idx.sort((a, b) => probs[offset + b]! - probs[offset + a]! || a - b);
  return idx.slice(0, nUsed);
}

/**
 * @param tokens the corpus tokenized once, without BOS
 * @param opts.maxTokens stop after this many positions (BOS included): the last chunk is shortened to
 *   fit, so a limit below n_ctx evaluates that many positions, not a whole context
 * Routed experts that are not ReLU (Qwen3-MoE, Mixtral: SiLU) are profiled for their routing alone: a token
 * reads every neuron of each chosen expert, so every (expert, neuron) pair of a chosen expert counts as read
 * (activation_count = its expert's selections) — what placement needs to put popular experts on a device.
 * @throws EngineError 'BAD_INPUT' for a dense model whose FFN is not ReLU (nothing fires "exactly 0"), or an
 *   empty corpus.
 */
export function profileActivations(
  session: Session,
  tokens: readonly number[],
  opts: { bosId: number | undefined; maxTokens?: number; onChunk?: (done: number, total: number) => void },
): ProfileResult {
  const cfg = session.model.config;
  // dense experts: every neuron of a chosen expert is read
  const denseExperts = !!cfg.moe && cfg.ffn.activation !== "relu";
  if (cfg.ffn.activation !== "relu" && !cfg.moe) {
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
  const moe = cfg.moe;
  const nFf = moe ? moe.n_ff_exp : cfg.n_ff;
  const nx = moe ? moe.n_expert : 1;
  const counts = Array.from({ length: cfg.n_layer }, () => new Int32Array(nFf * nx));
  const selections = moe ? Array.from({ length: cfg.n_layer }, () => new Int32Array(nx)) : undefined;
  const fractions: number[][] = Array.from({ length: cfg.n_layer }, () => []);
  let positions = 0;
  // experts: slot u of token t holds expert ids[u]'s gate pre-activations, [n_ff_exp × n_expert_used × T]
  const countExperts = (L: LayerCapture, l: number, nTok: number) => {
    const U = moe!.n_expert_used;
    const cnt = counts[l]!;
    const sel = selections![l]!;
    for (let t = 0; t < nTok; t++) {
      const ids = chosenExperts(L.routerProbs!, t * nx, nx, U);
      let n = 0;
      for (const [u, e] of ids.entries()) {
        sel[e]!++;
        const o = (t * U + u) * nFf;
        for (let i = 0; i < nFf; i++) {
          if (denseExperts || L.expertGate![o + i]! > 0) {
            cnt[e * nFf + i]!++;
            n++;
          }
        }
      }
      fractions[l]!.push(n / (U * nFf));
    }
  };
  for (let c = 0; c < nChunks; c++) {
    // the last chunk stops at `maxTokens` positions in all (a short limit need not fill a whole context)
    const room = limit - positions - (bos === undefined ? 0 : 1);
    const chunk = tokens.slice(c * chunkLen, c * chunkLen + Math.max(1, Math.min(chunkLen, room)));
    session.reset();
    session.evaluate(bos === undefined ? chunk : [bos, ...chunk], {
      onCapture: (layers, nTok) => {
        layers.forEach((L, l) => {
          if (moe) {
            countExperts(L, l, nTok);
            return;
          }
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
  return {
    counts,
    tokens: positions,
    activeFraction: fractions.map((f) => Float32Array.from(f)),
    ...(moe ? { nExpert: nx, selections } : {}),
  };
}

/** Per-layer summary of a profile. */
export interface LayerSparsity {
  mean: number;
  p50: number;
  p90: number;
  /** Smallest fraction of the layer's neurons that accounts for 80 % of its activations. */
  hot80: number;
  /** Neurons that never fired (with experts: (expert, neuron) pairs). */
  dead: number;
  /** With experts: the smallest share of experts receiving 80 % of the routed tokens. */
  hotExperts80?: number;
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

/**
 * Mean/p50/p90 active fraction, hot80 share and dead neurons per layer. With experts (`selections`): the
 * fractions are of the chosen experts' neurons (firings ÷ (n_ff_exp · tokens routed)), hot80 and dead are
 * over every (expert, neuron), and `hotExperts80` is the smallest share of experts receiving 80 % of the
 * routed tokens.
 */
export function summarizeSparsity(p: {
  counts: Int32Array[];
  activeFraction?: Float32Array[];
  tokens: number;
  selections?: Int32Array[];
}): LayerSparsity[] {
  return p.counts.map((c, l) => {
    const fr = p.activeFraction?.[l];
    const sorted = fr ? Float32Array.from(fr).sort() : new Float32Array(0);
    const sel = p.selections?.[l];
    const routed = sel ? sel.reduce((a, b) => a + b, 0) : p.tokens;
    const width = sel ? c.length / sel.length : c.length;
    const fired = c.reduce((a, b) => a + b, 0);
    const mean = routed > 0 ? fired / (routed * width) : 0;
    return {
      mean,
      p50: fr ? quantile(sorted, 0.5) : Number.NaN,
      p90: fr ? quantile(sorted, 0.9) : Number.NaN,
      hot80: hotShare(c, 0.8),
      dead: c.reduce((n, v) => n + (v === 0 ? 1 : 0), 0),
      ...(sel ? { hotExperts80: hotShare(sel, 0.8) } : {}),
    };
  });
}

/**
 * Checks that statistics were measured on this model.
 * @throws EngineError 'STATS_MISMATCH' naming the mismatch (layer count, n_ff, or model fingerprint).
 */
export function checkStatsForModel(
  stats: ActivationStats,
  model: { n_layer: number; n_ff: number; moe?: { n_expert: number; n_ff_exp: number } },
  fingerprint?: string,
): void {
  if (model.moe && stats.nExpert !== model.moe.n_expert) {
    throw new EngineError(
      "STATS_MISMATCH",
      stats.nExpert === undefined
        ? "these activation statistics have no experts; this model routes tokens to experts: run `powerinfer profile` on it"
        : `activation statistics are for ${stats.nExpert} experts, this model has ${model.moe.n_expert}`,
    );
  }
  if (!model.moe && stats.nExpert !== undefined) {
    throw new EngineError(
      "STATS_MISMATCH",
      `activation statistics are for a model with ${stats.nExpert} routed experts; this model has none`,
    );
  }
  const nFf = model.moe ? model.moe.n_ff_exp : model.n_ff;
  if (stats.counts.length !== model.n_layer) {
    throw new EngineError(
      "STATS_MISMATCH",
      `activation statistics are for a model with ${stats.counts.length} layers, this model has ${model.n_layer}`,
    );
  }
  if (stats.nFf !== nFf) {
    throw new EngineError(
      "STATS_MISMATCH",
      `activation statistics are for n_ff ${stats.nFf}, this model has ${model.moe ? "n_ff_exp" : "n_ff"} ${nFf}`,
    );
  }
  if (fingerprint && stats.modelSha256 && stats.modelSha256 !== fingerprint) {
    throw new EngineError(
      "STATS_MISMATCH",
      `activation statistics were measured on another model file (fingerprint ${stats.modelSha256.slice(0, 12)}…, this file ${fingerprint.slice(0, 12)}…)`,
    );
  }
}
