/**
 * Reference (scalar, unoptimised) dequantization and quantization of ggml block formats.
 *
 * Block layouts are those of ggml's `ggml-common.h`; arithmetic is done in float32 (Math.fround) in
 * the order ggml's reference C code uses, so results are bit-identical with ggml's `dequantize_row_*`
 * and `quantize_row_*_ref` wherever the C compiler does not fuse multiply-adds.
 */

import { GgufError } from "./errors.js";
import { GGML_TYPE_INFO, GGMLType, ggmlTypeName, isGgmlType } from "./ggml-types.js";
import { bf16ToF32, f16Lut, f32ToBf16, f32ToF16 } from "./float.js";

const fr = Math.fround;

function checkInput(type: GGMLType, bytes: Uint8Array, nElements: number): number {
  if (!isGgmlType(type)) throw new GgufError("UNKNOWN_TYPE", `unknown ggml type id ${type}`);
  const { blockSize, typeSize } = GGML_TYPE_INFO[type];
  if (!Number.isSafeInteger(nElements) || nElements < 0 || nElements % blockSize !== 0) {
    throw new GgufError(
      "BAD_SHAPE",
      `${nElements} elements is not a multiple of the ${ggmlTypeName(type)} block size ${blockSize}`,
    );
  }
  const nBlocks = nElements / blockSize;
  if (bytes.length < nBlocks * typeSize) {
    throw new GgufError(
      "TRUNCATED",
      `${nElements} ${ggmlTypeName(type)} elements need ${nBlocks * typeSize} bytes, got ${bytes.length}`,
    );
  }
  return nBlocks;
}

/** Scale and min of sub-block j (0..7) from the 12 packed 6-bit K-quant scale bytes at `q[o..o+12)`. */
function scaleMinK4(j: number, q: Uint8Array, o: number): [number, number] {
  if (j < 4) return [q[o + j] & 63, q[o + j + 4] & 63];
  return [(q[o + j + 4] & 0xf) | ((q[o + j - 4] >> 6) << 4), (q[o + j + 4] >> 4) | ((q[o + j] >> 6) << 4)];
}

/**
 * Dequantize `nElements` values of `type` from `bytes` into float32.
 *
 * Supported: F32, F16, BF16, F64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and I8/I16/I32 as a
 * plain numeric conversion.
 * @param bytes tensor data (little-endian), at least `nElements / blockSize * typeSize` bytes
 * @param nElements element count, a multiple of the type's block size
 * @throws GgufError `UNSUPPORTED_TYPE` for other types, `BAD_SHAPE` / `TRUNCATED` for bad sizes
 */
