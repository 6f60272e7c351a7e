// The float64 reference the conformance kit trusts: number formats, dequantization of every dtype
// (hand-built blocks, and agreement with @powerinfer/gguf's independent dequantize), the ops on
// hand-computed values, the activation-rounding bounds, and the graph interpreter.
import {
  ACTIVATION_ROUNDING,
  activationErrors,
  bf16ToNumber,
  type DType,
  dequantizeReference,
  DTYPE_CODES,
  exactActivations,
  Graph,
  refGelu,
  halfToNumber,
  numberToBf16,
  numberToHalf,
  ConformanceRng,
  randomWeightBytes,
  refAttention,
  refAxpySparse,
  referenceCompute,
  refMulMat,
  refMulMatSparse,
  refRmsNorm,
  refRope,
  refSoftmax,
  ROPE_NEOX,
  ROPE_NORMAL,
  roundToHalf,
  refSilu,
  WEIGHT_DTYPES,
} from "@powerinfer/core";
import { dequantize } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";

const close = (a: ArrayLike<number>, b: ArrayLike<number>, tol = 1e-12) => {
  expect(a.length).toBe(b.length);
  for (let i = 0; i < a.length; i++)
    expect(Math.abs(a[i]! - b[i]!), `element ${i}: ${a[i]} vs ${b[i]}`).toBeLessThanOrEqual(tol);
};

describe("half and bfloat16", () => {
  it("round-trips every half bit pattern and rounds to nearest even", () => {
    const bad: number[] = [];
    for (let h = 0; h < 65536; h++) {
      const v = halfToNumber(h);
      if (Number.isNaN(v) ? !Number.isNaN(halfToNumber(numberToHalf(v))) : numberToHalf(v) !== h) bad.push(h);
    }
    expect(bad).toEqual([]);
    expect(numberToHalf(1)).toBe(0x3c00);
    expect(numberToHalf(65504)).toBe(0x7bff);
    expect(numberToHalf(65520)).toBe(0x7c00); // rounds up to Inf
    expect(numberToHalf(2 ** -24)).toBe(1);
    expect(numberToHalf(2 ** -25)).toBe(0); // tie to even (0)
    expect(numberToHalf(1 + 2 ** -11)).toBe(0x3c00); // tie to even
    expect(numberToHalf(1 + 3 * 2 ** -11)).toBe(0x3c02); // tie to even (up)
    expect(numberToHalf(-0.1)).toBe(0xae66);
    expect(bf16ToNumber(numberToBf16(1 + 2 ** -8))).toBe(1);
    expect(bf16ToNumber(numberToBf16(1 + 3 * 2 ** -8))).toBe(1 + 2 ** -6);
    expect(roundToHalf(0.1)).toBe(halfToNumber(0x2e66));
  });
});

function half(v: number): [number, number] {
  const h = numberToHalf(v);
  return [h & 0xff, h >> 8];
}

/** Packs eight 6-bit (scale, min) pairs the way q4_K/q5_K store them. */
function packScalesK4(sc: number[], mn: number[]): number[] {
  const b = new Array(12).fill(0);
  for (let j = 0; j < 8; j++) {
    if (j < 4) {
      b[j] |= sc[j]!;
      b[j + 4] |= mn[j]!;
    } else {
      b[j + 4] = (sc[j]! & 0xf) | ((mn[j]! & 0xf) << 4);
      b[j - 4] |= (sc[j]! >> 4) << 6;
      b[j] |= (mn[j]! >> 4) << 6;
    }
  }
  return b;
}

