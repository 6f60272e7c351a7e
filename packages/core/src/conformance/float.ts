/**
 * Half (IEEE binary16) and bfloat16 conversions for the conformance kit, written independently of
 * `@powerinfer/gguf` so that the kit's reference does not share a bug with the code it checks.
 *
 * Decoding is exact. Encoding first rounds to float32 (what a backend holding an F32 intermediate
 * starts from), then rounds to nearest, ties to even — the rounding of x86 F16C `vcvtps2ph` with
 * imm 0, of CUDA `__float2half_rn`, and of ggml's scalar fallbacks.
 */

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** Rounds half to even (x is finite and ≥ 0). */
function roundHalfEven(x: number): number {
  const r = Math.round(x);
  return r - x === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** binary16 bit pattern → number (exact). */
export function halfToNumber(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 31) return mant ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1024 + mant) * 2 ** (exp - 25);
}

/** number → binary16 bit pattern (float32 first, then round to nearest even; overflow → ±Inf). */
export function numberToHalf(v: number): number {
  const x = Math.fround(v);
  if (Number.isNaN(x)) return 0x7e00;
  const sign = x < 0 || Object.is(x, -0) ? 0x8000 : 0;
  const a = Math.abs(x);
  if (a === Number.POSITIVE_INFINITY) return sign | 0x7c00;
  if (a < 2 ** -14) return sign | roundHalfEven(a * 2 ** 24); // subnormal (1024 = smallest normal, also right)
  let e = Math.floor(Math.log2(a));
  if (2 ** e > a) e--;
  if (2 ** (e + 1) <= a) e++;
  let mant = roundHalfEven((a / 2 ** e - 1) * 1024);
  if (mant === 1024) {
    mant = 0;
    e++;
  }
  if (e > 15) return sign | 0x7c00;
  return sign | ((e + 15) << 10) | mant;
}

/** bfloat16 bit pattern → number (exact). */
export function bf16ToNumber(b: number): number {
  u32[0] = (b & 0xffff) << 16;
  return f32[0]!;
}

/** number → bfloat16 bit pattern (float32 first, then round to nearest even; NaN stays a quiet NaN). */
export function numberToBf16(v: number): number {
  f32[0] = v;
  const x = u32[0]!;
  if ((x & 0x7fffffff) > 0x7f800000) return ((x >>> 16) | 0x40) & 0xffff;
  return ((x + 0x7fff + ((x >>> 16) & 1)) >>> 16) & 0xffff;
}

/** Rounds a number to the nearest binary16 value (as a number). */
export function roundToHalf(v: number): number {
  return halfToNumber(numberToHalf(v));
}