export function dequantize(type: GGMLType, bytes: Uint8Array, nElements: number): Float32Array {
  const nb = checkInput(type, bytes, nElements);
  const out = new Float32Array(nElements);
  const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const h = f16Lut();
  const f16 = (o: number) => h[bytes[o] | (bytes[o + 1] << 8)];
  switch (type) {
    case GGMLType.F32:
      for (let i = 0; i < nElements; i++) out[i] = dv.getFloat32(i * 4, true);
      return out;
    case GGMLType.F64:
      for (let i = 0; i < nElements; i++) out[i] = dv.getFloat64(i * 8, true);
      return out;
    case GGMLType.F16:
      for (let i = 0; i < nElements; i++) out[i] = f16(i * 2);
      return out;
    case GGMLType.BF16:
      for (let i = 0; i < nElements; i++) out[i] = bf16ToF32(bytes[i * 2] | (bytes[i * 2 + 1] << 8));
      return out;
    case GGMLType.I8:
      for (let i = 0; i < nElements; i++) out[i] = dv.getInt8(i);
      return out;
    case GGMLType.I16:
      for (let i = 0; i < nElements; i++) out[i] = dv.getInt16(i * 2, true);
      return out;
    case GGMLType.I32:
      for (let i = 0; i < nElements; i++) out[i] = dv.getInt32(i * 4, true);
      return out;
    case GGMLType.Q4_0: // { f16 d; u8 qs[16] }: x[j] = (lo(qs[j]) - 8) d, x[j+16] = (hi(qs[j]) - 8) d
      for (let b = 0; b < nb; b++) {
        const o = b * 18;
        const d = f16(o);
        const y = b * 32;
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 2 + j];
          out[y + j] = ((q & 0xf) - 8) * d;
          out[y + j + 16] = ((q >> 4) - 8) * d;
        }
      }
      return out;
    case GGMLType.Q4_1: // { f16 d; f16 m; u8 qs[16] }: x = q d + m
      for (let b = 0; b < nb; b++) {
        const o = b * 20;
        const d = f16(o);
        const m = f16(o + 2);
        const y = b * 32;
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 4 + j];
          out[y + j] = fr((q & 0xf) * d) + m;
          out[y + j + 16] = fr((q >> 4) * d) + m;
        }
      }
      return out;
    case GGMLType.Q5_0: // { f16 d; u32 qh; u8 qs[16] }: 5th bit of element j in qh bit j
      for (let b = 0; b < nb; b++) {
        const o = b * 22;
        const d = f16(o);
        const qh = dv.getUint32(o + 2, true);
        const y = b * 32;
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 6 + j];
          const x0 = ((q & 0xf) | (((qh >>> j) & 1) << 4)) - 16;
          const x1 = ((q >> 4) | (((qh >>> (j + 16)) & 1) << 4)) - 16;
          out[y + j] = x0 * d;
          out[y + j + 16] = x1 * d;
        }
      }
      return out;
    case GGMLType.Q5_1: // { f16 d; f16 m; u32 qh; u8 qs[16] }: x = q d + m
      for (let b = 0; b < nb; b++) {
        const o = b * 24;
        const d = f16(o);
        const m = f16(o + 2);
        const qh = dv.getUint32(o + 4, true);
        const y = b * 32;
        for (let j = 0; j < 16; j++) {
          const q = bytes[o + 8 + j];
          const x0 = (q & 0xf) | (((qh >>> j) & 1) << 4);
          const x1 = (q >> 4) | (((qh >>> (j + 16)) & 1) << 4);
          out[y + j] = fr(x0 * d) + m;
          out[y + j + 16] = fr(x1 * d) + m;
        }
      }
      return out;
    case GGMLType.Q8_0: // { f16 d; i8 qs[32] }
      for (let b = 0; b < nb; b++) {
        const o = b * 34;
        const d = f16(o);
        const y = b * 32;
        for (let j = 0; j < 32; j++) out[y + j] = dv.getInt8(o + 2 + j) * d;
      }
      return out;
    case GGMLType.Q4_K: // { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }, 8 sub-blocks of 32
      for (let b = 0; b < nb; b++) {
        const o = b * 144;
        const d = f16(o);
        const dmin = f16(o + 2);
        let q = o + 16;
        let y = b * 256;
        for (let is = 0; is < 8; is += 2) {
          const [sc1, m1] = scaleMinK4(is, bytes, o + 4);
          const [sc2, m2] = scaleMinK4(is + 1, bytes, o + 4);
          const d1 = fr(d * sc1);
          const mm1 = fr(dmin * m1);
          const d2 = fr(d * sc2);
          const mm2 = fr(dmin * m2);
          for (let l = 0; l < 32; l++) out[y + l] = fr(d1 * (bytes[q + l] & 0xf)) - mm1;
          for (let l = 0; l < 32; l++) out[y + 32 + l] = fr(d2 * (bytes[q + l] >> 4)) - mm2;
          q += 32;
          y += 64;
        }
      }
      return out;
    case GGMLType.Q5_K: // { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }
      for (let b = 0; b < nb; b++) {
        const o = b * 176;
        const d = f16(o);
        const dmin = f16(o + 2);
        const qh = o + 16;
        let ql = o + 48;
        let y = b * 256;
        let u1 = 1;
        let u2 = 2;
        for (let is = 0; is < 8; is += 2) {
          const [sc1, m1] = scaleMinK4(is, bytes, o + 4);
          const [sc2, m2] = scaleMinK4(is + 1, bytes, o + 4);
          const d1 = fr(d * sc1);
          const mm1 = fr(dmin * m1);
          const d2 = fr(d * sc2);
          const mm2 = fr(dmin * m2);
          for (let l = 0; l < 32; l++) {
            out[y + l] = fr(d1 * ((bytes[ql + l] & 0xf) + (bytes[qh + l] & u1 ? 16 : 0))) - mm1;
          }
          for (let l = 0; l < 32; l++) {
            out[y + 32 + l] = fr(d2 * ((bytes[ql + l] >> 4) + (bytes[qh + l] & u2 ? 16 : 0))) - mm2;
          }
          ql += 32;
          y += 64;
          u1 <<= 2;
          u2 <<= 2;
        }
      }
      return out;
    case GGMLType.Q6_K: // { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }
      for (let b = 0; b < nb; b++) {
        const o = b * 210;
        const d = f16(o + 208);
        let ql = o;
        let qh = o + 128;
        let sc = o + 192;
        let y = b * 256;
        for (let n = 0; n < 2; n++) {
          for (let l = 0; l < 32; l++) {
            const is = l >> 4;
            const q1 = ((bytes[ql + l] & 0xf) | (((bytes[qh + l] >> 0) & 3) << 4)) - 32;
            const q2 = ((bytes[ql + l + 32] & 0xf) | (((bytes[qh + l] >> 2) & 3) << 4)) - 32;
            const q3 = ((bytes[ql + l] >> 4) | (((bytes[qh + l] >> 4) & 3) << 4)) - 32;
            const q4 = ((bytes[ql + l + 32] >> 4) | (((bytes[qh + l] >> 6) & 3) << 4)) - 32;
            out[y + l] = fr(d * dv.getInt8(sc + is)) * q1;
            out[y + l + 32] = fr(d * dv.getInt8(sc + is + 2)) * q2;
            out[y + l + 64] = fr(d * dv.getInt8(sc + is + 4)) * q3;
            out[y + l + 96] = fr(d * dv.getInt8(sc + is + 6)) * q4;
          }
          y += 128;
          ql += 64;
          qh += 32;
          sc += 8;
        }
      }
      return out;
    default:
      throw new GgufError("UNSUPPORTED_TYPE", `no reference dequantization for ${ggmlTypeName(type)}`);
  }
}

