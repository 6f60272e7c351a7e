/**
 * The raw interface of the GPU addons (native/gpu/addon.cpp: `powerinfer_cuda.node`,
 * `powerinfer_rocm.node`, `powerinfer_gpu_emu.node`) and their loading. Loading never throws:
 * {@link loadGpuAddon} returns the addon or the reason it is unavailable.
 */
import { existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import type { NativeBackendInstance } from "@powerinfer/core";

/** One device as the addon reports it. Memory in bytes. */
export interface NativeGpuDevice {
  index: number;
  name: string;
  /** "sm_90" (CUDA), "gfx90a" (ROCm), "emulated". */
  arch: string;
  /** "9.0" on CUDA; the HIP runtime's major.minor on ROCm. */
  computeCapability: string;
  warpSize: number;
  multiprocessors: number;
  /** Bytes free on the device; the total when `freeMemoryKnown` is false. */
  freeMemory: number;
  totalMemory: number;
  /**
   * False in the probe's report: reading free memory needs a context, and the probe creates none on any
   * GPU (it reads device properties only). A loaded backend's `device()` reports it.
   */
  freeMemoryKnown?: boolean;
  /** False when this build has no code for the device (`why` says so). */
  supported: boolean;
  why: string;
}

export interface NativeGpuProbe {
  ok: boolean;
  /** Why not, without the "unavailable: " prefix (e.g. "no NVIDIA driver"); empty when ok. */
  reason: string;
  driverVersion: number;
  runtimeVersion: number;
  devices: NativeGpuDevice[];
}

/** One backend instance of an addon: core's wire-level instance plus device properties. */
export interface NativeGpuBackend extends NativeBackendInstance {
  arenaBytes(): number;
  deviceInfo(): NativeGpuDevice;
}

export interface NativeGpuAddon {
  /** "cuda", "rocm" or "emu". */
  platform: string;
  /** Device code targets of the build, e.g. "sm_80 sm_86 sm_89 sm_90 compute_90". */
  archs: string;
  probe(): NativeGpuProbe;
  Backend: new (options: {
    device: number;
    /** < 0: unlimited. */
    memoryBudget: number;
    /** Emulator only: lanes per warp (32 or 64). */
    emuWarpSize?: number;
    /** Emulator only: bytes of emulated device memory. */
    emuMemory?: number;
  }) => NativeGpuBackend;
}

/** What a package's build script recorded (`build/Release/native-status.json`). */
export interface NativeBuildStatus {
  /** Per addon name ("cuda", "emu", "rocm"): whether it was built, and why not. */
  [addon: string]: { built: boolean; reason: string } | undefined;
}

/** The build status next to an addon, or undefined when the build script never ran. Never throws. */
export function readBuildStatus(addonFile: string): NativeBuildStatus | undefined {
  try {
    return JSON.parse(readFileSync(join(dirname(addonFile), "native-status.json"), "utf8")) as NativeBuildStatus;
  } catch {
    return undefined;
  }
}

const cache = new Map<string, { addon?: NativeGpuAddon; error?: string }>();

/**
 * The addon at `path`, or why it cannot be loaded (cached per path). Never throws.
 * @param buildHint the command that builds it, for the message when the file is missing.
 */
export function loadGpuAddon(path: string, buildHint: string): { addon?: NativeGpuAddon; error?: string } {
  const hit = cache.get(path);
  if (hit) return hit;
  let r: { addon?: NativeGpuAddon; error?: string };
  if (!existsSync(path)) {
    r = { error: `native addon not built (${path} missing; run \`${buildHint}\`)` };
  } else {
    try {
      const require = createRequire(import.meta.url);
      r = { addon: require(path) as NativeGpuAddon };
    } catch (e) {
      r = { error: `native addon failed to load: ${(e as Error).message.split("\n")[0]}` };
    }
  }
  cache.set(path, r);
  return r;
}
