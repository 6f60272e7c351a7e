/**
 * The device options every command that decodes shares (run, chat, serve, batched, perplexity, profile,
 * plan): a device backend for hot neurons and offloaded layers, its memory budget, the GPU index, and
 * `--n-gpu-layers`. {@link loadModelWithDevice} loads the model on the main backend and places part of it
 * on the device, so every command decodes through the same hybrid path.
 */
import { existsSync } from "node:fs";
import type { Backend } from "@powerinfer/core";
import type { PlacementPlan, Throughput } from "@powerinfer/core/placement";
import {
  type DevicePlan,
  defaultGpuIndexPath,
  defaultStatsPath,
  type Model,
  measureReadThroughput,
  type ResolvedPlan,
  resolvePlan,
} from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { loadDeviceBackend } from "../backends.js";
import { choice, float, int, loadModelFromCli, type ModelCliOptions } from "./common.js";

export interface DeviceCliOptions {
  vramBudget?: number;
  deviceBackend: string;
  stats?: string;
  gpuIndex?: string;
  resetGpuIndex?: boolean;
  disableGpuIndex?: boolean;
  nGpuLayers?: number;
  solver: string;
  bucketSize: number;
}

/** Adds the device options (see the module comment). */
export function deviceOptions(cmd: Command): Command {
  return cmd
    .option(
      "--vram-budget <GiB>",
      "device memory for hot neurons and offloaded layers in GiB (default: the device's free memory minus 10 %)",
      float("vram-budget", { min: 0 }),
    )
    .option(
      "--device-backend <name>",
      'backend holding the hot neurons ("auto": a GPU backend when one is usable; "cpu" stands in for tests)',
      "auto",
    )
    .option("--stats <file>", "activation statistics (default: <model>.activations.gguf)")
    .option("--gpu-index <file>", "GPU index to reuse or write (default: <model>.generated.gpuidx)")
    .option("--reset-gpu-index", "solve the plan again even when a matching GPU index exists")
    .option("--disable-gpu-index", "no device: every FFN neuron and layer on the main backend")
    .option(
      "--n-gpu-layers <n>",
      "(-ngl) attention and KV cache of the last N layers on the device (dense models: the whole layers, as llama.cpp's -ngl; default: none)",
      int("n-gpu-layers", { min: 0 }),
    )
    .option("--solver <name>", "ilp (exact) or greedy", choice("solver", ["ilp", "greedy"]), "ilp")
    .option("--bucket-size <n>", "neurons per bucket of the integer program", int("bucket-size", { min: 1 }), 256);
}

/** Budget in bytes: --vram-budget, else 90 % of the device's free memory. */
export function budgetBytes(o: Pick<DeviceCliOptions, "vramBudget">, deviceFree: number): number {
  if (o.vramBudget !== undefined) {
    if (!(o.vramBudget >= 0)) throw new InvalidArgumentError("--vram-budget must be ≥ 0");
    return Math.floor(o.vramBudget * 2 ** 30);
  }
  return Math.floor(deviceFree * 0.9);
}

/**
 * The placement plan for the device options: `resolvePlan` with --stats, --gpu-index, --reset-gpu-index,
 * --solver, --bucket-size, --kv-type and --n-gpu-layers.
 * @throws InvalidArgumentError for --n-gpu-layers beyond the model's layers; what resolvePlan throws.
 */
export function resolvePlanFromCli(
  model: Model,
  deviceName: string,
  o: ModelCliOptions & DeviceCliOptions,
  at: { budget: number; nCtx: number; throughput?: Throughput },
): Promise<ResolvedPlan> {
  checkGpuLayers(o, model);
  return resolvePlan(model, {
    budgetBytes: at.budget,
    backend: deviceName,
    statsPath: o.stats,
    gpuIndexPath: o.gpuIndex,
    reset: o.resetGpuIndex,
    solver: o.solver as "ilp",
    bucketSize: o.bucketSize,
    nCtx: at.nCtx,
    kvType: o.kvType as "f16",
    nGpuLayers: o.nGpuLayers ?? 0,
    throughput: at.throughput,
  });
}

/** @throws InvalidArgumentError when --n-gpu-layers is more than the model's layers. */
function checkGpuLayers(o: Pick<DeviceCliOptions, "nGpuLayers">, model: Model): void {
  const n = model.config.n_layer;
  if (o.nGpuLayers !== undefined && o.nGpuLayers > n) {
    throw new InvalidArgumentError(`--n-gpu-layers ${o.nGpuLayers} is more than the model's ${n} layers`);
  }
}

export interface LoadedWithDevice {
  backend: Backend;
  model: Model;
  /** The device backend when part of the model was placed on it. */
  device?: Backend;
  /** The hot-neuron plan (absent without statistics, e.g. a dense model with --n-gpu-layers only). */
  plan?: PlacementPlan;
  /** Frees the model, the device placement and both backends. */
  dispose(): void;
}

/**
 * Loads the model (main backend: the CPU when a device is used and --backend is "auto") and places hot
 * neurons and the last --n-gpu-layers layers on the device backend. Without a usable device, without
 * statistics or a GPU index (and no --n-gpu-layers), or with a budget that holds nothing, everything stays
 * on the main backend with a one-line note on stderr (unless `quiet`).
 * @throws what loadModelFromCli, resolvePlan and Model.offload throw; InvalidArgumentError for
 *   --n-gpu-layers beyond the model's layers.
 */
