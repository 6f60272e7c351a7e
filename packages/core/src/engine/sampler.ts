/**
 * The sampler chain, in llama.cpp's common order: logit bias → penalties → top-k → top-p → min-p →
 * temperature → draw. Temperature ≤ 0 is greedy (argmax of the raw logits, ties → lowest id, as llama.cpp's greedy
 * sampler). Same seed, same logits → same tokens.
 */

import { EngineError } from "./errors.js";

/** Sampling options; every field has llama.cpp's default. */
export interface SamplerOptions {
  /** Softmax temperature; ≤ 0 is greedy. Default 0.8. */
  temperature?: number;
  /** Keep the k most likely tokens; ≤ 0 keeps all. Default 40. */
  topK?: number;
  /** Nucleus sampling: keep the smallest set with cumulative probability ≥ p; 1 disables. Default 0.95. */
  topP?: number;
  /** Drop tokens whose probability is below min_p × the top probability; 0 disables. Default 0.05. */
  minP?: number;
  /** Repetition penalty over the last `penaltyLastN` tokens (CTRL, Keskar et al. 2019); 1 disables. Default 1. */
  repeatPenalty?: number;
  /** Subtracted once from a recent token's logit (OpenAI presence penalty); default 0. */
  presencePenalty?: number;
  /** Subtracted per occurrence of a recent token (OpenAI frequency penalty); default 0. */
  frequencyPenalty?: number;
  /** How many recent tokens the penalties look at. Default 64. */
  penaltyLastN?: number;
  /** RNG seed (uint32). Default: a random seed. */
  seed?: number;
  /** Added to a token's logit before everything else (OpenAI/llama.cpp `logit_bias`); −Infinity bans it. */
  logitBias?: ReadonlyMap<number, number>;
}

/** Index of the largest value; ties go to the lowest index. */
export function argmax(logits: Float32Array): number {
  let best = 0;
  let bv = logits[0]!;
  for (let i = 1; i < logits.length; i++) {
    const v = logits[i]!;
    if (v > bv) {
      bv = v;
      best = i;
    }
  }
  return best;
}

/** Small deterministic PRNG (mulberry32): uniform floats in [0, 1). */
function mulberry32(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export class Sampler {
  readonly options: Required<SamplerOptions>;
  private readonly rand: () => number;
  private readonly recent: number[] = [];

  constructor(options: SamplerOptions = {}) {
    this.options = {
      temperature: options.temperature ?? 0.8,
      topK: options.topK ?? 40,
      topP: options.topP ?? 0.95,
      minP: options.minP ?? 0.05,
      repeatPenalty: options.repeatPenalty ?? 1,
      presencePenalty: options.presencePenalty ?? 0,
      frequencyPenalty: options.frequencyPenalty ?? 0,
      penaltyLastN: options.penaltyLastN ?? 64,
      seed: options.seed ?? Math.floor(Math.random() * 2 ** 32),
      logitBias: options.logitBias ?? new Map(),
    };
    const o = this.options;
    const bad = (what: string) => {
      throw new EngineError("BAD_INPUT", what);
    };
    if (!Number.isFinite(o.temperature)) bad(`temperature ${o.temperature} is not a number`);
    if (!Number.isInteger(o.topK) || o.topK < 0) bad(`top_k must be an integer ≥ 0, got ${o.topK}`);
    if (!(o.topP > 0 && o.topP <= 1)) bad(`top_p must be in (0, 1], got ${o.topP}`);
    if (!(o.minP >= 0 && o.minP <= 1)) bad(`min_p must be in [0, 1], got ${o.minP}`);
    if (!(o.repeatPenalty > 0)) bad(`repeat penalty must be > 0, got ${o.repeatPenalty}`);
    if (!Number.isFinite(o.presencePenalty) || !Number.isFinite(o.frequencyPenalty)) bad("penalties must be numbers");
    if (!Number.isInteger(o.penaltyLastN) || o.penaltyLastN < 0)
      bad(`penalty window must be an integer ≥ 0, got ${o.penaltyLastN}`);
    if (!Number.isInteger(o.seed) || o.seed < 0 || o.seed > 0xffffffff)
      bad(`seed must be an integer in [0, 2^32), got ${o.seed}`);
    for (const [t, b] of o.logitBias) {
      if (!Number.isInteger(t) || t < 0) bad(`logit bias: token id must be an integer ≥ 0, got ${t}`);
      if (Number.isNaN(b) || b === Number.POSITIVE_INFINITY) bad(`logit bias of token ${t} must be a number, got ${b}`);
    }
    this.rand = mulberry32(this.options.seed);
  }

  /** Records a token (prompt or generated) for the penalties. */
  accept(token: number): void {
    this.recent.push(token);
    const n = Math.max(0, this.options.penaltyLastN);
    if (this.recent.length > n) this.recent.splice(0, this.recent.length - n);
  }

  /**
   * Picks the next token. `logits` (length n_vocab) is not modified.
   * @returns a token id in [0, n_vocab).
   */
  sample(logits: Float32Array): number {
    const o = this.options;
    const penalised = o.repeatPenalty !== 1 || o.presencePenalty !== 0 || o.frequencyPenalty !== 0;
    let l = logits;
    if (o.logitBias.size > 0) {
      l = Float32Array.from(logits);
      for (const [t, b] of o.logitBias) if (t < l.length) l[t] = l[t]! + b;
    }
    if (penalised && this.recent.length > 0) {
      if (l === logits) l = Float32Array.from(logits);
      const counts = new Map<number, number>();
      for (const t of this.recent) counts.set(t, (counts.get(t) ?? 0) + 1);
      for (const [t, c] of counts) {
        if (t < 0 || t >= l.length) continue;
        let v = l[t]!;
        v = v <= 0 ? v * o.repeatPenalty : v / o.repeatPenalty;
        v -= c * o.frequencyPenalty + o.presencePenalty;
        l[t] = v;
      }
    }
    if (o.temperature <= 0) return argmax(l);

    // candidates sorted by logit, descending (stable: lower id first on ties)
    let ids = Array.from({ length: l.length }, (_, i) => i);
    ids.sort((a, b) => l[b]! - l[a]! || a - b);
    if (o.topK > 0 && o.topK < ids.length) ids = ids.slice(0, o.topK);
    const softmax = (xs: number[]) => {
      const m = l[xs[0]!]!;
      const p = xs.map((i) => Math.exp(l[i]! - m));
      const s = p.reduce((a, b) => a + b, 0);
      return p.map((v) => v / s);
    };
    if (o.topP < 1) {
      const p = softmax(ids);
      let cum = 0;
      let keep = ids.length;
      for (let i = 0; i < p.length; i++) {
        cum += p[i]!;
        if (cum >= o.topP) {
          keep = i + 1;
          break;
        }
      }
      ids = ids.slice(0, Math.max(1, keep));
    }
    if (o.minP > 0) {
      const p = softmax(ids);
      const cut = p[0]! * o.minP;
      const keep = p.findIndex((v) => v < cut);
      if (keep > 0) ids = ids.slice(0, keep);
    }
    const m = l[ids[0]!]!;
    const w = ids.map((i) => Math.exp((l[i]! - m) / o.temperature));
    const total = w.reduce((a, b) => a + b, 0);
    let r = this.rand() * total;
    for (let i = 0; i < ids.length; i++) {
      r -= w[i]!;
      if (r < 0) return ids[i]!;
    }
    return ids[ids.length - 1]!;
  }
}