describe("dequantizeReference", () => {
  it("decodes hand-built blocks of every legacy quant type", () => {
    const q40 = Uint8Array.from([...half(1), ...Array.from({ length: 16 }, (_, j) => j | ((15 - j) << 4))]);
    const v40 = dequantizeReference("q4_0", q40, 32).values;
    for (let j = 0; j < 16; j++) {
      expect(v40[j]).toBe(j - 8);
      expect(v40[j + 16]).toBe(7 - j);
    }
    const q41 = Uint8Array.from([...half(2), ...half(-1), 0x21, ...new Array(15).fill(0)]);
    const v41 = dequantizeReference("q4_1", q41, 32);
    expect([v41.values[0], v41.values[16], v41.values[1]]).toEqual([1, 3, -1]);
    expect(v41.magnitude[16]).toBe(5); // |d·q| + |m|
    const qh = (1 << 3) | (1 << 20);
    const q50 = Uint8Array.from([
      ...half(0.5),
      qh & 0xff,
      (qh >> 8) & 0xff,
      (qh >> 16) & 0xff,
      qh >>> 24,
      ...new Array(16).fill(0),
    ]);
    const v50 = dequantizeReference("q5_0", q50, 32).values;
    expect(v50[3]).toBe(0);
    expect(v50[20]).toBe(0);
    expect(v50[4]).toBe(-8);
    const q51 = Uint8Array.from([...half(0.25), ...half(1), 0, 0, 0, 0x80, 0x0f, ...new Array(15).fill(0xf0)]);
    const v51 = dequantizeReference("q5_1", q51, 32).values;
    expect(v51[0]).toBe(0.25 * 15 + 1);
    expect(v51[31]).toBe(0.25 * 31 + 1); // 5th bit of element 31 is bit 31 of qh
    expect(v51[1]).toBe(1);
    const q80 = Uint8Array.from([...half(0.5), 127, 0x81, ...new Array(30).fill(2)]);
    expect(Array.from(dequantizeReference("q8_0", q80, 32).values.slice(0, 3))).toEqual([63.5, -63.5, 1]);
  });

  it("decodes hand-built K-quant blocks (scale packing, nibble halves, 5th and 6th bits)", () => {
    const sc = [1, 2, 3, 4, 40, 50, 60, 63];
    const mn = [5, 6, 7, 8, 33, 44, 55, 17];
    const scales = packScalesK4(sc, mn);
    const qs = Array.from({ length: 128 }, (_, i) => (i % 16) | ((15 - (i % 16)) << 4));
    const q4k = Uint8Array.from([...half(0.5), ...half(0.25), ...scales, ...qs]);
    const v4 = dequantizeReference("q4_K", q4k, 256).values;
    for (let c = 0; c < 4; c++) {
      for (const l of [0, 7, 31]) {
        expect(v4[64 * c + l]).toBe(0.5 * sc[2 * c]! * (l % 16) - 0.25 * mn[2 * c]!);
        expect(v4[64 * c + 32 + l]).toBe(0.5 * sc[2 * c + 1]! * (15 - (l % 16)) - 0.25 * mn[2 * c + 1]!);
      }
    }
    const qh5 = Array.from({ length: 32 }, (_, l) => (l === 9 ? 1 << 5 : 0));
    const q5k = Uint8Array.from([...half(0.5), ...half(0.25), ...scales, ...qh5, ...qs]);
    const v5 = dequantizeReference("q5_K", q5k, 256).values;
    expect(v5[64 * 2 + 32 + 9]).toBe(0.5 * sc[5]! * (15 - 9 + 16) - 0.25 * mn[5]!);
    expect(v5[64 * 2 + 9]).toBe(0.5 * sc[4]! * 9 - 0.25 * mn[4]!);

    const ql = Array.from({ length: 128 }, (_, i) => i & 0xff);
    const qh6 = Array.from({ length: 64 }, (_, i) => (i === 49 ? 0b10_00_00_00 | 0b00_10_00_00 : 0));
    const sc6 = Array.from({ length: 16 }, (_, i) => (i - 8) & 0xff);
    const q6k = Uint8Array.from([...ql, ...qh6, ...sc6, ...half(0.125)]);
    const v6 = dequantizeReference("q6_K", q6k, 256).values;
    // element 128 + 64 + 17: half n = 1, quarter s = 2, l = 17: high nibble of ql[64 + 17], bits 4–5 of qh[32 + 17]
    const q = ((81 >> 4) | (2 << 4)) - 32;
    expect(v6[128 + 64 + 17]).toBe(0.125 * (13 - 8) * q);
    // element 128 + 96 + 17: s = 3, high nibble of ql[64 + 32 + 17], bits 6–7 of qh[49]
    expect(v6[128 + 96 + 17]).toBe(0.125 * (15 - 8) * (((113 >> 4) | (2 << 4)) - 32));
    expect(v6[0]).toBe(0.125 * -8 * (0 - 32));
  });

  it("agrees with @powerinfer/gguf's dequantize on random valid blocks of every weight dtype", () => {
    const rng = new ConformanceRng(11);
    for (const dt of WEIGHT_DTYPES) {
      const n = dt.endsWith("_K") ? 512 : 96;
      const bytes = randomWeightBytes(dt, n, rng);
      const mine = dequantizeReference(dt, bytes, n);
      const theirs = dequantize(DTYPE_CODES[dt], bytes, n);
      const bad: string[] = [];
      for (let i = 0; i < n; i++) {
        const v = mine.values[i]!;
        // gguf computes in float32: two roundings at most
        if (
          !Number.isFinite(v) ||
          mine.magnitude[i]! < Math.abs(v) ||
          Math.abs(v - theirs[i]!) > 2 ** -22 * mine.magnitude[i]!
        ) {
          bad.push(`${dt}[${i}]: ${v} vs ${theirs[i]}`);
        }
      }
      expect(bad).toEqual([]);
    }
  });
});

