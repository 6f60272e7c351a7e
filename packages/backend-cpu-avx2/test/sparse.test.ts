/**
 * The sparse ops (`mul_mat_sparse`, `axpy_sparse`) for every weight dtype, at 1 thread, 2 threads and
 * on the scalar path: all-active equals dense, random masks equal the float64 reference of the masked
 * formula, row counters prove that inactive rows are not read, axpy_sparse is deterministic.
 */
import { type Backend, DTYPE_LAYOUT, type DType, Graph, type TensorHandle } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import {
  backend,
  CONFIGS,
  dotTol,
  oddK,
  Rng,
  randomWeights,
  refDot,
  roundActivation,
  usable,
  WEIGHT_DTYPES,
  type Weights,
} from "./helpers.js";

interface SparseCase {
  logits?: Float32Array;
  rows?: Int32Array;
  threshold: number;
  nOut: number;
  T: number;
}

function run(
  b: Backend,
  op: "mul_mat_sparse" | "axpy_sparse",
  wt: TensorHandle,
  x: Float32Array,
  c: SparseCase,
): { y: Float32Array; rowsRead: number } {
  const g = new Graph();
  const w = g.handle(wt);
  const xi = g.input("f32", [op === "mul_mat_sparse" ? wt.ne[0]! : c.nOut, c.T], x);
  const opts = {
    logits: c.logits ? g.input("f32", [c.nOut, c.T], c.logits) : undefined,
    rows: c.rows ? g.input("i32", [c.rows.length], c.rows) : undefined,
    threshold: c.threshold,
    nOut: c.nOut,
  };
  const y = g.output(op === "mul_mat_sparse" ? g.mulMatSparse(w, xi, opts) : g.axpySparse(w, xi, opts));
  const r = b.compute(g);
  return { y, rowsRead: r.rowsRead[0]! };
}

/** Active (neuron, token) pairs and, per neuron, its weight row, following the interface's rules. */
function activity(
  c: SparseCase,
  mRows: number,
): { active: (i: number, t: number) => boolean; rowOf: Map<number, number> } {
  const rowOf = new Map<number, number>();
  if (c.rows) {
    const compact = mRows === c.rows.length;
    c.rows.forEach((id, j) => {
      if (!rowOf.has(id)) rowOf.set(id, compact ? j : id);
    });
  } else {
    for (let i = 0; i < c.nOut; i++) rowOf.set(i, i);
  }
  const active = (i: number, t: number) => rowOf.has(i) && (!c.logits || c.logits[t * c.nOut + i]! >= c.threshold);
  return { active, rowOf };
}

function mulMatSparseRef(dtype: DType, w: Weights, k: number, x: Float32Array, c: SparseCase, mRows: number) {
  const { active, rowOf } = activity(c, mRows);
  const value = new Float64Array(c.nOut * c.T);
  const tol = new Float64Array(c.nOut * c.T);
  let pairs = 0;
  for (let t = 0; t < c.T; t++) {
    const xr = roundActivation(dtype, x, t * k, k);
    for (let i = 0; i < c.nOut; i++) {
      if (!active(i, t)) continue;
      const d = refDot(dtype, w, rowOf.get(i)!, k, xr);
      value[t * c.nOut + i] = d.value;
      tol[t * c.nOut + i] = dotTol(k, d.scale);
      pairs++;
    }
  }
  return { value, tol, pairs, active };
}

function axpySparseRef(w: Weights, e: number, a: Float32Array, c: SparseCase, mRows: number) {
  const { active, rowOf } = activity(c, mRows);
  const value = new Float64Array(e * c.T);
  const scale = new Float64Array(e * c.T);
  let pairs = 0;
  for (let t = 0; t < c.T; t++) {
    for (let i = 0; i < c.nOut; i++) {
      if (!active(i, t)) continue;
      pairs++;
      const r = rowOf.get(i)!;
      const av = a[t * c.nOut + i]!;
      for (let j = 0; j < e; j++) {
        value[t * e + j] += av * w.values[r * e + j]!;
        scale[t * e + j] += Math.abs(av) * w.magnitude[r * e + j]!;
      }
    }
  }
  return { value, scale, pairs };
}

