/**
 * Finding or making the placement plan of a model: reuse `<model>.generated.gpuidx` when it was solved
 * for the same budget, backend and statistics; otherwise solve it from `<model>.activations.gguf` and
 * write it (PowerInfer's GPU index format, readable by PowerInfer).
 */
import { existsSync } from "node:fs";
import {
  type ActivationStats,
  type GpuIndex,
  modelFingerprint,
  readActivationStats,
  readGpuIndex,
  writeGpuIndex,
} from "@powerinfer/gguf";
import type { Model } from "./engine.js";
import { EngineError } from "../errors.js";
import { hotNeuronBytes } from "./offload.js";
import { checkStatsForModel } from "./profile.js";
import { gpuIndexToPlan, type PlacementPlan, planPlacement, planToGpuIndex } from "@powerinfer/core/placement";

export const defaultStatsPath = (modelPath: string) => `${modelPath.replace(/\.gguf$/i, "")}.activations.gguf`;
export const defaultGpuIndexPath = (modelPath: string) => `${modelPath.replace(/\.gguf$/i, "")}.generated.gpuidx`;

export interface ResolvePlanOptions {
  /** Device bytes for hot neurons. */
  budgetBytes: number;
  /** Name of the device backend the plan is for (recorded in the GPU index). */
  backend: string;
  /** Activation statistics (default: `<model>.activations.gguf`). */
  statsPath?: string;
  /** GPU index to reuse or write (default: `<model>.generated.gpuidx`). */
  gpuIndexPath?: string;
  /** Solve again even when a matching GPU index exists. */
  reset?: boolean;
  solver?: "ilp" | "greedy";
  /** Buckets of this many neurons (default 256; smaller for tiny models). */
  bucketSize?: number;
  /** Don't write the GPU index (e.g. a read-only model folder). */
  noWrite?: boolean;
}

export interface ResolvedPlan {
  plan: PlacementPlan;
  /** True when an existing GPU index was used as it was. */
  reused: boolean;
  /** Where the plan was read from or written to (the path asked for when it was not saved). */
  gpuIndexPath: string;
  /** Why a GPU index was (not) reused or written. */
  notes: string[];
}

/**
 * @throws EngineError 'BAD_INPUT' when statistics are missing or belong to another model, GgufError for bad files.
 */
