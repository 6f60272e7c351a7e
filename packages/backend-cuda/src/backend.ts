/**
 * A loaded GPU backend: core's {@link Backend} interface over a GPU addon (CUDA, ROCm or the
 * emulator — the same class for all three).
 */
import {
  type Backend,
  BackendError,
  type ComputeResult,
  type DeviceInfo,
  type DType,
  DTYPE_CODES,
  dtypeBytes,
  type FileTensorSource,
  type Graph,
  OP_CODES,
  type OpName,
  type TensorHandle,
  toBackendError,
} from "@powerinfer/core";
import type { NativeComputeResult, NativeGpuBackend, NativeGpuDevice } from "./native.js";

/** DeviceInfo of core from an addon's device. */
export function deviceInfo(d: NativeGpuDevice): DeviceInfo {
  return { kind: "gpu", name: d.name, freeMemory: d.freeMemory, totalMemory: d.totalMemory };
}

class GpuTensor implements TensorHandle {
  constructor(
    readonly backend: string,
    readonly id: number,
    readonly dtype: DType,
    readonly ne: readonly number[],
    readonly byteLength: number,
  ) {}
}

/** A GPU backend instance. Create it with a descriptor's `load()` (e.g. `cudaBackend.load()`). */
export class GpuBackend implements Backend {
  /** Host threads: the device computes, one host thread drives it. */
  readonly threads = 1;
  private readonly live = new Map<number, GpuTensor>();
  private disposed = false;

  constructor(
    readonly name: string,
    private readonly native: NativeGpuBackend,
    readonly devices: DeviceInfo[],
  ) {}

  /** The device as the runtime reports it now (name, arch, warp size, free/total memory). */
  device(): NativeGpuDevice {
    this.check();
    try {
      return this.native.deviceInfo();
    } catch (e) {
      throw toBackendError(this.name, e, "UNAVAILABLE");
    }
  }

  /** Device bytes of the compute arena (graph inputs, intermediates, scratch), outside `allocatedBytes`. */
  arenaBytes(): number {
    this.check();
    return this.native.arenaBytes();
  }

  private check(): void {
    if (this.disposed) throw new BackendError("DISPOSED", `${this.name}: the backend was disposed`);
  }

  private own(t: TensorHandle): GpuTensor {
    this.check();
    const mine = this.live.get(t?.id);
    if (!mine || mine !== t) {
      throw new BackendError("BAD_TENSOR", `${this.name}: tensor ${t?.id} is not a live tensor of this backend`);
    }
    return mine;
  }

  private shape(dtype: DType, ne: readonly number[]): number {
    if (DTYPE_CODES[dtype] === undefined) throw new BackendError("BAD_TENSOR", `${this.name}: unknown dtype ${dtype}`);
    if (!Array.isArray(ne) || ne.length < 1 || ne.length > 4 || ne.some((n) => !Number.isInteger(n) || n < 1)) {
      throw new BackendError("BAD_TENSOR", `${this.name}: bad shape [${String(ne)}]`);
    }
    try {
      return dtypeBytes(dtype, ne);
    } catch (e) {
      throw new BackendError("BAD_TENSOR", `${this.name}: ${(e as Error).message}`);
    }
  }

  /**
   * `true` for get_rows/mul_mat/mul_mat_sparse/axpy_sparse and the routed-expert products
   * mul_mat_id/mul_mat_id_sparse/axpy_id_sparse with f32, f16, bf16, q8_0, q4_0 weights,
   * attention/attention_swa with f32/f16 caches, cpy into f32/f16/bf16, and every other op on f32. Other weight
   * dtypes (K-quants, q4_1, q5_*) answer false, so placement keeps them on the CPU.
   */
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

  /** Device bytes held by tensors (the compute arena is not counted; see {@link arenaBytes}). */
  allocatedBytes(): number {
    this.check();
    return this.native.allocatedBytes();
  }

  /**
   * A device tensor filled from `data` (exactly `dtypeBytes(dtype, ne)` bytes) or zeroed.
   * @throws BackendError 'OUT_OF_MEMORY' beyond the memory budget or when the device refuses, 'BAD_TENSOR'.
   */
  createTensor(dtype: DType, ne: readonly number[], data?: ArrayBufferView): TensorHandle {
    this.check();
    const bytes = this.shape(dtype, ne);
    if (data !== undefined && data.byteLength !== bytes) {
      throw new BackendError(
        "BAD_TENSOR",
        `${this.name}: data has ${data.byteLength} bytes, ${dtype}[${ne.join(", ")}] needs ${bytes}`,
      );
    }
    let id: number;
    try {
      id = this.native.createTensor(DTYPE_CODES[dtype], ne, data);
    } catch (e) {
      throw toBackendError(this.name, e, "BAD_TENSOR");
    }
    const t = new GpuTensor(this.name, id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
  }

  /** A device tensor uploaded from a file range (read in 64 MiB pieces). @throws BackendError 'IO', 'OUT_OF_MEMORY'. */
  mapTensor(dtype: DType, ne: readonly number[], source: FileTensorSource): TensorHandle {
    this.check();
    const bytes = this.shape(dtype, ne);
    let id: number;
    try {
      id = this.native.loadTensor(DTYPE_CODES[dtype], ne, source.path, source.fileOffset, source.byteLength);
    } catch (e) {
      throw toBackendError(this.name, e, "IO");
    }
    const t = new GpuTensor(this.name, id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
  }

  readTensor(t: TensorHandle): Uint8Array {
    const mine = this.own(t);
    try {
      return this.native.readTensor(mine.id);
    } catch (e) {
      throw toBackendError(this.name, e, "BAD_TENSOR");
    }
  }

  writeTensor(t: TensorHandle, data: ArrayBufferView, offset = 0): void {
    const mine = this.own(t);
    try {
      this.native.writeTensor(mine.id, data, offset);
    } catch (e) {
      throw toBackendError(this.name, e, "BAD_TENSOR");
    }
  }

  freeTensor(t: TensorHandle): void {
    const mine = this.own(t);
    this.live.delete(mine.id);
    try {
      this.native.freeTensor(mine.id);
    } catch (e) {
      throw toBackendError(this.name, e, "BAD_TENSOR");
    }
  }

  /**
   * Validates the graph natively, uploads its inputs, runs its kernels in order on the device and
   * copies its outputs back, in one call.
   * @throws BackendError 'BAD_GRAPH' / 'UNSUPPORTED_OP' (checked before anything runs), 'OUT_OF_MEMORY'
   *   (the compute arena), 'UNAVAILABLE' (a device fault).
   */
  compute(graph: Graph): ComputeResult {
    this.check();
    const g = graph.encode();
    let r: NativeComputeResult;
    try {
      r = this.native.compute(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
    } catch (e) {
      throw toBackendError(this.name, e);
    }
    return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
  }

  /** As {@link compute}, driven from a libuv worker thread; the graph's arrays must not change until it settles. */
  async computeAsync(graph: Graph): Promise<ComputeResult> {
    this.check();
    const g = graph.encode();
    try {
      const r = await this.native.computeAsync(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
      return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
    } catch (e) {
      throw toBackendError(this.name, e);
    }
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.live.clear();
    this.native.dispose();
  }
}
