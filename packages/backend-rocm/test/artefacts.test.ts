/**
 * Where hipcc exists the ROCm addon was built from the shared kernel source and embeds code objects for
 * gfx906, gfx908, gfx90a and gfx1030 (the targets of Debian's ROCm 5.2). Skipped with the reason otherwise.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { readBuildStatus } from "@powerinfer/backend-cuda";
import { describe, expect, it } from "vitest";
import { rocmAddonPath, rocmTargets } from "../src/index.js";

const works = (cmd: string) => {
  const r = spawnSync(cmd, ["--version"], { stdio: "ignore", env: { ...process.env, HIP_PLATFORM: "amd" } });
  return !r.error && r.status === 0;
};
const hipcc = [process.env["HIPCC"], "hipcc", "/opt/rocm/bin/hipcc"].find((c) => c && works(c));
const wanted = hipcc !== undefined && process.env["POWERINFER_BUILD_ROCM"] !== "0" && works("cmake");

describe("ROCm build artefacts", () => {
  it.skipIf(!wanted)("the addon embeds code for gfx906, gfx908, gfx90a and gfx1030", () => {
    expect(readBuildStatus(rocmAddonPath())?.["rocm"]).toEqual({ built: true, reason: "" });
    expect(existsSync(rocmAddonPath())).toBe(true);
    const targets = rocmTargets(rocmAddonPath());
    if (process.env["POWERINFER_ROCM_ARCHS"] === undefined)
      expect(targets).toEqual(["gfx1030", "gfx906", "gfx908", "gfx90a"]);
    else expect(targets.length).toBeGreaterThan(0);
  });

  it.runIf(!wanted)(
    `skipped: ${hipcc ? "POWERINFER_BUILD_ROCM=0 or no cmake" : "no ROCm toolchain (hipcc not found)"}`,
    () => {
      expect(readBuildStatus(rocmAddonPath())?.["rocm"]?.built ?? false).toBe(false);
    },
  );
});
