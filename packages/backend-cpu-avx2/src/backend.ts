/**
 * The loaded CPU backend: core's {@link Backend} interface over the native addon.
 */
import {
  type Backend,
  BackendError,
  type BackendErrorCode,
  type ComputeResult,
  type DeviceInfo,
  type DType,
  DTYPE_CODES,
  dtypeBytes,
  type FileTensorSource,
  type Graph,
  type NeuronCacheOptions,
  type NeuronCacheStats,
  OP_CODES,
  type OpName,
  type TensorHandle,
  toBackendError as coreToBackendError,
} from "@powerinfer/core";
import type { NativeBackend, NativeComputeResult } from "./native.js";

/** Turns an error of the addon (an Error with a `code`) into a {@link BackendError}. */
export function toBackendError(e: unknown, fallback: BackendErrorCode = "BAD_GRAPH"): BackendError {
  return coreToBackendError("cpu", e, fallback);
}

function dtypeCode(dtype: DType): number {
  const c = DTYPE_CODES[dtype];
  if (c === undefined) throw new BackendError("BAD_TENSOR", `cpu: unknown dtype ${String(dtype)}`);
  return c;
}

function checkShape(dtype: DType, ne: readonly number[]): number {
  if (!Array.isArray(ne) || ne.length < 1 || ne.length > 4) {
    throw new BackendError("BAD_TENSOR", `cpu: tensor rank must be 1..4, got [${String(ne)}]`);
  }
  for (const n of ne) {
    if (!Number.isInteger(n) || n < 1)
      throw new BackendError("BAD_TENSOR", `cpu: bad dimension ${n} in [${ne.join(", ")}]`);
  }
  try {
    return dtypeBytes(dtype, ne);
  } catch (e) {
    throw new BackendError("BAD_TENSOR", `cpu: ${(e as Error).message}`);
  }
}

class CpuTensor implements TensorHandle {
  readonly backend = "cpu";
  constructor(
    readonly id: number,
    readonly dtype: DType,
    readonly ne: readonly number[],
    readonly byteLength: number,
  ) {}
}

/** A CPU backend instance. Create it with `cpuBackend.load()`. */
export class CpuBackend implements Backend {
  readonly name = "cpu";
  private readonly live = new Map<number, CpuTensor>();
  private disposed = false;

  constructor(
    private readonly native: NativeBackend,
    readonly devices: DeviceInfo[],
  ) {}

  /** Worker threads (the calling thread included). */
  get threads(): number {
    return this.native.threads;
  }

  /** The kernel set in use: "avx2" or "scalar". */
  get kernel(): string {
    return this.native.kernel;
  }

  /** Why that kernel set: "avx2+fma+f16c", "scalar (forced by forceScalar)", "scalar (CPU lacks AVX2)". */
  get kernelReason(): string {
    return this.native.kernelReason;
  }

  private check(): void {
    if (this.disposed) throw new BackendError("DISPOSED", "cpu: the backend was disposed");
  }

  private own(t: TensorHandle): CpuTensor {
    this.check();
    const mine = this.live.get(t?.id);
    if (!mine || mine !== t) {
      throw new BackendError(
        "BAD_TENSOR",
        `cpu: tensor ${t?.id} is not a live tensor of this backend (freed or foreign)`,
      );
    }
    return mine;
  }

  supportsOp(op: OpName, dtypes: readonly DType[]): boolean {
    const code = OP_CODES[op];
    if (code === undefined) return false;
    const codes: number[] = [];
    for (const d of dtypes) {
      const c = DTYPE_CODES[d];
      if (c === undefined) return false;
      codes.push(c);
    }
    return this.native.supportsOp(code, codes);
  }

  allocatedBytes(): number {
    this.check();
    return this.native.allocatedBytes();
  }

