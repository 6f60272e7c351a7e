/**
 * The backend interface (specification version {@link BACKEND_API_VERSION}).
 *
 * A backend package exports a {@link BackendDescriptor}; the registry probes it (cheap, side-effect
 * free) and loads it on demand. A loaded {@link Backend} owns tensors (weights mapped or uploaded,
 * persistent buffers such as the KV cache) and computes whole {@link Graph}s in one call.
 *
 * Shapes follow ggml: `ne[0]` is the innermost, contiguous dimension. A matrix whose rows are
 * neurons (`blk.N.ffn_up.weight`, ne = [n_embd, n_ff]) has `ne[0] = n_embd` (row length) and
 * `ne[1] = n_ff` (row count).
 */
import type { Graph } from "./graph.js";

/** Version of this interface. A backend built for another major version is refused by the registry. */
export const BACKEND_API_VERSION = 1;

/** Element types a backend may hold. Quantized names follow ggml (`q4_K` is ggml's Q4_K). */
export type DType =
  | "f32"
  | "f16"
  | "bf16"
  | "q8_0"
  | "q4_0"
  | "q4_1"
  | "q5_0"
  | "q5_1"
  | "q4_K"
  | "q5_K"
  | "q6_K"
  | "i32";

export const DTYPES: readonly DType[] = [
  "f32",
  "f16",
  "bf16",
  "q8_0",
  "q4_0",
  "q4_1",
  "q5_0",
  "q5_1",
  "q4_K",
  "q5_K",
  "q6_K",
  "i32",
];

/** Block size (elements) and bytes per block of each dtype (ggml's layouts). */
export const DTYPE_LAYOUT: Readonly<Record<DType, { blockSize: number; typeSize: number }>> = {
  f32: { blockSize: 1, typeSize: 4 },
  f16: { blockSize: 1, typeSize: 2 },
  bf16: { blockSize: 1, typeSize: 2 },
  q8_0: { blockSize: 32, typeSize: 34 },
  q4_0: { blockSize: 32, typeSize: 18 },
  q4_1: { blockSize: 32, typeSize: 20 },
  q5_0: { blockSize: 32, typeSize: 22 },
  q5_1: { blockSize: 32, typeSize: 24 },
  q4_K: { blockSize: 256, typeSize: 144 },
  q5_K: { blockSize: 256, typeSize: 176 },
  q6_K: { blockSize: 256, typeSize: 210 },
  i32: { blockSize: 1, typeSize: 4 },
};

/**
 * Bytes of a contiguous tensor.
 * @param ne shape, ne[0] first; ne[0] must be a multiple of the dtype's block size.
 * @throws RangeError when ne[0] is not a multiple of the block size.
 */
export function dtypeBytes(dtype: DType, ne: readonly number[]): number {
  const { blockSize, typeSize } = DTYPE_LAYOUT[dtype];
  const ne0 = ne[0] ?? 1;
  if (ne0 % blockSize !== 0) {
    throw new RangeError(`${dtype}: row length ${ne0} is not a multiple of the block size ${blockSize}`);
  }
  let rows = 1;
  for (let i = 1; i < ne.length; i++) rows *= ne[i]!;
  return (ne0 / blockSize) * typeSize * rows;
}

/** One compute device of a backend. Memory in bytes. */
export interface DeviceInfo {
  kind: "cpu" | "gpu";
  name: string;
  /** Free memory in bytes (for a CPU device: available system memory). */
  freeMemory: number;
  /** Total memory in bytes. */
  totalMemory: number;
}

/** What `probe()` found. `reason` says why a backend is unusable, or what it chose (e.g. "avx2+fma+f16c"). */
export interface ProbeResult {
  usable: boolean;
  /** Higher is preferred by `"auto"` selection (CPU backends ~10, GPU backends ~100). */
  score: number;
  reason: string;
  devices: DeviceInfo[];
}

