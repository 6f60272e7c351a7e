/**
 * The sampler chain, in llama.cpp's common order: logit bias → penalties → top-k → top-p → min-p →
 * temperature → draw. Temperature ≤ 0 is greedy (argmax of the raw logits, ties → lowest id, as llama.cpp's greedy
 * sampler). Each step follows llama.cpp's sampler of that name (llama-sampler.cpp: float arithmetic, the
 * order candidates are kept in) and the draw comes from `std::mt19937` seeded with the seed, as llama.cpp's
 * `dist` sampler, so the same seed, settings and logits give llama.cpp's tokens.
 */

import { EngineError } from "../errors.js";

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
  /**
   * Under a constraint (a grammar): false (default, llama.cpp's `common_sampler_sample`) draws from the
   * unconstrained chain, keeps the token when the grammar allows it, and otherwise draws again (a second
   * random number) from the chain over the allowed tokens only; true draws once, from the allowed tokens
   * only (llama.cpp's `grammar_first`). Greedy picks the same token either way.
   */
  grammarFirst?: boolean;
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

/**
 * The 32-bit Mersenne Twister (Matsumoto & Nishimura 1998) exactly as C++'s `std::mt19937`, the engine
 * llama.cpp's samplers draw from, so the same seed gives llama.cpp's draws.
 */
export class Mt19937 {
  private readonly mt = new Uint32Array(624);
  private index = 624;

  /** @param seed uint32, as `std::mt19937(seed)`. */
  constructor(seed: number) {
    const mt = this.mt;
    mt[0] = seed >>> 0;
    for (let i = 1; i < 624; i++) {
      const prev = mt[i - 1]!;
      mt[i] = (Math.imul(1812433253, prev ^ (prev >>> 30)) + i) >>> 0;
    }
  }

  /** The next uint32 draw. */
  next(): number {
    const mt = this.mt;
    if (this.index >= 624) {
      for (let k = 0; k < 624; k++) {
        const y = (mt[k]! & 0x80000000) | (mt[(k + 1) % 624]! & 0x7fffffff);
        mt[k] = mt[(k + 397) % 624]! ^ (y >>> 1) ^ (y & 1 ? 0x9908b0df : 0);
      }
      this.index = 0;
    }
    let y = mt[this.index++]!;
    y ^= y >>> 11;
    y ^= (y << 7) & 0x9d2c5680;
    y ^= (y << 15) & 0xefc60000;
    y ^= y >>> 18;
    return y >>> 0;
  }

  /**
   * A double in [0, 1) as libstdc++'s `std::generate_canonical<double, 53>` makes it from this engine (what
   * `std::uniform_real_distribution<double>(0, 1)` returns): two draws a, b → (a + b·2³²) / 2⁶⁴, in double
   * arithmetic, with 1 replaced by the largest double below it.
   */
  canonical(): number {
    const a = this.next();
    const b = this.next();
    const r = (a + b * 2 ** 32) / 2 ** 64;
    return r >= 1 ? 1 - 2 ** -53 : r;
  }
}

const f32 = Math.fround;

/**
 * What a grammar (or any constraint) allows next; see `GrammarConstraint` in ../grammar. The sampler masks
 * the candidates with it after the logit bias and penalties, before top-k (llama.cpp applies its grammar
 * sampler first; a −∞ logit is unchanged by bias and penalties, so the two orders give the same tokens).
 */
export interface TokenConstraint {
  /** May token `id` come next? */
  allows(id: number): boolean;
  /** Sets out[id] = 1 for every allowed token, 0 for the others; returns how many are allowed. */
  mask(out: Uint8Array): number;
}

/**
 * The `n` best tokens by (logit descending, id ascending) — the order the sampler sorts candidates in —
 * best first. O(n_vocab) with a small sorted window.
 */
export function topCandidates(l: Float32Array, n: number): number[] {
  const ids: number[] = [];
  const vals: number[] = [];
  for (let i = 0; i < l.length; i++) {
    const v = l[i]!;
    if (ids.length === n && !(v > vals[n - 1]!)) continue;
    let j = ids.length < n ? ids.length : n - 1;
    if (ids.length < n) {
      ids.push(i);
      vals.push(v);
    }
    // equal values keep id order: an earlier (lower) id stays in front
    while (j > 0 && vals[j - 1]! < v) {
      ids[j] = ids[j - 1]!;
      vals[j] = vals[j - 1]!;
      j--;
    }
    ids[j] = i;
    vals[j] = v;
  }
  return ids;
}

