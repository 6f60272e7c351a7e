/** The shared GPU suite on the CUDA backend: runs on a machine with an NVIDIA GPU, skipped with the reason elsewhere. */
import { cudaBackend } from "../src/index.js";
import { describeGpuBackend } from "./gpu-suite.js";

await describeGpuBackend("CUDA backend on the device", cudaBackend);
