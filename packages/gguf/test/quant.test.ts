import { describe, expect, it } from "vitest";
import {
  bf16ToF32,
  dequantize,
  f16ToF32,
  f32ToBf16,
  f32ToF16,
  GGML_TYPE_INFO,
  GGMLType,
  GgufError,
  type GgufFile,
  openGguf,
  quantize,
  quantizeQ4_0,
  quantizeQ8_0,
  readTensorBytes,
  readTensorF32,
  tensorByteLength,
} from "../src/index.js";
import { model } from "./helpers.js";

const F16 = { half: 0x3800, quarter: 0x3400, one: 0x3c00, two: 0x4000, minusOne: 0xbc00 };

function block(size: number, fill: (b: Uint8Array, dv: DataView) => void): Uint8Array {
  const b = new Uint8Array(size);
  fill(b, new DataView(b.buffer));
  return b;
}

describe("ggml type table", () => {
  it("has current ggml ids and block geometry", () => {
    expect(GGMLType.Q8_0).toBe(8);
    expect(GGMLType.IQ2_XXS).toBe(16);
    expect(GGMLType.I8).toBe(24);
    expect(GGMLType.I32).toBe(26);
    expect(GGMLType.F64).toBe(28);
    expect(GGMLType.BF16).toBe(30);
    expect(GGMLType.TQ1_0).toBe(34);
    expect(GGMLType.MXFP4).toBe(39);
    const sizes = Object.fromEntries(Object.values(GGML_TYPE_INFO).map((i) => [i.name, [i.blockSize, i.typeSize]]));
    expect(sizes).toMatchObject({
      F32: [1, 4],
      F16: [1, 2],
      BF16: [1, 2],
      Q4_0: [32, 18],
      Q4_1: [32, 20],
      Q5_0: [32, 22],
      Q5_1: [32, 24],
      Q8_0: [32, 34],
      Q8_1: [32, 36],
      Q2_K: [256, 84],
      Q3_K: [256, 110],
      Q4_K: [256, 144],
      Q5_K: [256, 176],
      Q6_K: [256, 210],
      Q8_K: [256, 292],
      IQ2_XXS: [256, 66],
      IQ2_XS: [256, 74],
      IQ3_XXS: [256, 98],
      IQ1_S: [256, 50],
      IQ4_NL: [32, 18],
      IQ3_S: [256, 110],
      IQ2_S: [256, 82],
      IQ4_XS: [256, 136],
      IQ1_M: [256, 56],
      TQ1_0: [256, 54],
      TQ2_0: [256, 66],
      MXFP4: [32, 17],
      I64: [1, 8],
      F64: [1, 8],
    });
  });

  it("tensorByteLength: blocks per row, and refuses rows that are not whole blocks", () => {
    expect(tensorByteLength(GGMLType.Q4_0, [64, 172])).toBe(2 * 172 * 18);
    expect(tensorByteLength(GGMLType.Q6_K, [512, 3])).toBe(2 * 3 * 210);
    expect(tensorByteLength(GGMLType.F32, [])).toBe(4);
    expect(() => tensorByteLength(GGMLType.Q8_0, [172, 64])).toThrow(/not a multiple of its block size 32/);
    expect(() => tensorByteLength(GGMLType.Q4_K, [128])).toThrow(GgufError);
    expect(() => tensorByteLength(4 as GGMLType, [32])).toThrow(/unknown ggml type id 4/);
  });
});

