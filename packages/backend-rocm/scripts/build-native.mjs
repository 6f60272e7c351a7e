#!/usr/bin/env node
// Builds build/Release/powerinfer_rocm.node with cmake-js: the GPU kernel source of
// @powerinfer/backend-cuda (native/gpu) compiled by hipcc (HIP_PLATFORM=amd) for AMD GPUs, and records
// what it built in build/Release/native-status.json, which the probe reads: without hipcc nothing is
// built and the backend probes "unavailable: no ROCm toolchain".
//
// Never fails the install or build unless POWERINFER_REQUIRE_NATIVE=1 (CI) and hipcc exists: then a
// failing compile (an error, or a warning in our sources: -Werror) exits 1. A missing hipcc is an
// error only with POWERINFER_REQUIRE_ROCM=1 (.ci/run sets it after installing hipcc).
//
// Environment: POWERINFER_REQUIRE_NATIVE=1, POWERINFER_REQUIRE_ROCM=1, POWERINFER_NATIVE_JOBS (default 2),
// POWERINFER_SKIP_NATIVE=1, POWERINFER_BUILD_ROCM=0 (skip), POWERINFER_ROCM_ARCHS (";"-separated, default
// gfx906;gfx908;gfx90a;gfx1030), HIPCC (the compiler).
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
const tag = "@powerinfer/backend-rocm";
const status = { rocm: { built: false, reason: "" } };

function writeStatus() {
  mkdirSync(outDir, { recursive: true });
  writeFileSync(join(outDir, "native-status.json"), `${JSON.stringify(status, null, 2)}\n`);
}

function done(reason, fail) {
  status.rocm.reason = reason;
  writeStatus();
  if (fail) {
    console.error(`${tag}: ROCm addon not built: ${reason}`);
    process.exit(1);
  }
  console.warn(`${tag}: ROCm addon not built: ${reason}; the backend will report "unavailable"`);
  process.exit(0);
}

function has(cmd, args = ["--version"]) {
  const r = spawnSync(cmd, args, { stdio: "ignore", env: { ...process.env, HIP_PLATFORM: "amd" } });
  return !r.error && r.status === 0;
}

if (process.env.POWERINFER_SKIP_NATIVE === "1") done("not built (POWERINFER_SKIP_NATIVE=1)", false);
if (process.env.POWERINFER_BUILD_ROCM === "0") done("not built (POWERINFER_BUILD_ROCM=0)", false);
const hipcc = [process.env.HIPCC, "hipcc", "/opt/rocm/bin/hipcc"].find((c) => c && has(c));
if (!hipcc) done("no ROCm toolchain", process.env.POWERINFER_REQUIRE_ROCM === "1");
if (!has("cmake")) done("cmake not found on PATH", strict);

let cmakeJs;
let gpuSrc;
try {
  cmakeJs = require.resolve("cmake-js/bin/cmake-js");
  gpuSrc = join(dirname(require.resolve("@powerinfer/backend-cuda/package.json")), "native", "gpu");
} catch (e) {
  done(`a dependency is missing: ${e.message.split("\n")[0]}`, strict);
}

const args = [cmakeJs, "build", "--config", "Release", "--parallel", jobs, "--log-level", "warn"];
const hipccPath = spawnSync("sh", ["-c", 'command -v "$1"', "sh", hipcc], { encoding: "utf8" }).stdout.trim() || hipcc;
args.push(`--CDPI_GPU_SRC=${gpuSrc}`, `--CDHIPCC=${hipccPath}`);
if (process.env.POWERINFER_ROCM_ARCHS) args.push(`--CDPOWERINFER_ROCM_ARCHS=${process.env.POWERINFER_ROCM_ARCHS}`);
const started = Date.now();
const r = spawnSync(process.execPath, args, {
  cwd: pkgDir,
  stdio: ["ignore", "inherit", "inherit"],
  env: { ...process.env, HIP_PLATFORM: "amd" },
});
if (r.error) done(`cmake-js could not run: ${r.error.message}`, strict);
if (r.status !== 0) done(`cmake-js build failed with exit code ${r.status} (see the compiler output above)`, strict);
status.rocm.built = existsSync(join(outDir, "powerinfer_rocm.node"));
if (!status.rocm.built) done("the build produced no powerinfer_rocm.node", strict);
writeStatus();
console.log(`${tag}: built powerinfer_rocm.node with ${hipcc} in ${((Date.now() - started) / 1000).toFixed(0)} s`);
