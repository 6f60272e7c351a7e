/**
 * The loaded CPU backend: core's native adapter ({@link NativeBackend}) over the CPU addon, plus what the
 * CPU has beyond the contract (the kernel set in use, file-backed weights with a neuron cache).
 */
import {
  BackendError,
  type BackendErrorCode,
  type DeviceInfo,
  DTYPE_CODES,
  type DType,
  type FileTensorSource,
  NativeBackend,
  type NeuronCacheOptions,
  type NeuronCacheStats,
  type TensorHandle,
  toBackendError as coreToBackendError,
} from "@powerinfer/core";
import type { NativeCpuBackend } from "./native.js";

/** Turns an error of the addon (an Error with a `code`) into a {@link BackendError}. */
export function toBackendError(e: unknown, fallback: BackendErrorCode = "BAD_GRAPH"): BackendError {
  return coreToBackendError("cpu", e, fallback);
}

/**
 * A CPU backend instance. Create it with `cpuBackend.load()`. Tensors are allocated 64-byte aligned and
 * counted against `memoryBudget`; `mapTensor` maps the file (read-only, private, counted 0) and, within
 * `hugePageCopyBytes`, copies a tensor of 2 MiB or more into memory backed by transparent huge pages.
 */
export class CpuBackend extends NativeBackend<NativeCpuBackend> {
  constructor(native: NativeCpuBackend, devices: DeviceInfo[]) {
    super("cpu", native, devices, native.threads);
  }

  /** The kernel set in use: "avx2", "avx2+avx512vnni" (the same kernels, byte dot products in VNNI) or "scalar". */
  get kernel(): string {
    return this.native.kernel;
  }

  /** Why that kernel set: "avx2+fma+f16c+avx512vnni", "avx2+fma+f16c", "scalar (forced by forceScalar)", "scalar (CPU lacks AVX2)". */
  get kernelReason(): string {
    return this.native.kernelReason;
  }

  /**
   * A file-backed sparse FFN weight (or, `cache.expertRows`, a stacked expert tensor cached one expert per
   * row): its rows are read on demand (O_DIRECT, or pread +
   * posix_fadvise(DONTNEED) where O_DIRECT is refused) into a neuron cache of `cache.hot` pinned rows
   * and `cache.coldRows` LRU rows, by 4 io_uring threads (64 reads in flight in all) where the kernel allows a ring,
   * else (or with POWERINFER_IO=pread) by a pool of pread threads (POWERINFER_IO_THREADS, default 16). Counts 0
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
    const bytes = this.shape(dtype, ne);
    if (cache.expertRows ? ne.length !== 3 : ne.length !== 2)
      throw new BackendError(
        "BAD_TENSOR",
        cache.expertRows
          ? `cpu: a cached expert stack is 3-d (rows = experts), got [${ne.join(", ")}]`
          : `cpu: a cached tensor is 2-d (rows = neurons), got [${ne.join(", ")}]`,
      );
    if (!Number.isInteger(cache.coldRows) || cache.coldRows < 0)
      throw new BackendError("BAD_TENSOR", `cpu: coldRows must be an integer ≥ 0, got ${cache.coldRows}`);
    let id: number;
    try {
      const shareWith = cache.shareWith ? this.own(cache.shareWith).id : undefined;
      id = this.native.mapTensorCached(DTYPE_CODES[dtype], ne, source.path, source.fileOffset, source.byteLength, {
        ...cache,
        shareWith,
      });
    } catch (e) {
      throw this.fail(e, "IO");
    }
    return this.track(id, dtype, ne, bytes);
  }

  /**
   * Bytes of mapped weights this backend holds as huge-page copies (`hugePageCopyBytes` of
   * `cpuBackend.load`): 0 when every weight is read through the file mapping.
   */
  hugePageCopyBytes(): number {
    this.check();
    return this.native.hugePageCopyBytes();
  }

  /**
   * Makes the huge-page copies that `mapTensor` reserved (`deferHugePageCopies` of `cpuBackend.load`) on a
   * worker thread, one tensor at a time, each swapped in when made; resolves when none is left (at once
   * when there were none). Computing meanwhile is correct (a tensor is read from its mapping until its copy
   * is in place) but slower.
   * @throws BackendError 'DISPOSED'.
   */
  async settle(): Promise<void> {
    this.check();
    while (this.native.pendingCopyBytes() > 0) await this.native.copyPendingAsync();
  }

  /** Bytes of huge-page copies reserved by `mapTensor` and not made yet (see {@link settle}). */
  pendingHugePageCopyBytes(): number {
    this.check();
    return this.native.pendingCopyBytes();
  }

  /** Counters of this backend's neuron caches (monotonic since creation). */
  neuronCacheStats(): NeuronCacheStats {
    this.check();
    return this.native.cacheStats();
  }
}
