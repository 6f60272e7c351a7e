/** Mapping GGUF tensors onto backend tensors. */
import { closeSync, openSync, readSync } from "node:fs";
import {
  dequantize,
  GGMLType,
  type GgufFile,
  type GgufTensorInfo,
  ggmlTypeName,
  readTensorBytes,
} from "@powerinfer/gguf";
import type { Backend, DType, TensorHandle } from "@powerinfer/core";
import { DTYPE_CODES } from "@powerinfer/core";
import { EngineError } from "../errors.js";

const DTYPE_BY_CODE = new Map<number, DType>(Object.entries(DTYPE_CODES).map(([k, v]) => [v, k as DType]));

/**
 * The backend dtype of a GGUF tensor type.
 * @throws EngineError 'UNSUPPORTED_TYPE' naming the tensor and type.
 */
export function dtypeOfTensor(t: GgufTensorInfo): DType {
  const d = DTYPE_BY_CODE.get(t.type);
  if (!d) {
    throw new EngineError(
      "UNSUPPORTED_TYPE",
      `tensor ${t.name} has type ${ggmlTypeName(t.type)}, which the engine does not support`,
    );
  }
  return d;
}

/** Maps GGUF tensors into a backend (zero-copy on a CPU backend), checking shapes. */
export class WeightMapper {
  /** Bytes of tensors mapped so far. */
  bytes = 0;
  constructor(
    readonly file: GgufFile,
    readonly backend: Backend,
  ) {}

  has(name: string): boolean {
    return this.file.tensorMap.has(name);
  }

  /**
   * @param ne expected shape (ne[0] first); checked when given.
   * @throws EngineError 'MISSING_TENSOR' or 'BAD_SHAPE'.
   */
  map(name: string, ne?: readonly number[]): TensorHandle {
    const t = this.file.tensorMap.get(name);
    if (!t) throw new EngineError("MISSING_TENSOR", `model file lacks tensor ${name}`);
    if (ne) {
      const got = [...t.shape];
      while (got.length > ne.length && got[got.length - 1] === 1) got.pop();
      if (got.length !== ne.length || got.some((v, i) => v !== ne[i])) {
        throw new EngineError("BAD_SHAPE", `tensor ${name} has shape [${t.shape}], expected [${ne}]`);
      }
    }
    this.bytes += t.byteLength;
    return this.backend.mapTensor(dtypeOfTensor(t), t.shape, {
      path: t.path ?? this.file.path,
      fileOffset: t.fileOffset,
      byteLength: t.byteLength,
    });
  }

  mapOptional(name: string, ne?: readonly number[]): TensorHandle | undefined {
    return this.has(name) ? this.map(name, ne) : undefined;
  }
}

/**
 * Copies selected rows of a row-per-neuron matrix (ne = [row length, n_rows], any dtype: rows are
 * contiguous runs of whole blocks) into a new tensor on `dst`, in the order given — the compact hot-row
 * copies a device holds. Source bytes are read back from the backend that holds the matrix.
 */
export function gatherRows(
  src: Backend,
  t: TensorHandle,
  rows: Int32Array,
  dst: Backend,
  file?: FileRows,
): TensorHandle {
  // a stack of experts {K, M, E} is E·M rows of K: pair e·M + i is expert e's row i
  const rowBytes = t.byteLength / t.ne.slice(1).reduce((a, b) => a * b, 1);
  const out = new Uint8Array(rows.length * rowBytes);
  if (file) {
    readFileRows(file, rows, rowBytes, out);
  } else {
    const bytes = src.readTensor(t);
    rows.forEach((r, j) => {
      out.set(bytes.subarray(r * rowBytes, (r + 1) * rowBytes), j * rowBytes);
    });
  }
  return dst.createTensor(t.dtype, [t.ne[0]!, Math.max(1, rows.length)], rows.length ? out : new Uint8Array(rowBytes));
}

/**
 * Where the rows of a matrix served from the model file (`--ram-budget`) lie: row r's bytes start at
 * `offset(r)` in `path`. {@link gatherRows} then reads only the rows it copies, not the whole tensor.
 */
export interface FileRows {
  path: string;
  offset(row: number): number;
}