describe("reference ops", () => {
  it("gelu is the tanh approximation, silu is x·σ(x)", () => {
    expect(refGelu(1)).toBeCloseTo(0.5 * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (1 + 0.044715))), 15);
    expect(refGelu(1)).toBeCloseTo(0.841192, 6);
    expect(refGelu(-3)).toBeCloseTo(-0.0036374, 6);
    expect(refSilu(1)).toBeCloseTo(0.7310585786300049, 15);
    expect(refSilu(0)).toBe(0);
  });

  it("rms_norm, softmax, mul_mat on small cases", () => {
    close(refRmsNorm([3, 4], 2, 0), [3 / Math.sqrt(12.5), 4 / Math.sqrt(12.5)]);
    close(refSoftmax([0, Math.log(3)], 2, 1), [0.25, 0.75]);
    close(refSoftmax([0, 1, 1000], 3, 0), [1 / 3, 1 / 3, 1 / 3]);
    // W [K=2, N=3] rows (1,2), (3,4), (5,6); x [2, T=2] columns (1,1), (1,-1)
    close(refMulMat(Float64Array.from([1, 2, 3, 4, 5, 6]), 2, 3, [1, 1, 1, -1], 2), [3, 7, 11, -1, -1, -1]);
  });

  it("rope rotates (2i, 2i+1) in normal mode and (i, i+n/2) in NeoX mode; dims ≥ n_dims pass through", () => {
    const p = { headDim: 6, nDims: 4, freqBase: 10000, freqScale: 1 };
    const x = [1, 2, 3, 4, 5, 6];
    const n = refRope(x, 6, [1], { ...p, mode: ROPE_NORMAL });
    const th1 = 10000 ** (-2 / 4);
    close(n, [
      Math.cos(1) - 2 * Math.sin(1),
      Math.sin(1) + 2 * Math.cos(1),
      3 * Math.cos(th1) - 4 * Math.sin(th1),
      3 * Math.sin(th1) + 4 * Math.cos(th1),
      5,
      6,
    ]);
    const nx = refRope(x, 6, [1], { ...p, mode: ROPE_NEOX });
    close(nx, [
      Math.cos(1) - 3 * Math.sin(1),
      2 * Math.cos(th1) - 4 * Math.sin(th1),
      Math.sin(1) + 3 * Math.cos(1),
      2 * Math.sin(th1) + 4 * Math.cos(th1),
      5,
      6,
    ]);
    close(refRope(x, 6, [0], { ...p, mode: ROPE_NEOX }), x);
  });

  it("attention is causal and maps query heads to KV heads by h / (H / H_kv)", () => {
    // d = 1, one head, cache positions 0..2 with k = (0, 1, 9), v = (2, 4, 100); n_past = 1, T = 1:
    // the query sees positions 0 and 1 only
    const e = Math.E;
    close(refAttention([1], [0, 1, 9], [2, 4, 100], 1, { headDim: 1, nHead: 1, nHeadKv: 1, nPast: 1, scale: 1 }), [
      (2 + 4 * e) / (1 + e),
    ]);
    // T = 2 from n_past 0: column 0 sees position 0 only
    const two = refAttention([1, 1], [0, 1, 9], [2, 4, 100], 2, {
      headDim: 1,
      nHead: 1,
      nHeadKv: 1,
      nPast: 0,
      scale: 1,
    });
    close(two, [2, (2 + 4 * e) / (1 + e)]);
    // 4 query heads, 2 KV heads: heads 0,1 read KV head 0 (v = 10), heads 2,3 read KV head 1 (v = 20)
    const g = refAttention([1, 1, 1, 1], [0, 0], [10, 20], 1, { headDim: 1, nHead: 4, nHeadKv: 2, nPast: 0, scale: 1 });
    close(g, [10, 10, 20, 20]);
  });

  it("sparse ops: gates, inclusive threshold, row lists, compact weights, rows read", () => {
    const w = Float64Array.from([1, 0, 0, 1, 1, 1, 2, 2]); // K = 2, M = 4 rows (1,0), (0,1), (1,1), (2,2)
    const x = [3, 5];
    const dense = refMulMat(w, 2, 4, x, 1);
    expect(refMulMatSparse(w, 2, 4, x, 1, { logits: null, rows: null, threshold: 0, nOut: 4 })).toEqual({
      y: dense,
      rowsRead: 4,
    });
    const gated = refMulMatSparse(w, 2, 4, x, 1, {
      logits: [0.5, -1, 0.25, 0.1],
      rows: null,
      threshold: 0.25,
      nOut: 4,
    });
    expect(Array.from(gated.y)).toEqual([3, 0, 8, 0]);
    expect(gated.rowsRead).toBe(2);
    const subset = refMulMatSparse(w, 2, 4, x, 1, { logits: null, rows: [1, 3], threshold: 0, nOut: 4 });
    expect(Array.from(subset.y)).toEqual([0, 5, 0, 16]);
    // compact: W has 2 rows holding neurons 1 and 3
    const compact = refMulMatSparse(Float64Array.from([0, 1, 2, 2]), 2, 2, x, 1, {
      logits: null,
      rows: [1, 3],
      threshold: 0,
      nOut: 4,
    });
    expect(compact).toEqual(subset);
    // axpy: Wt rows are neurons (E = 2); y = Σ a_i · row_i over active i
    const ax = refAxpySparse(w, 2, 4, [1, 10, 100, 1000], 1, {
      logits: [1, 1, -1, 1],
      rows: [0, 2, 3],
      threshold: 0,
      nOut: 4,
    });
    expect(Array.from(ax.y)).toEqual([1 + 2000, 2000]);
    expect(ax.rowsRead).toBe(2);
  });
});

