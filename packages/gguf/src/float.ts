/**
 * IEEE half (binary16) and bfloat16 conversions, bit-exact with ggml.
 *
 * - `f16ToF32` is exact (every half is a float32).
 * - `f32ToF16` rounds to nearest, ties to even (what F16C `vcvtps2ph` and ggml's scalar fallback do),
 *   with overflow to ±Inf and NaN kept NaN.
 * - `bf16ToF32` is exact; `f32ToBf16` rounds to nearest even and turns NaN into a quiet NaN, as ggml's
 *   `ggml_compute_fp32_to_bf16` does.
 */

const f32buf = new Float32Array(1);
const u32buf = new Uint32Array(f32buf.buffer);

let f16Table: Float32Array | undefined;

function f16ToF32Slow(h: number): number {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const mant = h & 0x3ff;
  if (exp === 0) return sign * mant * 2 ** -24;
  if (exp === 31) return mant ? Number.NaN : sign * Number.POSITIVE_INFINITY;
  return sign * (1 + mant / 1024) * 2 ** (exp - 15);
}

/** The 65536-entry half → float32 table (built on first use, 256 KiB). */
export function f16Lut(): Float32Array {
  if (!f16Table) {
    f16Table = new Float32Array(65536);
    for (let h = 0; h < 65536; h++) f16Table[h] = f16ToF32Slow(h);
  }
  return f16Table;
}

/** Decode an IEEE binary16 bit pattern (uint16) to a number (exact). */
export function f16ToF32(h: number): number {
  return f16Lut()[h & 0xffff];
}

/** Encode a number as an IEEE binary16 bit pattern: first rounded to float32, then RNE to half. */
export function f32ToF16(f: number): number {
  f32buf[0] = f;
  const x = u32buf[0];
  const sign = (x >>> 16) & 0x8000;
  const exp = (x >>> 23) & 0xff;
  let mant = x & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 | (mant >>> 13) : 0); // Inf / NaN (quiet)
  const e = exp - 127 + 15;
  if (e >= 31) return sign | 0x7c00; // overflow → Inf
  if (e <= 0) {
    // subnormal half (or zero): value = mant' * 2^-24
    if (e < -10) return sign; // rounds to zero (|f| < 2^-25)
    mant |= 0x800000; // implicit bit
    const shift = 14 - e; // 14..24
    const half = 1 << (shift - 1);
    const rest = mant & ((1 << shift) - 1);
    let r = mant >>> shift;
    if (rest > half || (rest === half && r & 1)) r++;
    return sign | r; // r may carry into the smallest normal, which is the right encoding
  }
  let r = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && r & 1)) r++; // may carry into the exponent (→ Inf), correct
  return sign | r;
}

/** Decode a bfloat16 bit pattern (uint16) to a number (exact). */
export function bf16ToF32(b: number): number {
  u32buf[0] = (b & 0xffff) << 16;
  return f32buf[0];
}

/** Encode a number as bfloat16: float32 first, then round to nearest even; NaN → quiet NaN (ggml). */
export function f32ToBf16(f: number): number {
  f32buf[0] = f;
  const x = u32buf[0];
  if ((x & 0x7fffffff) > 0x7f800000) return ((x >>> 16) | 64) & 0xffff;
  return ((x + (0x7fff + ((x >>> 16) & 1))) >>> 16) & 0xffff;
}
