/**
 * The backend conformance kit: {@link runConformance} runs every op a backend claims, for every dtype
 * it claims, on seeded random inputs of many shapes, and compares the results with the float64
 * reference ({@link referenceCompute}) under tolerances derived from worst-case rounding bounds
 * (see `tolerance.ts`).
 *
 * What each case checks:
 * - outputs are poisoned with NaN before compute, so every element must be written;
 * - every element is within its tolerance of the reference (NaN/Inf fail);
 * - sparse ops write exactly 0 outside the active set and report, in `rowsRead`, exactly the number of
 *   (active neuron, token) pairs;
 * - `cpy` converts into the requested rows of its destination and leaves the other rows byte-identical;
 * - the first case of every (op, dtype) pair is computed with `computeAsync`, the rest with `compute`;
 * - routed-expert ops (optional, see `EXPERT_OPS`): every slot reads its own expert's matrix, the sparse
 *   forms only the active neurons of the selected experts (exact zeros elsewhere, exact row counts);
 *   `top_k`, whose output is I32, is checked through `mul_mat_id` with F32 weights that return each
 *   selected index (so a backend claiming `top_k` must claim `mul_mat_id` for f32).
 *
 * Which dtype list the kit passes to `supportsOp` (the weight/source dtype first, per the interface):
 * - `get_rows`, `mul_mat`, `mul_mat_sparse`, `axpy_sparse`, `mul_mat_id`, `mul_mat_id_sparse`,
 *   `axpy_id_sparse`: `[weightDtype]` for every dtype but i32;
 * - `attention`: `[cacheDtype]`, f32 or f16 (K and V caches share it);
 * - `cpy`: `[destinationDtype]`, f32, f16 or bf16 (the source is always an F32 tensor);
 * - every other op: `["f32"]`.
 */
import { Graph, OP_CODES, type TensorId } from "../backend/graph.js";
import type { Backend, ComputeResult, DType, OpName, TensorHandle } from "../backend/types.js";
import { DTYPE_LAYOUT, DTYPES } from "../backend/types.js";
import { halfToNumber } from "./float.js";
import { dequantizeReference, encodeFloatTensor, ConformanceRng, randomWeightBytes } from "./quant.js";
import { refAttentionWeights, type ReferenceResult, referenceCompute, refRopePair, refRopeTheta } from "./reference.js";
import { activationErrors, dotTolerance, exactActivations, SLACK, TINY, U, U_BF16, U_F16 } from "./tolerance.js";

/** Every op of the interface, in wire-code order. */
export const CONFORMANCE_OPS: readonly OpName[] = (Object.keys(OP_CODES) as OpName[]).sort(
  (a, b) => OP_CODES[a] - OP_CODES[b],
);
/** Dtypes a weight may have (every dtype but i32). */
export const WEIGHT_DTYPES: readonly DType[] = DTYPES.filter((d) => d !== "i32");

/** The dtypes the kit asks `supportsOp(op, [dtype])` about for each op (see the module comment). */
export function conformanceDtypes(op: OpName): readonly DType[] {
  switch (op) {
    case "get_rows":
    case "mul_mat":
    case "mul_mat_sparse":
    case "axpy_sparse":
    case "mul_mat_id":
    case "mul_mat_id_sparse":
    case "axpy_id_sparse":
      return WEIGHT_DTYPES;
    case "attention":
    case "attention_swa":
      return ["f32", "f16"];
    case "cpy":
      return ["f32", "f16", "bf16"];
    default:
      return ["f32"];
  }
}

/** Options of {@link runConformance}. Every field is optional. */
export interface ConformanceOptions {
  /** Seed of the random inputs. Default 0x5eed. The same seed gives the same inputs for a pair whatever the filters. */
  seed?: number;
  /** Only these ops. Default: all of {@link CONFORMANCE_OPS}. */
  ops?: readonly OpName[];
  /** Only these dtypes (as in {@link conformanceDtypes}). Default: all. */
  dtypes?: readonly DType[];
  /** Receives one line per (op, dtype) pair and per failed case. Default: silent. */
  log?: (line: string) => void;
  /** Failures recorded per (op, dtype) pair; further failing cases are counted, not recorded. Default 3. */
  maxFailuresPerPair?: number;
}

/** An op and the dtype it was asked about. */
export interface ConformancePair {
  op: OpName;
  dtype: DType;
}

/** A case that failed. */
export interface ConformanceFailure extends ConformancePair {
  /** The case, e.g. "W[96,7] x[96,3]". */
  shape: string;
  /** Absolute error at the worst element (largest error/tolerance ratio); Infinity for NaN/unwritten. */
  maxErr: number;
  /** The tolerance at that element. */
  tol: number;
  message: string;
}

/** Result of {@link runConformance}. */
export interface ConformanceReport {
  backend: string;
  seed: number;
  /** Every (op, dtype) pair the backend claims (among those asked). */
  claimed: ConformancePair[];
  /** Claimed pairs whose every case passed. */
  passed: ConformancePair[];
  /** Failed cases (at most `maxFailuresPerPair` per pair). */
  failed: ConformanceFailure[];
  /** Cases run. */
  cases: number;
  /** True when every claimed pair passed. */
  ok: boolean;
}

/** One case's state: the tensors it created, the bytes the reference reads, the worst comparison. */
class CaseEnv {
  readonly handles = new Map<number, Uint8Array>();
  readonly created: TensorHandle[] = [];
  maxErr = 0;
  tol = 0;
  message: string | undefined;

  constructor(
    readonly backend: Backend,
    readonly useAsync: boolean,
  ) {}

  /** A backend tensor filled with `bytes`; the reference keeps its own copy. */
  tensor(dtype: DType, ne: readonly number[], bytes: Uint8Array): TensorHandle {
    const h = this.backend.createTensor(dtype, ne, bytes);
    this.created.push(h);
    this.handles.set(h.id, bytes.slice());
    return h;
  }

  /** Marks `id` as an output with a NaN-filled array. */
  poisoned(g: Graph, id: TensorId): Float32Array {
    const n = g.shape(id).reduce((a, b) => a * b, 1);
    return g.output(id, new Float32Array(n).fill(Number.NaN));
  }

  async compute(g: Graph): Promise<ComputeResult> {
    return this.useAsync ? await this.backend.computeAsync(g) : this.backend.compute(g);
  }

  reference(g: Graph): ReferenceResult {
    return referenceCompute(g, this.handles);
  }

  /** Records a failure (the first one of the case is kept). */
  fail(message: string, maxErr = Number.POSITIVE_INFINITY, tol = 0): void {
    if (this.message !== undefined) return;
    this.message = message;
    this.maxErr = maxErr;
    this.tol = tol;
  }

