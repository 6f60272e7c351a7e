/**
 * The GPU kernels under the CPU SIMT emulator, through the whole stack (TypeScript wrapper, addon,
 * graph executor, kernels): the shared GPU suite at warp 32 (NVIDIA) and at warp 64 (AMD gfx9
 * wavefronts), so that a kernel assuming 32 lanes fails here.
 */
import { describe, expect, it } from "vitest";
import { gpuEmulatorBackend } from "../src/index.js";
import { describeGpuBackend } from "./gpu-suite.js";

await describeGpuBackend("GPU kernels on the emulator, warp 32", gpuEmulatorBackend, { load: { emuWarpSize: 32 } });
await describeGpuBackend("GPU kernels on the emulator, warp 64", gpuEmulatorBackend, { load: { emuWarpSize: 64 } });

const usable = (gpuEmulatorBackend.probe() as { usable: boolean }).usable;
describe.skipIf(!usable)("emulator configuration", () => {
  it("runs with the warp size it was loaded with", async () => {
    for (const w of [32, 64] as const) {
      const b = await gpuEmulatorBackend.load({ emuWarpSize: w });
      try {
        expect(b.device().warpSize).toBe(w);
        expect(b.device().name).toBe(`SIMT emulator (warp ${w})`);
      } finally {
        b.dispose();
      }
    }
  });
});
