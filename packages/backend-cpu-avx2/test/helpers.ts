/**
 * Test helpers: backends at the three configurations every test runs (1 thread, 2 threads, forced
 * scalar), random weights of every dtype with their float reference values, and an exact emulation
 * of how llama.cpp rounds activations for each weight dtype (F16, BF16, Q8_0, Q8_1, Q8_K).
 */
import {
  type Backend,
  type BackendLoadOptions,
  bf16ToNumber,
  WEIGHT_DTYPES as CORE_WEIGHT_DTYPES,
  ConformanceRng,
  type DType,
  DTYPE_LAYOUT,
  halfToNumber,
  numberToBf16,
  numberToHalf,
} from "@powerinfer/core";
import { dequantize, GGMLType, quantize } from "@powerinfer/gguf";
import { cpuBackend } from "../src/index.js";

// Small test graphs would otherwise run on one thread (see POWERINFER_CPU_SERIAL_BYTES in executor.cpp):
// make every graph use the whole pool so the threaded paths are what the tests check.
process.env.POWERINFER_CPU_SERIAL_BYTES = "0";

export const usable = (cpuBackend.probe() as { usable: boolean; reason: string }).usable;
export const probeReason = (cpuBackend.probe() as { usable: boolean; reason: string }).reason;

export const CONFIGS: { name: string; opts: BackendLoadOptions }[] = [
  { name: "1 thread", opts: { threads: 1 } },
  { name: "2 threads", opts: { threads: 2 } },
  { name: "scalar", opts: { threads: 2, forceScalar: true } },
];

/** Every dtype a weight may have (core's list). */
export const WEIGHT_DTYPES: DType[] = [...CORE_WEIGHT_DTYPES];

export const GGML: Record<DType, GGMLType> = {
  f32: GGMLType.F32,
  f16: GGMLType.F16,
  bf16: GGMLType.BF16,
  q8_0: GGMLType.Q8_0,
  q4_0: GGMLType.Q4_0,
  q4_1: GGMLType.Q4_1,
  q5_0: GGMLType.Q5_0,
  q5_1: GGMLType.Q5_1,
  q4_K: GGMLType.Q4_K,
  q5_K: GGMLType.Q5_K,
  q6_K: GGMLType.Q6_K,
  i32: GGMLType.I32,
};

const cache = new Map<string, Promise<Backend>>();

/** A backend per configuration, shared by the tests of a file. */
export function backend(opts: BackendLoadOptions): Promise<Backend> {
  const key = JSON.stringify(opts);
  let b = cache.get(key);
  if (!b) {
    b = cpuBackend.load(opts);
    cache.set(key, b);
  }
  return b;
}

/** A row length that is valid for `dtype` and not a power of two (odd for float dtypes). */
export function oddK(dtype: DType, k = 1): number {
  const bs = DTYPE_LAYOUT[dtype].blockSize;
  if (bs === 1) return 64 * k + 35;
  if (bs === 32) return 64 * k + 32;
  return 256 * (k + 1);
}

/** core's seeded generator (mulberry32), plus sampling. */
export class Rng extends ConformanceRng {
  /** Fisher–Yates sample of m distinct integers of 0..n-1, ascending. */
  sample(n: number, m: number): Int32Array {
    const a = Int32Array.from({ length: n }, (_, i) => i);
    for (let i = 0; i < m; i++) {
      const j = i + Math.floor(this.next() * (n - i));
      const t = a[i]!;
      a[i] = a[j]!;
      a[j] = t;
    }
    return a.slice(0, m).sort();
  }
}

function putHalf(b: Uint8Array, o: number, v: number): void {
  const h = numberToHalf(v);
  b[o] = h & 0xff;
  b[o + 1] = h >> 8;
}

const getHalf = (b: Uint8Array, o: number) => halfToNumber(b[o]! | (b[o + 1]! << 8));