  /**
   * Compares `actual` with `ref` elementwise under `tol` (an array, or a function of the index) and
   * records a failure at the worst element (largest error/tolerance ratio). `zero[i]` marks elements
   * that must be exactly 0 (sparse ops' inactive outputs).
   */
  compare(
    label: string,
    actual: ArrayLike<number>,
    ref: ArrayLike<number>,
    tol: ArrayLike<number> | ((i: number) => number),
    ne0: number,
    zero?: Uint8Array,
  ): void {
    const at = (i: number) => `${label}[${i % ne0}, ${Math.floor(i / ne0)}]`;
    let nan = -1;
    let nanCount = 0;
    let nonzero = -1;
    let worst = -1;
    let worstRatio = -1;
    let bad = 0;
    for (let i = 0; i < ref.length; i++) {
      const a = actual[i]!;
      if (!Number.isFinite(a)) {
        if (nan < 0) nan = i;
        nanCount++;
        continue;
      }
      const err = Math.abs(a - ref[i]!);
      if (zero?.[i]) {
        if (a !== 0 && nonzero < 0) nonzero = i;
        continue;
      }
      const tl = typeof tol === "function" ? tol(i) : tol[i]!;
      const ratio = tl > 0 ? err / tl : err > 0 ? Number.POSITIVE_INFINITY : 0;
      if (err > tl) bad++;
      if (ratio > worstRatio) {
        worstRatio = ratio;
        worst = i;
      }
    }
    if (nan >= 0) {
      const what = Number.isNaN(actual[nan]!)
        ? "NaN: never written (outputs are poisoned with NaN) or computed as NaN"
        : `${actual[nan]}`;
      this.fail(`${at(nan)} is ${what}; reference ${ref[nan]} (${nanCount} of ${ref.length} elements not finite)`);
      return;
    }
    if (nonzero >= 0) {
      this.fail(
        `${at(nonzero)} = ${actual[nonzero]}, but that neuron is inactive: the output must be exactly 0`,
        Math.abs(actual[nonzero]!),
        0,
      );
      return;
    }
    if (worst < 0) return;
    if (worstRatio > 1) {
      const tl = typeof tol === "function" ? tol(worst) : tol[worst]!;
      const err = Math.abs(actual[worst]! - ref[worst]!);
      this.fail(
        `${at(worst)} = ${actual[worst]}, reference ${ref[worst]}: |error| ${err.toExponential(3)} > tolerance ${tl.toExponential(3)} (${bad} of ${ref.length} elements out of tolerance)`,
        err,
        tl,
      );
    }
  }

  free(): void {
    for (const h of this.created) {
      try {
        this.backend.freeTensor(h);
      } catch {
        // a backend that cannot free a tensor fails nothing here; its own tests cover freeing
      }
    }
  }
}

interface CaseDef {
  shape: string;
  run(env: CaseEnv): Promise<void>;
}

/** Row lengths for a weight dtype: odd sizes for floats, odd block counts for quantized types. */
function rowLengths(dtype: DType): number[] {
  const bs = DTYPE_LAYOUT[dtype].blockSize;
  if (bs === 1) return [1, 7, 67, 130, 300];
  if (bs === 32) return [32, 96, 160, 480];
  return [256, 512, 768];
}

/**
 * mul_mat shapes [K, N, T, exact] per block size; `exact` cases use {@link exactActivations} (tight
 * tolerance), the others uniform random activations (tolerance admits activation rounding).
 */
function mulMatShapes(dtype: DType): [number, number, number, boolean][] {
  const bs = DTYPE_LAYOUT[dtype].blockSize;
  if (bs === 1) {
    return [
      [1, 3, 2, false],
      [7, 5, 1, true],
      [67, 19, 3, false],
      [130, 4, 1, true],
      [300, 33, 5, false],
      [67, 6, 17, true],
    ];
  }
  if (bs === 32) {
    return [
      [32, 1, 1, true],
      [96, 7, 3, false],
      [160, 19, 1, true],
      [480, 9, 2, false],
      [96, 6, 17, true],
    ];
  }
  return [
    [256, 3, 1, true],
    [512, 7, 3, false],
    [768, 5, 2, true],
    [256, 4, 17, false],
  ];
}

/** Random activations: uniform in [−1, 1), or exactly representable ones (see {@link exactActivations}). */
function activations(rng: ConformanceRng, k: number, t: number, exact: boolean, nonzero = false): Float32Array {
  if (exact) return exactActivations(k, t, () => rng.next(), nonzero);
  if (!nonzero) return rng.f32(k * t);
  return Float32Array.from({ length: k * t }, () => (rng.next() < 0.5 ? -1 : 1) * rng.uniform(0.05, 1));
}

/** Tolerance of y[n, t] = Σ_k W[k, n]·x[k, t] for every output (see tolerance.ts). */
function matTolerance(dtype: DType, mag: Float64Array, k: number, n: number, x: Float32Array, t: number): Float64Array {
  const tol = new Float64Array(n * t);
  for (let c = 0; c < t; c++) {
    const e = activationErrors(dtype, x, c * k, k);
    for (let r = 0; r < n; r++) tol[c * n + r] = dotTolerance(mag, r * k, 1, x, c * k, e, 0, k);
  }
  return tol;
}

function getRowsCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  return rowLengths(dtype)
    .slice(0, 4)
    .map((k, i) => {
      const r = [3, 10, 1, 6][i]!;
      const t = [1, 4, 2, 5][i]!;
      return {
        shape: `W[${k},${r}] ids[${t}]`,
        async run(env) {
          const wb = randomWeightBytes(dtype, k * r, rng);
          const h = env.tensor(dtype, [k, r], wb);
          const back = env.backend.readTensor(h);
          if (back.length !== wb.length || back.some((b, j) => b !== wb[j])) {
            env.fail("readTensor does not return the bytes given to createTensor");
            return;
          }
          const ids = Int32Array.from({ length: t }, () => rng.int(0, r - 1));
          const g = new Graph();
          const y = g.getRows(g.handle(h), g.input("i32", [t], ids));
          const out = env.poisoned(g, y);
          await env.compute(g);
          const ref = env.reference(g).values[y]!;
          const { magnitude } = dequantizeReference(dtype, wb, k * r);
          env.compare(
            "y",
            out,
            ref,
            (i) => SLACK * 4 * U * magnitude[ids[Math.floor(i / k)]! * k + (i % k)]! + TINY,
            k,
          );
        },
      };
    });
}

function mulMatCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  return mulMatShapes(dtype).map(([k, n, t, exact]) => ({
    shape: `W[${k},${n}] x[${k},${t}]${exact ? " exact x" : ""}`,
    async run(env) {
      const wb = randomWeightBytes(dtype, k * n, rng);
      const h = env.tensor(dtype, [k, n], wb);
      const x = activations(rng, k, t, exact);
      const g = new Graph();
      const y = g.mulMat(g.handle(h), g.input("f32", [k, t], x));
      const out = env.poisoned(g, y);
      await env.compute(g);
      const ref = env.reference(g).values[y]!;
      const { magnitude } = dequantizeReference(dtype, wb, k * n);
      env.compare("y", out, ref, matTolerance(dtype, magnitude, k, n, x, t), n);
    },
  }));
}

/** A sparse-op scenario: which gates are present and how many neurons are active. */
interface SparseVariant {
  name: string;
  t: number;
  logits: boolean;
  rows: "none" | "subset" | "compact";
  /** Fraction of logits ≥ threshold (0 = nothing active). */
  frac: number;
}

const SPARSE_VARIANTS: SparseVariant[] = [
  { name: "dense", t: 3, logits: false, rows: "none", frac: 1 },
  { name: "logits", t: 1, logits: true, rows: "none", frac: 0.3 },
  { name: "logits", t: 4, logits: true, rows: "none", frac: 0.3 },
  { name: "rows+logits", t: 2, logits: true, rows: "subset", frac: 0.5 },
  { name: "compact+logits", t: 3, logits: true, rows: "compact", frac: 0.5 },
  { name: "compact", t: 1, logits: false, rows: "compact", frac: 1 },
  { name: "none active", t: 2, logits: true, rows: "none", frac: 0 },
];

interface SparseSetup {
  logits: Float32Array | undefined;
  rows: Int32Array | undefined;
  threshold: number;
  /** Weight rows (= nOut, or rows.length when compact). */
  m: number;
  /** active[t·nOut + i] */
  active: Uint8Array;
  /** Weight row of neuron i. */
  rowOf: (i: number) => number;
}

