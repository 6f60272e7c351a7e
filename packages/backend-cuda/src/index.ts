/**
 * `@powerinfer/backend-cuda`: the CUDA backend of powerinfer-ts — dense ops (F32, F16, BF16, Q8_0,
 * Q4_0 weights), attention over a device KV cache, and the hot-neuron sparse ops over compact row
 * buckets — plus the GPU kernel source it shares with `@powerinfer/backend-rocm` and a SIMT emulator
 * that runs those kernels on the CPU for tests.
 *
 * ```ts
 * import { cudaBackend } from "@powerinfer/backend-cuda";
 * registry.register(cudaBackend, 0);
 * const gpu = await cudaBackend.load({ memoryBudget: 6 * 2 ** 30 });
 * ```
 *
 * Importing never throws. Without a CUDA toolkit at build time the backend probes
 * "unavailable: no CUDA toolkit"; without the NVIDIA driver, "unavailable: no NVIDIA driver".
 */
import { fileURLToPath } from "node:url";
import { createGpuDescriptor } from "./descriptor.js";

export { deviceInfo, GpuBackend } from "./backend.js";
export {
  createGpuDescriptor,
  type GpuBackendDescriptor,
  type GpuDescriptorOptions,
  type GpuLoadOptions,
} from "./descriptor.js";
export { type FatbinEntry, fatbinEntries } from "./fatbin.js";
export {
  loadGpuAddon,
  type NativeBuildStatus,
  type NativeGpuAddon,
  type NativeGpuBackend,
  type NativeGpuDevice,
  type NativeGpuProbe,
  readBuildStatus,
} from "./native.js";

const built = (file: string) => fileURLToPath(new URL(`../build/Release/${file}`, import.meta.url));

/** Path of the CUDA addon: `POWERINFER_CUDA_ADDON`, else `<package>/build/Release/powerinfer_cuda.node`. */
export function cudaAddonPath(): string {
  return process.env["POWERINFER_CUDA_ADDON"] || built("powerinfer_cuda.node");
}

/** Path of the emulator addon (`<package>/build/Release/powerinfer_gpu_emu.node`). */
export function emulatorAddonPath(): string {
  return built("powerinfer_gpu_emu.node");
}

/** Where the shared GPU kernel source lives (for `@powerinfer/backend-rocm`'s build). */
export function gpuSourceDir(): string {
  return fileURLToPath(new URL("../native/gpu", import.meta.url));
}

/**
 * The CUDA backend (name "cuda", score 100 when usable). `load(options)`: `memoryBudget` (bytes of
 * tensors; beyond it createTensor throws 'OUT_OF_MEMORY'; default unlimited), `device` (default
 * `POWERINFER_GPU_DEVICE` or the first supported GPU).
 */
export const cudaBackend = createGpuDescriptor({
  name: "cuda",
  statusKey: "cuda",
  addonPath: cudaAddonPath,
  buildHint: "pnpm --filter @powerinfer/backend-cuda build",
  score: 100,
});

/**
 * The GPU kernels under the CPU SIMT emulator (name "gpu-emu", score 1): every GPU thread a fiber,
 * blocks one after another — slow, for tests of the kernels and of GPU code paths without a GPU.
 * `load({ emuWarpSize: 64 })` emulates AMD's 64-lane wavefronts. Not registered by the CLI.
 */
export const gpuEmulatorBackend = createGpuDescriptor({
  name: "gpu-emu",
  statusKey: "emu",
  addonPath: emulatorAddonPath,
  buildHint: "pnpm --filter @powerinfer/backend-cuda build",
  score: 1,
});

export default cudaBackend;