export class Sampler {
  readonly options: Required<SamplerOptions>;
  private readonly rng: Mt19937;
  private readonly recent: number[] = [];
  /**
   * Keep, after each {@link sample}, the candidates the chain left and their probabilities in
   * {@link lastCandidates} (llama.cpp's `post_sampling_probs`). Default false.
   */
  keepCandidates = false;
  /**
   * With {@link keepCandidates}: the last sample's candidates after the whole chain, most likely first, with
   * the probabilities the draw used (greedy: the chosen token alone, probability 1).
   */
  lastCandidates?: { id: number; p: number }[];

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
      grammarFirst: options.grammarFirst ?? false,
    };
    const o = this.options;
    const bad = (what: string) => {
      throw new EngineError("BAD_INPUT", what);
    };
    if (!Number.isFinite(o.temperature)) bad(`temperature ${o.temperature} is not a number`);
    if (!Number.isInteger(o.topK) || o.topK < 0) bad(`top_k must be an integer ≥ 0, got ${o.topK}`);
    // 0 keeps the most likely token only, as llama.cpp's top-p (it keeps tokens until their sum reaches p)
    if (!(o.topP >= 0 && o.topP <= 1)) bad(`top_p must be in [0, 1], got ${o.topP}`);
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
    this.rng = new Mt19937(this.options.seed);
  }

  /** Records a token (prompt or generated) for the penalties. */
  accept(token: number): void {
    this.recent.push(token);
    const n = Math.max(0, this.options.penaltyLastN);
    if (this.recent.length > n) this.recent.splice(0, this.recent.length - n);
  }

  /**
   * Picks the next token. `logits` (length n_vocab) is not modified.
   * @param constraint when given, only tokens it allows are picked (see `grammarFirst` for how). The masked
   *   draw picks the token the chain picks from the logits with every other token at −∞ (checked lazily:
   *   the best candidates one by one, the whole vocabulary only when they are not enough).
   * @returns a token id in [0, n_vocab); −1 when the constraint allows no token.
   */
  sample(logits: Float32Array, constraint?: TokenConstraint): number {
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
        // in float arithmetic, as llama.cpp's penalties sampler
        let v = l[t]!;
        v = v <= 0 ? f32(v * f32(o.repeatPenalty)) : f32(v / f32(o.repeatPenalty));
        v = f32(v - f32(f32(c * f32(o.frequencyPenalty)) + f32(o.presencePenalty)));
        l[t] = v;
      }
    }
    if (constraint) {
      if (!o.grammarFirst && o.temperature > 0) {
        // llama.cpp: the chain's token when the grammar allows it, else a second draw under the grammar
        const first = this.draw(l);
        if (constraint.allows(first)) return first;
      }
      return this.constrained(l, constraint);
    }
    if (o.temperature <= 0) {
      const id = argmax(l);
      if (this.keepCandidates) this.lastCandidates = [{ id, p: 1 }];
      return id;
    }

    return this.draw(l);
  }

  private maskBuf?: Uint8Array;

  /** Sampling under a constraint, equal to sampling from the logits with the disallowed tokens at −∞. */
  private constrained(l: Float32Array, c: TokenConstraint): number {
    const o = this.options;
    const allowedMask = (): { m: Uint8Array; n: number } => {
      if (!this.maskBuf || this.maskBuf.length !== l.length) this.maskBuf = new Uint8Array(l.length);
      const n = c.mask(this.maskBuf);
      return { m: this.maskBuf, n };
    };
    if (o.temperature <= 0) {
      // the argmax is allowed: it is also the argmax of the masked logits (same tie rule)
      const a = argmax(l);
      if (c.allows(a)) return a;
      const { m, n } = allowedMask();
      if (n === 0) return -1;
      let best = -1;
      for (let i = 0; i < l.length; i++) if (m[i] && (best < 0 || l[i]! > l[best]!)) best = i;
      return best;
    }
    if (o.topK > 0) {
      // top-k of the masked logits = the first k allowed tokens in the sampler's order; with fewer than k
      // allowed, the −∞ tokens top-k would keep get probability 0 and change nothing
      const k = Math.min(o.topK, l.length);
      const window = Math.min(l.length, Math.max(4 * k, 64));
      let picked: number[] = [];
      for (const id of topCandidates(l, window)) {
        if (c.allows(id)) picked.push(id);
        if (picked.length === k) break;
      }
      if (picked.length < k && window < l.length) {
        const { m } = allowedMask();
        picked = [];
        for (let i = 0; i < l.length; i++) if (m[i]) picked.push(i);
        picked.sort((a, b) => l[b]! - l[a]! || a - b);
        picked = picked.slice(0, k);
      }
      if (picked.length === 0) return -1;
      return this.draw(l, picked);
    }
    const { m, n } = allowedMask();
    if (n === 0) return -1;
    const masked = Float32Array.from(l);
    for (let i = 0; i < masked.length; i++) if (!m[i]) masked[i] = Number.NEGATIVE_INFINITY;
    return this.draw(masked);
  }

  /**
   * top-k (unless `topKIds`, the top-k candidates already sorted, is given) → top-p → min-p → temperature → dist, each as llama.cpp's sampler of that name (float
   * arithmetic, the candidates' order, min_keep 1), the draw from {@link Mt19937.canonical}: the first
   * candidate whose running sum of exp(logit − max) reaches that fraction of the total.
   */
  private draw(l: Float32Array, topKIds?: number[]): number {
    const o = this.options;
    let ids = topKIds ?? Array.from({ length: l.length }, (_, i) => i);
    let sorted = topKIds !== undefined;
    const sortDesc = () => {
      ids.sort((a, b) => l[b]! - l[a]! || a - b);
      sorted = true;
    };
    const maxLogit = () => (sorted ? l[ids[0]!]! : ids.reduce((m, i) => Math.max(m, l[i]!), Number.NEGATIVE_INFINITY));
    // (topKIds: top-k done by the caller, sorted)
    if (o.topK > 0 && !topKIds) {
      sortDesc();
      ids = ids.slice(0, Math.min(o.topK, ids.length));
    }
    const topP = f32(o.topP);
    if (topP < 1) {
      if (!sorted) sortDesc();
      const m = maxLogit();
      const p = ids.map((i) => f32(Math.exp(f32(l[i]! - m))));
      let sum = 0;
      for (const v of p) sum = f32(sum + v);
      let cum = 0;
      let keep = ids.length;
      for (let i = 0; i < p.length; i++) {
        cum = f32(cum + f32(p[i]! / sum));
        if (cum >= topP) {
          keep = i + 1;
          break;
        }
      }
      ids = ids.slice(0, keep);
    }
    const minP = f32(o.minP);
    if (minP > 0 && ids.length > 0) {
      let applied = false;
      if (!sorted) {
        const cut = f32(maxLogit() + f32(Math.log(minP)));
        const kept = ids.filter((i) => l[i]! >= cut);
        if (kept.length > 0) {
          ids = kept;
          applied = true;
        }
      }
      if (!applied) {
        if (!sorted) sortDesc();
        const cut = f32(l[ids[0]!]! + f32(Math.log(minP)));
        let i = 1;
        while (i < ids.length && l[ids[i]!]! >= cut) i++;
        ids = ids.slice(0, i);
      }
    }
    const temp = f32(o.temperature);
    const x = new Float32Array(ids.length);
    for (let i = 0; i < ids.length; i++) x[i] = f32(l[ids[i]!]! / temp);
    const u = this.rng.canonical();
    if (ids.length === 1) {
      if (this.keepCandidates) this.lastCandidates = [{ id: ids[0]!, p: 1 }];
      return ids[0]!;
    }
    let m = x[0]!;
    if (!sorted) for (const v of x) m = Math.max(m, v);
    const p = new Float64Array(ids.length);
    let total = 0;
    for (let i = 0; i < ids.length; i++) {
      p[i] = f32(Math.exp(f32(x[i]! - m)));
      total += p[i]!;
    }
    if (this.keepCandidates) {
      this.lastCandidates = ids.map((id, i) => ({ id, p: p[i]! / total })).sort((a, b) => b.p - a.p || a.id - b.id);
    }
    const target = total * u;
    let run = 0;
    for (let i = 0; i < ids.length; i++) {
      run += p[i]!;
      if (run >= target) return ids[i]!;
    }
    return ids[ids.length - 1]!;
  }
}