function sparseSetup(v: SparseVariant, nOut: number, rng: ConformanceRng): SparseSetup {
  let logits: Float32Array | undefined;
  let threshold = 0;
  if (v.logits) {
    logits = rng.f32(nOut * v.t);
    threshold = v.frac === 0 ? 2 : Math.fround(1 - 2 * v.frac);
    for (let i = 0; i < logits.length; i++) if (rng.next() < 0.05) logits[i] = threshold; // ≥ is inclusive
  }
  let rows: Int32Array | undefined;
  if (v.rows !== "none") {
    const ids: number[] = [];
    for (let i = 0; i < nOut; i++) if (rng.next() < 0.5) ids.push(i);
    if (ids.length === 0 || ids.length === nOut) ids.splice(0, ids.length, 1, nOut - 2);
    rows = Int32Array.from(ids);
  }
  const m = v.rows === "compact" ? rows!.length : nOut;
  const pos = new Map<number, number>();
  if (v.rows === "compact") for (const [j, id] of rows!.entries()) pos.set(id, j);
  const inRows = rows ? new Set(rows) : null;
  const active = new Uint8Array(nOut * v.t);
  for (let c = 0; c < v.t; c++) {
    for (let i = 0; i < nOut; i++) {
      active[c * nOut + i] = Number((!inRows || inRows.has(i)) && (!logits || logits[c * nOut + i]! >= threshold));
    }
  }
  return { logits, rows, threshold, m, active, rowOf: (i) => (v.rows === "compact" ? pos.get(i)! : i) };
}

function sparseGraphOpts(g: Graph, s: SparseSetup, nOut: number, t: number) {
  return {
    logits: s.logits ? g.input("f32", [nOut, t], s.logits) : undefined,
    rows: s.rows ? g.input("i32", [s.rows.length], s.rows) : undefined,
    threshold: s.threshold,
    nOut,
  };
}

function checkRowsRead(env: CaseEnv, r: ComputeResult, node: number, expected: number, refCount: number): void {
  if (expected !== refCount)
    throw new Error(`conformance kit bug: expected ${expected} rows, reference read ${refCount}`);
  const got = r.rowsRead?.[node];
  if (got !== expected) {
    env.fail(`rowsRead[${node}] = ${got}, expected ${expected} (one per active neuron and token)`);
  }
}

function mulMatSparseCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  const ks = rowLengths(dtype);
  return SPARSE_VARIANTS.map((v, vi) => {
    const k = ks[(vi + 1) % ks.length]!;
    const nOut = [37, 70, 13][vi % 3]!;
    const exact = vi % 2 === 0;
    return {
      shape: `${v.name}: W[${k},${nOut}] x[${k},${v.t}]${exact ? " exact x" : ""}`,
      async run(env) {
        const s = sparseSetup(v, nOut, rng);
        const wb = randomWeightBytes(dtype, k * s.m, rng);
        const h = env.tensor(dtype, [k, s.m], wb);
        const x = activations(rng, k, v.t, exact);
        const g = new Graph();
        const y = g.mulMatSparse(g.handle(h), g.input("f32", [k, v.t], x), sparseGraphOpts(g, s, nOut, v.t));
        const out = env.poisoned(g, y);
        const res = await env.compute(g);
        const ref = env.reference(g);
        const { magnitude } = dequantizeReference(dtype, wb, k * s.m);
        const tol = new Float64Array(nOut * v.t);
        const zero = new Uint8Array(nOut * v.t);
        for (let c = 0; c < v.t; c++) {
          const e = activationErrors(dtype, x, c * k, k);
          for (let i = 0; i < nOut; i++) {
            if (!s.active[c * nOut + i]) zero[c * nOut + i] = 1;
            else tol[c * nOut + i] = dotTolerance(magnitude, s.rowOf(i) * k, 1, x, c * k, e, 0, k);
          }
        }
        env.compare("y", out, ref.values[y]!, tol, nOut, zero);
        const expected = s.active.reduce((a, b) => a + b, 0);
        checkRowsRead(env, res, g.nodes.length - 1, expected, ref.rowsRead[g.nodes.length - 1]!);
      },
    };
  });
}

function axpySparseCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  const es = rowLengths(dtype);
  return SPARSE_VARIANTS.map((v, vi) => {
    const e = es[(vi + 2) % es.length]!;
    const nOut = [41, 13, 66][vi % 3]!;
    const exact = vi % 2 === 1;
    return {
      shape: `${v.name}: Wt[${e},${nOut}] a[${nOut},${v.t}]${exact ? " exact a" : ""}`,
      async run(env) {
        const s = sparseSetup(v, nOut, rng);
        const wb = randomWeightBytes(dtype, e * s.m, rng);
        const h = env.tensor(dtype, [e, s.m], wb);
        // activations are never exactly 0, so that "active" is decided by the gates alone
        const a = activations(rng, nOut, v.t, exact, true);
        const g = new Graph();
        const y = g.axpySparse(g.handle(h), g.input("f32", [nOut, v.t], a), sparseGraphOpts(g, s, nOut, v.t));
        const out = env.poisoned(g, y);
        const res = await env.compute(g);
        const ref = env.reference(g);
        const { magnitude } = dequantizeReference(dtype, wb, e * s.m);
        const tol = new Float64Array(e * v.t);
        for (let c = 0; c < v.t; c++) {
          const err = activationErrors(dtype, a, c * nOut, nOut);
          const act: number[] = [];
          for (let i = 0; i < nOut; i++) if (s.active[c * nOut + i]) act.push(i);
          const av = act.map((i) => a[c * nOut + i]!);
          const ev = act.map((i) => err[i]!);
          const mv = new Float64Array(act.length);
          for (let j = 0; j < e; j++) {
            act.forEach((i, q) => {
              mv[q] = magnitude[s.rowOf(i) * e + j]!;
            });
            tol[c * e + j] = dotTolerance(mv, 0, 1, av, 0, ev, 0, act.length);
          }
        }
        env.compare("y", out, ref.values[y]!, tol, e);
        const expected = s.active.reduce((x, b) => x + b, 0);
        checkRowsRead(env, res, g.nodes.length - 1, expected, ref.rowsRead[g.nodes.length - 1]!);
      },
    };
  });
}

/** A case of an op with one F32 input [n, t] and one output of the same shape. */
function unaryCase(
  shape: [number, number],
  gen: (n: number) => Float32Array,
  build: (g: Graph, x: TensorId) => TensorId,
  tol: (x: Float32Array, ref: Float64Array, n: number) => ArrayLike<number> | ((i: number) => number),
): CaseDef {
  const [n, t] = shape;
  return {
    shape: `x[${n},${t}]`,
    async run(env) {
      const x = gen(n * t);
      const g = new Graph();
      const y = build(g, g.input("f32", [n, t], x));
      const out = env.poisoned(g, y);
      await env.compute(g);
      const ref = env.reference(g).values[y]!;
      env.compare("y", out, ref, tol(x, ref, n), g.shape(y)[0]);
    },
  };
}

const NORM_SHAPES: [number, number][] = [
  [1, 2],
  [7, 1],
  [64, 3],
  [515, 2],
];

