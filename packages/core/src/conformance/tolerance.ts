/**
 * Tolerances of the conformance kit, derived from worst-case rounding-error bounds rather than fixed
 * constants, so that a correct float32 backend always passes and a wrong formula (an index off by one,
 * a swapped nibble, a missed mask) fails by orders of magnitude.
 *
 * Notation: u = 2^-24, the unit roundoff of float32. A float32 sum of n terms is off by at most
 * (n−1)·u·Σ|terms| (Higham, "Accuracy and Stability of Numerical Algorithms", §4.2); the bounds below
 * use (n + 8)·u to leave room for the few extra roundings around each sum.
 *
 * Activation rounding. A dot product with quantized weights may round the activation vector x first,
 * the way llama.cpp's CPU and CUDA kernels do (the weight type's "vec_dot_type"). The kit admits, per
 * weight dtype ({@link ACTIVATION_ROUNDING}):
 * - F16 weights: x rounded to F16: |Δx| ≤ |x|·2^-11 (+2^-25 for subnormal halves).
 * - BF16 weights: x rounded to BF16: |Δx| ≤ |x|·2^-8.
 * - Q8_0/Q4_0/Q5_0 weights: Q8_0 blocks (32 values, d = amax/127 stored as F16, q = round(x/d)):
 *   |Δx| ≤ d/2 + 127·|d − F16(d)| ≤ amax·(1/254 + 2^-11).
 * - Q4_1/Q5_1 weights: Q8_1 blocks: as Q8_0, plus the block sum s = d·Σq stored as F16, which the
 *   kernel multiplies by the weight block's offset m: covered by adding |x|·2^-11 per element and using
 *   the magnitude |d·q| + |m| of each weight ({@link Dequantized.magnitude}).
 * - K-quant weights: Q8_K blocks (256 values, float32 scale, |Δx| ≤ amax₂₅₆/254) or, as on CUDA, Q8_1.
 * - F32 weights: no rounding of x.
 * Every quantized type also admits F16 rounding. A block (or element) that the rounding represents
 * exactly contributes no error, which the kit exploits with {@link exactActivations}: half of its
 * cases use activations q/128 that every admitted rounding keeps exact, so their tolerance is the
 * float32 summation bound alone and a single missing or misplaced term fails.
 * The error of y = Σ w·x is then at most
 * Σ|w|·|Δx| + (K + 8)·u·Σ|w|·(|x| + |Δx|), which is the tolerance of `mul_mat`, `mul_mat_sparse`
 * and, with the activations a in place of x, `axpy_sparse`.
 */
import type { DType } from "../backend/types.js";
import { bf16ToNumber, numberToBf16, roundToHalf } from "./float.js";

/** Unit roundoff of float32. */
export const U = 2 ** -24;
/** Unit roundoff of F16 (half an ulp at 1). */
export const U_F16 = 2 ** -11;
/** Unit roundoff of BF16. */
export const U_BF16 = 2 ** -8;

/** Ways a backend may round an activation vector before a dot product with weights. */
export type ActivationRounding = "f16" | "bf16" | "q8_0" | "q8_1" | "q8_K";

/** The activation roundings the kit admits for each weight dtype (see the module comment). */
export const ACTIVATION_ROUNDING: Readonly<Record<DType, readonly ActivationRounding[]>> = {
  f32: [],
  i32: [],
  f16: ["f16"],
  bf16: ["bf16"],
  q8_0: ["q8_0", "f16"],
  q4_0: ["q8_0", "f16"],
  q5_0: ["q8_0", "f16"],
  q4_1: ["q8_1", "f16"],
  q5_1: ["q8_1", "f16"],
  q4_K: ["q8_K", "q8_1", "f16"],
  q5_K: ["q8_K", "q8_1", "f16"],
  q6_K: ["q8_K", "q8_1", "f16"],
};

/** x/d is an integer for every element of the block (the block is exactly representable with scale d). */
function blockExact(x: ArrayLike<number>, off: number, start: number, end: number, d: number): boolean {
  for (let j = start; j < end; j++) {
    const q = x[off + j]! / d;
    if (q !== Math.round(q)) return false;
  }
  return true;
}

/**
 * Rounding error bound of each 8-bit block of x[off..off+k): amax·(1/254 + F16 scale error), or, when
 * the block is exactly representable (every value an integer multiple of d = amax/127, d an F16 value
 * where the format stores d as F16), only the slack of inverting the scale (amax·2^-21).
 */
