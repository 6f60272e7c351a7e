/**
 * Loading of the native addon (`build/Release/powerinfer_cpu.node`) and its raw interface.
 * Loading never throws: {@link loadAddon} returns the addon or the reason it is unavailable.
 */
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import type { NativeBackendInstance, NeuronCacheStats } from "@powerinfer/core";

/** What `cpuInfo()` reports: CPU features and the kernel set the backend would choose. */
export interface NativeCpuInfo {
  avx2: boolean;
  fma: boolean;
  f16c: boolean;
  avx512f: boolean;
  /** "avx2", "avx2+avx512vnni" or "scalar". */
  kernel: string;
  /** Why: "avx2+fma+f16c+avx512vnni", "avx2+fma+f16c" or e.g. "scalar (CPU lacks AVX2)". */
  reason: string;
}

/** One native backend instance (see native/src/addon.cpp): core's wire-level instance plus the kernel set. */
export interface NativeCpuBackend extends NativeBackendInstance {
  readonly threads: number;
  readonly kernel: string;
  readonly kernelReason: string;
  mapTensorCached(
    dtype: number,
    ne: readonly number[],
    path: string,
    fileOffset: number,
    byteLength: number,
    cache: {
      rowStride?: number;
      hot?: Int32Array;
      coldRows: number;
      group?: number;
      pool?: number;
      expertRows?: boolean;
      transposeRows?: number;
      recordBytes?: number;
      bucketRows?: number;
      bucketStride?: number;
      shareWith?: number;
      partOffset?: number;
    },
  ): number;
  cacheStats(): NeuronCacheStats;
  hugePageCopyBytes(): number;
  /** Makes the copies deferHugePageCopies reserved, on a worker thread; resolves with the bytes copied. */
  copyPendingAsync(): Promise<number>;
  /** Bytes of reserved copies not made yet. */
  pendingCopyBytes(): number;
}

export interface NativeAddon {
  /** memoryBudget < 0 or ≥ 2^64: unlimited. */
  Backend: new (options: {
    threads: number;
    memoryBudget: number;
    forceScalar: boolean;
    /** Repack Q4_0/Q4_K weights at first dense use (default true). */
    repack?: boolean;
    /** Bytes of mapped weights (tensors ≥ 2 MiB) copied into huge-page memory (default 0). */
    hugePageCopyBytes?: number;
    /** mapTensor reserves the copies; copyPendingAsync makes them (default false). */
    deferHugePageCopies?: boolean;
  }) => NativeCpuBackend;
  cpuInfo(): NativeCpuInfo;
  /** Best read bandwidth in bytes/second over `iterations` sums of a `bytes`-sized F32 array. */
  benchReadBandwidth(bytes: number, threads: number, iterations: number): number;
}

/** Path of the addon: `POWERINFER_CPU_ADDON` when set, else `<package>/build/Release/powerinfer_cpu.node`. */
export function addonPath(): string {
  return (
    process.env.POWERINFER_CPU_ADDON ?? fileURLToPath(new URL("../build/Release/powerinfer_cpu.node", import.meta.url))
  );
}

let cached: { addon?: NativeAddon; error?: string } | undefined;

/** The addon, or why it cannot be loaded (cached after the first call). Never throws. */
export function loadAddon(): { addon?: NativeAddon; error?: string } {
  if (cached) return cached;
  const path = addonPath();
  if (!existsSync(path)) {
    cached = {
      error: `native addon not built (${path} missing; run \`pnpm --filter @powerinfer/backend-cpu-avx2 build\`)`,
    };
    return cached;
  }
  try {
    const require = createRequire(import.meta.url);
    cached = { addon: require(path) as NativeAddon };
  } catch (e) {
    cached = { error: `native addon failed to load: ${(e as Error).message.split("\n")[0]}` };
  }
  return cached;
}