export async function resolvePlan(model: Model, o: ResolvePlanOptions): Promise<ResolvedPlan> {
  const cfg = model.config;
  const path = model.file.path;
  const gpuIndexPath = o.gpuIndexPath ?? defaultGpuIndexPath(path);
  const statsPath = o.statsPath ?? defaultStatsPath(path);
  const bytesPerNeuron = Array.from({ length: cfg.n_layer }, (_, l) => hotNeuronBytes(model, l));
  const notes: string[] = [];
  if (!o.reset && existsSync(gpuIndexPath)) {
    const idx = readGpuIndex(gpuIndexPath);
    const { layers, provenance } = gpuIndexToPlan(idx, bytesPerNeuron);
    const shapeOk =
      layers.length === cfg.n_layer &&
      idx.layers.every((L) => L.gpuIdx.length === cfg.n_ff) &&
      layers.every((L) => L.hot.every((n) => n >= 0 && n < cfg.n_ff));
    const totalBytes = layers.reduce((s, L) => s + L.bytes, 0);
    const ours =
      provenance &&
      provenance.budgetBytes === o.budgetBytes &&
      provenance.backend === o.backend &&
      provenance.statsFile === statsPath;
    // an index without our provenance keys (PowerInfer's solver writes none) is used as it is when it fits
    const foreign = !provenance && totalBytes <= o.budgetBytes;
    if (shapeOk && (ours || foreign)) {
      const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
      notes.push(
        ours
          ? `reusing ${gpuIndexPath} (solved for this budget, backend and statistics)`
          : `using ${gpuIndexPath} as it is: a GPU index without powerinfer-ts's provenance keys (written by PowerInfer?), ${layers.reduce((s, L) => s + L.hot.length, 0)} hot neurons, ${mib(totalBytes)} within the ${mib(o.budgetBytes)} budget`,
      );
      // the expected shares come from the statistics the plan was solved with, when they are still there
      const counts = existsSync(statsPath) ? readActivationStats(statsPath).counts : undefined;
      let served = 0;
      let all = 0;
      const withShare = layers.map((L, l) => {
        const c = counts?.[l];
        if (!c) return { ...L, deviceShare: Number.NaN };
        const total = c.reduce((a, b) => a + b, 0);
        const hot = L.hot.reduce((a, n) => a + c[n]!, 0);
        served += hot;
        all += total;
        return { ...L, deviceShare: total ? hot / total : 0 };
      });
      return {
        plan: {
          layers: withShare,
          totalBytes,
          budgetBytes: o.budgetBytes,
          deviceShare: counts && all ? served / all : Number.NaN,
          solver: String(idx.extra?.find((e) => e.key === "powerinfer.plan.solver")?.value ?? "ilp") as "ilp",
          method: "index",
          bound: Number.NaN,
          gap: Number.NaN,
        },
        reused: true,
        gpuIndexPath,
        notes,
      };
    }
    notes.push(
      !shapeOk
        ? `${gpuIndexPath} does not fit this model (${layers.length} layers of ${idx.layers[0]?.gpuIdx.length ?? 0} neurons; the model has ${cfg.n_layer} of ${cfg.n_ff}); solving again`
        : provenance
          ? `${gpuIndexPath} was solved for another budget, backend or statistics file; solving again`
          : `${gpuIndexPath} (written by PowerInfer?) holds ${(totalBytes / 2 ** 20).toFixed(2)} MiB of hot neurons, more than the ${(o.budgetBytes / 2 ** 20).toFixed(2)} MiB budget; solving again`,
    );
  }
  if (!existsSync(statsPath)) {
    throw new EngineError(
      "BAD_INPUT",
      `no activation statistics at ${statsPath}: run \`powerinfer profile -m ${path} -f TEXT\` first`,
    );
  }
  const stats: ActivationStats = readActivationStats(statsPath);
  checkStatsForModel(stats, cfg, modelFingerprint(model.file));
  const plan = await planPlacement(
    {
      counts: stats.counts,
      tokenCount: stats.tokenCount,
      bytesPerNeuron,
      budgetBytes: o.budgetBytes,
      bucketSize: o.bucketSize,
    },
    { solver: o.solver },
  );
  // A GPU index the user named is theirs: replaced only on --reset-gpu-index; a new plan goes to the
  // default path beside the model instead (when that is another file), or stays in memory.
  let writePath: string | undefined = gpuIndexPath;
  if (o.gpuIndexPath !== undefined && !o.reset && existsSync(gpuIndexPath)) {
    const fallback = defaultGpuIndexPath(path);
    writePath = fallback !== gpuIndexPath ? fallback : undefined;
    notes.push(
      `${gpuIndexPath} is kept as it is (--reset-gpu-index replaces it); ${writePath ? `the new plan goes to ${writePath}` : "the new plan is not saved"}`,
    );
  }
  if (!o.noWrite && writePath) {
    const idx: GpuIndex = planToGpuIndex(plan, cfg.n_ff, {
      budgetBytes: o.budgetBytes,
      backend: o.backend,
      statsFile: statsPath,
    });
    try {
      writeGpuIndex(writePath, idx);
      notes.push(`wrote ${writePath}`);
    } catch (e) {
      // a read-only model folder: use the plan without saving it
      notes.push(
        `could not write ${writePath} (${(e as Error).message}); using the plan unsaved — pass --gpu-index PATH to keep it`,
      );
      writePath = undefined;
    }
  }
  return { plan, reused: false, gpuIndexPath: writePath ?? gpuIndexPath, notes };
}
