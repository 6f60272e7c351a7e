/**
 * `@powerinfer/backend-cpu-avx2`: the native CPU backend (AVX2+FMA+F16C kernels with a portable scalar
 * fallback chosen at run time), implementing core's backend interface.
 *
 * ```ts
 * import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
 * registry.register(cpuBackend);
 * const backend = await cpuBackend.load({ threads: 2 });
 * ```
 *
 * Importing this module never throws; when the addon is missing or cannot load, `probe()` reports
 * `usable: false` with reason "unavailable: <why>" and `load()` throws BackendError 'UNAVAILABLE'.
 */
import {
  BACKEND_API_VERSION,
  type BackendDescriptor,
  BackendError,
  type BackendLoadOptions,
  type DeviceInfo,
  type ProbeResult,
} from "@powerinfer/core";
import { CpuBackend, toBackendError } from "./backend.js";
import { loadAddon } from "./native.js";
import { availableMemory, cpuModelName, physicalCores, systemMemory, transparentHugePages } from "./system.js";

export { CpuBackend } from "./backend.js";
export { addonPath, loadAddon, type NativeCpuInfo } from "./native.js";
export {
  availableMemory,
  cgroupMemory,
  cgroupMemoryLimit,
  cpuModelName,
  physicalCores,
  systemMemory,
  transparentHugePages,
} from "./system.js";

function cpuDevice(): DeviceInfo {
  const mem = systemMemory();
  return { kind: "cpu", name: cpuModelName(), freeMemory: mem.free, totalMemory: mem.total };
}

/**
 * The CPU backend descriptor (name "cpu", score 10 when usable).
 *
 * `load(options)`:
 * - `threads`: worker threads including the caller; default {@link physicalCores}().
 * - `memoryBudget`: bytes `createTensor` may allocate (mapped weights and the compute arena do not
 *   count); default unlimited.
 * - `forceScalar`: use the portable kernels even on an AVX2 CPU; default false.
 * - `repack`: repack Q4_0 and Q4_K weights (row count divisible by 8) into groups of 8 interleaved rows at
 *   their first dense matrix product, for a faster matrix × vector and prompt GEMM; the copy (Q4_0: the
 *   tensor's size, Q4_K: 2.8 % more, its scales decoded) replaces the mapped pages (which are released) and
 *   counts against `memoryBudget`, results are bit-identical; default true (false: every weight stays
 *   zero-copy).
 * - `hugePageCopyBytes`: mapped weights of 2 MiB or more are copied into memory advised for transparent huge
 *   pages while the copies total at most this many bytes (0: every weight stays mapped, zero-copy). A model
 *   file's page cache may hold 4 KiB pages (a freshly written or randomly read file); the sparse operators'
 *   scattered rows then miss the TLB on nearly every row (2-vCPU AMD EPYC, 4-layer 7B F16 slice: sparse
 *   decode 48–51 t/s mapped, 55–62 t/s copied, alternating runs). The copy's mapped pages are released (the
 *   file's page cache keeps them, reclaimable); a copy that is later repacked goes back to the mapping.
 *   Default: 75 % of {@link availableMemory}() when {@link transparentHugePages}(), else 0.
 * - `deferHugePageCopies`: `mapTensor` only reserves those copies and `settle()` makes them on a worker
 *   thread (a server answers while a large model loads: 4.2 s of a blocked event loop for a 1.6 GB model
 *   here); default false.
 * @throws BackendError 'UNAVAILABLE' when the addon is missing or options are invalid.
 */
export const cpuBackend: BackendDescriptor = {
  name: "cpu",
  apiVersion: BACKEND_API_VERSION,

  probe(): ProbeResult {
    try {
      const { addon, error } = loadAddon();
      if (!addon) return { usable: false, score: 0, reason: `unavailable: ${error}`, devices: [cpuDevice()] };
      const info = addon.cpuInfo();
      return { usable: true, score: 10, reason: info.reason, devices: [cpuDevice()] };
    } catch (e) {
      return { usable: false, score: 0, reason: `unavailable: ${(e as Error).message}`, devices: [] };
    }
  },

  async load(options: BackendLoadOptions = {}): Promise<CpuBackend> {
    const { addon, error } = loadAddon();
    if (!addon) throw new BackendError("UNAVAILABLE", `cpu: unavailable: ${error}`);
    const threads = options.threads ?? physicalCores();
    if (!Number.isInteger(threads) || threads < 1 || threads > 512) {
      throw new BackendError("UNAVAILABLE", `cpu: threads must be an integer in 1..512, got ${threads}`);
    }
    const memoryBudget = options.memoryBudget ?? -1; // −1: unlimited
    if (options.memoryBudget !== undefined && !(options.memoryBudget >= 0)) {
      throw new BackendError("UNAVAILABLE", `cpu: memoryBudget must be a number ≥ 0, got ${options.memoryBudget}`);
    }
    const copy = options.hugePageCopyBytes ?? (transparentHugePages() ? Math.floor(0.75 * availableMemory()) : 0);
    if (!(copy >= 0)) {
      throw new BackendError("UNAVAILABLE", `cpu: hugePageCopyBytes must be a number ≥ 0, got ${copy}`);
    }
    try {
      const native = new addon.Backend({
        threads,
        memoryBudget,
        forceScalar: options.forceScalar ?? false,
        repack: options.repack ?? true,
        hugePageCopyBytes: copy,
        deferHugePageCopies: options.deferHugePageCopies ?? false,
      });
      return new CpuBackend(native, [cpuDevice()]);
    } catch (e) {
      throw toBackendError(e, "UNAVAILABLE");
    }
  },
};

export default cpuBackend;