export async function loadModelWithDevice(
  o: ModelCliOptions & DeviceCliOptions,
  quiet = false,
  /** KV cache positions the command will hold over all its sessions (default: one session of -c). */
  kvPositions?: (nCtxDefault: number) => number,
): Promise<LoadedWithDevice> {
  const note = (s: string) => {
    if (!quiet) process.stderr.write(`${s}\n`);
  };
  const wantDevice = !o.disableGpuIndex;
  let device = wantDevice
    ? await loadDeviceBackend(
        o.deviceBackend,
        { threads: 1, memoryBudget: o.vramBudget && o.vramBudget * 2 ** 30 },
        () => {},
      )
    : undefined;
  let loaded: { backend: Backend; model: Model };
  try {
    loaded = await loadModelFromCli(
      device && o.backend === "auto" && !process.env["POWERINFER_BACKEND"] ? { ...o, backend: "cpu" } : o,
      quiet,
    );
  } catch (e) {
    device?.dispose();
    throw e;
  }
  const { backend, model } = loaded;
  const cfg = model.config;
  const out: LoadedWithDevice = {
    backend,
    model,
    dispose() {
      model.dispose();
      backend.dispose();
      out.device?.dispose();
    },
  };
  const drop = (why: string) => {
    note(why);
    device?.dispose();
    device = undefined;
  };
  try {
    checkGpuLayers(o, model);
    if (!device) {
      if (wantDevice && (o.nGpuLayers || o.vramBudget !== undefined || o.deviceBackend !== "auto"))
        note(`note: no device backend is usable: everything runs on ${backend.name}`);
      return out;
    }
    if (cfg.moe && !o.nGpuLayers) {
      drop(
        `note: hot neurons of routed experts on a device are not supported yet: everything runs on ${backend.name} (--n-gpu-layers N moves N layers' attention)`,
      );
      return out;
    }
    const ngl = o.nGpuLayers ?? 0;
    const statsPath = o.stats ?? defaultStatsPath(o.model);
    // routed experts: attention only (--n-gpu-layers), every expert stays on main
    const sparse = (model.sparse !== "off" || cfg.ffn.activation === "relu") && !cfg.moe;
    const havePlanInput = existsSync(statsPath) || existsSync(o.gpuIndex ?? defaultGpuIndexPath(o.model));
    const budget = budgetBytes(o, device.devices[0]?.freeMemory ?? 0);
    let hot: Int32Array[] = Array.from({ length: cfg.n_layer }, () => new Int32Array(0));
    let attention: boolean[] | undefined;
    if (havePlanInput && sparse) {
      // the planner weighs each layer's attention and KV cache against hot neurons in the same budget
      const nCtxDefault = o.ctxSize ?? Math.min(cfg.n_ctx_train, 4096);
      // a short calibration: each backend's read speed in a matrix × vector product, for the expected tokens/s
      const cpuBps = measureReadThroughput(backend);
      const devBps = measureReadThroughput(device, Math.min(64 * 2 ** 20, Math.max(2 ** 20, budget / 4)));
      const throughput =
        cpuBps && devBps
          ? { cpuBytesPerSecond: cpuBps, deviceBytesPerSecond: devBps, source: "measured" as const }
          : undefined;
      const r = await resolvePlanFromCli(model, device.name, o, {
        budget,
        nCtx: kvPositions?.(nCtxDefault) ?? nCtxDefault,
        throughput,
      });
      for (const n of r.notes) note(n);
      const tps = r.plan.expectedTokensPerSecond;
      if (Number.isFinite(tps)) {
        const gbs = (x: number) => `${(x / 1e9).toFixed(1)} GB/s`;
        const t = r.plan.throughput;
        note(
          `plan: expected ${tps.toFixed(1)} tokens/s from the layers' bytes read (${t.source === "measured" ? "measured at load" : "planner defaults"}: ${backend.name} ${gbs(t.cpuBytesPerSecond)}, ${device.name} ${gbs(t.deviceBytesPerSecond)})`,
        );
      }
      out.plan = r.plan;
      hot = r.plan.layers.map((L) => L.hot);
      attention = r.plan.layers.map((L) => !!L.attention);
    } else if (ngl === 0) {
      drop(
        sparse
          ? `note: no activation statistics (${statsPath}), so no hot/cold split: every FFN neuron stays on ${backend.name}; run \`powerinfer profile\` first`
          : `note: a dense model gains nothing from a hot/cold split; --n-gpu-layers N puts whole layers on the device`,
      );
      return out;
    }
    // the planner's attention layers, or (no statistics) --n-gpu-layers: the last N layers' attention — and,
    // for a dense FFN, the whole layers — on the device
    const plan: DevicePlan = {
      layers: hot.map((h, l) => {
        const offloaded = attention ? attention[l]! : l >= cfg.n_layer - ngl;
        return {
          hot: offloaded && !sparse && !cfg.moe ? Int32Array.from({ length: cfg.n_ff }, (_, i) => i) : h,
          attention: offloaded,
        };
      }),
    };
    if (plan.layers.every((L) => L.hot.length === 0 && !L.attention)) {
      drop(`note: the device budget holds no hot neuron: every FFN neuron stays on ${backend.name}`);
      return out;
    }
    const placed = model.offload(device, plan);
    out.device = device;
    note(
      `hybrid: ${placed.hotNeurons} hot neurons and ${placed.attentionLayers} attention layers (${(placed.deviceBytes() / 2 ** 20).toFixed(2)} MiB) on ${device.name}, the rest on ${backend.name}`,
    );
    return out;
  } catch (e) {
    device?.dispose();
    model.dispose();
    backend.dispose();
    throw e;
  }
}