describe("half and bfloat16", () => {
  it("f16ToF32 decodes normals, subnormals, infinities and NaN", () => {
    expect(f16ToF32(0x3c00)).toBe(1);
    expect(f16ToF32(0xc000)).toBe(-2);
    expect(f16ToF32(0x7bff)).toBe(65504);
    expect(f16ToF32(0x0001)).toBe(2 ** -24);
    expect(f16ToF32(0x03ff)).toBe(1023 * 2 ** -24);
    expect(f16ToF32(0x0400)).toBe(2 ** -14);
    expect(f16ToF32(0x7c00)).toBe(Number.POSITIVE_INFINITY);
    expect(f16ToF32(0xfc00)).toBe(Number.NEGATIVE_INFINITY);
    expect(Object.is(f16ToF32(0x8000), -0)).toBe(true);
    expect(f16ToF32(0x7e00)).toBeNaN();
  });

  it("f32ToF16 rounds to nearest, ties to even", () => {
    expect(f32ToF16(1)).toBe(0x3c00);
    expect(f32ToF16(1 + 2 ** -11)).toBe(0x3c00); // tie → even (down)
    expect(f32ToF16(1 + 3 * 2 ** -11)).toBe(0x3c02); // tie → even (up)
    expect(f32ToF16(1 + 2 ** -11 + 2 ** -20)).toBe(0x3c01); // above the tie
    expect(f32ToF16(65504)).toBe(0x7bff);
    expect(f32ToF16(65520)).toBe(0x7c00); // rounds to Inf
    expect(f32ToF16(65519)).toBe(0x7bff);
    expect(f32ToF16(2 ** -24)).toBe(0x0001);
    expect(f32ToF16(2 ** -25)).toBe(0x0000); // tie between 0 and the smallest subnormal → 0
    expect(f32ToF16(3 * 2 ** -25)).toBe(0x0002); // tie 1.5 → 2
    expect(f32ToF16(2 ** -14 - 2 ** -25)).toBe(0x0400); // largest subnormal rounds up to the smallest normal
    expect(f32ToF16(-0)).toBe(0x8000);
    expect(f32ToF16(Number.NEGATIVE_INFINITY)).toBe(0xfc00);
    expect(f32ToF16(Number.NaN) & 0x7c00).toBe(0x7c00);
    expect(f32ToF16(Number.NaN) & 0x3ff).not.toBe(0);
  });

  it("f32ToF16 ∘ f16ToF32 is the identity on every non-NaN half", () => {
    for (let h = 0; h < 65536; h++) {
      if ((h & 0x7c00) === 0x7c00 && h & 0x3ff) continue;
      if (f32ToF16(f16ToF32(h)) !== h) throw new Error(`half ${h.toString(16)} does not round-trip`);
    }
  });

  it("bf16 conversions round to nearest even like ggml and quiet NaNs", () => {
    expect(bf16ToF32(0x3f80)).toBe(1);
    expect(bf16ToF32(0xc040)).toBe(-3);
    expect(f32ToBf16(1)).toBe(0x3f80);
    expect(f32ToBf16(1 + 2 ** -8)).toBe(0x3f80); // tie → even
    expect(f32ToBf16(1 + 3 * 2 ** -8)).toBe(0x3f82);
    expect(f32ToBf16(1 + 2 ** -8 + 2 ** -20)).toBe(0x3f81);
    expect(f32ToBf16(3.4028234663852886e38)).toBe(0x7f80); // max float rounds to Inf (as ggml does)
    expect(f32ToBf16(Number.NaN) & 0x7fc0).toBe(0x7fc0);
  });
});

