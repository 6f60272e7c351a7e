/**
 * The shared GPU suite (written once in @powerinfer/backend-cuda) on the ROCm backend: runs on a
 * machine with a supported AMD GPU, skipped with the reason elsewhere. The kernels' wavefront-64
 * behaviour is also covered without a GPU by the emulator at warp 64 (backend-cuda's emulator tests).
 */
import { describeGpuBackend } from "../../backend-cuda/test/gpu-suite.js";
import { rocmBackend } from "../src/index.js";

await describeGpuBackend("ROCm backend on the device", rocmBackend);