/** Reads `rows` (each `rowBytes`) from the file into `out`, in order; adjacent rows in one read. */
function readFileRows(file: FileRows, rows: Int32Array, rowBytes: number, out: Uint8Array): void {
  let fd: number;
  try {
    fd = openSync(file.path, "r");
  } catch (e) {
    throw new EngineError("IO", `cannot open ${file.path}: ${(e as Error).message}`);
  }
  try {
    for (let j = 0; j < rows.length; ) {
      const at = file.offset(rows[j]!);
      let k = j + 1;
      while (k < rows.length && file.offset(rows[k]!) === at + (k - j) * rowBytes && k - j < 256) k++;
      const len = (k - j) * rowBytes;
      let got = 0;
      while (got < len) {
        const n = readSync(fd, out, j * rowBytes + got, len - got, at + got);
        if (n === 0) throw new EngineError("IO", `${file.path} ends before byte ${at + len}`);
        got += n;
      }
      j = k;
    }
  } catch (e) {
    if (e instanceof EngineError) throw e;
    throw new EngineError("IO", `reading rows of ${file.path} failed: ${(e as Error).message}`);
  } finally {
    closeSync(fd);
  }
}

/**
 * The neuron-major copy of a down projection ({n_ff, n_embd} → {n_embd, n_ff}) on `backend`, from
 * the tensor's bytes in the file: F16 stays F16 (its bits moved, not converted), every other dtype
 * becomes F32.
 */
export function transposeDown(file: GgufFile, backend: Backend, name: string): TensorHandle {
  const t = file.tensorMap.get(name);
  if (!t) throw new EngineError("MISSING_TENSOR", `model file lacks tensor ${name}`);
  const [nFf, nEmbd] = [t.shape[0]!, t.shape[1]!];
  const { src, f16 } = floatElements(file, t);
  const out = f16 ? new Uint16Array(nFf * nEmbd) : new Float32Array(nFf * nEmbd);
  transposeBlocked(src, out, 0, nEmbd, nFf); // row e holds W[e, 0..n_ff)
  return backend.createTensor(f16 ? "f16" : "f32", [nEmbd, nFf], out);
}

/** A tensor's elements: F16 as its raw 16-bit values, any other dtype as F32 (dequantized). */
function floatElements(
  file: GgufFile,
  t: GgufTensorInfo,
  part?: { offset: number; length: number; elements: number },
): { src: Uint16Array | Float32Array; f16: boolean } {
  const bytes = part ? readTensorBytes(file, t, part) : readTensorBytes(file, t);
  const n = part ? part.elements : t.nElements;
  if (t.type === GGMLType.F16) {
    const aligned = bytes.byteOffset % 2 === 0 ? bytes : bytes.slice();
    return { src: new Uint16Array(aligned.buffer, aligned.byteOffset, n), f16: true };
  }
  return { src: dequantize(t.type, bytes, n), f16: false };
}

/**
 * The neuron-major rows of chosen (expert, neuron) pairs of a stacked down projection (file tensor `name`,
 * {n_ff_exp, n_embd, n_expert}) on `backend`: pair p = e·n_ff_exp + i becomes row j (its index in `pairs`) of
 * a {n_embd, pairs.length} tensor holding column i of expert e's matrix. F16 stays F16 (bits moved), every
 * other dtype becomes F32 (dequantized) — the compact down rows of a split expert layer's hot pairs.
 * @throws EngineError 'MISSING_TENSOR'; RangeError for a pair outside n_ff_exp · n_expert.
 */