describe("dequantize: hand-computed blocks", () => {
  it("F32 / F16 / BF16 / F64 / I8 / I16 / I32", () => {
    expect(dequantize(GGMLType.F32, new Uint8Array(new Float32Array([1.5, -2]).buffer), 2)).toEqual(
      new Float32Array([1.5, -2]),
    );
    expect(dequantize(GGMLType.F16, Uint8Array.of(0x00, 0x3c, 0x00, 0xc0), 2)).toEqual(new Float32Array([1, -2]));
    expect(dequantize(GGMLType.BF16, Uint8Array.of(0x80, 0x3f, 0x40, 0xc0), 2)).toEqual(new Float32Array([1, -3]));
    expect(dequantize(GGMLType.F64, new Uint8Array(new Float64Array([0.25]).buffer), 1)).toEqual(
      new Float32Array([0.25]),
    );
    expect(dequantize(GGMLType.I8, Uint8Array.of(0xff, 0x05), 2)).toEqual(new Float32Array([-1, 5]));
    expect(dequantize(GGMLType.I16, Uint8Array.of(0x00, 0x80), 1)).toEqual(new Float32Array([-32768]));
    expect(dequantize(GGMLType.I32, Uint8Array.of(0xfe, 0xff, 0xff, 0xff), 1)).toEqual(new Float32Array([-2]));
  });

  it("F32 from an unaligned view", () => {
    const buf = new Uint8Array(9);
    new DataView(buf.buffer).setFloat32(1, 3.25, true);
    new DataView(buf.buffer).setFloat32(5, -1, true);
    expect(dequantize(GGMLType.F32, buf.subarray(1), 2)).toEqual(new Float32Array([3.25, -1]));
  });

  it("Q4_0: (nibble - 8) · d, low nibbles first", () => {
    const b = block(18, (b, dv) => {
      dv.setUint16(0, F16.half, true);
      b.fill(0x08, 2);
      b[2] = 0x9f; // x[0] = 15-8 = 7 → 3.5; x[16] = 9-8 = 1 → 0.5
      b[17] = 0x0f; // x[15] = 7 → 3.5; x[31] = 0-8 → -4
    });
    const y = dequantize(GGMLType.Q4_0, b, 32);
    expect([y[0], y[16], y[15], y[31], y[1], y[17]]).toEqual([3.5, 0.5, 3.5, -4, 0, -4]);
  });

  it("Q4_1: nibble · d + m", () => {
    const b = block(20, (b, dv) => {
      dv.setUint16(0, F16.half, true);
      dv.setUint16(2, F16.minusOne, true);
      b[4] = 0x2f; // x[0] = 15·0.5 - 1 = 6.5; x[16] = 2·0.5 - 1 = 0
    });
    const y = dequantize(GGMLType.Q4_1, b, 32);
    expect([y[0], y[16], y[1], y[17]]).toEqual([6.5, 0, -1, -1]);
  });

  it("Q5_0: 5-bit (nibble | qh bit << 4) - 16, times d", () => {
    const b = block(22, (b, dv) => {
      dv.setUint16(0, F16.quarter, true);
      dv.setUint32(2, 0x00010001, true); // high bit of x[0] (bit 0) and of x[16] (bit 16)
      b[6] = 0x3a; // x[0] = (10|16)-16 = 10 → 2.5; x[16] = (3|16)-16 = 3 → 0.75
    });
    const y = dequantize(GGMLType.Q5_0, b, 32);
    expect([y[0], y[16], y[1], y[17]]).toEqual([2.5, 0.75, -4, -4]);
  });

  it("Q5_1: 5-bit value · d + m", () => {
    const b = block(24, (b, dv) => {
      dv.setUint16(0, F16.quarter, true);
      dv.setUint16(2, F16.one, true);
      dv.setUint32(4, 0x80000000, true); // high bit of x[31]
      b[8 + 15] = 0xf0; // x[15] = 0 → 1; x[31] = (15|16) = 31 → 31·0.25 + 1 = 8.75
    });
    const y = dequantize(GGMLType.Q5_1, b, 32);
    expect([y[15], y[31], y[0]]).toEqual([1, 8.75, 1]);
  });

  it("Q8_0: int8 · d", () => {
    const b = block(34, (_, dv) => {
      dv.setUint16(0, F16.two, true);
      dv.setInt8(2, -3);
      dv.setInt8(33, 127);
      dv.setInt8(3, -128);
    });
    const y = dequantize(GGMLType.Q8_0, b, 32);
    expect([y[0], y[1], y[2], y[31]]).toEqual([-6, -256, 0, 254]);
  });

  it("Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins", () => {
    const b = block(144, (b, dv) => {
      dv.setUint16(0, F16.one, true); // d = 1
      dv.setUint16(2, F16.half, true); // dmin = 0.5
      const sc = 4;
      b[sc + 0] = 2; // scale of sub-block 0
      b[sc + 4] = 3; // min of sub-block 0
      b[sc + 1] = 0x41; // scale of sub-block 1 = 1; top bits 01 → bit 4 of sub-block 5's scale
      b[sc + 5] = 0x84; // min of sub-block 1 = 4; top bits 10 → bit 5 of sub-block 5's min
      b[sc + 9] = 0x21; // sub-block 5: scale low 1 (|16 → 17), min low 2 (|32 → 34)
      const qs = 16;
      b[qs + 0] = 0x5a; // x[0] (sub-block 0, low nibble 10), x[32] (sub-block 1, high nibble 5)
      b[qs + 64] = 0x70; // x[128] (sub-block 4, 0), x[160] (sub-block 5, 7)
    });
    const y = dequantize(GGMLType.Q4_K, b, 256);
    expect(y[0]).toBe(1 * 2 * 10 - 0.5 * 3); // 18.5
    expect(y[1]).toBe(-1.5); // q = 0
    expect(y[32]).toBe(1 * 1 * 5 - 0.5 * 4); // 3
    expect(y[33]).toBe(-2);
    expect(y[128]).toBe(0); // scale 0, min 0
    expect(y[160]).toBe(17 * 7 - 0.5 * 34); // 102
    expect(y[161]).toBe(-17);
    expect(y[255]).toBe(0);
  });

  it("Q5_K: like Q4_K with a fifth bit from qh", () => {
    const b = block(176, (b, dv) => {
      dv.setUint16(0, F16.one, true);
      dv.setUint16(2, 0, true);
      b[4 + 2] = 1; // scale of sub-block 2
      b[4 + 3] = 2; // scale of sub-block 3
      b[16 + 0] = 0b1100; // qh[0]: bit 2 → x[64] (sub-block 2), bit 3 → x[96] (sub-block 3)
      b[48 + 32] = 0x43; // qs[32]: low nibble 3 → x[64]; high nibble 4 → x[96]
    });
    const y = dequantize(GGMLType.Q5_K, b, 256);
    expect(y[64]).toBe(3 + 16);
    expect(y[96]).toBe(2 * (4 + 16));
    expect(y[65]).toBe(0);
    expect(y[0]).toBe(0);
  });

  it("Q6_K: 6-bit (ql | qh << 4) - 32, times d · int8 scale", () => {
    const b = block(210, (b, dv) => {
      dv.setUint16(208, F16.half, true); // d = 0.5
      const ql = 0;
      const qh = 128;
      const sc = 192;
      dv.setInt8(sc + 0, 2);
      dv.setInt8(sc + 2, -1);
      dv.setInt8(sc + 4, 0);
      dv.setInt8(sc + 6, 4);
      dv.setInt8(sc + 8, 3);
      b[ql + 0] = 0x0f; // x[0] low 4 bits 15; x[64] high nibble 0
      b[qh + 0] = 0b11; // x[0] high 2 bits 3 → q = 63 - 32 = 31
      b[ql + 32] = 0x20; // x[32] low 0, x[96] high nibble 2
      b[qh + 0] |= 0b11 << 6; // x[96] high 2 bits 3 → q = (2 | 48) - 32 = 18
      b[ql + 64] = 0x01; // second half: x[128] = 1 - 32 = -31
    });
    const y = dequantize(GGMLType.Q6_K, b, 256);
    expect(y[0]).toBe(0.5 * 2 * 31);
    expect(y[32]).toBe(0.5 * -1 * -32);
    expect(Math.abs(y[64])).toBe(0); // scale 0 (−0)
    expect(y[96]).toBe(0.5 * 4 * 18);
    expect(y[128]).toBe(0.5 * 3 * -31);
    expect(y[1]).toBe(0.5 * 2 * -32);
  });

  it("rejects unsupported types, partial blocks and short buffers", () => {
    const err = (fn: () => unknown) => {
      try {
        fn();
      } catch (e) {
        return e as GgufError;
      }
      throw new Error("did not throw");
    };
    expect(err(() => dequantize(GGMLType.IQ2_XXS, new Uint8Array(66), 256)).code).toBe("UNSUPPORTED_TYPE");
    expect(err(() => dequantize(GGMLType.Q8_0, new Uint8Array(34), 16)).code).toBe("BAD_SHAPE");
    expect(err(() => dequantize(GGMLType.Q8_0, new Uint8Array(33), 32)).code).toBe("TRUNCATED");
  });
});

