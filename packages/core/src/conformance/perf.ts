/**
 * The conformance kit's perf mode (the role of llama.cpp's `test-backend-ops perf`): for every op a
 * backend claims, per dtype, one graph of a fixed, decode-sized shape, timed over repeated computes, side
 * by side with a baseline backend (the CPU backend, typically). Values are not checked here (that is
 * {@link runConformance}'s job); each graph is computed once before timing.
 *
 * Shapes (n = `size`, default 1024; T = 1 token unless said):
 * - get_rows W[n, 4n] → 8 rows; mul_mat W[n, n]·x[n]; mul_mat_sparse / axpy_sparse W[n, 4n], 10 % of
 *   the 4n neurons active (by logits);
 * - attention / attention_swa: 8 heads of 64 over a cache of 4n/4 positions (window 128 for swa);
 * - mul_mat_id / *_id_sparse: 8 experts [n, n/2], 2 used per token; moe_sum over them; top_k of 8;
 * - elementwise and norms on [4n]; rope on [8·64]; cpy of [n] into a [n, 16] tensor; slice/reshape of [4n].
 */
import { Graph, type TensorId } from "../backend/graph.js";
import type { Backend, DType, OpName, TensorHandle } from "../backend/types.js";
import { DTYPE_LAYOUT } from "../backend/types.js";
import { CONFORMANCE_OPS, conformanceDtypes } from "./kit.js";
import { ConformanceRng, randomWeightBytes } from "./quant.js";

/** Options of {@link runConformancePerf}. */
export interface ConformancePerfOptions {
  /** The backend shown beside (e.g. the CPU backend). Its column is empty where it does not claim the pair. */
  baseline?: Backend;
  /** Only these ops. Default: every op. */
  ops?: readonly OpName[];
  /** Only these dtypes. Default: all of {@link conformanceDtypes}. */
  dtypes?: readonly DType[];
  /** The size parameter n of the shapes above (a multiple of 256). Default 1024. */
  size?: number;
  /** Timed computes per graph (the median is reported). Default 5. */
  repeats?: number;
  /** Receives each row as it is measured. */
  log?: (line: string) => void;
}

/** One measured (op, dtype) pair. Times in microseconds per compute call (median). */
export interface ConformancePerfRow {
  op: OpName;
  dtype: DType;
  /** The shape measured, in words ("W[1024,1024]·x[1024,1]"). */
  shape: string;
  /** Undefined where the backend does not claim the pair (then the row is the baseline's alone). */
  us?: number;
  baselineUs?: number;
  /** Weight and activation bytes the graph reads once (for bandwidth figures). */
  bytes: number;
  /** Why the backend's (or the baseline's) measurement failed, when it did (the run goes on). */
  error?: string;
}

export interface ConformancePerfReport {
  backend: string;
  baseline?: string;
  rows: ConformancePerfRow[];
}

interface PerfCase {
  graph: Graph;
  shape: string;
  bytes: number;
  handles: TensorHandle[];
}

const RNG_SEED = 0x9e1f;