/** ggml-style Q8 rounding of x: blocks of `block`, d = amax/127 (F16 when `f16`), q = round(x/d). */
function roundQ8(x: Float32Array, block: number, f16: boolean): Float64Array {
  const out = new Float64Array(x.length);
  for (let b = 0; b < x.length; b += block) {
    let amax = 0;
    for (let j = b; j < Math.min(x.length, b + block); j++) amax = Math.max(amax, Math.abs(x[j]!));
    const d = Math.fround(amax / 127);
    const id = d ? Math.fround(1 / d) : 0;
    const ds = f16 ? roundToHalf(d) : d;
    for (let j = b; j < Math.min(x.length, b + block); j++) out[j] = ds * Math.round(Math.fround(x[j]! * id));
  }
  return out;
}

describe("activation rounding bounds", () => {
  it("bound the error of every admitted rounding on random vectors, and vanish on exact activations", () => {
    const rng = new ConformanceRng(3);
    const round: Record<string, (x: Float32Array) => Float64Array> = {
      f16: (x) => Float64Array.from(x, roundToHalf),
      bf16: (x) => Float64Array.from(x, (v) => bf16ToNumber(numberToBf16(v))),
      q8_0: (x) => roundQ8(x, 32, true),
      q8_1: (x) => roundQ8(x, 32, true),
      q8_K: (x) => roundQ8(x, 256, false),
    };
    for (const dt of WEIGHT_DTYPES as DType[]) {
      for (let trial = 0; trial < 5; trial++) {
        const k = 512;
        const x = rng.f32(k, -3, 3);
        const e = activationErrors(dt, x, 0, k);
        const xe = exactActivations(k, 1, () => rng.next());
        const ee = activationErrors(dt, xe, 0, k);
        const bad: string[] = [];
        for (const s of ACTIVATION_ROUNDING[dt]) {
          const r = round[s]!(x);
          const re = round[s]!(xe);
          for (let i = 0; i < k; i++) {
            if (Math.abs(r[i]! - x[i]!) > e[i]!) bad.push(`${dt}/${s}[${i}]: |${r[i]} - ${x[i]}| > ${e[i]}`);
            if (re[i] !== xe[i]) bad.push(`${dt}/${s}[${i}]: exact activation ${xe[i]} rounded to ${re[i]}`);
          }
        }
        for (let i = 0; i < k; i++)
          if (ee[i]! > Math.abs(xe[i]!) * 2 ** -11 + 2 ** -20) bad.push(`${dt} exact bound ${ee[i]}`);
        expect(bad).toEqual([]);
      }
    }
  });
});

