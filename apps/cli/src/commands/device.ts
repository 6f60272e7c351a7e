/**
 * The device options every command that decodes shares (run, chat, serve, batched, perplexity, profile,
 * plan): a device backend for hot neurons and offloaded layers, its memory budget, the GPU index, and
 * `--n-gpu-layers`. {@link loadModelWithDevice} loads the model on the main backend and places part of it
 * on the device, so every command decodes through the same hybrid path.
 */
import { existsSync } from "node:fs";
import { type Backend, BackendError } from "@powerinfer/core";
import type { PlacementPlan, Throughput } from "@powerinfer/core/placement";
import {
  attentionBytes,
  attentionWeightBytes,
  contextSize,
  type DevicePlan,
  defaultGpuIndexPath,
  defaultStatsPath,
  EngineError,
  hotNeuronBytes,
  type Model,
  measureReadThroughput,
  type ResolvedPlan,
  resolvePlan,
} from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { loadDeviceBackend } from "../backends.js";
import {
  annotateStatsError,
  checkInputFile,
  choice,
  float,
  gpuLayersArg,
  int,
  loadModelFromCli,
  type ModelCliOptions,
  plural,
} from "./common.js";

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
      float("vram-budget", { min: 0, max: 2 ** 20 }),
    )
    .option(
      "--device-backend <name>",
      'backend holding the hot neurons ("auto": a GPU backend when one is usable; "cpu" stands in for tests)',
      (v: string) => {
        if (v.trim() === "") throw new InvalidArgumentError("--device-backend is empty: give a backend name or auto");
        return v;
      },
      "auto",
    )
    .option("--stats <file>", "activation statistics (default: <model>.activations.gguf)")
    .option("--gpu-index <file>", "GPU index to reuse or write (default: <model>.generated.gpuidx)")
    .option("--reset-gpu-index", "solve the plan again even when a matching GPU index exists")
    .option("--disable-gpu-index", "no device: every FFN neuron and layer on the main backend")
    .option(
      "--n-gpu-layers <n>",
      "(-ngl) attention and KV cache of the last N layers on the device (dense models: the whole layers, as llama.cpp's -ngl); all (or ≤ -2) every layer; auto (or -1, the default) lets the planner choose",
      gpuLayersArg(),
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
 * --solver, --bucket-size, --kv-type and --n-gpu-layers (exactly the last N layers' attention, as llama.cpp's
 * -ngl; without it the planner decides which layers' attention goes to the device).
 * @throws what resolvePlan throws.
 */
export function resolvePlanFromCli(
  model: Model,
  deviceName: string,
  o: ModelCliOptions & DeviceCliOptions,
  at: { budget: number; nCtx: number; throughput?: Throughput },
): Promise<ResolvedPlan> {
  // --n-gpu-layers that cannot fit is the user's option, named as such (the planner would say nGpuLayers)
  const ngl = gpuLayers(o, model);
  let forced = 0;
  for (let l = model.config.n_layer - ngl; l < model.config.n_layer; l++)
    forced += attentionBytes(model, l, at.nCtx, o.kvType as "f16");
  if (forced > at.budget) {
    const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
    return Promise.reject(
      new InvalidArgumentError(
        `--n-gpu-layers ${ngl} needs ${mib(forced)} on ${deviceName} (attention and KV cache for ${at.nCtx} positions), more than the ${mib(at.budget)} budget (--vram-budget)`,
      ),
    );
  }
  // a statistics file that cannot be read is named with the option that chose it
  const statsPath = o.stats ?? defaultStatsPath(model.file.path);
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
    nGpuLayers: gpuLayers(o, model),
    // -ngl N: exactly those layers' attention, as llama.cpp's
    exactGpuLayers: o.nGpuLayers !== undefined,
    throughput: at.throughput,
  }).catch((e: unknown) => {
    throw annotateStatsError(e, statsPath, o.stats !== undefined, model.file.path);
  });
}

/** --n-gpu-layers, at most the model's layers (llama.cpp's `-ngl 99` means every layer); 0 when absent. */
export function gpuLayers(o: Pick<DeviceCliOptions, "nGpuLayers">, model: Model): number {
  return Math.min(o.nGpuLayers ?? 0, model.config.n_layer);
}

export interface LoadedWithDevice {
  backend: Backend;
  model: Model;
  /** The device backend when part of the model was placed on it. */
  device?: Backend;
  /** The hot-neuron plan (absent without statistics, e.g. a dense model with --n-gpu-layers only). */
  plan?: PlacementPlan;
  /** One line: what is on the device (empty without one). */
  summary: string;
  /** Frees the model, the device placement and both backends. */
  dispose(): void;
}