/** Builds the perf graph of one pair on `backend`, or undefined for ops with no perf case. */
function buildCase(backend: Backend, op: OpName, dtype: DType, n: number): PerfCase | undefined {
  const rng = new ConformanceRng(RNG_SEED);
  const handles: TensorHandle[] = [];
  const g = new Graph();
  const f32 = (len: number, lo = -1, hi = 1) => Float32Array.from({ length: len }, () => lo + (hi - lo) * rng.next());
  const weight = (dt: DType, ne: number[]): TensorId => {
    const count = ne.reduce((a, b) => a * b, 1);
    const h = backend.createTensor(dt, ne, randomWeightBytes(dt, count, rng));
    handles.push(h);
    return g.handle(h);
  };
  const wbytes = (dt: DType, count: number) => (count / DTYPE_LAYOUT[dt].blockSize) * DTYPE_LAYOUT[dt].typeSize;
  const vec = (len: number, cols = 1) => g.input("f32", [len, cols], f32(len * cols));
  const out = (t: TensorId) => {
    g.output(t);
    return t;
  };
  const n4 = 4 * n;
  switch (op) {
    case "get_rows": {
      const w = weight(dtype, [n, n4]);
      const ids = g.input(
        "i32",
        [8],
        Int32Array.from({ length: 8 }, (_, i) => (i * 977) % n4),
      );
      out(g.getRows(w, ids));
      return { graph: g, shape: `W[${n},${n4}] → 8 rows`, bytes: wbytes(dtype, 8 * n), handles };
    }
    case "mul_mat": {
      out(g.mulMat(weight(dtype, [n, n]), vec(n)));
      return { graph: g, shape: `W[${n},${n}]·x[${n},1]`, bytes: wbytes(dtype, n * n) + 4 * n, handles };
    }
    case "mul_mat_sparse":
    case "axpy_sparse": {
      const logits = g.input("f32", [n4, 1], f32(n4, -9, 1)); // ≥ 0 for 10 %
      if (op === "mul_mat_sparse") out(g.mulMatSparse(weight(dtype, [n, n4]), vec(n), { logits, threshold: 0 }));
      else out(g.axpySparse(weight(dtype, [n, n4]), vec(n4), { logits, threshold: 0 }));
      return {
        graph: g,
        shape: `W[${n},${n4}], 10 % of ${n4} active`,
        bytes: Math.round(wbytes(dtype, n * n4) / 10) + 4 * n4,
        handles,
      };
    }
    case "attention":
    case "attention_swa": {
      const hd = 64;
      const heads = 8;
      const ctx = n;
      const cache = () => {
        const ne = [hd * heads, ctx];
        const h = backend.createTensor(dtype, ne, randomWeightBytes(dtype, hd * heads * ctx, rng));
        handles.push(h);
        return g.handle(h);
      };
      const p = { headDim: hd, nHead: heads, nHeadKv: heads, nPast: ctx - 1, scale: 1 / 8 };
      out(g.attention(vec(hd * heads), cache(), cache(), op === "attention_swa" ? { ...p, window: 128 } : p));
      const seen = op === "attention_swa" ? 128 : ctx;
      return {
        graph: g,
        shape: `${heads}×${hd} heads over ${seen} cached positions`,
        bytes: 2 * wbytes(dtype, hd * heads * seen),
        handles,
      };
    }
    case "mul_mat_id":
    case "mul_mat_id_sparse":
    case "axpy_id_sparse":
    case "moe_sum":
    case "top_k": {
      const ne = 8;
      const m = n / 2;
      const ids = g.input("i32", [2, 1], Int32Array.from([3, 6]));
      if (op === "top_k") {
        out(g.mulMatId(weight("f32", [8, 8, ne]), vec(8), g.topK(vec(ne), 2)));
        return { graph: g, shape: `top 2 of ${ne} (through mul_mat_id f32)`, bytes: 4 * ne, handles };
      }
      if (op === "moe_sum") {
        out(g.moeSum(vec(n, 2), vec(ne), ids, { norm: true }));
        return { graph: g, shape: `y[${n},2,1] over ${ne} experts`, bytes: 8 * n, handles };
      }
      if (op === "mul_mat_id") {
        out(g.mulMatId(weight(dtype, [n, m, ne]), vec(n), ids));
        return { graph: g, shape: `2 of ${ne} experts W[${n},${m}]`, bytes: 2 * wbytes(dtype, n * m), handles };
      }
      const logits = g.input("f32", [m, 2, 1], f32(2 * m, -9, 1));
      if (op === "mul_mat_id_sparse")
        out(g.mulMatIdSparse(weight(dtype, [n, m, ne]), vec(n), ids, { logits, threshold: 0 }));
      else out(g.axpyIdSparse(weight(dtype, [n, m, ne]), g.input("f32", [m, 2, 1], f32(2 * m)), ids, { logits }));
      return {
        graph: g,
        shape: `2 of ${ne} experts W[${n},${m}], 10 % active`,
        bytes: Math.round((2 * wbytes(dtype, n * m)) / 10),
        handles,
      };
    }
    case "rope": {
      const pos = g.input("i32", [1], Int32Array.from([17]));
      out(g.rope(vec(512), pos, { headDim: 64, nDims: 64, mode: 0, freqBase: 10000, freqScale: 1 }));
      return { graph: g, shape: "8×64 values", bytes: 2048, handles };
    }
    case "cpy": {
      const dst = backend.createTensor(dtype, [n, 16]);
      handles.push(dst);
      g.cpy(vec(n), g.handle(dst), 3);
      return { graph: g, shape: `[${n}] into row 3 of [${n},16]`, bytes: 4 * n, handles };
    }
    case "slice":
      out(g.slice(vec(n4), n, n));
      return { graph: g, shape: `${n} of [${n4}]`, bytes: 4 * n, handles };
    case "reshape":
      out(g.reshape(vec(n4), [64, n4 / 64]));
      return { graph: g, shape: `[${n4}] → [64,${n4 / 64}]`, bytes: 4 * n4, handles };
    case "add":
    case "mul":
      out(op === "add" ? g.add(vec(n4), vec(n4)) : g.mul(vec(n4), vec(n4)));
      return { graph: g, shape: `[${n4}] ∘ [${n4}]`, bytes: 8 * n4, handles };
    case "rms_norm":
    case "norm":
      out(op === "norm" ? g.norm(vec(n4), 1e-5) : g.rmsNorm(vec(n4), 1e-5));
      return { graph: g, shape: `[${n4}]`, bytes: 4 * n4, handles };
    case "softmax":
    case "scale":
    case "silu":
    case "relu":
    case "gelu":
    case "sigmoid": {
      const x = vec(n4);
      const y =
        op === "softmax"
          ? g.softmax(x, 1)
          : op === "scale"
            ? g.scale(x, 0.5)
            : op === "silu"
              ? g.silu(x)
              : op === "relu"
                ? g.relu(x)
                : op === "gelu"
                  ? g.gelu(x)
                  : g.sigmoid(x);
      out(y);
      return { graph: g, shape: `[${n4}]`, bytes: 4 * n4, handles };
    }
    default:
      for (const h of handles) backend.freeTensor(h);
      return undefined;
  }
}