export function expertDownRows(file: GgufFile, backend: Backend, name: string, pairs: Int32Array): TensorHandle {
  const t = file.tensorMap.get(name);
  if (!t) throw new EngineError("MISSING_TENSOR", `model file lacks tensor ${name}`);
  const [nFf, nEmbd, nExp] = [t.shape[0]!, t.shape[1]!, t.shape[2] ?? 1];
  const f16 = t.type === GGMLType.F16;
  const n = Math.max(1, pairs.length);
  const out = f16 ? new Uint16Array(n * nEmbd) : new Float32Array(n * nEmbd);
  // one expert's matrix at a time (a stack can be larger than memory: --ram-budget)
  const byExpert = new Map<number, number[]>();
  pairs.forEach((p, j) => {
    if (!(p >= 0 && p < nFf * nExp)) throw new RangeError(`pair ${p} outside n_ff_exp × n_expert = ${nFf} × ${nExp}`);
    const e = Math.floor(p / nFf);
    if (!byExpert.has(e)) byExpert.set(e, []);
    byExpert.get(e)!.push(j);
  });
  const expertBytes = t.byteLength / nExp;
  for (const [e, js] of byExpert) {
    const { src } = floatElements(file, t, { offset: e * expertBytes, length: expertBytes, elements: nFf * nEmbd });
    for (const j of js) {
      const i = pairs[j]! % nFf;
      for (let r = 0; r < nEmbd; r++) out[j * nEmbd + r] = src[i + r * nFf]!;
    }
  }
  return backend.createTensor(f16 ? "f16" : "f32", [nEmbd, n], out);
}

/**
 * Row-major transpose of the [rows × cols] matrix at element `base` of `src` into the same place of `out`:
 * out[base + c·rows + r] = src[base + r·cols + c], in 32 × 32 blocks (a plain double loop strides through
 * one of the two arrays a whole row per element). Any element type (F32 values, raw F16 bits).
 */
export function transposeBlocked<T extends Float32Array | Uint16Array>(
  src: T,
  out: T,
  base: number,
  rows: number,
  cols: number,
): void {
  const B = 32;
  for (let r0 = 0; r0 < rows; r0 += B) {
    const r1 = Math.min(rows, r0 + B);
    for (let c0 = 0; c0 < cols; c0 += B) {
      const c1 = Math.min(cols, c0 + B);
      for (let r = r0; r < r1; r++) {
        const s0 = base + r * cols;
        for (let c = c0; c < c1; c++) out[base + c * rows + r] = src[s0 + c]!;
      }
    }
  }
}

/**
 * Whether sparse experts read a stacked down projection of this type neuron-major (a copy made by
 * {@link transposeDownExperts}): F16 and F32, whose copy has the file's size, so a token reads only its
 * firing neurons' rows. A quantized stack (Q4_0: 0.56 bytes per weight) has no exact neuron-major form
 * of its own size: its copy would be F32 (7× the bytes per row), more than the dense product reads at
 * SmallThinker's 40 % firing. It stays as the file stores it, and the down projection runs densely
 * (`mul_mat_id`) over the sparse activations: inactive neurons' activations are 0, so the result is
 * the dense run's bit for bit, while gate and up still skip what they can. A PowerInfer-layout file
 * (`gen-model --format pwri`, `convert --to pwri`) stores the stack neuron-major in its own type
 * (`blk.N.ffn_down_exps_t.weight`, quantized along n_embd), which sparse experts read row by row.
 */
export function expertDownNeuronMajor(type: GGMLType): boolean {
  return type === GGMLType.F16 || type === GGMLType.F32;
}

/**
 * The neuron-major copy of stacked expert down projections ({n_ff_exp, n_embd, n_expert} →
 * {n_embd, n_ff_exp, n_expert}) on `backend`: F16 stays F16, every other dtype becomes F32 (the engine
 * makes it only for F16 and F32 stacks: {@link expertDownNeuronMajor}).
 */
export function transposeDownExperts(file: GgufFile, backend: Backend, name: string): TensorHandle {
  const t = file.tensorMap.get(name);
  if (!t) throw new EngineError("MISSING_TENSOR", `model file lacks tensor ${name}`);
  const [nFf, nEmbd, nExp] = [t.shape[0]!, t.shape[1]!, t.shape[2] ?? 1];
  const { src, f16 } = floatElements(file, t);
  const n = nFf * nEmbd;
  const out = f16 ? new Uint16Array(n * nExp) : new Float32Array(n * nExp);
  // expert x: its n_embd rows of n_ff_exp → n_ff_exp rows of n_embd
  for (let x = 0; x < nExp; x++) transposeBlocked(src, out, x * n, nEmbd, nFf);
  return backend.createTensor(f16 ? "f16" : "f32", [nEmbd, nFf, nExp], out);
}
