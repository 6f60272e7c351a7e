/**
 * Weight formats for the conformance kit: float64 dequantization of every {@link DType}, a per-element
 * magnitude bound used by the tolerances, and generators of *valid* random tensors (random quantized
 * values with sane F16 scales, never random bytes that could decode to NaN/Inf scales).
 *
 * Block layouts are ggml's (ggml-common.h), little-endian, F16 scales:
 * - q8_0 (34 B / 32): d, qs[32] int8                       w = d·q
 * - q4_0 (18 B / 32): d, qs[16] (low nibbles = elements 0..15, high = 16..31)   w = d·(q − 8)
 * - q4_1 (20 B / 32): d, m, qs[16]                          w = d·q + m
 * - q5_0 (22 B / 32): d, qh u32 (bit j = 5th bit of element j), qs[16]           w = d·(q − 16)
 * - q5_1 (24 B / 32): d, m, qh u32, qs[16]                  w = d·q + m
 * - q4_K (144 B / 256): d, dmin, scales[12] (eight 6-bit scale/min pairs), qs[128]; per 64 elements the
 *   low nibbles of 32 bytes are sub-block 2j and the high nibbles sub-block 2j+1;   w = d·sc·q − dmin·m
 * - q5_K (176 B / 256): as q4_K plus qh[32]; bit 2j / 2j+1 of qh[l] is the 5th bit of element l of
 *   sub-block 2j / 2j+1.
 * - q6_K (210 B / 256): ql[128], qh[64], scales[16] int8, d; per 128 elements, element l + 32·s
 *   (s = 0..3) takes the low/high nibble of ql[l] / ql[l+32] and bits 2s..2s+1 of qh[l];
 *   w = d·scale[l/16 + 2s]·(q − 32).
 */
import type { DType } from "../backend/types.js";
import { DTYPE_LAYOUT } from "../backend/types.js";
import { bf16ToNumber, halfToNumber, numberToBf16, numberToHalf } from "./float.js";

const half = (b: Uint8Array, o: number) => halfToNumber(b[o]! | (b[o + 1]! << 8));
const u32le = (b: Uint8Array, o: number) => (b[o]! | (b[o + 1]! << 8) | (b[o + 2]! << 16) | (b[o + 3]! << 24)) >>> 0;

/**
 * Dequantized values and, per element, a bound on the magnitudes that enter a kernel's arithmetic
 * (`|d·q| + |m|` for formats with an offset, `|w|` otherwise): the rounding error of a dot product
 * scales with it, not with |w|.
 */
export interface Dequantized {
  values: Float64Array;
  magnitude: Float64Array;
}

/** The 6-bit scale and min of sub-block j (0..7) of a q4_K/q5_K block whose scales start at s. */
function scaleMinK4(b: Uint8Array, s: number, j: number): [number, number] {
  if (j < 4) return [b[s + j]! & 63, b[s + j + 4]! & 63];
  return [(b[s + j + 4]! & 0xf) | ((b[s + j - 4]! >> 6) << 4), (b[s + j + 4]! >> 4) | ((b[s + j]! >> 6) << 4)];
}

/**
 * Float64 dequantization of `n` elements (n a multiple of the block size) of `dtype` from `bytes`.
 * Exact: every product of an F16 scale and a small integer is representable in float64.
 * @throws RangeError when `bytes` is too short or n is not a multiple of the block size.
 */