function expectClose(actual: Float32Array, expected: Float64Array, tol: (i: number) => number, what: string): void {
  let worst = 0;
  let at = -1;
  for (let i = 0; i < expected.length; i++) {
    const r = Math.abs(actual[i]! - expected[i]!) / tol(i);
    if (!(r <= worst)) {
      worst = r;
      at = i;
    }
  }
  expect(worst, `${what}: element ${at} = ${actual[at]}, expected ${expected[at]}`).toBeLessThanOrEqual(1);
}

describe.skipIf(!usable)("sparse ops", () => {
  for (const cfg of CONFIGS) {
    describe(cfg.name, () => {
      for (const dtype of WEIGHT_DTYPES) {
        it(`${dtype}: all-active equals dense; random masks equal the masked reference`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(500 + WEIGHT_DTYPES.indexOf(dtype));
          const k = oddK(dtype, 1); // row length (n_embd)
          const nOut = 37; // neurons (odd)
          const w = randomWeights(dtype, k, nOut, rng);
          const wt = b.createTensor(dtype, [k, nOut], w.bytes);
          for (const T of [1, 5]) {
            const x = rng.f32(k * T, -2, 2);
            const a = rng.f32(nOut * T, -2, 2);
            // all active: mul_mat_sparse equals mul_mat bit for bit (every output in the dtype's dot arithmetic,
            // whether the batch's busy rows go through tiles or row by row)
            const g = new Graph();
            const dense = g.output(g.mulMat(g.handle(wt), g.input("f32", [k, T], x)));
            b.compute(g);
            const all = run(b, "mul_mat_sparse", wt, x, { threshold: 0, nOut, T });
            expect(all.y).toEqual(dense);
            expect(all.rowsRead).toBe(nOut * T);
            const allLogits = run(b, "mul_mat_sparse", wt, x, {
              logits: new Float32Array(nOut * T).fill(1),
              threshold: 0.5,
              nOut,
              T,
            });
            expect(allLogits.y).toEqual(all.y);
            // all active axpy_sparse equals the dense product with the transposed (dequantized) matrix
            const down = new Float32Array(nOut * k);
            for (let i = 0; i < nOut; i++) for (let j = 0; j < k; j++) down[j * nOut + i] = w.values[i * k + j]!;
            const downT = b.createTensor("f32", [nOut, k], new Uint8Array(down.buffer));
            const g2 = new Graph();
            const denseAxpy = g2.output(g2.mulMat(g2.handle(downT), g2.input("f32", [nOut, T], a)));
            b.compute(g2);
            b.freeTensor(downT);
            const ax = run(b, "axpy_sparse", wt, a, { threshold: 0, nOut, T });
            expect(ax.rowsRead).toBe(nOut * T);
            const axRef = axpySparseRef(w, k, a, { threshold: 0, nOut, T }, nOut);
            for (let i = 0; i < denseAxpy.length; i++) {
              expect(Math.abs(ax.y[i]! - denseAxpy[i]!)).toBeLessThanOrEqual(1e-5 * axRef.scale[i]! + 1e-30);
            }

            // random masks: logits gate, a subset of rows (full W), and a compact W
            const logits = rng.f32(nOut * T, -1, 1);
            logits[3] = Number.NaN; // never active
            const subset = rng.sample(nOut, 19);
            const cases: { name: string; c: SparseCase; w: Weights; m: number }[] = [
              { name: "logits", c: { logits, threshold: 0.1, nOut, T }, w, m: nOut },
              {
                name: "rows",
                c: { rows: Int32Array.from([...subset, subset[0]!]), threshold: 0, nOut, T },
                w,
                m: nOut,
              },
              { name: "rows+logits", c: { logits, rows: subset, threshold: -0.2, nOut, T }, w, m: nOut },
            ];
            // compact: W row j holds neuron subset[j]
            const compactW = randomWeights(dtype, k, subset.length, rng);
            cases.push({
              name: "compact+logits",
              c: { logits, rows: subset, threshold: 0, nOut, T },
              w: compactW,
              m: subset.length,
            });
            for (const { name, c, w: cw, m } of cases) {
              const h = cw === w ? wt : b.createTensor(dtype, [k, m], cw.bytes);
              const ms = run(b, "mul_mat_sparse", h, x, c);
              const ref = mulMatSparseRef(dtype, cw, k, x, c, m);
              expect(ms.rowsRead, `${name} rowsRead`).toBe(ref.pairs);
              for (let t = 0; t < T; t++) {
                for (let i = 0; i < nOut; i++) {
                  if (!ref.active(i, t))
                    expect(Object.is(ms.y[t * nOut + i], 0), `${name}: inactive ${i},${t} is exactly 0`).toBe(true);
                }
              }
              expectClose(ms.y, ref.value, (i) => ref.tol[i]! + 1e-30, `mul_mat_sparse ${name} T=${T}`);
              // a column's outputs do not depend on the rest of the batch: each column alone (T = 1) gives the same bits
              for (let t = 0; T > 1 && t < T; t++) {
                const one = run(b, "mul_mat_sparse", h, x.subarray(t * k, (t + 1) * k), {
                  ...c,
                  logits: c.logits?.subarray(t * nOut, (t + 1) * nOut),
                  T: 1,
                });
                expect(one.y, `${name}: column ${t} alone`).toEqual(ms.y.subarray(t * nOut, (t + 1) * nOut));
              }
              const as = run(b, "axpy_sparse", h, a, c);
              const aref = axpySparseRef(cw, k, a, c, m);
              expect(as.rowsRead, `${name} axpy rowsRead`).toBe(aref.pairs);
              expectClose(as.y, aref.value, (i) => 1e-5 * aref.scale[i]! + 1e-30, `axpy_sparse ${name} T=${T}`);
              if (h !== wt) b.freeTensor(h);
            }
          }
          b.freeTensor(wt);
        });
      }

      it("decode over many active rows (several row groups per work chunk, each fetching the next): mul_mat_sparse equals dense mul_mat bit for bit at the active rows, axpy_sparse the masked reference", async () => {
        const b = await backend(cfg.opts);
        const rng = new Rng(4242);
        for (const dtype of WEIGHT_DTYPES) {
          const k = oddK(dtype, 1);
          const nOut = 1200;
          const w = randomWeights(dtype, k, nOut, rng);
          const wt = b.createTensor(dtype, [k, nOut], w.bytes);
          const x = rng.f32(k, -2, 2);
          const a = rng.f32(nOut, -2, 2);
          const g = new Graph();
          const dense = g.output(g.mulMat(g.handle(wt), g.input("f32", [k, 1], x)));
          b.compute(g);
          const logits = rng.f32(nOut, -1, 1); // about 55 % active
          const c: SparseCase = { logits, threshold: -0.1, nOut, T: 1 };
          const ms = run(b, "mul_mat_sparse", wt, x, c);
          let active = 0;
          for (let i = 0; i < nOut; i++) {
            if (logits[i]! >= -0.1) {
              active++;
              expect(ms.y[i], `${dtype} row ${i}`).toBe(dense[i]);
            } else {
              expect(Object.is(ms.y[i], 0), `${dtype} inactive ${i} is exactly 0`).toBe(true);
            }
          }
          expect(ms.rowsRead).toBe(active);
          const as = run(b, "axpy_sparse", wt, a, c);
          const aref = axpySparseRef(w, k, a, c, nOut);
          expect(as.rowsRead).toBe(aref.pairs);
          expectClose(as.y, aref.value, (i) => 1e-5 * aref.scale[i]! + 1e-30, `${dtype} axpy_sparse`);
          b.freeTensor(wt);
        }
      });

      for (const op of ["mul_mat_sparse", "axpy_sparse"] as const) {
        it(`${op}: at 10 % active the row counters show ≤ 12 % of rows read`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(77);
          const k = 256;
          const nOut = 1000;
          const T = 3;
          const w = randomWeights("q4_0", k, nOut, rng);
          const wt = b.createTensor("q4_0", [k, nOut], w.bytes);
          const x = rng.f32((op === "mul_mat_sparse" ? k : nOut) * T);
          // logits gate: each token has its own random 10 % of neurons
          const logits = new Float32Array(nOut * T).fill(-1);
          for (let t = 0; t < T; t++) for (const i of rng.sample(nOut, nOut / 10)) logits[t * nOut + i] = 1;
          const byLogits = run(b, op, wt, x, { logits, threshold: 0, nOut, T });
          expect(byLogits.rowsRead).toBe((nOut / 10) * T);
          expect(byLogits.rowsRead).toBeLessThanOrEqual(0.12 * nOut * T);
          // rows list of 10 % (a hot/cold bucket)
          const rows = rng.sample(nOut, nOut / 10);
          const byRows = run(b, op, wt, x, { rows, threshold: 0, nOut, T });
          expect(byRows.rowsRead).toBeLessThanOrEqual(0.12 * nOut * T);
          b.freeTensor(wt);
        });
      }
    });
  }

  it("axpy_sparse with a batch (rows a multiple of 64 long: the register-tiled path, two passes of up to 512 tokens): at 1 thread a column alone gives the same bits; 2 threads and the scalar table match the float64 reference", async () => {
    const rng = new Rng(321);
    const T = 520;
    for (const dtype of WEIGHT_DTYPES) {
      const e = DTYPE_LAYOUT[dtype].blockSize === 256 ? 512 : 192;
      const nOut = 45;
      const w = randomWeights(dtype, e, nOut, rng);
      const a = rng.f32(nOut * T, -2, 2);
      const logits = rng.f32(nOut * T, -1, 1);
      for (let t = 0; t < T; t++) logits[t * nOut + 7] = 1; // a busy row
      for (let i = 0; i < nOut; i++) logits[9 * nOut + i] = -1; // a token with no active row
      const cases: SparseCase[] = [
        { logits, threshold: 0.2, nOut, T },
        { logits, rows: Int32Array.from([40, 3, 7, 12, 3, 30]), threshold: -0.5, nOut, T },
      ];
      for (const c of cases) {
        const ref = axpySparseRef(w, e, a, c, nOut);
        for (const opts of [{ threads: 1 }, { threads: 2 }, { threads: 2, forceScalar: true }]) {
          const b = await backend(opts);
          const wt = b.createTensor(dtype, [e, nOut], w.bytes);
          const r = run(b, "axpy_sparse", wt, a, c);
          expect(r.rowsRead, `${dtype} rowsRead`).toBe(ref.pairs);
          expectClose(
            r.y,
            ref.value,
            (i) => 1e-5 * ref.scale[i]! + 1e-30,
            `axpy_sparse ${dtype} T=${T} ${JSON.stringify(opts)}`,
          );
          for (const t of opts.threads === 1 ? [0, 1, 9, 100, 511, 512, 519] : []) {
            const one = run(b, "axpy_sparse", wt, a.subarray(t * nOut, (t + 1) * nOut), {
              ...c,
              logits: c.logits.subarray(t * nOut, (t + 1) * nOut),
              T: 1,
            });
            expect(one.y, `${dtype}: column ${t} alone`).toEqual(r.y.subarray(t * e, (t + 1) * e));
          }
          b.freeTensor(wt);
        }
      }
    }
  });

  it("axpy_sparse is bit-identical across runs, and 1 vs 2 threads agree within summation-order error", async () => {
    const rng = new Rng(99);
    for (const dtype of ["f32", "f16", "q4_0", "q6_K"] as DType[]) {
      const e = oddK(dtype, 2);
      const nOut = 301;
      const T = 2;
      const w = randomWeights(dtype, e, nOut, rng);
      const a = rng.f32(nOut * T, -2, 2);
      const logits = rng.f32(nOut * T);
      const c: SparseCase = { logits, threshold: -0.5, nOut, T };
      const out: Float32Array[] = [];
      for (const threads of [2, 2, 2, 1]) {
        const b = await backend({ threads });
        const wt = b.createTensor(dtype, [e, nOut], w.bytes);
        out.push(run(b, "axpy_sparse", wt, a, c).y);
        b.freeTensor(wt);
      }
      expect(out[1]).toEqual(out[0]);
      expect(out[2]).toEqual(out[0]);
      const ref = axpySparseRef(w, e, a, c, nOut);
      for (let i = 0; i < out[0]!.length; i++) {
        expect(Math.abs(out[3]![i]! - out[0]![i]!)).toBeLessThanOrEqual(2 * nOut * 2 ** -24 * ref.scale[i]! + 1e-30);
      }
    }
  });
});