function normCases(op: "rms_norm" | "norm", rng: ConformanceRng): CaseDef[] {
  return NORM_SHAPES.map((shape, i) => {
    const eps = [1e-5, 1e-6, 1e-5, 1e-6][i]!;
    const offset = op === "norm" ? [0, 3, 0.5, -2][i]! : 0;
    return unaryCase(
      shape,
      (m) => rng.f32(m, offset - 1, offset + 1),
      (g, x) => (op === "rms_norm" ? g.rmsNorm(x, eps) : g.norm(x, eps)),
      (x, ref, n) => {
        const tol = new Float64Array(x.length);
        for (let c = 0; c < x.length / n; c++) {
          let mean = 0;
          let absMean = 0;
          let sq = 0;
          for (let j = 0; j < n; j++) {
            const v = x[c * n + j]!;
            mean += v / n;
            absMean += Math.abs(v) / n;
            sq += (v * v) / n;
          }
          const varr = op === "norm" ? sq - mean * mean : sq;
          const r = 1 / Math.sqrt(Math.max(varr, 0) + eps);
          const g = (n + 8) * U;
          for (let j = 0; j < n; j++) {
            const yj = Math.abs(ref[c * n + j]!);
            if (op === "rms_norm") tol[c * n + j] = SLACK * yj * g + TINY;
            else {
              // mean error (n+1)u·mean|x|, centring, and a one- or two-pass variance (relative (n+8)u·E[x²]/var)
              const dmu = (n + 1) * U * absMean;
              const dev = Math.abs(x[c * n + j]! - mean);
              tol[c * n + j] = SLACK * (r * (dmu + g * dev) + yj * g * (sq + mean * mean) * r * r) + TINY;
            }
          }
        }
        return tol;
      },
    );
  });
}

interface RopeCase {
  headDim: number;
  nHead: number;
  nDims: number;
  mode: number;
  freqBase: number;
  freqScale: number;
  t: number;
  maxPos: number;
}

const ROPE_CASES: RopeCase[] = [
  { headDim: 8, nHead: 1, nDims: 8, mode: 0, freqBase: 10000, freqScale: 1, t: 1, maxPos: 10 },
  { headDim: 64, nHead: 3, nDims: 64, mode: 2, freqBase: 10000, freqScale: 1, t: 4, maxPos: 600 },
  { headDim: 64, nHead: 2, nDims: 32, mode: 0, freqBase: 500000, freqScale: 0.25, t: 2, maxPos: 300 },
  { headDim: 128, nHead: 2, nDims: 128, mode: 2, freqBase: 1e6, freqScale: 1, t: 3, maxPos: 4000 },
  { headDim: 80, nHead: 1, nDims: 20, mode: 2, freqBase: 10000, freqScale: 1, t: 2, maxPos: 100 },
];

function ropeCases(rng: ConformanceRng): CaseDef[] {
  return ROPE_CASES.map((p) => {
    const n = p.headDim * p.nHead;
    return {
      shape: `x[${n},${p.t}] head_dim ${p.headDim} n_dims ${p.nDims} ${p.mode === 2 ? "neox" : "normal"} base ${p.freqBase} scale ${p.freqScale}`,
      async run(env) {
        const x = rng.f32(n * p.t);
        const pos = Int32Array.from({ length: p.t }, () => rng.int(0, p.maxPos));
        const g = new Graph();
        const y = g.rope(g.input("f32", [n, p.t], x), g.input("i32", [p.t], pos), p);
        const out = env.poisoned(g, y);
        await env.compute(g);
        const ref = env.reference(g).values[y]!;
        const tol = new Float64Array(n * p.t); // dims ≥ n_dims pass through exactly
        for (let c = 0; c < p.t; c++) {
          for (let h = 0; h < p.nHead; h++) {
            const base = c * n + h * p.headDim;
            for (let i = 0; i < p.nDims / 2; i++) {
              // θ computed in float32 (e.g. by repeated multiplication): relative error ≤ (3i + 8)·u
              const dTheta = Math.abs(refRopeTheta(pos[c]!, i, p)) * (3 * i + 8) * U;
              const [i0, i1] = refRopePair(i, p);
              const mag = Math.abs(x[base + i0]!) + Math.abs(x[base + i1]!);
              tol[base + i0] = tol[base + i1] = SLACK * mag * (dTheta + 4 * U) + TINY;
            }
          }
        }
        env.compare("y", out, ref, tol, n);
      },
    };
  });
}

function softmaxCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number][] = [
    [1, 2, 1],
    [5, 1, 0.125],
    [33, 3, 1],
    [200, 2, 3],
  ];
  return shapes.map(([n, t, scale]) => {
    const c = unaryCase(
      [n, t],
      (m) => rng.f32(m, -5, 5),
      (g, x) => g.softmax(x, scale),
      (x, ref, nn) => {
        const tol = new Float64Array(x.length);
        for (let col = 0; col < x.length / nn; col++) {
          let m = Number.NEGATIVE_INFINITY;
          for (let j = 0; j < nn; j++) m = Math.max(m, scale * x[col * nn + j]!);
          const arg = (j: number) => (Math.abs(scale * x[col * nn + j]!) + Math.abs(m)) * 2 * U;
          let maxArg = 0;
          for (let j = 0; j < nn; j++) maxArg = Math.max(maxArg, arg(j));
          for (let j = 0; j < nn; j++) {
            tol[col * nn + j] = SLACK * Math.abs(ref[col * nn + j]!) * (arg(j) + maxArg + (nn + 20) * U) + TINY;
          }
        }
        return tol;
      },
    );
    return { ...c, shape: `${c.shape} scale ${scale}` };
  });
}

interface AttnCase {
  d: number;
  h: number;
  hkv: number;
  ctx: number;
  nPast: number;
  t: number;
  /** attention_swa's window. */
  window?: number;
}

/** attention_swa: windows shorter than, equal to and longer than the visible context. */
const ATTN_SWA_CASES: AttnCase[] = [
  { d: 8, h: 1, hkv: 1, ctx: 6, nPast: 2, t: 1, window: 1 },
  { d: 64, h: 4, hkv: 2, ctx: 20, nPast: 7, t: 3, window: 4 },
  { d: 16, h: 6, hkv: 1, ctx: 12, nPast: 3, t: 4, window: 5 },
  { d: 32, h: 8, hkv: 8, ctx: 14, nPast: 0, t: 5, window: 30 },
  // a prompt-sized batch (≥ 64 tokens: the CPU backend's tiled arithmetic, as llama.cpp's)
  { d: 32, h: 2, hkv: 1, ctx: 96, nPast: 11, t: 70, window: 40 },
];

const ATTN_CASES: AttnCase[] = [
  { d: 8, h: 1, hkv: 1, ctx: 6, nPast: 0, t: 1 },
  { d: 64, h: 4, hkv: 2, ctx: 20, nPast: 7, t: 3 },
  { d: 16, h: 6, hkv: 1, ctx: 12, nPast: 3, t: 4 },
  { d: 128, h: 2, hkv: 2, ctx: 9, nPast: 8, t: 1 },
  { d: 32, h: 8, hkv: 8, ctx: 14, nPast: 0, t: 5 },
  // a prompt-sized batch: two query tiles of 64, key tiles of 64 partly masked
  { d: 64, h: 4, hkv: 2, ctx: 100, nPast: 20, t: 70 },
];

/**
 * Attention tolerance. Score errors δ (q·k in float32 over d terms, q rounded to F16 for an F16
 * cache, exp and max subtraction) change the output by at most (e^{2δ} − 1)·Σ p|v| (the softmax
 * weights move by a factor within e^{±2δ}); summing C weighted values adds (C + 8)·ε·Σ p|v| with
 * ε = u for an F32 cache and ε = 2^-11 for an F16 cache (ggml's flash attention accumulates V in F16).
 */
