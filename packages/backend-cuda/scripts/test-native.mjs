#!/usr/bin/env node
// Builds and runs the native tests (native/test, ctest): the kernels under the SIMT emulator at warp 32
// and 64, with AddressSanitizer + UndefinedBehaviorSanitizer on the host code; with
// POWERINFER_NATIVE_DEVICE=1 also the same tests on the NVIDIA GPU
// (exit 77 = skipped when there is none). Build directory: build/native-test (incremental).
// Environment: POWERINFER_NATIVE_JOBS (default 2), POWERINFER_SANITIZE=0 (no sanitizers),
// POWERINFER_NATIVE_DEVICE=1 (also build and run the CUDA device tests; needs nvcc).
import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const device = process.env.POWERINFER_NATIVE_DEVICE === "1";
const buildDir = join(pkgDir, "build", device ? "native-test-device" : "native-test");
const jobs = process.env.POWERINFER_NATIVE_JOBS ?? "2";
const sanitize = process.env.POWERINFER_SANITIZE === "0" || device ? "OFF" : "ON";

function run(cmd, args) {
  const r = spawnSync(cmd, args, { cwd: pkgDir, stdio: "inherit" });
  if (r.error) {
    console.error(`test:native: cannot run ${cmd}: ${r.error.message}`);
    process.exit(2);
  }
  if (r.status !== 0) process.exit(r.status ?? 1);
}

run("cmake", [
  "-S",
  pkgDir,
  "-B",
  buildDir,
  "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
  "-DPOWERINFER_BUILD_TESTS=ON",
  `-DPOWERINFER_SANITIZE=${sanitize}`,
  `-DPOWERINFER_CUDA=${device ? "ON" : "OFF"}`,
  ...(process.env.POWERINFER_CUDA_ARCHS ? [`-DPOWERINFER_CUDA_ARCHS=${process.env.POWERINFER_CUDA_ARCHS}`] : []),
]);
const targets = ["powerinfer_gpu_tests", ...(device ? ["powerinfer_cuda_tests"] : [])];
run("cmake", ["--build", buildDir, "--parallel", jobs, "--target", ...targets]);
run("ctest", ["--test-dir", buildDir, "--output-on-failure"]);
