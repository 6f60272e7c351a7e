/**
 * Build artefacts: where nvcc exists the CUDA addon was built and its fat binary holds SASS for
 * sm_80, sm_86, sm_89 and sm_90 plus PTX compute_90 (read from the ELF's .nv_fatbin section, no
 * cuobjdump needed); the emulator addon exists wherever cmake does. Skipped with the reason otherwise.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { createRequire } from "node:module";
import { describe, expect, it } from "vitest";
import { cudaAddonPath, emulatorAddonPath, fatbinEntries, type NativeGpuAddon, readBuildStatus } from "../src/index.js";

const works = (cmd: string) => {
  const r = spawnSync(cmd, ["--version"], { stdio: "ignore" });
  return !r.error && r.status === 0;
};
const nvcc = [process.env["CUDACXX"], "nvcc", "/usr/local/cuda/bin/nvcc"].find((c) => c && works(c));
const cudaWanted = nvcc !== undefined && process.env["POWERINFER_BUILD_CUDA"] !== "0";
const defaultArchs = process.env["POWERINFER_CUDA_ARCHS"] === undefined;

describe("CUDA build artefacts", () => {
  it.skipIf(!cudaWanted)("the addon carries SASS for sm_80, sm_86, sm_89, sm_90 and PTX for compute_90", () => {
    expect(readBuildStatus(cudaAddonPath())?.["cuda"]).toEqual({ built: true, reason: "" });
    expect(existsSync(cudaAddonPath())).toBe(true);
    const entries = fatbinEntries(cudaAddonPath());
    const sass = new Set(entries.filter((e) => e.kind === "sass").map((e) => e.sm));
    const ptx = new Set(entries.filter((e) => e.kind === "ptx").map((e) => e.sm));
    if (defaultArchs) {
      expect([...sass].sort()).toEqual([80, 86, 89, 90]);
      expect([...ptx]).toEqual([90]);
      const addon = createRequire(import.meta.url)(cudaAddonPath()) as NativeGpuAddon;
      expect(addon.platform).toBe("cuda");
      expect(addon.archs).toBe("sm_80 sm_86 sm_89 sm_90 compute_90");
    } else {
      expect(sass.size + ptx.size).toBeGreaterThan(0);
    }
  });

  it.runIf(!cudaWanted)(`skipped: ${nvcc ? "POWERINFER_BUILD_CUDA=0" : "no CUDA toolkit (nvcc not found)"}`, () => {
    expect(readBuildStatus(cudaAddonPath())?.["cuda"]?.built ?? false).toBe(false);
  });

  it.skipIf(!works("cmake"))("the emulator addon is built", () => {
    expect(existsSync(emulatorAddonPath())).toBe(true);
  });
});
