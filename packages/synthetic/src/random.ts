/**
 * Counter-based random numbers for the synthetic-model generator: every weight is a pure function of
 * (seed, tensor, element index), so tensors can be produced in any chunk order (a transposed copy of a
 * matrix reads the same values) and the same options always give the same bytes.
 *
 * - {@link mix32}: a 32-bit integer finalizer (xor-shift-multiply, constants from Chris Wellons'
 *   "lowbias32" search), used as a hash.
 * - {@link gauss}: a standard normal sample from a hash: the inverse normal CDF tabulated at 2^12 + 1
 *   points (a float32 table that stays in L1) and interpolated linearly with the low 20 bits; the table is
 *   rescaled so the distribution has variance exactly 1 (tails are cut at about ±3.5σ).
 */
import { normalQuantile } from "./stats-math.js";

/** 32-bit hash of a 32-bit integer (bijective). */
export function mix32(x: number): number {
  x ^= x >>> 16;
  x = Math.imul(x, 0x7feb352d);
  x ^= x >>> 15;
  x = Math.imul(x, 0x846ca68b);
  x ^= x >>> 16;
  return x >>> 0;
}

/** A key for a stream of values: the hash of a list of small integers (seed, layer, tensor kind, …). */
export function streamKey(...parts: number[]): number {
  let h = 0x2545f491;
  for (const p of parts) h = mix32((h ^ mix32(p >>> 0)) + 0x9e3779b9);
  return h;
}

/** Uniform uint32 for element `idx` of the stream `key`. */
export function hashU32(key: number, idx: number): number {
  return mix32((Math.imul(idx, 0x9e3779b1) + key) >>> 0);
}

/** Uniform in [0, 1) for element `idx` of stream `key`. */
export function uniform(key: number, idx: number): number {
  return hashU32(key, idx) / 4294967296;
}

const TABLE_BITS = 12;
const FRAC_BITS = 32 - TABLE_BITS;
const FRAC_MASK = (1 << FRAC_BITS) - 1;
const FRAC_SCALE = 1 / (1 << FRAC_BITS);
const TABLE_SIZE = 1 << TABLE_BITS;

/** Inverse normal CDF at i / 2^12 (ends clamped to half a step), scaled to unit variance. */
const TABLE: Float32Array = (() => {
  const t = new Float64Array(TABLE_SIZE + 1);
  const half = 0.5 / TABLE_SIZE;
  for (let i = 0; i <= TABLE_SIZE; i++) t[i] = normalQuantile(Math.min(1 - half, Math.max(half, i / TABLE_SIZE)));
  // variance of the piecewise-linear distribution: mean over cells of E[(a + (b − a)u)²], u ~ U(0, 1)
  let v = 0;
  for (let i = 0; i < TABLE_SIZE; i++) {
    const a = t[i]!;
    const b = t[i + 1]!;
    v += (a * a + a * b + b * b) / 3;
  }
  const s = 1 / Math.sqrt(v / TABLE_SIZE);
  for (let i = 0; i <= TABLE_SIZE; i++) t[i]! *= s;
  return Float32Array.from(t);
})();

/** Standard normal sample for element `idx` of stream `key`. */
export function gauss(key: number, idx: number): number {
  const u = mix32((Math.imul(idx, 0x9e3779b1) + key) >>> 0);
  const i = u >>> FRAC_BITS;
  const a = TABLE[i]!;
  return a + (TABLE[i + 1]! - a) * ((u & FRAC_MASK) * FRAC_SCALE);
}

/**
 * Fills `out[o + j] = scale · gauss(key, idx0 + j·stride)` for j < n (the hot loop of the generator,
 * kept monomorphic and free of calls).
 */
export function fillGauss(
  out: Float32Array,
  o: number,
  n: number,
  key: number,
  idx0: number,
  stride: number,
  scale: number,
): void {
  const T = TABLE;
  let idx = idx0;
  for (let j = 0; j < n; j++) {
    let x = (Math.imul(idx, 0x9e3779b1) + key) | 0;
    x ^= x >>> 16;
    x = Math.imul(x, 0x7feb352d);
    x ^= x >>> 15;
    x = Math.imul(x, 0x846ca68b);
    x ^= x >>> 16;
    const i = x >>> FRAC_BITS;
    const a = T[i]!;
    out[o + j] = scale * (a + (T[i + 1]! - a) * ((x & FRAC_MASK) * FRAC_SCALE));
    idx += stride;
  }
}