/** Options for {@link BackendDescriptor.load}. Every field is optional. */
export interface BackendLoadOptions {
  /** Worker threads for CPU work. Default: the backend's choice (physical cores for the CPU backend). */
  threads?: number;
  /** Bytes this backend may allocate for tensors; allocation beyond it throws {@link BackendError} 'OUT_OF_MEMORY'. Default: unlimited. */
  memoryBudget?: number;
  /** CPU backend: force the portable scalar kernels even when SIMD is available (for tests). Default false. */
  forceScalar?: boolean;
  /**
   * CPU backend: repack weights into the backend's own interleaved layouts at their first dense use
   * (today Q4_0 and Q4_K with a row count divisible by 8: groups of 8 rows, see the backend's README). The copy
   * replaces the mapped pages in memory and counts against memoryBudget; results are bit-identical either
   * way. false keeps every weight zero-copy (`--no-repack`). Default true.
   */
  repack?: boolean;
  /**
   * CPU backend: bytes of mapped weights (tensors of 2 MiB or more) it may copy into memory backed by
   * transparent huge pages (fewer TLB misses for the sparse operators' scattered rows); 0 keeps every weight
   * mapped from its file (`--mmap`). Default: the backend's choice (75 % of the available memory when the
   * kernel offers transparent huge pages).
   */
  hugePageCopyBytes?: number;
  /**
   * CPU backend: `mapTensor` only reserves the huge-page copies (the same tensors as without deferral) and
   * {@link Backend.settle} makes them on a worker thread, so that a server's event loop keeps answering
   * while a large model loads; until then the weights are read through the file mapping (the same bytes).
   * Default false (each copy is made inside `mapTensor`).
   */
  deferHugePageCopies?: boolean;
}

/** What a backend package exports. */
export interface BackendDescriptor {
  /** Unique name, e.g. "cpu", "cuda". */
  readonly name: string;
  /** The interface version it implements; must equal {@link BACKEND_API_VERSION}. */
  readonly apiVersion: number;
  /** Cheap, side-effect-free check: is the toolchain/driver/CPU feature there, which devices. Never throws. */
  probe(): ProbeResult | Promise<ProbeResult>;
  /** Imports the native code and creates a backend instance. */
  load(options?: BackendLoadOptions): Promise<Backend>;
}

/** A tensor owned by a backend (weights, KV cache, any persistent buffer). */
export interface TensorHandle {
  readonly backend: string;
  readonly dtype: DType;
  /** Shape, ne[0] first, 1–4 dims. */
  readonly ne: readonly number[];
  readonly byteLength: number;
  /** Backend-private identifier. */
  readonly id: number;
}

/** Where a tensor lies in a file (a GGUF tensor's data). Offsets in bytes from the file start. */
export interface FileTensorSource {
  path: string;
  fileOffset: number;
  byteLength: number;
}

/**
 * How a file-backed sparse FFN weight is cached (see {@link Backend.mapTensorCached}). Rows are neurons
 * (ne[1] rows of ne[0] elements).
 */
export interface NeuronCacheOptions {
  /** Bytes between row starts in the file (default: the row size, i.e. a plain row-major tensor). */
  rowStride?: number;
  /**
   * Bundled layout: bytes of one neuron record in the file (all parts: up, gate, down rows); the cache
   * holds whole records and this tensor is the part at offset 0. Default: the tensor's row size.
   */
  recordBytes?: number;
  /** Bundled layout: records per bucket (buckets start 4 KiB aligned; default 1). */
  bucketRows?: number;
  /** Bundled layout: bytes between bucket starts (default rowStride × bucketRows). */
  bucketStride?: number;
  /**
   * Bundled layout: this tensor is another part of the records of `shareWith`'s cache, at byte
   * `partOffset` of each record (the other options are then ignored; its requests are not counted).
   */
  shareWith?: TensorHandle;
  partOffset?: number;
  /**
   * Tensors with the same pool > 0 and row size share one LRU region (the sum of their coldRows): one
   * layer can use slots another is not using. 0: a region of its own.
   */
  pool?: number;
  /** Rows pinned in memory for the tensor's lifetime (read at bind time): the hot neurons. */
  hot?: Int32Array;
  /** Further rows held in a least-recently-used region, filled from the file on demand. */
  coldRows: number;
  /**
   * Tensors with the same group > 0 are the weights of one FFN: the active list of the first sparse op
   * queues the reads of all of them (expert stacks: the experts the first expert op uses).
   */
  group?: number;
  /**
   * A stacked expert tensor ne = [n_embd, n_ff_exp, n_expert] (or [n_ff_exp, n_embd, n_expert]) cached one
   * expert per row: row e is expert e's whole matrix (contiguous in the file), `hot` and `coldRows` count
   * experts, and only the routed-expert ops (mul_mat_id, mul_mat_id_sparse, axpy_id_sparse) read it.
   * Not combinable with the bundled-layout options.
   */
  expertRows?: boolean;
  /**
   * With expertRows, F16/F32 only: the file holds each expert as `transposeRows` rows (llama.cpp's down
   * stack {n_ff_exp, n_embd, n_expert}: n_embd rows of n_ff_exp) and the tensor (ne = [n_embd, n_ff_exp,
   * n_expert], neuron-major) receives each expert transposed as it is read, so axpy_id_sparse reads only
   * the active neurons' rows. readTensor returns the transposed bytes.
   */
  transposeRows?: number;
}