describe("referenceCompute", () => {
  it("chains ops, reads handles, and lets a later node see what cpy wrote", () => {
    const rng = new ConformanceRng(5);
    const wBytes = randomWeightBytes("q4_0", 64 * 3, rng);
    const cache = new Uint8Array(2 * 8 * 4); // f16 [8, 4], zero
    const handles = new Map<number, Uint8Array>([
      [1, wBytes],
      [2, cache],
    ]);
    const h = (id: number, dtype: DType, ne: number[], byteLength: number) => ({
      backend: "t",
      id,
      dtype,
      ne,
      byteLength,
    });
    const g = new Graph();
    const x = rng.f32(64 * 2);
    const xi = g.input("f32", [64, 2], x);
    const y = g.mulMat(g.handle(h(1, "q4_0", [64, 3], wBytes.length)), g.rmsNorm(xi, 1e-6));
    const s = g.silu(y);
    const src = rng.f32(8 * 2, -1, 1);
    const c = g.cpy(g.input("f32", [8, 2], src), g.handle(h(2, "f16", [8, 4], cache.length)), 1);
    const rows = g.getRows(c, g.input("i32", [3], Int32Array.from([1, 2, 0])));
    const r = referenceCompute(g, handles);
    const w = dequantizeReference("q4_0", wBytes, 64 * 3).values;
    const expected = refMulMat(w, 64, 3, refRmsNorm(x, 64, 1e-6), 2).map(refSilu);
    close(r.values[s]!, expected);
    const got = r.values[rows]!;
    close(got.subarray(0, 16), Array.from(src, roundToHalf));
    close(got.subarray(16), new Array(8).fill(0));
    expect(Array.from(r.rowsRead)).toEqual([0, 0, 0, 0, 0]);
    // the handle's bytes were written in place (row 1..2 of the f16 cache)
    expect(halfToNumber(cache[16]! | (cache[17]! << 8))).toBe(roundToHalf(src[0]!));
  });
});