function q8BlockErrors(x: ArrayLike<number>, off: number, k: number, block: number, f16Scale: boolean): Float64Array {
  const out = new Float64Array(Math.ceil(k / block));
  for (let b = 0; b < out.length; b++) {
    const start = b * block;
    const end = Math.min(start + block, k);
    let amax = 0;
    for (let j = start; j < end; j++) amax = Math.max(amax, Math.abs(x[off + j]!));
    const d = Math.fround(amax / 127);
    const exact = amax === 0 || ((!f16Scale || roundToHalf(d) === d) && blockExact(x, off, start, end, d));
    out[b] = exact ? amax * 2 ** -21 : amax * (1 / 254 + (f16Scale ? U_F16 : 4 * U));
  }
  return out;
}

/**
 * Per element of x[off..off+k), the largest rounding error any admitted activation rounding of
 * `weightDtype` may introduce (blocks start at `off`). An element (or block) that the format
 * represents exactly gets (almost) no error, so that inputs chosen to be exactly representable
 * ({@link exactActivations}) give tight tolerances that catch a single missing term.
 */
export function activationErrors(weightDtype: DType, x: ArrayLike<number>, off: number, k: number): Float64Array {
  const e = new Float64Array(k);
  const schemes = ACTIVATION_ROUNDING[weightDtype];
  if (schemes.length === 0) return e;
  const q32 = schemes.some((s) => s === "q8_0" || s === "q8_1") ? q8BlockErrors(x, off, k, 32, true) : null;
  const q256 = schemes.includes("q8_K") ? q8BlockErrors(x, off, k, 256, false) : null;
  for (let i = 0; i < k; i++) {
    const xi = x[off + i]!;
    const ax = Math.abs(xi);
    let m = 0;
    for (const s of schemes) {
      let v: number;
      switch (s) {
        case "f16":
          v = roundToHalf(xi) === xi ? 0 : ax * U_F16 + 2 ** -25;
          break;
        case "bf16":
          v = bf16ToNumber(numberToBf16(xi)) === xi ? 0 : ax * U_BF16 + 2 ** -134;
          break;
        case "q8_0":
          v = q32![i >> 5]!;
          break;
        case "q8_1":
          // plus the block sum s = d·Σq stored as F16, multiplied by the weight block's offset
          v = q32![i >> 5]! + ax * U_F16;
          break;
        case "q8_K":
          v = q256![i >> 8]!;
          break;
      }
      m = Math.max(m, v);
    }
    e[i] = m;
  }
  return e;
}

/**
 * Activations that every admitted rounding represents exactly: x = q/128 with integer q in
 * [−127, 127] (exact in F16 and BF16), and a ±127 in every 32-element block so that each Q8 block's
 * scale is amax/127 = 1/128 exactly (256-element Q8_K blocks included). `nonzero` excludes q = 0.
 */
export function exactActivations(k: number, columns: number, next: () => number, nonzero = false): Float32Array {
  const x = new Float32Array(k * columns);
  for (let c = 0; c < columns; c++) {
    for (let i = 0; i < k; i++) {
      let q = Math.floor(next() * 255) - 127;
      if (nonzero && q === 0) q = 1;
      x[c * k + i] = q / 128;
    }
    for (let b = 0; b < k; b += 32) {
      const i = b + Math.floor(next() * Math.min(32, k - b));
      x[c * k + i] = (next() < 0.5 ? -127 : 127) / 128;
    }
  }
  return x;
}

/** Slack on every derived bound (covers second-order terms the bounds drop). */
export const SLACK = 1.02;
/** Absolute floor of every tolerance (float32 underflow). */
export const TINY = 1e-30;

/**
 * Tolerance of Σ_{j<k} w[wo + j·ws]·x[xo + j] given the weight magnitudes `mag` (same indexing as w)
 * and the admitted activation errors `e` (indexed like x from xo).
 */
export function dotTolerance(
  mag: ArrayLike<number>,
  wo: number,
  ws: number,
  x: ArrayLike<number>,
  xo: number,
  e: ArrayLike<number>,
  eo: number,
  k: number,
): number {
  let se = 0;
  let sx = 0;
  for (let j = 0; j < k; j++) {
    const m = mag[wo + j * ws]!;
    const ej = e[eo + j]!;
    se += m * ej;
    sx += m * (Math.abs(x[xo + j]!) + ej);
  }
  return SLACK * (se + (k + 8) * U * sx) + TINY;
}