  /**
   * A zero-filled tensor, or one filled from `data` (exactly `dtypeBytes(dtype, ne)` bytes).
   * Allocated 64-byte aligned and counted against `memoryBudget`.
   * @throws BackendError 'BAD_TENSOR' (shape, dtype or data length), 'OUT_OF_MEMORY' (budget), 'DISPOSED'.
   */
  createTensor(dtype: DType, ne: readonly number[], data?: ArrayBufferView): TensorHandle {
    this.check();
    const bytes = checkShape(dtype, ne);
    if (data !== undefined && data.byteLength !== bytes) {
      throw new BackendError(
        "BAD_TENSOR",
        `cpu: data has ${data.byteLength} bytes, ${dtype}[${ne.join(", ")}] needs ${bytes}`,
      );
    }
    let id: number;
    try {
      id = this.native.createTensor(dtypeCode(dtype), ne, data);
    } catch (e) {
      throw toBackendError(e, "BAD_TENSOR");
    }
    const t = new CpuTensor(id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
  }

  /**
   * A tensor whose bytes stay in the file: the file is mmapped once (read-only, private) and the tensor
   * points into the mapping (zero copy; counts 0 toward `allocatedBytes`).
   * @throws BackendError 'BAD_TENSOR' (byteLength ≠ shape, range beyond the file, misaligned), 'IO' (open/mmap).
   */
  mapTensor(dtype: DType, ne: readonly number[], source: FileTensorSource): TensorHandle {
    this.check();
    const bytes = checkShape(dtype, ne);
    let id: number;
    try {
      id = this.native.mapTensor(dtypeCode(dtype), ne, source.path, source.fileOffset, source.byteLength);
    } catch (e) {
      throw toBackendError(e, "IO");
    }
    const t = new CpuTensor(id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
  }

  /**
   * A file-backed sparse FFN weight: its rows are read on demand (O_DIRECT, or pread +
   * posix_fadvise(DONTNEED) where O_DIRECT is refused) into a neuron cache of `cache.hot` pinned rows
   * and `cache.coldRows` LRU rows, by a pool of reader threads (POWERINFER_IO_THREADS, default 16). Counts 0
   * toward `allocatedBytes`; its slots are reported by {@link neuronCacheStats}.
   * @throws BackendError 'BAD_TENSOR' (shape, range beyond the file, hot row out of range), 'IO' (open/read),
   *   'OUT_OF_MEMORY' (slots).
   */
  mapTensorCached(
    dtype: DType,
    ne: readonly number[],
    source: FileTensorSource,
    cache: NeuronCacheOptions,
  ): TensorHandle {
    this.check();
    const bytes = checkShape(dtype, ne);
    if (ne.length !== 2)
      throw new BackendError("BAD_TENSOR", `cpu: a cached tensor is 2-d (rows = neurons), got [${ne.join(", ")}]`);
    if (!Number.isInteger(cache.coldRows) || cache.coldRows < 0)
      throw new BackendError("BAD_TENSOR", `cpu: coldRows must be an integer ≥ 0, got ${cache.coldRows}`);
    let id: number;
    try {
      const shareWith = cache.shareWith ? this.own(cache.shareWith).id : undefined;
      id = this.native.mapTensorCached(dtypeCode(dtype), ne, source.path, source.fileOffset, source.byteLength, {
        ...cache,
        shareWith,
      });
    } catch (e) {
      throw toBackendError(e, "IO");
    }
    const t = new CpuTensor(id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
  }

  /** Counters of this backend's neuron caches (monotonic since creation). */
  neuronCacheStats(): NeuronCacheStats {
    this.check();
    return this.native.cacheStats();
  }

  readTensor(t: TensorHandle): Uint8Array {
    const mine = this.own(t);
    try {
      return this.native.readTensor(mine.id);
    } catch (e) {
      throw toBackendError(e, "BAD_TENSOR");
    }
  }

  /** @throws BackendError 'BAD_TENSOR' for a mapped (read-only) tensor or a write beyond its end. */
  writeTensor(t: TensorHandle, data: ArrayBufferView, offset = 0): void {
    const mine = this.own(t);
    try {
      this.native.writeTensor(mine.id, data, offset);
    } catch (e) {
      throw toBackendError(e, "BAD_TENSOR");
    }
  }

  freeTensor(t: TensorHandle): void {
    const mine = this.own(t);
    this.live.delete(mine.id);
    try {
      this.native.freeTensor(mine.id);
    } catch (e) {
      throw toBackendError(e, "BAD_TENSOR");
    }
  }

  /**
   * Computes a graph in one native call on the calling thread (plus the pool's workers).
   * @throws BackendError 'BAD_GRAPH' for a malformed graph (checked natively before anything runs).
   */
  compute(graph: Graph): ComputeResult {
    this.check();
    const g = graph.encode();
    let r: NativeComputeResult;
    try {
      r = this.native.compute(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
    } catch (e) {
      throw toBackendError(e);
    }
    return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
  }

  /** As {@link compute}, on a libuv worker thread; the graph's arrays must not be touched until it settles. */
  async computeAsync(graph: Graph): Promise<ComputeResult> {
    this.check();
    const g = graph.encode();
    try {
      const r = await this.native.computeAsync(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
      return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
    } catch (e) {
      throw toBackendError(e);
    }
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.live.clear();
    this.native.dispose();
  }
}
