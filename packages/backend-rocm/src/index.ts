/**
 * `@powerinfer/backend-rocm`: the ROCm backend of powerinfer-ts for AMD GPUs — the kernels of
 * `@powerinfer/backend-cuda` (one shared source, `native/gpu`) compiled with hipcc, behind the same
 * TypeScript wrapper.
 *
 * ```ts
 * import { rocmBackend } from "@powerinfer/backend-rocm";
 * registry.register(rocmBackend, 0);
 * ```
 *
 * Importing never throws. Built only where hipcc exists (else "unavailable: no ROCm toolchain");
 * targets gfx906, gfx908, gfx90a, gfx1030 with Debian's ROCm 5.2 (`POWERINFER_ROCM_ARCHS` for others).
 */
import { fileURLToPath } from "node:url";
import { createGpuDescriptor } from "@powerinfer/backend-cuda";

/** Path of the addon: `POWERINFER_ROCM_ADDON`, else `<package>/build/Release/powerinfer_rocm.node`. */
export function rocmAddonPath(): string {
  return (
    process.env["POWERINFER_ROCM_ADDON"] ||
    fileURLToPath(new URL("../build/Release/powerinfer_rocm.node", import.meta.url))
  );
}

/** The AMD GPU targets a build carries, read from the code objects embedded in the addon. */
export { rocmTargets } from "./targets.js";

/**
 * The ROCm backend (name "rocm", score 100 when usable). `load(options)`: `memoryBudget` (bytes of
 * tensors; default unlimited), `device` (default `POWERINFER_GPU_DEVICE` or the first supported GPU).
 */
export const rocmBackend = createGpuDescriptor({
  name: "rocm",
  statusKey: "rocm",
  addonPath: rocmAddonPath,
  buildHint: "pnpm --filter @powerinfer/backend-rocm build",
  score: 100,
});

export default rocmBackend;
