/**
 * The loaded CPU backend: core's native adapter ({@link NativeBackend}) over the CPU addon, plus what the
 * CPU has beyond the contract (the kernel set in use).
 */
import {
  type BackendError,
  type BackendErrorCode,
  type DeviceInfo,
  NativeBackend,
  toBackendError as coreToBackendError,
} from "@powerinfer/core";
import type { NativeCpuBackend } from "./native.js";

/** Turns an error of the addon (an Error with a `code`) into a {@link BackendError}. */
export function toBackendError(e: unknown, fallback: BackendErrorCode = "BAD_GRAPH"): BackendError {
  return coreToBackendError("cpu", e, fallback);
}

/**
 * A CPU backend instance. Create it with `cpuBackend.load()`. Tensors are allocated 64-byte aligned and
 * counted against `memoryBudget`; `mapTensor` maps the file (read-only, private; zero copy, counted 0).
 */
export class CpuBackend extends NativeBackend<NativeCpuBackend> {
  constructor(native: NativeCpuBackend, devices: DeviceInfo[]) {
    super("cpu", native, devices, native.threads);
  }

  /** The kernel set in use: "avx2" or "scalar". */
  get kernel(): string {
    return this.native.kernel;
  }

  /** Why that kernel set: "avx2+fma+f16c", "scalar (forced by forceScalar)", "scalar (CPU lacks AVX2)". */
  get kernelReason(): string {
    return this.native.kernelReason;
  }
}