/** Counters of a backend's neuron caches, monotonic since the backend was created (take differences). */
export interface NeuronCacheStats {
  /** Rows asked for that were already in memory (pinned, cached, or read ahead by an earlier op of the FFN's own step are misses). */
  hits: number;
  /** Rows read from the file for the step that asked for them. */
  misses: number;
  /** Read calls issued (adjacent rows are read together). */
  reads: number;
  /** Bytes transferred from the file (whole 4 KiB blocks). */
  bytesRead: number;
  /** Compute threads' time waiting for rows, summed over threads (ms). */
  stallMs: number;
  /** Wall time with at least one read in flight (ms). */
  ioBusyMs: number;
  /** Failed reads (the compute that needed them threw BackendError 'IO'). */
  ioErrors: number;
  /** Bytes held by the caches' slots now (pinned + LRU). */
  cacheBytes: number;
  /** Reader threads (the CPU backend: 4 with io_uring, each with a ring of its own). */
  ioThreads: number;
  /**
   * Reads an io_uring reader keeps in flight; 0 or absent: the reader threads issue one pread each
   * (`POWERINFER_IO=pread`, or a kernel that refuses io_uring).
   */
  ioDepth?: number;
  /** Whether every cache reads with O_DIRECT (false: reads through the page cache, posix_fadvise(DONTNEED) after each). */
  direct: boolean;
}

/** Op names of the interface. See {@link Graph} for each op's contract. */
export type OpName =
  | "get_rows"
  | "mul_mat"
  | "rms_norm"
  | "norm"
  | "rope"
  | "softmax"
  | "attention"
  | "add"
  | "mul"
  | "scale"
  | "silu"
  | "relu"
  | "gelu"
  | "cpy"
  | "slice"
  | "mul_mat_sparse"
  | "axpy_sparse"
  | "sigmoid"
  | "top_k"
  | "mul_mat_id"
  | "moe_sum"
  | "mul_mat_id_sparse"
  | "axpy_id_sparse"
  | "reshape"
  | "attention_swa"
  | "moe_scatter";

/**
 * The ops of routed experts (mixture-of-experts FFNs): an optional capability. A backend that does not
 * implement them answers `supportsOp` with false, and loading a model with experts on it fails with
 * EngineError 'UNSUPPORTED_OP' naming the backend and the op (there is no host fallback: the experts a
 * token uses are computed inside the graph).
 */
export const EXPERT_OPS: readonly OpName[] = [
  "top_k",
  "mul_mat_id",
  "moe_sum",
  "mul_mat_id_sparse",
  "axpy_id_sparse",
  "moe_scatter",
];

/** Result of computing a graph. */
export interface ComputeResult {
  /** Per graph node: rows of the weight matrix actually read (sparse ops; dense ops report 0). */
  rowsRead: Float64Array;
  /** Wall time of the compute call in milliseconds, measured by the backend. */
  elapsedMs: number;
}

