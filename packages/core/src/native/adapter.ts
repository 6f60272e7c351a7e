/**
 * The one adapter from a native addon to a {@link Backend}: tensor bookkeeping, shape and data checks, the
 * graph's wire encoding ({@link Graph.encode}) handed to the addon, and the addon's errors turned into
 * {@link BackendError}s. The CPU and GPU packages use it alike; an out-of-tree native backend does too.
 *
 * An addon built on `native/include/powerinfer/wire.h` exposes a constructor whose instances implement
 * {@link NativeBackendInstance}; dtypes and ops cross the boundary as the header's wire codes.
 */
import type { Graph } from "../backend/graph.js";
import { DTYPE_CODES, OP_CODES } from "../backend/graph.js";
import {
  type Backend,
  BackendError,
  type BackendErrorCode,
  type ComputeResult,
  type DeviceInfo,
  type DType,
  dtypeBytes,
  type FileTensorSource,
  type OpName,
  type TensorHandle,
  toBackendError,
} from "../backend/types.js";

/** What a native compute returns: rows read per sparse node (wire order), and wall time in ms. */
export interface NativeComputeResult {
  rowsRead: Float64Array;
  elapsedMs: number;
}

/** One instance of a native addon's backend class. Dtypes and ops are wire codes (wire.h). */
export interface NativeBackendInstance {
  /** A zero-filled tensor, or one filled from `data`; returns its id (> 0). */
  createTensor(dtype: number, ne: readonly number[], data?: ArrayBufferView): number;
  /** A tensor whose bytes come from a file range (mapped, uploaded or read: the backend's choice). */
  mapTensor(dtype: number, ne: readonly number[], path: string, fileOffset: number, byteLength: number): number;
  readTensor(id: number): Uint8Array;
  writeTensor(id: number, data: ArrayBufferView, offset: number): void;
  freeTensor(id: number): void;
  allocatedBytes(): number;
  supportsOp(op: number, dtypes: readonly number[]): boolean;
  /** Runs an encoded graph (see {@link Graph.encode}) in one call. */
  compute(
    tensors: Int32Array,
    nodes: Int32Array,
    params: Float64Array,
    inputs: ArrayBufferView[],
    outputs: Float32Array[],
  ): NativeComputeResult;
  /** As compute, off the JavaScript thread; the arrays must not change until it settles. */
  computeAsync(
    tensors: Int32Array,
    nodes: Int32Array,
    params: Float64Array,
    inputs: ArrayBufferView[],
    outputs: Float32Array[],
  ): Promise<NativeComputeResult>;
  dispose(): void;
}

class NativeTensor implements TensorHandle {
  constructor(
    readonly backend: string,
    readonly id: number,
    readonly dtype: DType,
    readonly ne: readonly number[],
    readonly byteLength: number,
  ) {}
}

/**
 * core's {@link Backend} over a native addon instance. Subclasses add what their device has beyond the
 * contract (the CPU's kernel set, a GPU's device properties).
 */
export class NativeBackend<N extends NativeBackendInstance = NativeBackendInstance> implements Backend {
  private readonly live = new Map<number, NativeTensor>();
  private disposed = false;

  /**
   * @param name the registry name, also the prefix of every error message ("cpu: …")
   * @param native the addon instance (owned: disposed with this backend)
   * @param threads host threads computing (the calling thread included)
   */
  constructor(
    readonly name: string,
    protected readonly native: N,
    readonly devices: DeviceInfo[],
    readonly threads: number,
  ) {}

  /** @throws BackendError 'DISPOSED' after {@link dispose}. */
  protected check(): void {
    if (this.disposed) throw new BackendError("DISPOSED", `${this.name}: the backend was disposed`);
  }

  /** Turns an addon error (an Error with a wire error `code`) into a BackendError named for this backend. */
  protected fail(e: unknown, fallback: BackendErrorCode = "BAD_GRAPH"): BackendError {
    return toBackendError(this.name, e, fallback);
  }

  protected own(t: TensorHandle): TensorHandle {
    this.check();
    const mine = this.live.get(t?.id);
    if (!mine || mine !== t) {
      throw new BackendError(
        "BAD_TENSOR",
        `${this.name}: tensor ${t?.id} is not a live tensor of this backend (freed or foreign)`,
      );
    }
    return mine;
  }

