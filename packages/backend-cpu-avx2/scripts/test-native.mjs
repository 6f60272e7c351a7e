#!/usr/bin/env node
// Builds and runs the native unit tests (native/test, ctest) with AddressSanitizer and
// UndefinedBehaviorSanitizer: `pnpm --filter @powerinfer/backend-cpu-avx2 test:native`.
// Build directory: build/native-test (incremental). Exit code: ctest's (0 = all passed).
// Environment: POWERINFER_NATIVE_JOBS (parallel jobs, default 2), POWERINFER_SANITIZE=0 to build without sanitizers.
import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const buildDir = join(pkgDir, "build", "native-test");
const jobs = process.env.POWERINFER_NATIVE_JOBS ?? "2";
const sanitize = process.env.POWERINFER_SANITIZE === "0" ? "OFF" : "ON";

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
]);
run("cmake", ["--build", buildDir, "--parallel", jobs, "--target", "powerinfer_native_tests"]);
run("ctest", ["--test-dir", buildDir, "--output-on-failure"]);