/** A loaded backend. */
export interface Backend {
  readonly name: string;
  readonly devices: DeviceInfo[];
  /** Threads the backend computes with (1 for a device backend's host side). */
  readonly threads: number;
  /**
   * Whether `op` is implemented for the given dtypes: the weight/source dtype first (e.g. ["q4_0"] for
   * a mul_mat with Q4_0 weights). Placement and the conformance kit ask this.
   */
  supportsOp(op: OpName, dtypes: readonly DType[]): boolean;
  /** Bytes currently allocated by this backend's tensors (mapped weights count 0 on a CPU backend). */
  allocatedBytes(): number;
  /**
   * A tensor filled from `data` (or zero when absent).
   * @throws BackendError 'OUT_OF_MEMORY' beyond the memory budget, 'BAD_TENSOR' when `data` has the wrong length.
   */
  createTensor(dtype: DType, ne: readonly number[], data?: ArrayBufferView): TensorHandle;
  /** A tensor whose bytes stay in the file: mmapped zero-copy on the CPU, uploaded on a device. */
  mapTensor(dtype: DType, ne: readonly number[], source: FileTensorSource): TensorHandle;
  /**
   * Optional: a weight whose rows stay in the file and are read on demand into a neuron cache (pinned
   * hot rows + an LRU region), bypassing the page cache. Only the sparse ops (mul_mat_sparse,
   * axpy_sparse, without a row list) may read it — or, cached one expert per row
   * ({@link NeuronCacheOptions.expertRows}), the routed-expert ops; any other use is a BAD_GRAPH error at compute.
   */
  mapTensorCached?(
    dtype: DType,
    ne: readonly number[],
    source: FileTensorSource,
    cache: NeuronCacheOptions,
  ): TensorHandle;
  /** Optional: counters of the neuron caches (backends with {@link mapTensorCached}). */
  neuronCacheStats?(): NeuronCacheStats;
  /** Copies a tensor's bytes out (for tests and tools). */
  readTensor(t: TensorHandle): Uint8Array;
  /** Overwrites bytes of a tensor starting at byte `offset`. */
  writeTensor(t: TensorHandle, data: ArrayBufferView, offset?: number): void;
  /** Frees a tensor. Using it afterwards throws. */
  freeTensor(t: TensorHandle): void;
  /** Computes a graph synchronously in one call; outputs land in the arrays the graph named. */
  compute(graph: Graph): ComputeResult;
  /** Computes a graph off the JS thread so that another backend can work at the same time. */
  computeAsync(graph: Graph): Promise<ComputeResult>;
  /**
   * Optional: finishes work the backend deferred off the JS thread (the CPU backend's huge-page copies of
   * mapped weights with {@link BackendLoadOptions.deferHugePageCopies}); resolves at once when there is none.
   * `Model.load` awaits it before it returns.
   */
  settle?(): Promise<void>;
  /** Frees everything. The backend is unusable afterwards. */
  dispose(): void;
}

export type BackendErrorCode =
  | "UNAVAILABLE"
  | "OUT_OF_MEMORY"
  | "UNSUPPORTED_OP"
  | "BAD_TENSOR"
  | "BAD_GRAPH"
  | "IO"
  | "DISPOSED"
  | "API_VERSION"
  /** A malformed backend configuration file (see discovery.ts). */
  | "BAD_CONFIG";

/** Every error a backend or the registry throws on purpose. */
export class BackendError extends Error {
  constructor(
    readonly code: BackendErrorCode,
    message: string,
  ) {
    super(message);
    this.name = "BackendError";
  }
}

const BACKEND_ERROR_CODES = new Set<BackendErrorCode>([
  "UNAVAILABLE",
  "OUT_OF_MEMORY",
  "UNSUPPORTED_OP",
  "BAD_TENSOR",
  "BAD_GRAPH",
  "IO",
  "DISPOSED",
  "API_VERSION",
  "BAD_CONFIG",
]);

/**
 * A native addon's error (an Error whose `code` is a {@link BackendErrorCode}) as a {@link BackendError}
 * whose message starts with `name: `; any other error gets `fallback` as its code.
 */
export function toBackendError(name: string, e: unknown, fallback: BackendErrorCode = "BAD_GRAPH"): BackendError {
  if (e instanceof BackendError) return e;
  const err = e as { code?: unknown; message?: unknown };
  const code =
    typeof err?.code === "string" && BACKEND_ERROR_CODES.has(err.code as BackendErrorCode)
      ? (err.code as BackendErrorCode)
      : fallback;
  return new BackendError(code, `${name}: ${String(err?.message ?? e)}`);
}