describe("reference quantizers", () => {
  it("quantizeQ8_0: d = max|x|/127, round half away from zero", () => {
    const x = new Float32Array(32);
    x[0] = 127;
    x[1] = -63.5; // → -64 (half away from zero)
    x[2] = 0.5; // → 1
    x[3] = -0.49; // → 0
    const q = quantizeQ8_0(x);
    const dv = new DataView(q.buffer);
    expect(f16ToF32(dv.getUint16(0, true))).toBe(1);
    expect([dv.getInt8(2), dv.getInt8(3), dv.getInt8(4), dv.getInt8(5)]).toEqual([127, -64, 1, 0]);
    expect(quantizeQ8_0(new Float32Array(32))).toEqual(new Uint8Array(34)); // all zero → d = 0, q = 0
  });

  it("quantizeQ4_0: d = (value of max magnitude) / -8, q = min(15, trunc(x/d + 8.5))", () => {
    const x = new Float32Array(32);
    x[0] = -8; // max magnitude, negative → d = 1
    x[1] = 8; // 8/1 + 8.5 = 16.5 → clamped to 15 (dequantizes to 7)
    x[16] = 2.4; // 10.9 → 10
    x[17] = -2.6; // 5.9 → 5
    const q = quantizeQ4_0(x);
    expect(f16ToF32(q[0] | (q[1] << 8))).toBe(1);
    expect(q[2]).toBe(0 | (10 << 4));
    expect(q[3]).toBe(15 | (5 << 4));
    const y = dequantize(GGMLType.Q4_0, q, 32);
    expect([y[0], y[1], y[16], y[17], y[2]]).toEqual([-8, 7, 2, -3, 0]);
  });

  it("quantize() covers F32/F16/BF16/Q8_0/Q4_0 and refuses the rest", () => {
    const x = Float32Array.from({ length: 64 }, (_, i) => Math.sin(i) * 3);
    for (const t of [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0]) {
      const q = quantize(t, x);
      expect(q.length).toBe(tensorByteLength(t, [64]));
      const y = dequantize(t, q, 64);
      // Q4_0: d = 3/8, error ≤ d (clamped end); Q8_0: d = 3/127, error ≤ d/2; F16/BF16: relative 2^-9.
      const tol = t === GGMLType.Q4_0 ? 0.38 : 0.02;
      for (let i = 0; i < 64; i++) expect(Math.abs(y[i] - x[i])).toBeLessThanOrEqual(tol);
    }
    expect(() => quantize(GGMLType.Q4_K, new Float32Array(256))).toThrow(/no reference quantizer for Q4_K/);
    expect(() => quantizeQ8_0(new Float32Array(31))).toThrow(/not a multiple/);
  });
});