  /** Bytes of `dtype[ne]`. @throws BackendError 'BAD_TENSOR' for an unknown dtype or a bad shape. */
  protected shape(dtype: DType, ne: readonly number[]): number {
    if (DTYPE_CODES[dtype] === undefined) {
      throw new BackendError("BAD_TENSOR", `${this.name}: unknown dtype ${String(dtype)}`);
    }
    if (!Array.isArray(ne) || ne.length < 1 || ne.length > 4) {
      throw new BackendError("BAD_TENSOR", `${this.name}: tensor rank must be 1..4, got [${String(ne)}]`);
    }
    for (const n of ne) {
      if (!Number.isInteger(n) || n < 1)
        throw new BackendError("BAD_TENSOR", `${this.name}: bad dimension ${n} in [${ne.join(", ")}]`);
    }
    try {
      return dtypeBytes(dtype, ne);
    } catch (e) {
      throw new BackendError("BAD_TENSOR", `${this.name}: ${(e as Error).message}`);
    }
  }

  protected track(id: number, dtype: DType, ne: readonly number[], bytes: number): TensorHandle {
    const t = new NativeTensor(this.name, id, dtype, [...ne], bytes);
    this.live.set(id, t);
    return t;
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

  /** Bytes held by tensors (a device's compute arena may be counted apart). */
  allocatedBytes(): number {
    this.check();
    return this.native.allocatedBytes();
  }

  /**
   * A zero-filled tensor, or one filled from `data` (exactly `dtypeBytes(dtype, ne)` bytes).
   * @throws BackendError 'BAD_TENSOR' (shape, dtype or data length), 'OUT_OF_MEMORY' (budget), 'DISPOSED'.
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
      id = this.native.createTensor(DTYPE_CODES[dtype]!, ne, data);
    } catch (e) {
      throw this.fail(e, "BAD_TENSOR");
    }
    return this.track(id, dtype, ne, bytes);
  }

  /**
   * A tensor whose bytes come from a file range (the CPU maps it, zero copy; a GPU uploads it).
   * @throws BackendError 'BAD_TENSOR' (byteLength ≠ shape, range beyond the file, misaligned), 'IO',
   *   'OUT_OF_MEMORY'.
   */
  mapTensor(dtype: DType, ne: readonly number[], source: FileTensorSource): TensorHandle {
    this.check();
    const bytes = this.shape(dtype, ne);
    let id: number;
    try {
      id = this.native.mapTensor(DTYPE_CODES[dtype]!, ne, source.path, source.fileOffset, source.byteLength);
    } catch (e) {
      throw this.fail(e, "IO");
    }
    return this.track(id, dtype, ne, bytes);
  }

  readTensor(t: TensorHandle): Uint8Array {
    const mine = this.own(t);
    try {
      return this.native.readTensor(mine.id);
    } catch (e) {
      throw this.fail(e, "BAD_TENSOR");
    }
  }

  /** @throws BackendError 'BAD_TENSOR' for a read-only (mapped) tensor or a write beyond its end. */
  writeTensor(t: TensorHandle, data: ArrayBufferView, offset = 0): void {
    const mine = this.own(t);
    try {
      this.native.writeTensor(mine.id, data, offset);
    } catch (e) {
      throw this.fail(e, "BAD_TENSOR");
    }
  }

  freeTensor(t: TensorHandle): void {
    const mine = this.own(t);
    this.live.delete(mine.id);
    try {
      this.native.freeTensor(mine.id);
    } catch (e) {
      throw this.fail(e, "BAD_TENSOR");
    }
  }

  /**
   * Runs the graph in one native call (validated natively before anything runs).
   * @throws BackendError 'BAD_GRAPH' / 'UNSUPPORTED_OP' for a graph the backend refuses, or the addon's code.
   */
  compute(graph: Graph): ComputeResult {
    this.check();
    const g = graph.encode();
    let r: NativeComputeResult;
    try {
      r = this.native.compute(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
    } catch (e) {
      throw this.fail(e);
    }
    return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
  }

  /** As {@link compute}, off the JavaScript thread; the graph's arrays must not be touched until it settles. */
  async computeAsync(graph: Graph): Promise<ComputeResult> {
    this.check();
    const g = graph.encode();
    try {
      const r = await this.native.computeAsync(g.tensors, g.nodes, g.params, g.inputs, g.outputs);
      return { rowsRead: r.rowsRead, elapsedMs: r.elapsedMs };
    } catch (e) {
      throw this.fail(e);
    }
  }

  dispose(): void {
    if (this.disposed) return;
    this.disposed = true;
    this.live.clear();
    this.native.dispose();
  }
}
