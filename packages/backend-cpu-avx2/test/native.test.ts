/**
 * Runs the C++ unit tests (native/test) built with AddressSanitizer + UndefinedBehaviorSanitizer via
 * `scripts/test-native.mjs` (cmake + ctest). Skipped, with the reason, where cmake is missing.
 */
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const pkgDir = fileURLToPath(new URL("..", import.meta.url));
const cmake = spawnSync("cmake", ["--version"], { stdio: "ignore" });
const haveCmake = !cmake.error && cmake.status === 0;

describe("native unit tests (ASan + UBSan)", () => {
  it.skipIf(!haveCmake)(
    "build and pass under sanitizers (ctest)",
    () => {
      const r = spawnSync(process.execPath, ["scripts/test-native.mjs"], { cwd: pkgDir, encoding: "utf8" });
      const out = `${r.stdout}\n${r.stderr}`;
      expect(r.status, out.slice(-4000)).toBe(0);
      expect(out).toMatch(/100% tests passed/);
    },
    600_000,
  );

  it.runIf(!haveCmake)("skipped: cmake is not on PATH", () => {});
});