function checkBlocks(f32: ArrayLike<number>, block: number, name: string): number {
  if (f32.length % block !== 0) {
    throw new GgufError("BAD_SHAPE", `${f32.length} elements is not a multiple of the ${name} block size ${block}`);
  }
  return f32.length / block;
}

/**
 * Quantize to Q8_0 like ggml's `quantize_row_q8_0_ref`: per 32 values d = max|x| / 127,
 * q = round-half-away(x / d), stored as { f16 d; i8 qs[32] } (34 bytes per block).
 * @throws GgufError `BAD_SHAPE` when the length is not a multiple of 32
 */
export function quantizeQ8_0(f32: ArrayLike<number>): Uint8Array {
  const nb = checkBlocks(f32, 32, "Q8_0");
  const out = new Uint8Array(nb * 34);
  for (let b = 0; b < nb; b++) {
    const x = b * 32;
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(fr(f32[x + j])));
    const d = fr(amax / 127);
    const id = d !== 0 ? fr(1 / d) : 0;
    const h = f32ToF16(d);
    const o = b * 34;
    out[o] = h & 0xff;
    out[o + 1] = h >> 8;
    for (let j = 0; j < 32; j++) {
      const v = fr(fr(f32[x + j]) * id);
      const r = Math.sign(v) * Math.floor(Math.abs(v) + 0.5); // roundf: half away from zero
      out[o + 2 + j] = r & 0xff;
    }
  }
  return out;
}

/**
 * Quantize to Q4_0 like ggml's `quantize_row_q4_0_ref`: per 32 values d = m / -8 where m is the
 * value of largest magnitude, q = min(15, trunc(x / d + 8.5)), stored as { f16 d; u8 qs[16] } with
 * element j in the low nibble and j+16 in the high nibble of qs[j] (18 bytes per block).
 * @throws GgufError `BAD_SHAPE` when the length is not a multiple of 32
 */
export function quantizeQ4_0(f32: ArrayLike<number>): Uint8Array {
  const nb = checkBlocks(f32, 32, "Q4_0");
  const out = new Uint8Array(nb * 18);
  for (let b = 0; b < nb; b++) {
    const x = b * 32;
    let amax = 0;
    let max = 0;
    for (let j = 0; j < 32; j++) {
      const v = fr(f32[x + j]);
      if (amax < Math.abs(v)) {
        amax = Math.abs(v);
        max = v;
      }
    }
    const d = fr(max / -8);
    const id = d !== 0 ? fr(1 / d) : 0;
    const h = f32ToF16(d);
    const o = b * 18;
    out[o] = h & 0xff;
    out[o + 1] = h >> 8;
    for (let j = 0; j < 16; j++) {
      const x0 = fr(fr(f32[x + j]) * id);
      const x1 = fr(fr(f32[x + 16 + j]) * id);
      const q0 = Math.min(15, Math.trunc(fr(x0 + 8.5)));
      const q1 = Math.min(15, Math.trunc(fr(x1 + 8.5)));
      out[o + 2 + j] = q0 | (q1 << 4);
    }
  }
  return out;
}

/**
 * Encode float values as `type`: F32, F16 (RNE), BF16 (RNE, ggml), Q8_0 and Q4_0 (reference
 * quantizers above).
 * @throws GgufError `UNSUPPORTED_TYPE` for other types, `BAD_SHAPE` for a length that is not a
 *   multiple of the block size
 */
export function quantize(type: GGMLType, f32: ArrayLike<number>): Uint8Array {
  switch (type) {
    case GGMLType.F32: {
      const out = new Uint8Array(f32.length * 4);
      const dv = new DataView(out.buffer);
      for (let i = 0; i < f32.length; i++) dv.setFloat32(i * 4, f32[i], true);
      return out;
    }
    case GGMLType.F16:
    case GGMLType.BF16: {
      const enc = type === GGMLType.F16 ? f32ToF16 : f32ToBf16;
      const out = new Uint8Array(f32.length * 2);
      for (let i = 0; i < f32.length; i++) {
        const v = enc(f32[i]);
        out[i * 2] = v & 0xff;
        out[i * 2 + 1] = v >> 8;
      }
      return out;
    }
    case GGMLType.Q8_0:
      return quantizeQ8_0(f32);
    case GGMLType.Q4_0:
      return quantizeQ4_0(f32);
    default:
      throw new GgufError("UNSUPPORTED_TYPE", `no reference quantizer for ${ggmlTypeName(type)}`);
  }
}
