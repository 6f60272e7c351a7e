/**
 * A loaded GPU backend: core's native adapter ({@link NativeBackend}) over a GPU addon (CUDA, ROCm or the
 * emulator — the same class for all three), plus the device's properties and its compute arena.
 */
import { type DeviceInfo, NativeBackend } from "@powerinfer/core";
import type { NativeGpuBackend, NativeGpuDevice } from "./native.js";

/** DeviceInfo of core from an addon's device. */
export function deviceInfo(d: NativeGpuDevice): DeviceInfo {
  return { kind: "gpu", name: d.name, freeMemory: d.freeMemory, totalMemory: d.totalMemory };
}

/**
 * A GPU backend instance. Create it with a descriptor's `load()` (e.g. `cudaBackend.load()`). One host
 * thread drives the device. `mapTensor` uploads the file range (read in 64 MiB pieces); `supportsOp` is
 * true for get_rows/mul_mat/mul_mat_sparse/axpy_sparse and the routed-expert products with f32, f16,
 * bf16, q8_0, q4_0 weights, attention with f32/f16 caches, cpy into f32/f16/bf16 and every other op on
 * f32; other weight dtypes answer false, so placement keeps them on the CPU.
 */
export class GpuBackend extends NativeBackend<NativeGpuBackend> {
  constructor(name: string, native: NativeGpuBackend, devices: DeviceInfo[]) {
    super(name, native, devices, 1);
  }

  /** The device as the runtime reports it now (name, arch, warp size, free/total memory). */
  device(): NativeGpuDevice {
    this.check();
    try {
      return this.native.deviceInfo();
    } catch (e) {
      throw this.fail(e, "UNAVAILABLE");
    }
  }

  /** Device bytes of the compute arena (graph inputs, intermediates, scratch), outside `allocatedBytes`. */
  arenaBytes(): number {
    this.check();
    return this.native.arenaBytes();
  }
}
