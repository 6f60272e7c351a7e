/** Products, metrics, thresholds, text split: against naive float64 references. */
import { type Backend, referenceCompute, writeGraphOutputs } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import {
  backendMatMul,
  confusionAt,
  hotListConfusion,
  jsMatMul,
  maskStride,
  quality,
  Rng,
  splitText,
  thresholdForRecall,
  transpose,
} from "../src/index.ts";

function naiveNT(a: Float32Array, b: Float32Array, m: number, n: number, k: number): Float64Array {
  const c = new Float64Array(m * n);
  for (let i = 0; i < m; i++)
    for (let j = 0; j < n; j++) for (let p = 0; p < k; p++) c[i * n + j]! += a[i * k + p]! * b[j * k + p]!;
  return c;
}

function rand(n: number, rng: Rng): Float32Array {
  return Float32Array.from({ length: n }, () => rng.normal());
}

/** A backend whose compute() is core's float64 reference interpreter (no native code). */
const referenceBackend = {
  name: "reference",
  compute(g: Parameters<Backend["compute"]>[0]) {
    const r = referenceCompute(g, new Map());
    writeGraphOutputs(g, r, new Map());
    return { rowsRead: Array.from(r.rowsRead), elapsedMs: 0 };
  },
} as unknown as Backend;

describe("C = A·Bᵀ", () => {
  const rng = new Rng(7);
  for (const [m, n, k] of [
    [1, 1, 1],
    [4, 4, 8],
    [5, 7, 3],
    [13, 9, 33],
    [32, 20, 17],
  ] as const) {
    it(`js and backend mul_mat match float64 for ${m}×${k} · (${n}×${k})ᵀ`, () => {
      const a = rand(m * k, rng);
      const b = rand(n * k, rng);
      const ref = naiveNT(a, b, m, n, k);
      for (const mm of [jsMatMul, backendMatMul(referenceBackend)]) {
        const c = mm.gemmNT(a, b, m, n, k);
        c.forEach((v, i) => {
          expect(Math.abs(v - ref[i]!)).toBeLessThan(1e-4 * (1 + Math.abs(ref[i]!)));
        });
      }
    });
  }

  it("writes into a given output and checks sizes", () => {
    const out = new Float32Array(6);
    expect(jsMatMul.gemmNT(new Float32Array(4).fill(1), new Float32Array(6).fill(2), 2, 3, 2, out)).toBe(out);
    expect([...out]).toEqual([4, 4, 4, 4, 4, 4]);
    expect(() => jsMatMul.gemmNT(new Float32Array(3), new Float32Array(6), 2, 3, 2)).toThrow(/A has 3/);
  });

  it("transposes any shape", () => {
    const a = rand(37 * 70, rng);
    const t = transpose(a, 37, 70);
    for (let i = 0; i < 37; i++) for (let j = 0; j < 70; j++) expect(t[j * 37 + i]).toBe(a[i * 70 + j]);
  });
});

/** Bit-packed masks from a boolean function. */
function masks(n: number, f: number, on: (t: number, i: number) => boolean): Uint8Array {
  const s = maskStride(f);
  const m = new Uint8Array(n * s);
  for (let t = 0; t < n; t++) for (let i = 0; i < f; i++) if (on(t, i)) m[t * s + (i >> 3)]! |= 1 << (i & 7);
  return m;
}

describe("metrics", () => {
  it("confusion counts and quality", () => {
    // 2 tokens × 3 neurons; fired: (0,0), (0,2), (1,1)
    const m = masks(2, 3, (t, i) => (t === 0 && i !== 1) || (t === 1 && i === 1));
    const z = Float32Array.of(1, 1, -1, 0.5, -2, 3);
    const c = confusionAt(z, m, 2, 3, 0);
    expect(c).toEqual({ tp: 1, fp: 3, fn: 2, tokens: 2, nFf: 3 });
    const q = quality(c);
    expect(q.recall).toBeCloseTo(1 / 3);
    expect(q.precision).toBeCloseTo(1 / 4);
    expect(q.predictedFraction).toBeCloseTo(4 / 6);
    expect(q.trueFraction).toBeCloseTo(0.5);
  });

  it("thresholdForRecall gives the largest threshold reaching the target", () => {
    const rng = new Rng(3);
    const n = 50;
    const f = 40;
    const m = masks(n, f, () => rng.next() < 0.2);
    const z = rand(n * f, rng);
    for (const target of [0.5, 0.8, 0.95, 1]) {
      const t = thresholdForRecall(z, m, n, f, target);
      expect(quality(confusionAt(z, m, n, f, t)).recall).toBeGreaterThanOrEqual(target);
      // any larger logit value as threshold misses the target
      const above = [...z].filter((v) => v > t).sort((a, b) => a - b)[0];
      if (above !== undefined) expect(quality(confusionAt(z, m, n, f, above)).recall).toBeLessThan(target);
    }
  });

  it("the hot list takes the most frequent training neurons", () => {
    const counts = Int32Array.of(5, 100, 7, 50);
    const m = masks(4, 4, (t, i) => i === 1 || (i === 0 && t === 0));
    const c = hotListConfusion(counts, 2, m, 4); // hot = {1, 3}
    expect(c).toEqual({ tp: 4, fp: 4, fn: 1, tokens: 4, nFf: 4 });
  });
});

describe("splitText", () => {
  it("cuts at the line break nearest to the requested fraction", () => {
    const text = Array.from({ length: 100 }, (_, i) => `line ${i} of the text`).join("\n");
    const s = splitText(text, 0.2);
    expect(s.train + s.heldOut).toBe(text);
    expect(s.heldOut.startsWith("line ")).toBe(true);
    expect(s.train.endsWith("\n")).toBe(true);
    expect(Math.abs(s.heldOut.length / text.length - 0.2)).toBeLessThan(0.02);
  });
  it("falls back to a space, then to the exact cut", () => {
    expect(splitText("aaaa bbbb cccc dddd eeee", 0.2).heldOut).toBe("eeee");
    expect(splitText("abcdefghij", 0.3).heldOut).toBe("hij");
    expect(() => splitText("abc", 1)).toThrow(/holdout/);
  });
});