export interface DeviceLoadOptions {
  /** KV cache positions the command will hold over all its sessions (default: one session of -c). */
  kvPositions?: (nCtxDefault: number) => number;
  /**
   * Several sequences decode in one step (serve, batched): columns of the largest step, for the device's
   * scratch where the attention outputs of offloaded layers are gathered (kept out of the plan's budget).
   */
  batchColumns?: number;
}

const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;

/**
 * Loads the model (main backend: the CPU when a device is used and --backend is "auto") and places part of
 * it on the device backend: the planner's hot neurons and attention layers, or with --n-gpu-layers N the
 * attention and KV cache of exactly the last N layers (a dense model: the whole layers) and the planner's hot
 * neurons in what is left. Without a usable device, without statistics or a GPU index (and no
 * --n-gpu-layers), or with a budget that holds nothing, everything stays on the main backend with a one-line
 * note on stderr (unless `quiet`).
 * @throws what loadModelFromCli, resolvePlan and Model.offload throw; InvalidArgumentError when
 *   --n-gpu-layers does not fit in --vram-budget or the placement does not fit on the device.
 */
export async function loadModelWithDevice(
  o: ModelCliOptions & DeviceCliOptions,
  quiet = false,
  lo: DeviceLoadOptions = {},
): Promise<LoadedWithDevice> {
  const note = (s: string) => {
    if (!quiet) process.stderr.write(`${s}\n`);
  };
  const wantDevice = !o.disableGpuIndex;
  if (!wantDevice) {
    const ignored = [
      o.vramBudget !== undefined && "--vram-budget",
      o.deviceBackend !== "auto" && "--device-backend",
      o.nGpuLayers !== undefined && "--n-gpu-layers",
      o.gpuIndex !== undefined && "--gpu-index",
      o.resetGpuIndex && "--reset-gpu-index",
    ].filter(Boolean);
    if (ignored.length)
      note(`note: --disable-gpu-index: ${ignored.join(", ")} ignored, everything runs on the main backend`);
  }
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
    summary: "",
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
    if (!device) {
      if (wantDevice && (o.nGpuLayers || o.vramBudget !== undefined || o.deviceBackend !== "auto"))
        note(`note: no device backend is usable: everything runs on ${backend.name}`);
      if (o.stats !== undefined && o.ramBudget === undefined) {
        // a file the user named must be there even when this run does not read it
        checkInputFile(o.stats, "activation statistics file (--stats)");
        note(
          `note: --stats ${o.stats} not used: activation statistics place hot neurons on a device or in the --ram-budget cache, and this run has neither`,
        );
      }
      return out;
    }
    const ngl = gpuLayers(o, model);
    const forced = o.nGpuLayers !== undefined;
    // a hot/cold split: sparse or ReLU FFNs, and routed experts ((expert, neuron) pairs, sparse or dense)
    const sparse = model.sparse !== "off" || cfg.ffn.activation === "relu" || !!cfg.moe;
    const statsPath = o.stats ?? defaultStatsPath(o.model);
    const havePlanInput = existsSync(statsPath) || existsSync(o.gpuIndex ?? defaultGpuIndexPath(o.model));
    const budget = budgetBytes(o, device.devices[0]?.freeMemory ?? 0);
    const nCtxDefault = contextSize(cfg, o.ctxSize);
    const nCtx = lo.kvPositions?.(nCtxDefault) ?? nCtxDefault;
    const kvBytes = (l: number) => attentionBytes(model, l, nCtx, o.kvType as "f16") - attentionWeightBytes(model, l);
    // the scratch where several sequences' attention outputs are gathered on the device
    const scratch = lo.batchColumns ? cfg.head_dim * cfg.n_head * Math.max(16, lo.batchColumns) * 4 : 0;
    const last = (l: number) => l >= cfg.n_layer - ngl;
    // --n-gpu-layers N: exactly the last N layers' attention (and, for a dense FFN, the whole layers)
    let forcedBytes = 0;
    for (let l = 0; l < cfg.n_layer; l++) {
      if (!forced || !last(l)) continue;
      forcedBytes += attentionBytes(model, l, nCtx, o.kvType as "f16");
      if (!sparse) forcedBytes += cfg.n_ff * hotNeuronBytes(model, l);
    }
    if (forced && forcedBytes + (ngl ? scratch : 0) > budget) {
      throw new InvalidArgumentError(
        `--n-gpu-layers ${ngl} needs ${mib(forcedBytes + (ngl ? scratch : 0))} on ${device.name} (attention${sparse ? "" : ", FFN"} and KV cache for ${nCtx} positions), more than the ${mib(budget)} budget (--vram-budget)`,
      );
    }
    let hot: Int32Array[] = Array.from({ length: cfg.n_layer }, () => new Int32Array(0));
    let attention: boolean[] = Array.from({ length: cfg.n_layer }, (_, l) => forced && last(l));
    let throughputLine = "";
    if (havePlanInput && sparse) {
      // a short calibration: each backend's read speed in a matrix × vector product, for the expected tokens/s
      const cpuBps = measureReadThroughput(backend);
      const devBps = measureReadThroughput(device, Math.min(64 * 2 ** 20, Math.max(2 ** 20, budget / 4)));
      const throughput =
        cpuBps && devBps
          ? { cpuBytesPerSecond: cpuBps, deviceBytesPerSecond: devBps, source: "measured" as const }
          : undefined;
      let r: ResolvedPlan | undefined;
      try {
        // the planner weighs each layer's attention and KV cache against hot neurons (with --n-gpu-layers
        // exactly the last N layers'), in the budget less the batch scratch
        r = await resolvePlanFromCli(model, device.name, o, {
          budget: Math.max(0, budget - scratch),
          nCtx,
          throughput,
        });
      } catch (e) {
        if (!(e instanceof EngineError && e.code === "NO_STATS")) throw e;
        if (!forced) {
          drop(`note: ${e.message}; every FFN neuron stays on ${backend.name}`);
          return out;
        }
        note(`note: ${e.message}; only the --n-gpu-layers layers go to ${device.name}`);
      }
      if (r) {
        for (const n of r.notes) note(n);
        out.plan = r.plan;
        hot = r.plan.layers.map((L) => L.hot);
        attention = r.plan.layers.map((L) => !!L.attention);
        const tps = r.plan.expectedTokensPerSecond;
        const t = r.plan.throughput;
        const gbs = (x: number) => `${(x / 1e9).toFixed(1)} GB/s`;
        if (Number.isFinite(tps))
          throughputLine = `plan: expected ${tps.toFixed(1)} tokens/s from the layers' bytes read (${t.source === "measured" ? "read speeds measured at load" : "the planner's default read speeds"}: main ${backend.name} ${gbs(t.cpuBytesPerSecond)}, device ${device.name} ${gbs(t.deviceBytesPerSecond)})`;
      }
    } else if (!forced) {
      drop(
        sparse
          ? `note: no activation statistics (${statsPath}), so no hot/cold split: every FFN neuron stays on ${backend.name}; run \`powerinfer profile\` first`
          : `note: a dense model gains nothing from a hot/cold split; --n-gpu-layers N puts whole layers on the device`,
      );
      return out;
    }
    const plan: DevicePlan = {
      layers: hot.map((h, l) => ({
        hot: attention[l] && !sparse ? Int32Array.from({ length: cfg.n_ff }, (_, i) => i) : h,
        attention: attention[l],
      })),
    };
    if (plan.layers.every((L) => L.hot.length === 0 && !L.attention)) {
      drop(`note: the device budget holds no hot neuron: every FFN neuron stays on ${backend.name}`);
      return out;
    }
    let placed: ReturnType<Model["offload"]>;
    try {
      placed = model.offload(device, plan);
    } catch (e) {
      if (e instanceof BackendError && e.code === "OUT_OF_MEMORY") {
        throw new InvalidArgumentError(
          `the placement does not fit on ${device.name} (${e.message.replace(/^[^:]*: /, "")}): lower --n-gpu-layers or --vram-budget`,
        );
      }
      throw e;
    }
    out.device = device;
    if (throughputLine) note(throughputLine);
    const whole = plan.layers.filter((L) => L.attention && L.hot.length === cfg.n_ff).length;
    const kv = plan.layers.reduce((s, L, l) => s + (L.attention ? kvBytes(l) : 0), 0);
    // routed experts: hot (expert, neuron) pairs (offload.ts)
    const what = cfg.moe
      ? placed.hotNeurons > 0
        ? `${placed.hotNeurons} hot (expert, neuron) pairs and ${plural(placed.attentionLayers, "attention layer")}`
        : `${placed.attentionLayers === 1 ? "1 layer's" : `${placed.attentionLayers} layers'`} attention (experts stay on ${backend.name})`
      : sparse
        ? `${placed.hotNeurons} hot neurons and ${plural(placed.attentionLayers, "attention layer")}`
        : plural(whole, "whole layer");
    out.summary = `${what} on ${device.name} (${mib(placed.deviceBytes())} of weights${kv ? ` + ${mib(kv)} of KV cache` : ""}), the rest on ${backend.name}`;
    note(`hybrid: ${out.summary}`);
    return out;
  } catch (e) {
    device?.dispose();
    model.dispose();
    backend.dispose();
    throw e;
  }
}
