/**
 * Runs the native tests (native/test via ctest): every kernel under the SIMT emulator at warp 32 and
 * 64, host code under AddressSanitizer + UndefinedBehaviorSanitizer. Skipped, with the reason, where
 * cmake is missing. (On a GPU machine the device kit runs them on the device.)
 */
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const pkgDir = fileURLToPath(new URL("..", import.meta.url));
const cmake = spawnSync("cmake", ["--version"], { stdio: "ignore" });
const haveCmake = !cmake.error && cmake.status === 0;

describe("native GPU tests on the emulator (ASan + UBSan)", () => {
  it.skipIf(!haveCmake)(
    "build and pass at warp 32 and 64 (ctest)",
    () => {
      const r = spawnSync(process.execPath, ["scripts/test-native.mjs"], { cwd: pkgDir, encoding: "utf8" });
      const out = `${r.stdout}\n${r.stderr}`;
      expect(r.status, out.slice(-4000)).toBe(0);
      expect(out).toMatch(/100% tests passed, 0 tests failed out of 2/);
    },
    600_000,
  );

  it.runIf(!haveCmake)("skipped: cmake is not on PATH", () => {});
});