/** Random valid blocks of a quantized dtype: random quants, F16 scales that keep |w| ≲ 2. */
function randomBlocks(dtype: DType, n: number, rng: Rng): Uint8Array {
  const { blockSize, typeSize } = DTYPE_LAYOUT[dtype];
  const nb = n / blockSize;
  const out = rng.bytes(nb * typeSize);
  const sign = () => (rng.next() < 0.5 ? -1 : 1);
  for (let b = 0; b < nb; b++) {
    const o = b * typeSize;
    switch (dtype) {
      case "q5_0":
        putHalf(out, o, sign() * rng.uniform(0.03, 0.07));
        break;
      case "q4_1":
      case "q5_1":
        putHalf(out, o, dtype === "q4_1" ? rng.uniform(0.06, 0.15) : rng.uniform(0.03, 0.07));
        putHalf(out, o + 2, rng.uniform(-1.2, 0.2));
        break;
      case "q4_K":
      case "q5_K":
        putHalf(out, o, dtype === "q4_K" ? rng.uniform(0.0008, 0.002) : rng.uniform(0.0004, 0.001));
        putHalf(out, o + 2, rng.uniform(0.001, 0.02));
        break;
      case "q6_K":
        putHalf(out, o + 208, sign() * rng.uniform(0.0002, 0.0005));
        break;
      default:
        throw new Error(`randomBlocks: ${dtype}`);
    }
  }
  return out;
}

/** Per element, |offset| of formats whose values are d·q − m (0 elsewhere): errors scale with |d·q| + |m|. */
function offsets(dtype: DType, bytes: Uint8Array, n: number): Float64Array {
  const m = new Float64Array(n);
  if (dtype === "q4_1" || dtype === "q5_1") {
    const ts = DTYPE_LAYOUT[dtype].typeSize;
    for (let i = 0; i < n; i++) m[i] = Math.abs(getHalf(bytes, Math.floor(i / 32) * ts + 2));
  } else if (dtype === "q4_K" || dtype === "q5_K") {
    const ts = DTYPE_LAYOUT[dtype].typeSize;
    for (let i = 0; i < n; i++) {
      const o = Math.floor(i / 256) * ts;
      const j = Math.floor((i % 256) / 32);
      const s = o + 4;
      const mj = j < 4 ? bytes[s + j + 4]! & 63 : (bytes[s + j + 4]! >> 4) | ((bytes[s + j]! >> 6) << 4);
      m[i] = Math.abs(getHalf(bytes, o + 2) * mj);
    }
  }
  return m;
}

export interface Weights {
  bytes: Uint8Array;
  /** Dequantized values (gguf's reference dequantizer), row-major [rows][K]. */
  values: Float32Array;
  /** |w| bound per element including a block offset's size (core's reference). */
  magnitude: Float64Array;
}

/**
 * Random weights [K, rows]: F32/F16/BF16/Q8_0/Q4_0 made by quantizing random floats with gguf's
 * reference quantizers, the other types random valid blocks; values from gguf's dequantizer.
 */
export function randomWeights(dtype: DType, k: number, rows: number, rng: Rng): Weights {
  const n = k * rows;
  let bytes: Uint8Array;
  if (dtype === "f32" || dtype === "f16" || dtype === "bf16" || dtype === "q8_0" || dtype === "q4_0") {
    bytes = quantize(GGML[dtype], rng.f32(n, -1, 1));
  } else {
    bytes = randomBlocks(dtype, n, rng);
  }
  const values = dequantize(GGML[dtype], bytes, n);
  const off = offsets(dtype, bytes, n);
  const magnitude = Float64Array.from(values, (v, i) => Math.abs(v) + 2 * off[i]!);
  return { bytes, values, magnitude };
}

