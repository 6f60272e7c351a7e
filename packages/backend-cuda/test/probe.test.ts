/**
 * The probe on a machine without an NVIDIA GPU (this one, CI): importing never throws, the probe
 * reports `usable: false` with the exact reason, and `load()` fails with that reason. The no-toolkit,
 * missing-addon and broken-addon cases are simulated with POWERINFER_CUDA_ADDON.
 */
import { existsSync, mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { BackendError } from "@powerinfer/core";
import { afterEach, describe, expect, it } from "vitest";

const mod = await import("../src/index.js");
const { cudaBackend, cudaAddonPath, readBuildStatus } = mod;

/** Whether the NVIDIA driver is installed (its kernel module or user-space library). */
function hasNvidiaDriver(): boolean {
  if (existsSync("/proc/driver/nvidia/version")) return true;
  return ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1"].some(
    existsSync,
  );
}

afterEach(() => {
  delete process.env["POWERINFER_CUDA_ADDON"];
});

describe("CUDA probe without a GPU", () => {
  it("importing the package does not throw and exports the descriptor", () => {
    expect(cudaBackend.name).toBe("cuda");
    expect(typeof cudaBackend.probe).toBe("function");
  });

  it("reports the exact reason on this machine, quickly", () => {
    const t0 = performance.now();
    const p = cudaBackend.probe() as { usable: boolean; reason: string; score: number };
    expect(performance.now() - t0).toBeLessThan(5000);
    const status = readBuildStatus(cudaAddonPath())?.["cuda"];
    if (status && !status.built) {
      expect(p).toMatchObject({ usable: false, score: 0, reason: `unavailable: ${status.reason}` });
    } else if (!status) {
      expect(p.usable).toBe(false);
      expect(p.reason).toMatch(/^unavailable: native addon not built/);
    } else if (!hasNvidiaDriver()) {
      expect(p).toEqual({ usable: false, score: 0, reason: "unavailable: no NVIDIA driver", devices: [] });
    } else {
      // a GPU machine: usable, or a precise reason
      expect(
        p.usable || /^unavailable: (no CUDA device|NVIDIA driver too old|.* has compute capability)/.test(p.reason),
      ).toBe(true);
    }
  });

  it.skipIf(hasNvidiaDriver())("load() fails with BackendError UNAVAILABLE and the probe's reason", async () => {
    const reason = (cudaBackend.probe() as { reason: string }).reason;
    const err = await cudaBackend.load().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(BackendError);
    expect((err as BackendError).code).toBe("UNAVAILABLE");
    expect((err as BackendError).message).toBe(`cuda: ${reason}`);
  });

  it('a build without nvcc probes "unavailable: no CUDA toolkit"', async () => {
    const dir = mkdtempSync(join(tmpdir(), "pi-cuda-"));
    writeFileSync(
      join(dir, "native-status.json"),
      JSON.stringify({ cuda: { built: false, reason: "no CUDA toolkit" }, emu: { built: true, reason: "" } }),
    );
    process.env["POWERINFER_CUDA_ADDON"] = join(dir, "powerinfer_cuda.node");
    expect(cudaBackend.probe()).toEqual({
      usable: false,
      score: 0,
      reason: "unavailable: no CUDA toolkit",
      devices: [],
    });
    await expect(cudaBackend.load()).rejects.toThrow("cuda: unavailable: no CUDA toolkit");
  });

  it("a missing or broken addon is reported, not thrown", () => {
    const dir = mkdtempSync(join(tmpdir(), "pi-cuda-"));
    process.env["POWERINFER_CUDA_ADDON"] = join(dir, "missing.node");
    const missing = cudaBackend.probe() as { usable: boolean; reason: string };
    expect(missing.usable).toBe(false);
    expect(missing.reason).toMatch(/^unavailable: native addon not built \(.*missing\.node missing/);
    writeFileSync(join(dir, "broken.node"), "not an ELF file");
    process.env["POWERINFER_CUDA_ADDON"] = join(dir, "broken.node");
    const broken = cudaBackend.probe() as { usable: boolean; reason: string };
    expect(broken.usable).toBe(false);
    expect(broken.reason).toMatch(/^unavailable: native addon failed to load: /);
  });
});
