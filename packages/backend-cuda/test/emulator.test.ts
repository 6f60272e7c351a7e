/**
 * The GPU kernels under the CPU SIMT emulator, through the whole stack (TypeScript wrapper, addon,
 * graph executor, kernels): the shared GPU suite at warp 32 (NVIDIA) and at warp 64 (AMD gfx9
 * wavefronts) — the second one over the ops whose kernels reduce across a warp.
 */
import { gpuEmulatorBackend } from "../src/index.js";
import { describeGpuBackend } from "./gpu-suite.js";

await describeGpuBackend("GPU kernels on the emulator, warp 32", gpuEmulatorBackend, { load: { emuWarpSize: 32 } });
await describeGpuBackend("GPU kernels on the emulator, warp 64", gpuEmulatorBackend, {
  load: { emuWarpSize: 64 },
  ops: ["mul_mat", "mul_mat_sparse", "rms_norm", "norm", "softmax", "attention"],
  hybrid: false,
});