function attentionTolerance(
  c: AttnCase,
  cache: DType,
  q: Float32Array,
  k: Float64Array,
  v: Float64Array,
): Float64Array {
  const p = { headDim: c.d, nHead: c.h, nHeadKv: c.hkv, nPast: c.nPast, scale: 1 / Math.sqrt(c.d), window: c.window };
  const tol = new Float64Array(c.d * c.h * c.t);
  const kRow = c.d * c.hkv;
  const epsQ = cache === "f16" ? U_F16 : 0;
  const epsAcc = cache === "f16" ? U_F16 : U;
  for (let t = 0; t < c.t; t++) {
    for (let h = 0; h < c.h; h++) {
      const gq = Math.floor(h / (c.h / c.hkv));
      const w = refAttentionWeights(q, k, h, t, p);
      const qo = t * c.d * c.h + h * c.d;
      const scores: number[] = [];
      const bounds: number[] = [];
      for (let pos = 0; pos < w.length; pos++) {
        let s = 0;
        let sa = 0;
        for (let j = 0; j < c.d; j++) {
          const prod = q[qo + j]! * k[pos * kRow + gq * c.d + j]!;
          s += prod;
          sa += Math.abs(prod);
        }
        scores.push(p.scale * s);
        bounds.push(p.scale * sa * (epsQ + (c.d + 4) * U));
      }
      const maxS = Math.max(...scores.map(Math.abs));
      let delta = 0;
      for (let pos = 0; pos < w.length; pos++) {
        delta = Math.max(delta, bounds[pos]! + (Math.abs(scores[pos]!) + maxS) * 2 * U + 8 * U);
      }
      for (let j = 0; j < c.d; j++) {
        let spv = 0;
        for (let pos = 0; pos < w.length; pos++) spv += w[pos]! * Math.abs(v[pos * kRow + gq * c.d + j]!);
        tol[qo + j] = SLACK * spv * (Math.expm1(2 * delta) + (w.length + 8) * (epsAcc + 10 * U)) + TINY;
      }
    }
  }
  return tol;
}

function attentionCases(dtype: DType, rng: ConformanceRng, withCpy: boolean, swa = false): CaseDef[] {
  const cases: CaseDef[] = (swa ? ATTN_SWA_CASES : ATTN_CASES).map((c) => ({
    shape: `q[${c.d}·${c.h},${c.t}] cache[${c.d}·${c.hkv},${c.ctx}] n_past ${c.nPast}${c.window ? ` window ${c.window}` : ""}`,
    run: (env) => runAttention(env, c, dtype, rng, false),
  }));
  if (withCpy && !swa) {
    const c = ATTN_CASES[1]!;
    cases.push({
      shape: `cpy K,V then attention: q[${c.d}·${c.h},${c.t}] cache[${c.d}·${c.hkv},${c.ctx}] n_past ${c.nPast}`,
      run: (env) => runAttention(env, c, dtype, rng, true),
    });
  }
  return cases;
}

async function runAttention(
  env: CaseEnv,
  c: AttnCase,
  dtype: DType,
  rng: ConformanceRng,
  withCpy: boolean,
): Promise<void> {
  const kRow = c.d * c.hkv;
  const used = (c.nPast + c.t) * kRow;
  // positions past n_past + T − 1 hold stale, larger values that a correct kernel never reads
  const fill = () =>
    Float32Array.from({ length: kRow * c.ctx }, (_, i) => (i < used ? rng.uniform(-1, 1) : rng.uniform(-4, 4)));
  const kv = [fill(), fill()];
  const hk = env.tensor(dtype, [kRow, c.ctx], encodeFloatTensor(dtype as "f32" | "f16", kv[0]!));
  const hv = env.tensor(dtype, [kRow, c.ctx], encodeFloatTensor(dtype as "f32" | "f16", kv[1]!));
  const q = rng.f32(c.d * c.h * c.t, -2, 2);
  const g = new Graph();
  let kt = g.handle(hk);
  let vt = g.handle(hv);
  if (withCpy) {
    kt = g.cpy(g.input("f32", [kRow, c.t], rng.f32(kRow * c.t)), kt, c.nPast);
    vt = g.cpy(g.input("f32", [kRow, c.t], rng.f32(kRow * c.t)), vt, c.nPast);
  }
  const params = {
    headDim: c.d,
    nHead: c.h,
    nHeadKv: c.hkv,
    nPast: c.nPast,
    scale: 1 / Math.sqrt(c.d),
    window: c.window,
  };
  const y = g.attention(g.input("f32", [c.d * c.h, c.t], q), kt, vt, params);
  const out = env.poisoned(g, y);
  await env.compute(g);
  const ref = env.reference(g).values[y]!;
  const n = kRow * c.ctx;
  const k = dequantizeReference(dtype, env.handles.get(hk.id)!, n).values; // after the reference's cpy
  const v = dequantizeReference(dtype, env.handles.get(hv.id)!, n).values;
  env.compare("y", out, ref, attentionTolerance(c, dtype, q, k, v), c.d * c.h);
}

function binaryCases(op: "add" | "mul", rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, boolean][] = [
    [1, 1, false],
    [7, 3, true],
    [100, 2, false],
    [33, 4, true],
  ];
  return shapes.map(([n, t, bcast]) => ({
    shape: `a[${n},${t}] b[${n},${bcast ? 1 : t}]`,
    async run(env) {
      const a = rng.f32(n * t, -3, 3);
      const b = rng.f32(bcast ? n : n * t, -3, 3);
      const g = new Graph();
      const ai = g.input("f32", [n, t], a);
      const bi = g.input("f32", [n, bcast ? 1 : t], b);
      const y = op === "add" ? g.add(ai, bi) : g.mul(ai, bi);
      const out = env.poisoned(g, y);
      await env.compute(g);
      const ref = env.reference(g).values[y]!;
      env.compare("y", out, ref, (i) => SLACK * U * Math.abs(ref[i]!) + TINY, n);
    },
  }));
}

const ELEMENTWISE_SHAPES: [number, number][] = [
  [1, 1],
  [31, 2],
  [257, 1],
  [64, 3],
];

/** Inputs of elementwise activations: uniform in [−8, 8) plus exact 0 and the ends ±10, ±12. */
function activationInput(rng: ConformanceRng, n: number): Float32Array {
  const x = rng.f32(n, -8, 8);
  const special = [0, -10, 10, -12, 12, -0.5, 0.5];
  for (let i = 0; i < Math.min(special.length, n); i++) if (n > 8) x[i * 3] = special[i]!;
  return x;
}

function elementwiseCases(op: "scale" | "silu" | "relu" | "gelu", rng: ConformanceRng): CaseDef[] {
  return ELEMENTWISE_SHAPES.map((shape, i) => {
    const s = [0.5, Math.fround(1 / 3), -2.75, 1][i]!;
    const c = unaryCase(
      shape,
      (n) => activationInput(rng, n),
      (g, x) => (op === "scale" ? g.scale(x, s) : op === "silu" ? g.silu(x) : op === "relu" ? g.relu(x) : g.gelu(x)),
      (x, ref) => {
        switch (op) {
          case "scale":
            return (j: number) => SLACK * U * Math.abs(ref[j]!) + TINY;
          case "silu":
            return (j: number) => SLACK * 16 * U * Math.abs(ref[j]!) + TINY;
          case "relu":
            return () => 0;
          case "gelu":
            // admits ggml's F16 lookup table: input and output rounded to F16 (|gelu'| ≤ 1.13)
            return (j: number) =>
              SLACK * (U_F16 * (1.13 * Math.abs(x[j]!) + Math.abs(ref[j]!)) + 16 * U * Math.abs(ref[j]!)) + 2 ** -24;
        }
      },
    );
    return op === "scale" ? { ...c, shape: `${c.shape} s ${s}` } : c;
  });
}

function cpyCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number][] = [
    [1, 4, 1],
    [16, 9, 3],
    [67, 5, 2],
    [64, 7, 7],
  ];
  return shapes.map(([n, rows, t]) => ({
    shape: `src[${n},${t}] → dst ${dtype}[${n},${rows}]`,
    async run(env) {
      const off = rng.int(0, rows - t);
      const init = encodeFloatTensor(dtype as "f32" | "f16" | "bf16", rng.f32(n * rows, -4, 4));
      const h = env.tensor(dtype, [n, rows], init);
      const src = rng.f32(n * t, -70000, 70000).map((v, i) => (i % 3 === 0 ? v / 50000 : v / 1e3));
      const g = new Graph();
      g.cpy(g.input("f32", [n, t], src), g.handle(h), off);
      await env.compute(g);
      env.reference(g);
      const got = env.backend.readTensor(h);
      const want = env.handles.get(h.id)!;
      const es = dtype === "f32" ? 4 : 2;
      if (got.length !== want.length) {
        env.fail(`readTensor returned ${got.length} bytes, expected ${want.length}`);
        return;
      }
      for (let b = 0; b < got.length; b++) {
        const row = Math.floor(b / es / n);
        if ((row < off || row >= off + t) && got[b] !== want[b]) {
          env.fail(`byte ${b} (row ${row}) changed, but cpy writes only rows ${off}..${off + t - 1}`);
          return;
        }
      }
      const decode = (bytes: Uint8Array) => {
        const dv = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
        return Float64Array.from({ length: n * t }, (_, i) => {
          const o = (off * n + i) * es;
          if (dtype === "f32") return dv.getFloat32(o, true);
          if (dtype === "f16") return halfToNumber(dv.getUint16(o, true));
          return dequantizeReference("bf16", bytes.subarray(o, o + 2), 1).values[0]!;
        });
      };
      // any faithful rounding to the destination type (one ulp), exact for F32
      const ulp = dtype === "f32" ? 0 : dtype === "f16" ? 2 * U_F16 : 2 * U_BF16;
      env.compare("dst", decode(got), src, (i) => ulp * Math.abs(src[i]!) + (dtype === "f16" ? 2 ** -24 : 0), n);
    },
  }));
}

function sliceCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number, number][] = [
    [1, 1, 0, 1],
    [10, 3, 2, 5],
    [67, 2, 31, 36],
    [128, 4, 0, 64],
  ];
  return shapes
    .map(([n, t, off, len]) =>
      unaryCase(
        [n, t],
        (m) => rng.f32(m),
        (g, x) => g.slice(x, off, len),
        () => () => 0,
      ),
    )
    .map((c, i) => ({ ...c, shape: `${c.shape} offset ${shapes[i]![2]} length ${shapes[i]![3]}` }));
}

function casesFor(op: OpName, dtype: DType, rng: ConformanceRng, backend: Backend): CaseDef[] {
  switch (op) {
    case "get_rows":
      return getRowsCases(dtype, rng);
    case "mul_mat":
      return mulMatCases(dtype, rng);
    case "rms_norm":
    case "norm":
      return normCases(op, rng);
    case "rope":
      return ropeCases(rng);
    case "softmax":
      return softmaxCases(rng);
    case "attention": {
      let withCpy = false;
      try {
        withCpy = backend.supportsOp("cpy", [dtype]);
      } catch {
        withCpy = false;
      }
      return attentionCases(dtype, rng, withCpy);
    }
    case "attention_swa":
      return attentionCases(dtype, rng, false, true);
    case "add":
    case "mul":
      return binaryCases(op, rng);
    case "scale":
    case "silu":
    case "relu":
    case "gelu":
      return elementwiseCases(op, rng);
    case "cpy":
      return cpyCases(dtype, rng);
    case "slice":
      return sliceCases(rng);
    case "mul_mat_sparse":
      return mulMatSparseCases(dtype, rng);
    case "axpy_sparse":
      return axpySparseCases(dtype, rng);
    case "sigmoid":
      return sigmoidCases(rng);
    case "top_k":
      return topKCases(rng);
    case "mul_mat_id":
    case "mul_mat_id_sparse":
      return mulMatIdCases(op, dtype, rng);
    case "axpy_id_sparse":
      return axpyIdSparseCases(dtype, rng);
    case "moe_sum":
      return moeSumCases(rng);
    case "moe_scatter":
      return moeScatterCases(rng);
    case "reshape":
      return reshapeCases(rng);
  }
}

function reshapeCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number[]][] = [
    [12, 1, [4, 3]],
    [64, 3, [16, 12]],
    [30, 4, [5, 6, 4]],
    [7, 5, [35]],
  ];
  return shapes.map(([n, t, ne]) => ({
    shape: `x[${n},${t}] → [${ne}]`,
    async run(env) {
      const x = rng.f32(n * t, -3, 3);
      const g = new Graph();
      const y = g.reshape(g.input("f32", [n, t], x), ne);
      const out = env.poisoned(g, y);
      await env.compute(g);
      env.compare("y", out, env.reference(g).values[y]!, () => 0, ne[0]!);
    },
  }));
}

// ---- routed experts -----------------------------------------------------------------------------

function sigmoidCases(rng: ConformanceRng): CaseDef[] {
  return ELEMENTWISE_SHAPES.map((shape) =>
    unaryCase(
      shape,
      (n) => rng.f32(n, -12, 12),
      (g, x) => g.sigmoid(x),
      (_x, ref) => (j: number) => SLACK * 16 * U * Math.abs(ref[j]!) + TINY,
    ),
  );
}

/** Expert ids [U, T]: per token U distinct experts of 0..E−1 (as routing picks them), in random order. */
function expertIds(rng: ConformanceRng, nExpert: number, nUsed: number, t: number): Int32Array {
  const ids = new Int32Array(nUsed * t);
  for (let c = 0; c < t; c++) {
    const pool = Array.from({ length: nExpert }, (_, i) => i);
    for (let u = 0; u < nUsed; u++) {
      const j = rng.int(0, pool.length - 1);
      ids[c * nUsed + u] = pool[j]!;
      pool.splice(j, 1);
    }
  }
  return ids;
}

function topKCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number][] = [
    [4, 1, 1],
    [8, 2, 3],
    [64, 6, 5],
    [128, 8, 2],
    [5, 5, 4],
  ];
  return shapes.map(([n, k, t]) => ({
    shape: `x[${n},${t}] k ${k} (read through mul_mat_id f32)`,
    async run(env) {
      if (!env.backend.supportsOp("mul_mat_id", ["f32"])) {
        env.fail("top_k is checked through mul_mat_id with f32 weights, which the backend does not claim");
        return;
      }
      // distinct values, with some near-ties one float32 ulp apart
      const x = rng.f32(n * t, -4, 4);
      for (let i = 1; i < x.length; i += 7) x[i] = Math.fround(x[i - 1]! * (1 + 2 ** -23));
      // W_e = [[e + 1]] (K = 1, N = 1): slot u of token t returns ids[u, t] + 1 exactly
      const h = env.tensor(
        "f32",
        [1, 1, n],
        encodeFloatTensor(
          "f32",
          Float32Array.from({ length: n }, (_, e) => e + 1),
        ),
      );
      const g = new Graph();
      const ids = g.topK(g.input("f32", [n, t], x), k);
      const y = g.mulMatId(g.handle(h), g.input("f32", [1, t], new Float32Array(t).fill(1)), ids);
      const out = env.poisoned(g, y);
      await env.compute(g);
      const ref = env.reference(g).values[y]!;
      env.compare("ids+1", out, ref, () => 0, k);
    },
  }));
}

/** [K, M, E, U, T, x per slot, exact x] per block size. */
function expertShapes(dtype: DType): [number, number, number, number, number, boolean, boolean][] {
  const ks = rowLengths(dtype);
  return [
    [ks[0]!, 3, 4, 2, 1, false, true],
    [ks[1]!, 7, 8, 2, 3, false, false],
    [ks[2 % ks.length]!, 5, 6, 3, 2, true, true],
    [ks[1]!, 9, 3, 1, 4, false, false],
    [ks[0]!, 4, 5, 4, 17, true, false],
  ];
}