/** Byte equality of two typed arrays (Buffer.equals: fast on large tensors). */
function expectSameBytes(a: ArrayBufferView, b: ArrayBufferView, what: string): void {
  const x = Buffer.from(a.buffer, a.byteOffset, a.byteLength);
  const y = Buffer.from(b.buffer, b.byteOffset, b.byteLength);
  expect(x.equals(y), `${what}: bytes differ`).toBe(true);
}

/** Element-wise |got - want| ≤ tol(i), reported for the first failing element (fast: no expect per element). */
function assertClose(got: Float32Array, want: Float32Array, tol: (i: number) => number, what: string): void {
  expect(got.length).toBe(want.length);
  for (let i = 0; i < got.length; i++) {
    if (!(Math.abs(got[i] - want[i]) <= tol(i))) {
      throw new Error(`${what}[${i}]: ${got[i]} vs ${want[i]} (tolerance ${tol(i)})`);
    }
  }
}

describe("stories260K variants against the F32 file", () => {
  const f32 = openGguf(model("stories260K.gguf"));
  const ref = new Map(f32.tensors.map((t) => [t.name, readTensorF32(f32, t)]));

  function variant(rel: string): GgufFile {
    return openGguf(model(rel));
  }

  it("F16 tensors are exactly the F32 values rounded to nearest even", () => {
    const f = variant("stories260K-F16.gguf");
    let n = 0;
    for (const t of f.tensors) {
      const want = ref.get(t.name)!;
      const got = readTensorF32(f, t);
      if (t.type === GGMLType.F16) {
        expectSameBytes(readTensorBytes(f, t), quantize(GGMLType.F16, want), t.name);
        assertClose(got, want, (i) => Math.abs(want[i]) * 2 ** -11 + 2 ** -25, t.name);
        n++;
      } else {
        expectSameBytes(got, want, t.name);
      }
    }
    expect(n).toBe(37);
  });

  it("BF16 tensors are exactly the F32 values rounded like ggml", () => {
    const f = variant("stories260K-BF16.gguf");
    for (const t of f.tensors) {
      if (t.type !== GGMLType.BF16) continue;
      const want = ref.get(t.name)!;
      expectSameBytes(readTensorBytes(f, t), quantize(GGMLType.BF16, want), t.name);
      const got = readTensorF32(f, t);
      assertClose(got, want, (i) => Math.abs(want[i]) * 2 ** -8, t.name);
    }
  });

  /** Per-block scale d of a Q8_0 / Q4_0 tensor. */
  function scales(bytes: Uint8Array, typeSize: number): Float32Array {
    const out = new Float32Array(bytes.length / typeSize);
    for (let b = 0; b < out.length; b++) out[b] = f16ToF32(bytes[b * typeSize] | (bytes[b * typeSize + 1] << 8));
    return out;
  }

  it("Q8_0 tensors: within d/2 of F32 per element, and byte-identical to quantizeQ8_0", () => {
    for (const rel of ["stories260K-Q8_0-ffn_down-F16.gguf", "stories260K-Q4_0-ffn_down-F16.gguf"]) {
      const f = variant(rel);
      for (const t of f.tensors) {
        if (t.type !== GGMLType.Q8_0) continue;
        const want = ref.get(t.name)!;
        const bytes = readTensorBytes(f, t);
        expectSameBytes(bytes, quantizeQ8_0(want), t.name);
        const got = dequantize(t.type, bytes, t.nElements);
        const d = scales(bytes, 34);
        // |x - q·d| ≤ d/2 for the float32 d; storing d as f16 adds at most |q·d|·2^-11.
        assertClose(got, want, (i) => Math.abs(d[i >> 5]) * 0.5 * (1 + 2 ** -10) + Math.abs(got[i]) * 2 ** -11, t.name);
      }
    }
  });

  it("Q4_0 tensors: within d/2 of F32 (d where the +8 end clamps), byte-identical to quantizeQ4_0", () => {
    const f = variant("stories260K-Q4_0-ffn_down-F16.gguf");
    let n = 0;
    for (const t of f.tensors) {
      if (t.type !== GGMLType.Q4_0) continue;
      n++;
      const want = ref.get(t.name)!;
      const bytes = readTensorBytes(f, t);
      expectSameBytes(bytes, quantizeQ4_0(want), t.name);
      const got = dequantize(t.type, bytes, t.nElements);
      const d = scales(bytes, 18);
      // |x - q·d| ≤ d/2, except where x/d rounds past +7.5 and q clamps at 15 (7·d): there ≤ d.
      // Storing d as f16 adds at most |q·d|·2^-11.
      assertClose(
        got,
        want,
        (i) => {
          const ad = Math.abs(d[i >> 5]);
          const clamped = got[i] === 7 * d[i >> 5];
          return (clamped ? ad : ad * 0.5) * (1 + 2 ** -10) + Math.abs(got[i]) * 2 ** -11;
        },
        t.name,
      );
    }
    expect(n).toBe(31);
  });

  it("F16 ffn_down of the quantized variants equals the F16 file's", () => {
    const f16 = variant("stories260K-F16.gguf");
    const q8 = variant("stories260K-Q8_0-ffn_down-F16.gguf");
    for (let l = 0; l < 5; l++) {
      const name = `blk.${l}.ffn_down.weight`;
      expectSameBytes(readTensorBytes(q8, name), readTensorBytes(f16, name), name);
    }
  });
});

