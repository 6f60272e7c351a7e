/**
 * Backend descriptors over a GPU addon: {@link createGpuDescriptor} builds the probe and load of
 * core's {@link BackendDescriptor} for one addon file. `@powerinfer/backend-rocm` uses it too.
 */
import {
  BACKEND_API_VERSION,
  type BackendDescriptor,
  BackendError,
  type BackendLoadOptions,
  type ProbeResult,
} from "@powerinfer/core";
import { toBackendError } from "@powerinfer/core";
import { deviceInfo, GpuBackend } from "./backend.js";
import { loadGpuAddon, type NativeGpuAddon, type NativeGpuDevice, readBuildStatus } from "./native.js";

/** Options of {@link GpuBackendDescriptor.load} beyond core's: the device and, for the emulator, its shape. */
export interface GpuLoadOptions extends BackendLoadOptions {
  /** Device index. Default: `POWERINFER_GPU_DEVICE`, else the first device this build supports. */
  device?: number;
  /** Emulator only: lanes per warp, 32 or 64. Default: `POWERINFER_GPU_EMU_WARP`, else 32. */
  emuWarpSize?: 32 | 64;
  /** Emulator only: bytes of emulated device memory. Default 8 GiB. */
  emuMemory?: number;
}

export interface GpuDescriptorOptions {
  /** Backend name ("cuda", "rocm", "gpu-emu"). */
  name: string;
  /** Key of this addon in the package's `native-status.json` ("cuda", "rocm", "emu"). */
  statusKey: string;
  /** Path of the addon file. */
  addonPath: () => string;
  /** The command that builds it. */
  buildHint: string;
  /** Probe score when usable (GPU backends ~100). */
  score: number;
}

/** A GPU backend descriptor; `load` accepts {@link GpuLoadOptions}. */
export interface GpuBackendDescriptor extends BackendDescriptor {
  load(options?: GpuLoadOptions): Promise<GpuBackend>;
  /** The addon's own probe (devices with arch, warp size, …), or why there is none. Never throws. */
  probeDevices(): { devices: NativeGpuDevice[]; archs: string; reason?: string };
}

const GiB = 2 ** 30;

function describe(d: NativeGpuDevice): string {
  if (d.freeMemoryKnown === false) return `${d.name} (${d.arch}, ${(d.totalMemory / GiB).toFixed(1)} GiB)`;
  return `${d.name} (${d.arch}, ${(d.freeMemory / GiB).toFixed(1)} of ${(d.totalMemory / GiB).toFixed(1)} GiB free)`;
}

/** Builds a descriptor over one GPU addon. Importing and probing never throw. */
export function createGpuDescriptor(o: GpuDescriptorOptions): GpuBackendDescriptor {
  const addon = (): { addon?: NativeGpuAddon; error?: string } => {
    const path = o.addonPath();
    const status = readBuildStatus(path)?.[o.statusKey];
    if (status && !status.built) return { error: status.reason };
    return loadGpuAddon(path, o.buildHint);
  };

  const descriptor: GpuBackendDescriptor = {
    name: o.name,
    apiVersion: BACKEND_API_VERSION,

    probeDevices() {
      try {
        const { addon: a, error } = addon();
        if (!a) return { devices: [], archs: "", reason: error };
        const p = a.probe();
        return { devices: p.devices, archs: a.archs, reason: p.ok ? undefined : p.reason };
      } catch (e) {
        return { devices: [], archs: "", reason: `probe failed: ${(e as Error).message}` };
      }
    },

    probe(): ProbeResult {
      const { devices, reason } = descriptor.probeDevices();
      const usable = devices.filter((d) => d.supported);
      if (reason !== undefined || usable.length === 0) {
        return {
          usable: false,
          score: 0,
          reason: `unavailable: ${reason ?? devices[0]?.why ?? "no usable device"}`,
          devices: devices.map(deviceInfo),
        };
      }
      return {
        usable: true,
        score: o.score,
        reason: usable.map(describe).join("; "),
        devices: usable.map(deviceInfo),
      };
    },

    async load(options: GpuLoadOptions = {}): Promise<GpuBackend> {
      const { addon: a, error } = addon();
      if (!a) throw new BackendError("UNAVAILABLE", `${o.name}: unavailable: ${error}`);
      const memoryBudget = options.memoryBudget ?? -1;
      if (options.memoryBudget !== undefined && !(options.memoryBudget >= 0)) {
        throw new BackendError(
          "UNAVAILABLE",
          `${o.name}: memoryBudget must be a number ≥ 0, got ${options.memoryBudget}`,
        );
      }
      const p = a.probe();
      if (!p.ok) throw new BackendError("UNAVAILABLE", `${o.name}: unavailable: ${p.reason}`);
      const env = process.env["POWERINFER_GPU_DEVICE"];
      const device =
        options.device ?? (env !== undefined && env !== "" ? Number(env) : p.devices.find((d) => d.supported)?.index);
      const dev = p.devices.find((d) => d.index === device);
      if (device === undefined || !dev) {
        throw new BackendError("UNAVAILABLE", `${o.name}: no device ${String(device)} (${p.devices.length} found)`);
      }
      if (!dev.supported) throw new BackendError("UNAVAILABLE", `${o.name}: ${dev.why}`);
      const warpEnv = process.env["POWERINFER_GPU_EMU_WARP"];
      const emuWarpSize = options.emuWarpSize ?? (warpEnv === "64" ? 64 : warpEnv === "32" ? 32 : undefined);
      try {
        const native = new a.Backend({ device, memoryBudget, emuWarpSize, emuMemory: options.emuMemory });
        return new GpuBackend(o.name, native, [deviceInfo(native.deviceInfo())]);
      } catch (e) {
        throw toBackendError(o.name, e, "UNAVAILABLE");
      }
    },
  };
  return descriptor;
}