function mulMatIdCases(op: "mul_mat_id" | "mul_mat_id_sparse", dtype: DType, rng: ConformanceRng): CaseDef[] {
  const sparse = op === "mul_mat_id_sparse";
  return expertShapes(dtype).map(([k, m, nExpert, nUsed, t, perSlot, exact], ci) => {
    const withLogits = sparse && ci !== 3;
    return {
      shape: `W[${k},${m},${nExpert}] x[${k},${perSlot ? `${nUsed},` : ""}${t}] ids[${nUsed},${t}]${exact ? " exact x" : ""}${withLogits ? " logits" : ""}`,
      async run(env) {
        const wb = randomWeightBytes(dtype, k * m * nExpert, rng);
        const h = env.tensor(dtype, [k, m, nExpert], wb);
        const xCols = perSlot ? nUsed * t : t;
        const x = activations(rng, k, xCols, exact);
        const ids = expertIds(rng, nExpert, nUsed, t);
        const n = m * nUsed * t;
        let logits: Float32Array | undefined;
        const threshold = 0.25;
        if (withLogits) {
          logits = rng.f32(n);
          for (let i = 0; i < n; i += 9) logits[i] = threshold; // ≥ is inclusive
          if (ci === 4) logits.fill(-1, 0, m * nUsed); // token 0: nothing active
        }
        const g = new Graph();
        const xi = g.input("f32", perSlot ? [k, nUsed, t] : [k, t], x);
        const ii = g.input("i32", [nUsed, t], ids);
        const y = sparse
          ? g.mulMatIdSparse(g.handle(h), xi, ii, {
              logits: logits ? g.input("f32", [m, nUsed, t], logits) : undefined,
              threshold,
            })
          : g.mulMatId(g.handle(h), xi, ii);
        const out = env.poisoned(g, y);
        const res = await env.compute(g);
        const ref = env.reference(g);
        const { magnitude } = dequantizeReference(dtype, wb, k * m * nExpert);
        const tol = new Float64Array(n);
        const zero = new Uint8Array(n);
        let expected = 0;
        for (let c = 0; c < t; c++) {
          for (let u = 0; u < nUsed; u++) {
            const xc = perSlot ? c * nUsed + u : c;
            const e = activationErrors(dtype, x, xc * k, k);
            for (let i = 0; i < m; i++) {
              const o = (c * nUsed + u) * m + i;
              if (logits && !(logits[o]! >= threshold)) {
                zero[o] = 1;
                continue;
              }
              expected++;
              tol[o] = dotTolerance(magnitude, (ids[c * nUsed + u]! * m + i) * k, 1, x, xc * k, e, 0, k);
            }
          }
        }
        env.compare("y", out, ref.values[y]!, tol, m, zero);
        if (sparse) checkRowsRead(env, res, g.nodes.length - 1, expected, ref.rowsRead[g.nodes.length - 1]!);
      },
    };
  });
}

function axpyIdSparseCases(dtype: DType, rng: ConformanceRng): CaseDef[] {
  return expertShapes(dtype).map(([d, m, nExpert, nUsed, t, , exact], ci) => {
    const withLogits = ci !== 3;
    return {
      shape: `Wt[${d},${m},${nExpert}] a[${m},${nUsed},${t}] ids[${nUsed},${t}]${exact ? " exact a" : ""}${withLogits ? " logits" : ""}`,
      async run(env) {
        const wb = randomWeightBytes(dtype, d * m * nExpert, rng);
        const h = env.tensor(dtype, [d, m, nExpert], wb);
        const n = m * nUsed * t;
        const a = activations(rng, m, nUsed * t, exact, true);
        const ids = expertIds(rng, nExpert, nUsed, t);
        let logits: Float32Array | undefined;
        const threshold = -0.25;
        if (withLogits) {
          logits = rng.f32(n);
          for (let i = 0; i < n; i += 7) logits[i] = threshold;
          if (ci === 4) logits.fill(-1, 0, m * nUsed);
        }
        const g = new Graph();
        const y = g.axpyIdSparse(g.handle(h), g.input("f32", [m, nUsed, t], a), g.input("i32", [nUsed, t], ids), {
          logits: logits ? g.input("f32", [m, nUsed, t], logits) : undefined,
          threshold,
        });
        const out = env.poisoned(g, y);
        const res = await env.compute(g);
        const ref = env.reference(g);
        const { magnitude } = dequantizeReference(dtype, wb, d * m * nExpert);
        const tol = new Float64Array(d * nUsed * t);
        let expected = 0;
        for (let col = 0; col < nUsed * t; col++) {
          const e = ids[col]!;
          const err = activationErrors(dtype, a, col * m, m);
          const act: number[] = [];
          for (let i = 0; i < m; i++) if (!logits || logits[col * m + i]! >= threshold) act.push(i);
          expected += act.length;
          const av = act.map((i) => a[col * m + i]!);
          const ev = act.map((i) => err[i]!);
          const mv = new Float64Array(act.length);
          for (let j = 0; j < d; j++) {
            act.forEach((i, q) => {
              mv[q] = magnitude[(e * m + i) * d + j]!;
            });
            tol[col * d + j] = dotTolerance(mv, 0, 1, av, 0, ev, 0, act.length);
          }
        }
        env.compare("y", out, ref.values[y]!, tol, d);
        checkRowsRead(env, res, g.nodes.length - 1, expected, ref.rowsRead[g.nodes.length - 1]!);
      },
    };
  });
}

function moeSumCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number, number, boolean, number][] = [
    [7, 4, 2, 1, true, 1],
    [64, 8, 2, 3, true, 1],
    [33, 16, 4, 5, false, 1],
    [130, 6, 1, 2, true, 2.5],
    [16, 64, 8, 4, false, 0.75],
  ];
  return shapes.map(([d, nExpert, nUsed, t, norm, scale]) => ({
    shape: `y[${d},${nUsed},${t}] probs[${nExpert},${t}] ${norm ? "normalised" : "raw"} weights scale ${scale}`,
    async run(env) {
      const y = rng.f32(d * nUsed * t, -2, 2);
      const probs = rng.f32(nExpert * t, 0, 1);
      const ids = expertIds(rng, nExpert, nUsed, t);
      const g = new Graph();
      const o = g.moeSum(
        g.input("f32", [d, nUsed, t], y),
        g.input("f32", [nExpert, t], probs),
        g.input("i32", [nUsed, t], ids),
        { norm, scale },
      );
      const out = env.poisoned(g, o);
      await env.compute(g);
      const ref = env.reference(g).values[o]!;
      // every weight is off by a few roundings (sum, division, scale), every product and sum by one each
      const tol = new Float64Array(d * t);
      for (let c = 0; c < t; c++) {
        let ws = 0;
        for (let u = 0; u < nUsed; u++) ws += probs[c * nExpert + ids[c * nUsed + u]!]!;
        const div = norm ? Math.max(ws, 2 ** -14) : 1;
        for (let i = 0; i < d; i++) {
          let mag = 0;
          for (let u = 0; u < nUsed; u++) {
            mag += Math.abs((probs[c * nExpert + ids[c * nUsed + u]!]! / div) * scale * y[(c * nUsed + u) * d + i]!);
          }
          tol[c * d + i] = SLACK * (nUsed + 2 * nUsed + 8) * U * mag + TINY;
        }
      }
      env.compare("y", out, ref, tol, d);
    },
  }));
}