describe("PowerInfer Q4_0 fixture", () => {
  it("its Q4_0 / Q8_0 tensors are the reference quantization of the F16 file's values (up to FMA ties)", () => {
    const f16 = openGguf(model("powerinfer/tiny-f16.powerinfer.gguf"));
    const q4 = openGguf(model("powerinfer/tiny-q4_0.powerinfer.gguf"));
    const f32 = openGguf(model("powerinfer/tiny-f32.powerinfer.gguf"));
    let ties = 0;
    for (const t of q4.tensors) {
      const src = readTensorF32(f16, t.name);
      // The F32 fixture holds the same values as the F16 one.
      expectSameBytes(readTensorF32(f32, t.name), src, t.name);
      const bytes = readTensorBytes(q4, t);
      if (t.type === GGMLType.Q8_0) {
        expectSameBytes(bytes, quantizeQ8_0(src), t.name);
      } else if (t.type === GGMLType.Q4_0) {
        // PowerInfer's build contracted `x*id + 8.5f` into one FMA, so where x·id rounds to exactly
        // n - 0.5 in float32 its unrounded product is a hair below and truncation gives one less.
        // Every other nibble (and every scale) is what ggml's reference quantizer gives.
        const mine = quantizeQ4_0(src);
        for (let i = 0; i < bytes.length; i++) {
          if (bytes[i] === mine[i]) continue;
          const b = Math.floor(i / 18);
          const j = (i % 18) - 2;
          expect(j, `${t.name} scale byte ${i}`).toBeGreaterThanOrEqual(0);
          const d = f16ToF32(mine[b * 18] | (mine[b * 18 + 1] << 8));
          const id = Math.fround(1 / Math.fround(d === 0 ? 1 : dFromBlock(src, b)));
          for (const [shift, x] of [
            [0, src[b * 32 + j]],
            [4, src[b * 32 + j + 16]],
          ] as const) {
            const a = (bytes[i] >> shift) & 15;
            const m = (mine[i] >> shift) & 15;
            if (a === m) continue;
            expect(m - a, t.name).toBe(1);
            expect(Math.fround(Math.fround(x * id) + 8.5) % 1, `${t.name} nibble ${i}`).toBe(0);
            ties++;
          }
        }
      } else {
        expectSameBytes(readTensorF32(q4, t), src, t.name);
      }
    }
    expect(ties).toBeGreaterThan(0);
    expect(ties).toBeLessThan(20);
  });
});

/** The float32 scale d = max / -8 quantizeQ4_0 uses for block b. */
function dFromBlock(x: Float32Array, b: number): number {
  let amax = 0;
  let max = 0;
  for (let j = 0; j < 32; j++) {
    const v = x[b * 32 + j];
    if (amax < Math.abs(v)) {
      amax = Math.abs(v);
      max = v;
    }
  }
  return Math.fround(max / -8);
}