export function dequantizeReference(dtype: DType, bytes: Uint8Array, n: number): Dequantized {
  const { blockSize, typeSize } = DTYPE_LAYOUT[dtype];
  if (n % blockSize !== 0) throw new RangeError(`${dtype}: ${n} elements is not a multiple of ${blockSize}`);
  if (bytes.length < (n / blockSize) * typeSize) {
    throw new RangeError(`${dtype}: ${bytes.length} bytes hold fewer than ${n} elements`);
  }
  const v = new Float64Array(n);
  const mag = new Float64Array(n);
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const nb = n / blockSize;
  switch (dtype) {
    case "f32":
      for (let i = 0; i < n; i++) v[i] = dv.getFloat32(4 * i, true);
      break;
    case "i32":
      for (let i = 0; i < n; i++) v[i] = dv.getInt32(4 * i, true);
      break;
    case "f16":
      for (let i = 0; i < n; i++) v[i] = half(bytes, 2 * i);
      break;
    case "bf16":
      for (let i = 0; i < n; i++) v[i] = bf16ToNumber(bytes[2 * i]! | (bytes[2 * i + 1]! << 8));
      break;
    case "q8_0":
      for (let b = 0; b < nb; b++) {
        const o = b * 34;
        const d = half(bytes, o);
        for (let j = 0; j < 32; j++) v[b * 32 + j] = d * ((bytes[o + 2 + j]! << 24) >> 24);
      }
      break;
    case "q4_0":
    case "q4_1": {
      const hasMin = dtype === "q4_1";
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        const d = half(bytes, o);
        const m = hasMin ? half(bytes, o + 2) : 0;
        const qs = o + (hasMin ? 4 : 2);
        for (let j = 0; j < 16; j++) {
          const lo = bytes[qs + j]! & 0xf;
          const hi = bytes[qs + j]! >> 4;
          const i = b * 32 + j;
          if (hasMin) {
            v[i] = d * lo + m;
            v[i + 16] = d * hi + m;
            mag[i] = Math.abs(d * lo) + Math.abs(m);
            mag[i + 16] = Math.abs(d * hi) + Math.abs(m);
          } else {
            v[i] = d * (lo - 8);
            v[i + 16] = d * (hi - 8);
          }
        }
      }
      break;
    }
    case "q5_0":
    case "q5_1": {
      const hasMin = dtype === "q5_1";
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        const d = half(bytes, o);
        const m = hasMin ? half(bytes, o + 2) : 0;
        const qhOff = o + (hasMin ? 4 : 2);
        const qh = u32le(bytes, qhOff);
        const qs = qhOff + 4;
        for (let j = 0; j < 16; j++) {
          const lo = (bytes[qs + j]! & 0xf) | (((qh >>> j) & 1) << 4);
          const hi = (bytes[qs + j]! >> 4) | (((qh >>> (j + 16)) & 1) << 4);
          const i = b * 32 + j;
          if (hasMin) {
            v[i] = d * lo + m;
            v[i + 16] = d * hi + m;
            mag[i] = Math.abs(d * lo) + Math.abs(m);
            mag[i + 16] = Math.abs(d * hi) + Math.abs(m);
          } else {
            v[i] = d * (lo - 16);
            v[i + 16] = d * (hi - 16);
          }
        }
      }
      break;
    }
    case "q4_K":
    case "q5_K": {
      const five = dtype === "q5_K";
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        const d = half(bytes, o);
        const dmin = half(bytes, o + 2);
        const sc = o + 4;
        const qh = o + 16;
        const qs = o + 16 + (five ? 32 : 0);
        for (let c = 0; c < 4; c++) {
          for (let h = 0; h < 2; h++) {
            const [s, mn] = scaleMinK4(bytes, sc, 2 * c + h);
            const d1 = d * s;
            const m1 = dmin * mn;
            for (let l = 0; l < 32; l++) {
              const byte = bytes[qs + 32 * c + l]!;
              let q = h === 0 ? byte & 0xf : byte >> 4;
              if (five && (bytes[qh + l]! >> (2 * c + h)) & 1) q += 16;
              const i = b * 256 + 64 * c + 32 * h + l;
              v[i] = d1 * q - m1;
              mag[i] = Math.abs(d1 * q) + Math.abs(m1);
            }
          }
        }
      }
      break;
    }
    case "q6_K":
      for (let b = 0; b < nb; b++) {
        const o = b * 210;
        const d = half(bytes, o + 208);
        for (let n128 = 0; n128 < 2; n128++) {
          const ql = o + 64 * n128;
          const qh = o + 128 + 32 * n128;
          const sc = o + 192 + 8 * n128;
          for (let l = 0; l < 32; l++) {
            const hb = bytes[qh + l]!;
            const q = [
              (bytes[ql + l]! & 0xf) | ((hb & 3) << 4),
              (bytes[ql + l + 32]! & 0xf) | (((hb >> 2) & 3) << 4),
              (bytes[ql + l]! >> 4) | (((hb >> 4) & 3) << 4),
              (bytes[ql + l + 32]! >> 4) | (((hb >> 6) & 3) << 4),
            ];
            for (let s = 0; s < 4; s++) {
              const scale = (bytes[sc + (l >> 4) + 2 * s]! << 24) >> 24;
              v[b * 256 + 128 * n128 + 32 * s + l] = d * scale * (q[s]! - 32);
            }
          }
        }
      }
      break;
  }
  if (!(dtype === "q4_1" || dtype === "q5_1" || dtype === "q4_K" || dtype === "q5_K")) {
    for (let i = 0; i < n; i++) mag[i] = Math.abs(v[i]!);
  }
  return { values: v, magnitude: mag };
}