function rne(v: number): number {
  const r = Math.round(v);
  return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

const fr = Math.fround;
const half = (v: number) => halfToNumber(numberToHalf(v));

export interface RoundedActivation {
  /** The activation values the kernel multiplies with. */
  values: Float64Array;
  /** Q8_1 only: per 32-block s − d·Σq (the F16 rounding of the stored block sum s = d·Σq). */
  sumCorrection?: Float64Array;
}

/** x (K values) rounded the way llama.cpp's CPU kernels do for weights of `dtype`. */
export function roundActivation(dtype: DType, x: ArrayLike<number>, off: number, k: number): RoundedActivation {
  const v = new Float64Array(k);
  switch (dtype) {
    case "f16":
      for (let i = 0; i < k; i++) v[i] = half(x[off + i]!);
      return { values: v };
    case "bf16":
      for (let i = 0; i < k; i++) v[i] = bf16ToNumber(numberToBf16(x[off + i]!));
      return { values: v };
    case "q8_0":
    case "q4_0":
    case "q5_0":
    case "q4_1":
    case "q5_1": {
      const q1 = dtype === "q4_1" || dtype === "q5_1";
      const corr = new Float64Array(k / 32);
      for (let b = 0; b < k / 32; b++) {
        let amax = 0;
        for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(x[off + 32 * b + j]!));
        const d = fr(amax / 127);
        const id = amax !== 0 ? fr(127 / amax) : 0;
        const dh = half(d);
        let sum = 0;
        for (let j = 0; j < 32; j++) {
          const q = rne(fr(x[off + 32 * b + j]! * id));
          sum += q;
          v[32 * b + j] = q * dh;
        }
        if (q1) corr[b] = half(fr(d * sum)) - dh * sum;
      }
      return q1 ? { values: v, sumCorrection: corr } : { values: v };
    }
    case "q4_K":
    case "q5_K":
    case "q6_K": {
      for (let b = 0; b < k / 256; b++) {
        let amax = 0;
        let max = 0;
        for (let j = 0; j < 256; j++) {
          const a = Math.abs(x[off + 256 * b + j]!);
          if (a > amax) {
            amax = a;
            max = x[off + 256 * b + j]!;
          }
        }
        if (amax === 0) continue;
        const iscale = fr(-127 / max);
        const d = fr(1 / iscale);
        for (let j = 0; j < 256; j++) v[256 * b + j] = Math.min(127, rne(fr(iscale * x[off + 256 * b + j]!))) * d;
      }
      return { values: v };
    }
    default:
      for (let i = 0; i < k; i++) v[i] = x[off + i]!;
      return { values: v };
  }
}

/** The F16 block offset m of each 32-block of a Q4_1/Q5_1 row (0 for other dtypes). */
export function blockOffsets(dtype: DType, bytes: Uint8Array, row: number, k: number): Float64Array {
  const m = new Float64Array(k / 32);
  if (dtype !== "q4_1" && dtype !== "q5_1") return m;
  const ts = DTYPE_LAYOUT[dtype].typeSize;
  for (let b = 0; b < k / 32; b++) m[b] = getHalf(bytes, (row * (k / 32) + b) * ts + 2);
  return m;
}

/**
 * Reference of one dot product as the kernels define it: Σ w·x̃ with x̃ the rounded activation, plus
 * for Q8_1 the stored-sum correction. Returns the value and the magnitude Σ|w|·|x̃| for tolerances.
 */
export function refDot(
  dtype: DType,
  w: Weights,
  row: number,
  k: number,
  xr: RoundedActivation,
): { value: number; scale: number } {
  let s = 0;
  let scale = 0;
  for (let i = 0; i < k; i++) {
    s += w.values[row * k + i]! * xr.values[i]!;
    scale += w.magnitude[row * k + i]! * Math.abs(xr.values[i]!);
  }
  if (xr.sumCorrection) {
    const m = blockOffsets(dtype, w.bytes, row, k);
    for (let b = 0; b < k / 32; b++) s += m[b]! * xr.sumCorrection[b]!;
  }
  return { value: s, scale };
}

/** Tolerance of a float32 dot product of k terms with magnitude `scale` (typical-case bound). */
export function dotTol(k: number, scale: number): number {
  return 4 * (Math.sqrt(k) + 8) * 2 ** -24 * scale + 1e-30;
}
