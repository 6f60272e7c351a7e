/**
 * The one dense product predictor training needs, `C = A·Bᵀ` on row-major float32 matrices, with two
 * implementations: on a loaded core {@link Backend} (its `mul_mat` kernel, one graph per product — the
 * native CPU backend is about 8× faster than plain JavaScript here) and in JavaScript (4×4 register
 * tiles; used when no backend is given, and as the test oracle).
 */
import { type Backend, Graph } from "@powerinfer/core";
import { transposeBlocked } from "@powerinfer/engine";

/** Dense products on float32 row-major matrices. */
export interface MatMul {
  /** A short name for reports ("js", "backend cpu"). */
  readonly name: string;
  /**
   * `C[M×N] = A[M×K] · B[N×K]ᵀ`: c[i·N + j] = Σ_k a[i·K + k]·b[j·K + k]. Both operands have the
   * contracted dimension contiguous (rows of length K). Writes into `c` when given (length M·N).
   */
  gemmNT(a: Float32Array, b: Float32Array, m: number, n: number, k: number, c?: Float32Array): Float32Array;
}

function check(a: Float32Array, b: Float32Array, m: number, n: number, k: number, c?: Float32Array): Float32Array {
  if (a.length < m * k) throw new RangeError(`gemmNT: A has ${a.length} elements, needs ${m}×${k}`);
  if (b.length < n * k) throw new RangeError(`gemmNT: B has ${b.length} elements, needs ${n}×${k}`);
  if (c && c.length !== m * n) throw new RangeError(`gemmNT: C has ${c.length} elements, needs ${m}×${n}`);
  return c ?? new Float32Array(m * n);
}

/**
 * `C = A·Bᵀ` in JavaScript: 4×4 tiles of C held in 16 local accumulators, so each loaded element of A
 * and B is used four times (about 1.4 GFLOP/s on one core). Accumulates in float64 registers.
 */
export const jsMatMul: MatMul = {
  name: "js",
  gemmNT(a, b, m, n, k, c) {
    const out = check(a, b, m, n, k, c);
    const m4 = m - (m % 4);
    const n4 = n - (n % 4);
    for (let i = 0; i < m4; i += 4) {
      const a0 = i * k;
      const a1 = a0 + k;
      const a2 = a1 + k;
      const a3 = a2 + k;
      for (let j = 0; j < n4; j += 4) {
        const b0 = j * k;
        const b1 = b0 + k;
        const b2 = b1 + k;
        const b3 = b2 + k;
        let c00 = 0;
        let c01 = 0;
        let c02 = 0;
        let c03 = 0;
        let c10 = 0;
        let c11 = 0;
        let c12 = 0;
        let c13 = 0;
        let c20 = 0;
        let c21 = 0;
        let c22 = 0;
        let c23 = 0;
        let c30 = 0;
        let c31 = 0;
        let c32 = 0;
        let c33 = 0;
        for (let p = 0; p < k; p++) {
          const x0 = a[a0 + p]!;
          const x1 = a[a1 + p]!;
          const x2 = a[a2 + p]!;
          const x3 = a[a3 + p]!;
          const y0 = b[b0 + p]!;
          const y1 = b[b1 + p]!;
          const y2 = b[b2 + p]!;
          const y3 = b[b3 + p]!;
          c00 += x0 * y0;
          c01 += x0 * y1;
          c02 += x0 * y2;
          c03 += x0 * y3;
          c10 += x1 * y0;
          c11 += x1 * y1;
          c12 += x1 * y2;
          c13 += x1 * y3;
          c20 += x2 * y0;
          c21 += x2 * y1;
          c22 += x2 * y2;
          c23 += x2 * y3;
          c30 += x3 * y0;
          c31 += x3 * y1;
          c32 += x3 * y2;
          c33 += x3 * y3;
        }
        let o = i * n + j;
        out[o] = c00;
        out[o + 1] = c01;
        out[o + 2] = c02;
        out[o + 3] = c03;
        o += n;
        out[o] = c10;
        out[o + 1] = c11;
        out[o + 2] = c12;
        out[o + 3] = c13;
        o += n;
        out[o] = c20;
        out[o + 1] = c21;
        out[o + 2] = c22;
        out[o + 3] = c23;
        o += n;
        out[o] = c30;
        out[o + 1] = c31;
        out[o + 2] = c32;
        out[o + 3] = c33;
      }
    }
    // edges: rows m4.. (all columns) and columns n4.. (rows < m4)
    const dot = (i: number, j: number) => {
      let s = 0;
      const ai = i * k;
      const bj = j * k;
      for (let p = 0; p < k; p++) s += a[ai + p]! * b[bj + p]!;
      out[i * n + j] = s;
    };
    for (let i = m4; i < m; i++) for (let j = 0; j < n; j++) dot(i, j);
    for (let i = 0; i < m4; i++) for (let j = n4; j < n; j++) dot(i, j);
    return out;
  },
};

/**
 * `C = A·Bᵀ` on a backend's `mul_mat` (ggml convention: W ne {K, N} times x ne {K, M} gives ne {N, M},
 * which is C row-major). F32 operands are not rounded by the kernel.
 */
export function backendMatMul(backend: Backend): MatMul {
  return {
    name: `backend ${backend.name}`,
    gemmNT(a, b, m, n, k, c) {
      const out = check(a, b, m, n, k, c);
      const g = new Graph();
      const w = g.input("f32", [k, n], b.length === n * k ? b : b.subarray(0, n * k));
      const x = g.input("f32", [k, m], a.length === m * k ? a : a.subarray(0, m * k));
      g.output(g.mulMat(w, x), out);
      backend.compute(g);
      return out;
    },
  };
}

/** Row-major transpose: `out[j·rows + i] = src[i·cols + j]`, in 32×32 blocks (engine's transposeBlocked). */
export function transpose(src: Float32Array, rows: number, cols: number, out?: Float32Array): Float32Array {
  const dst = out ?? new Float32Array(rows * cols);
  transposeBlocked(src, dst, 0, rows, cols);
  return dst;
}
