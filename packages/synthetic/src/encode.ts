/**
 * Fast float32 → tensor-type encoders for generated weights (F32, F16, BF16, Q8_0, Q4_0, Q4_K).
 *
 * They produce valid blocks of the ggml formats (checked against `@powerinfer/gguf`'s reference
 * dequantization in the tests) but do not try to reproduce llama.cpp's quantizers bit for bit: Q4_K uses
 * a plain min/max fit per 32-value sub-block instead of llama.cpp's iterative search.
 */
import { dequantize, GGMLType } from "@powerinfer/gguf";

/** Weight types the generator writes. */
export type SyntheticDType = "F32" | "F16" | "BF16" | "Q8_0" | "Q4_0" | "Q4_K";

export const SYNTHETIC_DTYPES: readonly SyntheticDType[] = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K"];

export const GGML_TYPE_OF: Record<SyntheticDType, GGMLType> = {
  F32: GGMLType.F32,
  F16: GGMLType.F16,
  BF16: GGMLType.BF16,
  Q8_0: GGMLType.Q8_0,
  Q4_0: GGMLType.Q4_0,
  Q4_K: GGMLType.Q4_K,
};

/** Elements per block and bytes per block. */
export const BLOCK: Record<SyntheticDType, [number, number]> = {
  F32: [1, 4],
  F16: [1, 2],
  BF16: [1, 2],
  Q8_0: [32, 34],
  Q4_0: [32, 18],
  Q4_K: [256, 144],
};

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

/** float32 bits → IEEE half bits, round to nearest even (overflow → Inf, NaN kept). */
export function halfBits(x: number): number {
  f32[0] = x;
  return halfFromBits(u32[0]!);
}

function halfFromBits(b: number): number {
  const sign = (b >>> 16) & 0x8000;
  const exp = (b >>> 23) & 0xff;
  const mant = b & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  const e = exp - 112; // rebias 127 → 15
  if (e >= 31) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    const m = mant | 0x800000;
    const shift = 14 - e;
    let r = m >>> shift;
    const rest = m & ((1 << shift) - 1);
    const half = 1 << (shift - 1);
    if (rest > half || (rest === half && r & 1)) r++;
    return sign | r;
  }
  let r = (e << 10) | (mant >>> 13);
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && r & 1)) r++;
  return sign | r;
}

/** Bytes `n` elements of `dtype` take (n a multiple of the block size). */
export function encodedBytes(dtype: SyntheticDType, n: number): number {
  const [bs, ts] = BLOCK[dtype];
  return (n / bs) * ts;
}

/**
 * Encodes `n = src.length` values into `dst` (which must hold {@link encodedBytes} bytes, 4-byte
 * aligned within its buffer for F32). `src` is clobbered for F32 inputs to other types only in that
 * it may be read through a uint32 view.
 */
export function encode(dtype: SyntheticDType, src: Float32Array, dst: Uint8Array): void {
  const n = src.length;
  switch (dtype) {
    case "F32":
      new Uint8Array(dst.buffer, dst.byteOffset, n * 4).set(new Uint8Array(src.buffer, src.byteOffset, n * 4));
      return;
    case "F16":
      encodeHalf(src, dst, false);
      return;
    case "BF16":
      encodeHalf(src, dst, true);
      return;
    case "Q8_0":
      for (let blk = 0, o = 0; blk < n; blk += 32, o += 34) {
        let amax = 0;
        for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(src[blk + j]!));
        const h = halfBits(amax / 127);
        dst[o] = h & 0xff;
        dst[o + 1] = h >>> 8;
        const id = amax > 0 ? 127 / amax : 0;
        for (let j = 0; j < 32; j++) dst[o + 2 + j] = Math.round(src[blk + j]! * id) & 0xff;
      }
      return;
    case "Q4_0":
      for (let blk = 0, o = 0; blk < n; blk += 32, o += 18) {
        let amax = 0;
        let max = 0;
        for (let j = 0; j < 32; j++) {
          const v = src[blk + j]!;
          if (Math.abs(v) > amax) {
            amax = Math.abs(v);
            max = v;
          }
        }
        const d = max / -8;
        const h = halfBits(d);
        dst[o] = h & 0xff;
        dst[o + 1] = h >>> 8;
        const id = d !== 0 ? 1 / d : 0;
        for (let j = 0; j < 16; j++) {
          const q0 = Math.min(15, Math.trunc(src[blk + j]! * id + 8.5));
          const q1 = Math.min(15, Math.trunc(src[blk + 16 + j]! * id + 8.5));
          dst[o + 2 + j] = q0 | (q1 << 4);
        }
      }
      return;
    case "Q4_K":
      for (let blk = 0, o = 0; blk < n; blk += 256, o += 144) encodeQ4K(src, blk, dst, o);
      return;
  }
}