/** Median µs per compute of the pair's graph on `backend`, or undefined when it does not claim the pair. */
function timePair(
  backend: Backend,
  op: OpName,
  dtype: DType,
  n: number,
  repeats: number,
): { us?: number; shape: string; bytes: number; error?: string } | undefined {
  try {
    return timeClaimed(backend, op, dtype, n, repeats);
  } catch (e) {
    return { shape: "", bytes: 0, error: `${backend.name}: ${e instanceof Error ? e.message : String(e)}` };
  }
}

function timeClaimed(backend: Backend, op: OpName, dtype: DType, n: number, repeats: number) {
  if (!backend.supportsOp(op, [dtype])) return undefined;
  if (op === "top_k" && !backend.supportsOp("mul_mat_id", ["f32"])) return undefined;
  const c = buildCase(backend, op, dtype, n);
  if (!c) return undefined;
  try {
    backend.compute(c.graph); // warm-up
    const times: number[] = [];
    for (let r = 0; r < repeats; r++) {
      const t0 = performance.now();
      backend.compute(c.graph);
      times.push((performance.now() - t0) * 1000);
    }
    times.sort((a, b) => a - b);
    return { us: times[Math.floor(times.length / 2)]!, shape: c.shape, bytes: c.bytes };
  } finally {
    for (const h of c.handles) backend.freeTensor(h);
  }
}

/**
 * Times every claimed (op, dtype) pair on `backend` (and on `baseline`, when given).
 * @throws RangeError for a `size` that is not a positive multiple of 256, or `repeats` < 1.
 */
export async function runConformancePerf(
  backend: Backend,
  opts: ConformancePerfOptions = {},
): Promise<ConformancePerfReport> {
  const n = opts.size ?? 1024;
  const repeats = opts.repeats ?? 5;
  if (!Number.isInteger(n) || n < 256 || n > 16384 || n % 256 !== 0)
    throw new RangeError(`size must be a positive multiple of 256, at most 16384, got ${n}`);
  if (!Number.isInteger(repeats) || repeats < 1) throw new RangeError(`repeats must be ≥ 1, got ${repeats}`);
  const rows: ConformancePerfRow[] = [];
  for (const op of opts.ops ?? CONFORMANCE_OPS) {
    for (const dtype of conformanceDtypes(op)) {
      if (opts.dtypes && !opts.dtypes.includes(dtype)) continue;
      const mine = timePair(backend, op, dtype, n, repeats);
      // rows are the backend's claims; the baseline is measured beside them
      if (!mine) continue;
      const base = opts.baseline ? timePair(opts.baseline, op, dtype, n, repeats) : undefined;
      const row: ConformancePerfRow = {
        op,
        dtype,
        shape: mine.shape || base?.shape || "",
        us: mine.us,
        baselineUs: base?.us,
        bytes: mine.bytes || base?.bytes || 0,
      };
      const error = [mine.error, base?.error].filter(Boolean).join("; ");
      if (error) row.error = error;
      rows.push(row);
      opts.log?.(formatRow(row));
      await new Promise((r) => setImmediate(r));
    }
  }
  return { backend: backend.name, baseline: opts.baseline?.name, rows };
}

const fmtUs = (us?: number) =>
  us === undefined ? "—" : us >= 1000 ? `${(us / 1000).toFixed(2)} ms` : `${us.toFixed(1)} µs`;

function formatRow(r: ConformancePerfRow): string {
  const num = (v: number) => (v < 0.1 ? v.toPrecision(2) : v.toFixed(2));
  const ratio = r.us !== undefined && r.baselineUs !== undefined ? `${num(r.baselineUs / r.us)}×` : "—";
  const gbs = r.us !== undefined ? num(r.bytes / (r.us * 1e3)) : "—";
  const note = r.error ? ` failed: ${r.error}` : "";
  return `| ${r.op} | ${r.dtype} | ${r.shape} | ${fmtUs(r.us)} | ${fmtUs(r.baselineUs)} | ${ratio} | ${gbs}${note} |`;
}

/** The report as a markdown table: per op × dtype, time per call, the baseline's, speed ratio, GB/s. */
export function formatConformancePerf(report: ConformancePerfReport): string {
  const base = report.baseline ?? "baseline";
  const lines = [
    `perf of backend "${report.backend}"${report.baseline ? ` beside "${report.baseline}"` : ""} (median per compute call)`,
    `| op | dtype | shape | ${report.backend} | ${base} | speed vs ${base} | GB/s (${report.backend}) |`,
    "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ...report.rows.map(formatRow),
  ];
  return lines.join("\n");
}
