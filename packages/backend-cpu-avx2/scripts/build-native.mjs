#!/usr/bin/env node
// Builds the native addon (build/Release/powerinfer_cpu.node) with cmake-js, Release, against the
// Node-API headers of the `node-api-headers` package (no header download: package.json declares
// binary.napi_versions, which makes cmake-js use them).
//
// A machine without cmake or a C++ compiler, or a failing build, prints one line saying why and exits
// 0, so that `pnpm install` / `pnpm build` never fail there (the backend then probes as unavailable).
// With POWERINFER_REQUIRE_NATIVE=1 (CI) any of those is an error (exit 1).
//
// Environment: POWERINFER_REQUIRE_NATIVE=1 (fail hard), POWERINFER_NATIVE_JOBS (parallel jobs, default 2),
// POWERINFER_SKIP_NATIVE=1 (skip the build).
import { spawnSync } from "node:child_process";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const require = createRequire(join(pkgDir, "package.json"));
const strict = process.env.POWERINFER_REQUIRE_NATIVE === "1";
const jobs = process.env.POWERINFER_NATIVE_JOBS ?? "2";

function giveUp(reason) {
  const line = `@powerinfer/backend-cpu-avx2: native addon not built: ${reason}`;
  if (strict) {
    console.error(`${line} (POWERINFER_REQUIRE_NATIVE=1)`);
    process.exit(1);
  }
  console.warn(`${line}; the CPU backend will report "unavailable"`);
  process.exit(0);
}

function has(cmd, args = ["--version"]) {
  const r = spawnSync(cmd, args, { stdio: "ignore" });
  return !r.error && r.status === 0;
}

if (process.env.POWERINFER_SKIP_NATIVE === "1") giveUp("POWERINFER_SKIP_NATIVE=1");
if (!has("cmake")) giveUp("cmake not found on PATH");
const cxx = process.env.CXX ?? "c++";
if (!has(cxx) && !has("g++") && !has("clang++")) giveUp("no C++ compiler found (c++, g++, clang++)");

let cmakeJs;
try {
  cmakeJs = require.resolve("cmake-js/bin/cmake-js");
} catch {
  giveUp("cmake-js is not installed (devDependency)");
}

const r = spawnSync(
  process.execPath,
  [cmakeJs, "build", "--config", "Release", "--parallel", jobs, "--target", "powerinfer_cpu", "--log-level", "warn"],
  { cwd: pkgDir, stdio: ["ignore", "inherit", "inherit"] },
);
if (r.error) giveUp(`cmake-js could not run: ${r.error.message}`);
if (r.status !== 0) giveUp(`cmake-js build failed with exit code ${r.status} (see the compiler output above)`);