/**
 * moe_scatter, exact: per-slot values (one per neuron, or one per slot) laid out by expert with a fill, from input
 * ids and from top_k's ids; and get_rows by top_k's ids (a split expert layer's mask of hot pairs).
 */
function moeScatterCases(rng: ConformanceRng): CaseDef[] {
  const shapes: [number, number, number, number, boolean, number][] = [
    [1, 2, 1, 1, false, 0],
    [5, 8, 2, 3, false, -3.4e38],
    [5, 8, 2, 3, true, 0],
    [33, 16, 4, 5, false, -1.5],
    [768, 64, 6, 2, true, 0],
  ];
  return shapes.map(([m, nExpert, nUsed, t, perSlot, fill]) => ({
    shape: `src[${perSlot ? 1 : m},${nUsed},${t}] m ${m} n_expert ${nExpert} fill ${fill} (ids as input, from top_k; get_rows by top_k ids)`,
    async run(env) {
      const r = perSlot ? 1 : m;
      const src = rng.f32(r * nUsed * t, -2, 2);
      const ids = expertIds(rng, nExpert, nUsed, t);
      const g = new Graph();
      const s = g.input("f32", [r, nUsed, t], src);
      const a = g.moeScatter(s, g.input("i32", [nUsed, t], ids), { m, nExpert, fill });
      // the same ids from top_k over router values that rank them first, in slot order
      const probs = new Float32Array(nExpert * t);
      for (let c = 0; c < t; c++) for (let u = 0; u < nUsed; u++) probs[c * nExpert + ids[c * nUsed + u]!] = nUsed - u;
      const topIds = g.topK(g.input("f32", [nExpert, t], probs), nUsed);
      const b = g.moeScatter(s, topIds, { m, nExpert, fill });
      // a table of one row per expert, gathered by slot
      const table = rng.f32(m * nExpert, -1, 1);
      const rows = g.getRows(g.input("f32", [m, nExpert], table), topIds);
      const outs = [a, b, rows].map((y) => env.poisoned(g, y));
      await env.compute(g);
      const ref = env.reference(g).values;
      env.compare("scatter (input ids)", outs[0]!, ref[a]!, () => 0, m * nExpert);
      env.compare("scatter (top_k ids)", outs[1]!, ref[b]!, () => 0, m * nExpert);
      env.compare("get_rows (top_k ids)", outs[2]!, ref[rows]!, () => 0, m);
    },
  }));
}

/** A 32-bit hash of the seed and the pair, so each pair's inputs do not depend on the filters. */
function pairSeed(seed: number, op: OpName, dtype: DType): number {
  let h = 0x811c9dc5 ^ seed;
  for (const ch of `${op}/${dtype}`) h = Math.imul(h ^ ch.charCodeAt(0), 0x01000193);
  return h >>> 0;
}

/**
 * Runs the conformance kit on a loaded backend.
 *
 * For every op in {@link CONFORMANCE_OPS} and every dtype of {@link conformanceDtypes} that the
 * backend claims through `supportsOp`, builds 4–7 graphs on seeded random inputs (odd sizes, row
 * lengths not a multiple of 32 for float weights and odd block counts for quantized ones, batches of
 * 1 and more than 1, sparse ops with and without logits, row lists and compact weights), computes them
 * with the backend and compares against the float64 reference. Weights are created with
 * `backend.createTensor` and freed afterwards. Never throws for a backend fault: a case whose compute
 * throws is a failure with the error's message.
 *
 * @returns a report of what was claimed, what passed and every failing case; `ok` is true when every
 *   claimed pair passed. Print it with {@link formatConformanceReport}.
 */
export async function runConformance(backend: Backend, opts: ConformanceOptions = {}): Promise<ConformanceReport> {
  const seed = opts.seed ?? 0x5eed;
  const maxFail = opts.maxFailuresPerPair ?? 3;
  const report: ConformanceReport = {
    backend: backend.name,
    seed,
    claimed: [],
    passed: [],
    failed: [],
    cases: 0,
    ok: true,
  };
  for (const op of opts.ops ?? CONFORMANCE_OPS) {
    for (const dtype of conformanceDtypes(op)) {
      if (opts.dtypes && !opts.dtypes.includes(dtype)) continue;
      let claims = false;
      try {
        claims = backend.supportsOp(op, [dtype]);
      } catch (e) {
        opts.log?.(`${op} ${dtype}: supportsOp threw (${(e as Error).message}); treated as not claimed`);
      }
      if (!claims) continue;
      report.claimed.push({ op, dtype });
      const rng = new ConformanceRng(pairSeed(seed, op, dtype));
      const cases = casesFor(op, dtype, rng, backend);
      let failures = 0;
      for (const [i, c] of cases.entries()) {
        const env = new CaseEnv(backend, i === 0);
        try {
          await c.run(env);
        } catch (e) {
          env.fail(`threw: ${(e as Error)?.message ?? String(e)}`);
        } finally {
          env.free();
        }
        report.cases++;
        if (env.message === undefined) continue;
        failures++;
        const f: ConformanceFailure = {
          op,
          dtype,
          shape: c.shape,
          maxErr: env.maxErr,
          tol: env.tol,
          message: env.message,
        };
        if (failures <= maxFail) report.failed.push(f);
        opts.log?.(`FAIL ${op} ${dtype} ${c.shape}${i === 0 ? " (computeAsync)" : ""}: ${f.message}`);
      }
      if (failures === 0) report.passed.push({ op, dtype });
      opts.log?.(
        `${failures === 0 ? "ok  " : "FAIL"} ${op} ${dtype}: ${cases.length - failures}/${cases.length} cases`,
      );
    }
  }
  // a backend that claims nothing has shown nothing: not ok, unless filters asked for pairs it does not claim
  report.ok =
    report.passed.length === report.claimed.length && (report.claimed.length > 0 || !!opts.ops || !!opts.dtypes);
  return report;
}

/**
 * A human-readable report: one line per op with the dtypes that passed and failed, then every
 * recorded failure.
 */
export function formatConformanceReport(r: ConformanceReport): string {
  const lines: string[] = [];
  const failedPairs = r.claimed.length - r.passed.length;
  lines.push(
    `conformance of backend "${r.backend}" (seed ${r.seed}): ${r.passed.length}/${r.claimed.length} claimed op×dtype pairs passed` +
      `, ${r.cases} cases${failedPairs ? `, ${failedPairs} pairs FAILED` : ""}` +
      (r.claimed.length === 0 && !r.ok
        ? " — NOT OK: the backend claims no op (supportsOp answers false everywhere)"
        : ""),
  );
  const ops = [...new Set(r.claimed.map((p) => p.op))];
  const width = Math.max(0, ...ops.map((o) => o.length));
  for (const op of ops) {
    const claimed = r.claimed.filter((p) => p.op === op).map((p) => p.dtype);
    const ok = new Set(r.passed.filter((p) => p.op === op).map((p) => p.dtype));
    const bad = claimed.filter((d) => !ok.has(d));
    lines.push(
      `  ${op.padEnd(width)}  ok: ${[...ok].join(" ") || "-"}${bad.length ? `   FAILED: ${bad.join(" ")}` : ""}`,
    );
  }
  const unclaimed = CONFORMANCE_OPS.filter((o) => !ops.includes(o));
  if (unclaimed.length) lines.push(`  not claimed: ${unclaimed.join(" ")}`);
  for (const f of r.failed) {
    lines.push(
      `  FAIL ${f.op} ${f.dtype} ${f.shape}: ${f.message} (error ${f.maxErr.toExponential(3)}, tolerance ${f.tol.toExponential(3)})`,
    );
  }
  return lines.join("\n");
}