/** F16 (round to nearest even) or BF16 (ggml's rounding) of every value, 2 bytes each. */
function encodeHalf(src: Float32Array, dst: Uint8Array, bf: boolean): void {
  const n = src.length;
  const bits = new Uint32Array(src.buffer, src.byteOffset, n);
  const fast = LITTLE_ENDIAN && dst.byteOffset % 2 === 0;
  const h16 = fast ? new Uint16Array(dst.buffer, dst.byteOffset, n) : new Uint16Array(n);
  if (bf) {
    for (let i = 0; i < n; i++) {
      const b = bits[i]!;
      h16[i] = (b & 0x7fffffff) > 0x7f800000 ? (b >>> 16) | 64 : (b + 0x7fff + ((b >>> 16) & 1)) >>> 16;
    }
  } else {
    for (let i = 0; i < n; i++) {
      const b = bits[i]!;
      const a = b & 0x7fffffff;
      // normal halves: rebias the exponent and round the 13 dropped bits to nearest even in one add
      h16[i] =
        a >= 0x38800000 && a < 0x47800000
          ? ((a - 0x38000000 + 0xfff + ((a >>> 13) & 1)) >>> 13) | ((b >>> 16) & 0x8000)
          : halfFromBits(b);
    }
  }
  if (!fast) {
    for (let i = 0; i < n; i++) {
      dst[2 * i] = h16[i]! & 0xff;
      dst[2 * i + 1] = h16[i]! >>> 8;
    }
  }
}

/** Replaces `row` by the values a file of `dtype` stores for it (encode, then the reference decoder). */
export function roundTrip(dtype: SyntheticDType, row: Float32Array): void {
  if (dtype === "F32") return;
  const bytes = new Uint8Array(encodedBytes(dtype, row.length));
  encode(dtype, row, bytes);
  row.set(dequantize(GGML_TYPE_OF[dtype], bytes, row.length));
}

const scales = new Float64Array(8);
const mins = new Float64Array(8);
const ls = new Uint8Array(8);
const lm = new Uint8Array(8);

/**
 * One Q4_K super-block (256 values): { f16 d, f16 dmin, u8 scales[12], u8 qs[128] }; sub-block j (32
 * values) decodes as x = d·sc_j·q − dmin·m_j with 6-bit sc_j, m_j and 4-bit q. Each sub-block is fit by
 * its min and max (min clamped to ≤ 0); sc_j and m_j are then quantized relative to the largest.
 */
function encodeQ4K(src: Float32Array, at: number, dst: Uint8Array, o: number): void {
  let maxScale = 0;
  let maxMin = 0;
  for (let j = 0; j < 8; j++) {
    let lo = Number.POSITIVE_INFINITY;
    let hi = Number.NEGATIVE_INFINITY;
    for (let l = 0; l < 32; l++) {
      const v = src[at + 32 * j + l]!;
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    if (lo > 0) lo = 0;
    scales[j] = (hi - lo) / 15;
    mins[j] = -lo;
    if (scales[j]! > maxScale) maxScale = scales[j]!;
    if (mins[j]! > maxMin) maxMin = mins[j]!;
  }
  const dh = halfBits(maxScale / 63);
  const mh = halfBits(maxMin / 63);
  const d = halfValue(dh);
  const dmin = halfValue(mh);
  for (let j = 0; j < 8; j++) {
    ls[j] = d > 0 ? Math.min(63, Math.round(scales[j]! / d)) : 0;
    lm[j] = dmin > 0 ? Math.min(63, Math.round(mins[j]! / dmin)) : 0;
  }
  dst[o] = dh & 0xff;
  dst[o + 1] = dh >>> 8;
  dst[o + 2] = mh & 0xff;
  dst[o + 3] = mh >>> 8;
  const sc = o + 4;
  for (let j = 0; j < 4; j++) {
    dst[sc + j] = ls[j]! | ((ls[j + 4]! >>> 4) << 6);
    dst[sc + j + 4] = lm[j]! | ((lm[j + 4]! >>> 4) << 6);
    dst[sc + j + 8] = (ls[j + 4]! & 0xf) | ((lm[j + 4]! & 0xf) << 4);
  }
  const qs = o + 16;
  for (let pair = 0; pair < 4; pair++) {
    const j0 = 2 * pair;
    const q = (j: number, l: number) => {
      const s = d * ls[j]!;
      if (s === 0) return 0;
      const v = Math.round((src[at + 32 * j + l]! + dmin * lm[j]!) / s);
      return Math.max(0, Math.min(v, 15));
    };
    for (let l = 0; l < 32; l++) dst[qs + 32 * pair + l] = q(j0, l) | (q(j0 + 1, l) << 4);
  }
}

function halfValue(h: number): number {
  const e = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  const s = h & 0x8000 ? -1 : 1;
  if (e === 0) return s * m * 2 ** -24;
  if (e === 31) return m ? Number.NaN : s * Number.POSITIVE_INFINITY;
  return s * (1 + m / 1024) * 2 ** (e - 15);
}
