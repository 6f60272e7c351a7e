#!/usr/bin/env node
// Builds the GPU addons of @powerinfer/backend-cuda with cmake-js (Release, Node-API headers from the
// node-api-headers package: package.json declares binary.napi_versions):
//   build/Release/powerinfer_gpu_emu.node  the kernels under the CPU emulator (needs only a C++17 compiler)
//   build/Release/powerinfer_cuda.node     the CUDA backend, only when a CUDA compiler (nvcc) is found
// and records what it built in build/Release/native-status.json, which the probe reads: without nvcc
// the CUDA backend probes "unavailable: no CUDA toolkit".
//
// Never fails the install or build unless POWERINFER_REQUIRE_NATIVE=1 (CI): then a missing cmake or
// C++ compiler, or a failing compile, exits 1. A missing CUDA toolkit is never an error.
//
// Environment: POWERINFER_REQUIRE_NATIVE=1, POWERINFER_NATIVE_JOBS (default 2), POWERINFER_SKIP_NATIVE=1,
// POWERINFER_BUILD_CUDA=0 (skip CUDA even with nvcc), POWERINFER_CUDA_ARCHS (CMake form, default
// "80-real;86-real;89-real;90"), CUDACXX (the nvcc to use).
import { spawnSync } from "node:child_process";
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const outDir = join(pkgDir, "build", "Release");
const require = createRequire(join(pkgDir, "package.json"));
const strict = process.env.POWERINFER_REQUIRE_NATIVE === "1";
const jobs = process.env.POWERINFER_NATIVE_JOBS ?? "2";
const tag = "@powerinfer/backend-cuda";

const status = { cuda: { built: false, reason: "" }, emu: { built: false, reason: "" } };

function writeStatus() {
  mkdirSync(outDir, { recursive: true });
  writeFileSync(join(outDir, "native-status.json"), `${JSON.stringify(status, null, 2)}\n`);
}

function giveUp(reason) {
  status.cuda.reason ||= `native build failed: ${reason}`;
  status.emu.reason = `native build failed: ${reason}`;
  writeStatus();
  const line = `${tag}: native addons not built: ${reason}`;
  if (strict) {
    console.error(`${line} (POWERINFER_REQUIRE_NATIVE=1)`);
    process.exit(1);
  }
  console.warn(`${line}; the backend will report "unavailable"`);
  process.exit(0);
}

function has(cmd, args = ["--version"]) {
  const r = spawnSync(cmd, args, { stdio: "ignore" });
  return !r.error && r.status === 0;
}

/** The nvcc CMake would find: $CUDACXX, nvcc on PATH, /usr/local/cuda/bin/nvcc. */
function findNvcc() {
  for (const c of [process.env.CUDACXX, "nvcc", "/usr/local/cuda/bin/nvcc"]) {
    if (c && has(c)) return c;
  }
  return undefined;
}

if (process.env.POWERINFER_SKIP_NATIVE === "1") {
  status.cuda.reason = status.emu.reason = "not built (POWERINFER_SKIP_NATIVE=1)";
  writeStatus();
  console.warn(`${tag}: native build skipped (POWERINFER_SKIP_NATIVE=1)`);
  process.exit(0);
}

const nvcc = process.env.POWERINFER_BUILD_CUDA === "0" ? undefined : findNvcc();
if (!nvcc) {
  status.cuda.reason =
    process.env.POWERINFER_BUILD_CUDA === "0" ? "not built (POWERINFER_BUILD_CUDA=0)" : "no CUDA toolkit";
}
if (!has("cmake")) giveUp("cmake not found on PATH");
const cxx = process.env.CXX ?? "c++";
if (!has(cxx) && !has("g++") && !has("clang++")) giveUp("no C++ compiler found (c++, g++, clang++)");

let cmakeJs;
try {
  cmakeJs = require.resolve("cmake-js/bin/cmake-js");
} catch {
  giveUp("cmake-js is not installed (devDependency)");
}

const args = [cmakeJs, "build", "--config", "Release", "--parallel", jobs, "--log-level", "warn"];
args.push(`--CDPOWERINFER_CUDA=${nvcc ? "ON" : "OFF"}`);
if (nvcc && nvcc !== "nvcc") args.push(`--CDCMAKE_CUDA_COMPILER=${nvcc}`);
if (process.env.POWERINFER_CUDA_ARCHS) args.push(`--CDPOWERINFER_CUDA_ARCHS=${process.env.POWERINFER_CUDA_ARCHS}`);
const started = Date.now();
const r = spawnSync(process.execPath, args, { cwd: pkgDir, stdio: ["ignore", "inherit", "inherit"] });
if (r.error) giveUp(`cmake-js could not run: ${r.error.message}`);
if (r.status !== 0) giveUp(`cmake-js build failed with exit code ${r.status} (see the compiler output above)`);

status.emu.built = existsSync(join(outDir, "powerinfer_gpu_emu.node"));
if (!status.emu.built) status.emu.reason = "the build produced no powerinfer_gpu_emu.node";
if (nvcc) {
  status.cuda.built = existsSync(join(outDir, "powerinfer_cuda.node"));
  if (!status.cuda.built) status.cuda.reason = "CMake found no usable CUDA compiler (see its output above)";
}
writeStatus();
const secs = ((Date.now() - started) / 1000).toFixed(0);
console.log(
  `${tag}: built ${[status.cuda.built && "powerinfer_cuda.node", status.emu.built && "powerinfer_gpu_emu.node"].filter(Boolean).join(", ")} in ${secs} s` +
    (status.cuda.built ? "" : ` (CUDA: ${status.cuda.reason})`),
);
if (strict && nvcc && !status.cuda.built) {
  console.error(`${tag}: nvcc ${nvcc} was found but the CUDA addon was not built (POWERINFER_REQUIRE_NATIVE=1)`);
  process.exit(1);
}
