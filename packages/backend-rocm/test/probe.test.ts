/**
 * The ROCm probe on a machine without an AMD GPU (this one, CI): importing never throws, the probe
 * reports `usable: false` with the exact reason, `load()` fails with it; the no-toolchain and
 * missing-addon cases are simulated with POWERINFER_ROCM_ADDON.
 */
import { existsSync, mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readBuildStatus } from "@powerinfer/backend-cuda";
import { BackendError } from "@powerinfer/core";
import { afterEach, describe, expect, it } from "vitest";

const { rocmBackend, rocmAddonPath } = await import("../src/index.js");
const hasKfd = existsSync("/dev/kfd");

afterEach(() => {
  delete process.env["POWERINFER_ROCM_ADDON"];
});

describe("ROCm probe without an AMD GPU", () => {
  it("importing the package does not throw and exports the descriptor", () => {
    expect(rocmBackend.name).toBe("rocm");
  });

  it("reports the exact reason on this machine", () => {
    const p = rocmBackend.probe() as { usable: boolean; reason: string };
    const status = readBuildStatus(rocmAddonPath())?.["rocm"];
    if (status && !status.built) {
      expect(p).toEqual({ usable: false, score: 0, reason: `unavailable: ${status.reason}`, devices: [] });
    } else if (!status) {
      expect(p.reason).toMatch(/^unavailable: native addon not built/);
    } else if (!hasKfd) {
      expect(p).toEqual({
        usable: false,
        score: 0,
        reason: "unavailable: no AMD GPU driver (/dev/kfd missing: amdgpu kernel driver not loaded)",
        devices: [],
      });
    } else {
      expect(p.usable || /^unavailable: (no ROCm device|.* is gfx)/.test(p.reason)).toBe(true);
    }
  });

  it.skipIf(hasKfd)("load() fails with BackendError UNAVAILABLE and the probe's reason", async () => {
    const reason = (rocmBackend.probe() as { reason: string }).reason;
    const err = await rocmBackend.load().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(BackendError);
    expect((err as BackendError).code).toBe("UNAVAILABLE");
    expect((err as BackendError).message).toBe(`rocm: ${reason}`);
  });

  it('a build without hipcc probes "unavailable: no ROCm toolchain"; a missing addon is reported', () => {
    const dir = mkdtempSync(join(tmpdir(), "pi-rocm-"));
    writeFileSync(
      join(dir, "native-status.json"),
      JSON.stringify({ rocm: { built: false, reason: "no ROCm toolchain" } }),
    );
    process.env["POWERINFER_ROCM_ADDON"] = join(dir, "powerinfer_rocm.node");
    expect(rocmBackend.probe()).toEqual({
      usable: false,
      score: 0,
      reason: "unavailable: no ROCm toolchain",
      devices: [],
    });
    const other = mkdtempSync(join(tmpdir(), "pi-rocm-"));
    process.env["POWERINFER_ROCM_ADDON"] = join(other, "powerinfer_rocm.node");
    expect((rocmBackend.probe() as { reason: string }).reason).toMatch(/^unavailable: native addon not built/);
  });
});