/** A seeded pseudo-random generator (mulberry32): `next()` is uniform in [0, 1). */
export class ConformanceRng {
  private s: number;
  constructor(seed: number) {
    this.s = seed >>> 0;
  }
  next(): number {
    this.s = (this.s + 0x6d2b79f5) >>> 0;
    let t = this.s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  }
  /** Uniform in [lo, hi). */
  uniform(lo: number, hi: number): number {
    return lo + (hi - lo) * this.next();
  }
  /** Integer in [lo, hi] (inclusive). */
  int(lo: number, hi: number): number {
    return lo + Math.floor(this.next() * (hi - lo + 1));
  }
  /** Float32 array of uniform values in [lo, hi). */
  f32(n: number, lo = -1, hi = 1): Float32Array {
    const a = new Float32Array(n);
    for (let i = 0; i < n; i++) a[i] = this.uniform(lo, hi);
    return a;
  }
  bytes(n: number): Uint8Array {
    const a = new Uint8Array(n);
    for (let i = 0; i < n; i++) a[i] = this.int(0, 255);
    return a;
  }
}

function putHalf(b: Uint8Array, o: number, v: number): void {
  const h = numberToHalf(v);
  b[o] = h & 0xff;
  b[o + 1] = h >> 8;
}

/**
 * A valid random tensor of `dtype` with `n` elements (a multiple of the block size), values of order 1:
 * floats uniform in [−1, 1); quantized blocks with random quants and random positive/negative F16
 * scales in a range that keeps |w| ≲ 2. Int8 quants stay in [−127, 127] as ggml's quantizers produce.
 */
export function randomWeightBytes(dtype: DType, n: number, rng: ConformanceRng): Uint8Array {
  const { blockSize, typeSize } = DTYPE_LAYOUT[dtype];
  if (n % blockSize !== 0) throw new RangeError(`${dtype}: ${n} elements is not a multiple of ${blockSize}`);
  const nb = n / blockSize;
  const out = new Uint8Array(nb * typeSize);
  const dv = new DataView(out.buffer);
  const sign = () => (rng.next() < 0.5 ? -1 : 1);
  switch (dtype) {
    case "f32":
      for (let i = 0; i < n; i++) dv.setFloat32(4 * i, rng.uniform(-1, 1), true);
      break;
    case "i32":
      for (let i = 0; i < n; i++) dv.setInt32(4 * i, rng.int(-1000, 1000), true);
      break;
    case "f16":
      for (let i = 0; i < n; i++) dv.setUint16(2 * i, numberToHalf(rng.uniform(-1, 1)), true);
      break;
    case "bf16":
      for (let i = 0; i < n; i++) dv.setUint16(2 * i, numberToBf16(rng.uniform(-1, 1)), true);
      break;
    case "q8_0":
      for (let b = 0; b < nb; b++) {
        putHalf(out, b * 34, sign() * rng.uniform(0.004, 0.012));
        for (let j = 0; j < 32; j++) out[b * 34 + 2 + j] = rng.int(-127, 127) & 0xff;
      }
      break;
    case "q4_0":
    case "q5_0":
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        putHalf(out, o, sign() * (dtype === "q4_0" ? rng.uniform(0.06, 0.15) : rng.uniform(0.03, 0.07)));
        for (let j = 2; j < typeSize; j++) out[o + j] = rng.int(0, 255);
      }
      break;
    case "q4_1":
    case "q5_1":
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        putHalf(out, o, dtype === "q4_1" ? rng.uniform(0.06, 0.15) : rng.uniform(0.03, 0.07));
        putHalf(out, o + 2, rng.uniform(-1.2, 0.2));
        for (let j = 4; j < typeSize; j++) out[o + j] = rng.int(0, 255);
      }
      break;
    case "q4_K":
    case "q5_K":
      for (let b = 0; b < nb; b++) {
        const o = b * typeSize;
        putHalf(out, o, dtype === "q4_K" ? rng.uniform(0.0008, 0.002) : rng.uniform(0.0004, 0.001));
        putHalf(out, o + 2, rng.uniform(0.001, 0.02));
        for (let j = 4; j < typeSize; j++) out[o + j] = rng.int(0, 255);
      }
      break;
    case "q6_K":
      for (let b = 0; b < nb; b++) {
        const o = b * 210;
        for (let j = 0; j < 192; j++) out[o + j] = rng.int(0, 255);
        for (let j = 192; j < 208; j++) out[o + j] = rng.int(-128, 127) & 0xff;
        putHalf(out, o + 208, sign() * rng.uniform(0.0002, 0.0005));
      }
      break;
  }
  return out;
}

/** Encodes float values as a float tensor of `dtype` (f32, f16 or bf16), rounding to nearest even. */
export function encodeFloatTensor(dtype: "f32" | "f16" | "bf16", values: ArrayLike<number>): Uint8Array {
  const n = values.length;
  const out = new Uint8Array(n * (dtype === "f32" ? 4 : 2));
  const dv = new DataView(out.buffer);
  for (let i = 0; i < n; i++) {
    if (dtype === "f32") dv.setFloat32(4 * i, values[i]!, true);
    else dv.setUint16(2 * i, dtype === "f16" ? numberToHalf(values[i]!) : numberToBf16(values[i]!), true);
  }
  return out;
}
