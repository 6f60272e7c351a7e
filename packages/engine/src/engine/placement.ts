/**
 * Finding or making the placement plan of a model: reuse `<model>.generated.gpuidx` when it was solved
 * for the same budget, backend, statistics and attention sizes; otherwise solve it from
 * `<model>.activations.gguf` and write it (PowerInfer's GPU index format, readable by PowerInfer; the layers
 * whose attention the plan offloads are an extra key PowerInfer ignores).
 */
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { resolve as resolvePath } from "node:path";
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
import { attentionWeightBytes, hotNeuronBytes } from "./offload.js";
import { checkStatsForModel } from "./profile.js";
import {
  attentionByRule,
  DEFAULT_THROUGHPUT,
  evaluatePlacement,
  gpuIndexToPlan,
  type PlacementPlan,
  type PlanExperts,
  type PlannerInput,
  planPlacement,
  planToGpuIndex,
  type Throughput,
} from "@powerinfer/core/placement";

export const defaultStatsPath = (modelPath: string) => `${modelPath.replace(/\.gguf$/i, "")}.activations.gguf`;
export const defaultGpuIndexPath = (modelPath: string) => `${modelPath.replace(/\.gguf$/i, "")}.generated.gpuidx`;

/**
 * Device bytes of layer l's attention: what `Model.offload` copies to the device when the layer's attention
 * runs there ({@link attentionWeightBytes}: attention weights and biases, norms, the predictor and the down
 * bias) plus its KV cache for `nCtx` positions,
 * 2 · nCtx · head_dim · n_head_kv · (2 for f16, 4 for f32) bytes (as `KvCache` allocates it).
 * @throws EngineError 'BAD_INPUT' for a layer out of range or nCtx not an integer ≥ 1.
 */
export function attentionBytes(model: Model, l: number, nCtx: number, kvType: "f16" | "f32" = "f16"): number {
  const cfg = model.config;
  const L = model.weights.layers[l];
  if (!Number.isInteger(l) || !L) throw new EngineError("BAD_INPUT", `no layer ${l} (the model has ${cfg.n_layer})`);
  if (!Number.isInteger(nCtx) || nCtx < 1)
    throw new EngineError("BAD_INPUT", `nCtx must be an integer ≥ 1, got ${nCtx}`);
  return attentionWeightBytes(model, l) + 2 * nCtx * cfg.head_dim * cfg.n_head_kv * (kvType === "f32" ? 4 : 2);
}

export interface ResolvePlanOptions {
  /** Device bytes for the plan: hot neurons and, when attention is planned (nCtx or attentionBytes), attention + KV. */
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
  /**
   * Per layer, device bytes of attention + KV cache (see {@link attentionBytes}). With it (or `nCtx`) the plan
   * also decides `layers[l].attention`; with neither, attention stays on the CPU (a neurons-only plan).
   */
  attentionBytes?: readonly number[];
  /** Context size the KV cache is sized for; gives `attentionBytes` from the model when that is not given. */
  nCtx?: number;
  /** KV cache type for `attentionBytes` from `nCtx` (default f16). */
  kvType?: "f16" | "f32";
  /** Force attention of the last N layers on the device (llama.cpp -ngl); needs attention planned. */
  nGpuLayers?: number;
  /** With nGpuLayers: those layers' attention and no other (see PlannerInput.exactGpuLayers). */
  exactGpuLayers?: boolean;
  /** Per-backend speed for the plan's expected tokens/s (default: the planner's documented defaults). */
  throughput?: Throughput;
}

export interface ResolvedPlan {
  plan: PlacementPlan;
  /** True when an existing GPU index was used as it was. */
  reused: boolean;
  /** Where the plan was read from or written to (the path asked for when it was not saved). */
  gpuIndexPath: string;
  /** Why a GPU index was (not) reused or written. */
  notes: string[];
  /** Models with routed experts: what `explainPlan` needs to show experts beside (expert, neuron) pairs. */
  experts?: PlanExperts;
}

/**
 * @throws EngineError 'BAD_INPUT' when statistics are missing or belong to another model, GgufError for bad files.
 */
export async function resolvePlan(model: Model, o: ResolvePlanOptions): Promise<ResolvedPlan> {
  const cfg = model.config;
  const path = model.file.path;
  const gpuIndexPath = o.gpuIndexPath ?? defaultGpuIndexPath(path);
  const statsPath = o.statsPath ?? defaultStatsPath(path);
  // Routed experts: a "neuron" is an (expert, neuron) pair, e·n_ff_exp + i (the statistics' layout). Sparse
  // experts read a pair's rows when it fires; dense ones (no predictors, --sparse off) read every neuron of a
  // chosen expert, so a pair's count is then its expert's selection count.
  const moe = cfg.moe;
  const nNeurons = moe ? moe.n_ff_exp * moe.n_expert : cfg.n_ff;
  const expertRanking = moe ? (model.sparse === "off" ? "selections" : "activations") : undefined;
  const expertsOf = (stats: ActivationStats | undefined): { experts?: PlanExperts } =>
    moe
      ? {
          experts: {
            nExpert: moe.n_expert,
            nFfExp: moe.n_ff_exp,
            rankedBy: expertRanking,
            ...(stats?.selections ? { selections: stats.selections } : {}),
          },
        }
      : {};
  const bytesPerNeuron = Array.from({ length: cfg.n_layer }, (_, l) => hotNeuronBytes(model, l));
  const attBytes =
    o.attentionBytes ??
    (o.nCtx !== undefined
      ? Array.from({ length: cfg.n_layer }, (_, l) => attentionBytes(model, l, o.nCtx!, o.kvType))
      : undefined);
  if (attBytes && attBytes.length !== cfg.n_layer) {
    throw new EngineError("BAD_INPUT", `attentionBytes has ${attBytes.length} layers, the model ${cfg.n_layer}`);
  }
  const attTotal = attBytes?.reduce((s, b) => s + b, 0) ?? 0;
  const nGpuLayers = o.nGpuLayers ?? 0;
  if (nGpuLayers > 0 && !attBytes) {
    throw new EngineError("BAD_INPUT", "nGpuLayers needs attention planned: give nCtx or attentionBytes");
  }
  if (!Number.isInteger(nGpuLayers) || nGpuLayers < 0 || nGpuLayers > cfg.n_layer) {
    throw new EngineError("BAD_INPUT", `nGpuLayers must be an integer from 0 to ${cfg.n_layer}, got ${nGpuLayers}`);
  }
  const baseInput = {
    bytesPerNeuron,
    budgetBytes: o.budgetBytes,
    bucketSize: o.bucketSize,
    attentionBytes: attBytes,
    nGpuLayers,
    exactGpuLayers: o.exactGpuLayers,
    throughput: o.throughput,
  };
  const notes: string[] = [];
  const userNamed = o.gpuIndexPath !== undefined;
  const same = (a: string, b: string) => resolvePath(a) === resolvePath(b);
  if (same(gpuIndexPath, path) || same(gpuIndexPath, statsPath)) {
    throw new EngineError(
      "BAD_INPUT",
      `the GPU index path ${gpuIndexPath} is the ${same(gpuIndexPath, path) ? "model" : "activation statistics"} file; name another file`,
    );
  }
  const kind = indexFileKind(gpuIndexPath);
  if (kind === "other") {
    throw new EngineError(
      "BAD_INPUT",
      `${gpuIndexPath} exists and is not a GPU index (${indexReadError(gpuIndexPath)}): neither read nor replaced; name another file`,
    );
  }
  // what the statistics hold now (a profile run again at the same path must not reuse the old plan)
  // read once: its digest decides reuse, its counts evaluate a reused plan or solve a new one; a file that
  // cannot be read is reported where it is used (as before), not here
  let statsRead: { stats?: ActivationStats; error?: unknown } = {};
  if (existsSync(statsPath)) {
    try {
      statsRead = { stats: readActivationStats(statsPath) };
    } catch (error) {
      statsRead = { error };
    }
  }
  const statsNow = (): ActivationStats | undefined => {
    if (statsRead.error !== undefined) throw statsRead.error;
    return statsRead.stats;
  };
  const digestNow = statsRead.stats && statsDigest(statsRead.stats);
  if (!o.reset && existsSync(gpuIndexPath)) {
    const idx = readGpuIndex(gpuIndexPath);
    const { layers, provenance, attention: recorded } = gpuIndexToPlan(idx, bytesPerNeuron);
    const shapeOk =
      layers.length === cfg.n_layer &&
      idx.layers.every((L) => L.gpuIdx.length === nNeurons) &&
      layers.every((L) => L.hot.every((n) => n >= 0 && n < nNeurons)) &&
      (provenance?.expertCount ?? (moe ? undefined : 0)) === (moe?.n_expert ?? 0);
    const neuronBytes = layers.reduce((s, L) => s + L.bytes, 0);
    const ours =
      provenance &&
      provenance.budgetBytes === o.budgetBytes &&
      provenance.backend === o.backend &&
      provenance.statsFile === statsPath &&
      (provenance.statsDigest === undefined || digestNow === undefined || provenance.statsDigest === digestNow) &&
      (provenance.solver ?? "ilp") === (o.solver ?? "ilp") &&
      (provenance.attentionBytes ?? 0) === attTotal &&
      (provenance.nGpuLayers ?? 0) === nGpuLayers &&
      !!provenance.exactGpuLayers === !!o.exactGpuLayers &&
      provenance.expertRanking === expertRanking;
    // An index without our provenance keys (PowerInfer's solver writes none) is used as it is when it fits: its
    // neurons as given, attention decided by the rule (the last layers that fit beside them, forced ones first).
    // So is one of ours solved for other settings when there are no statistics to solve again from.
    const noStats = !existsSync(statsPath);
    const asIs = !provenance || (!ours && noStats);
    const foreignAttention =
      asIs && neuronBytes <= o.budgetBytes
        ? attBytes
          ? attentionByRule(attBytes, neuronBytes, o.budgetBytes, nGpuLayers, o.exactGpuLayers)
          : layers.map(() => false)
        : undefined;
    const attention = ours ? (recorded ?? layers.map(() => false)) : foreignAttention;
    if (shapeOk && attention) {
      const mib = (b: number) => `${(b / 2 ** 20).toFixed(2)} MiB`;
      const nAtt = attention.filter(Boolean).length;
      notes.push(
        ours
          ? `reusing ${gpuIndexPath} (solved for this budget, backend, statistics and attention sizes)`
          : `using ${gpuIndexPath} as it is: ${provenance ? `solved for other settings, and there are no statistics at ${statsPath} to solve again from` : "a GPU index without powerinfer-ts's provenance keys (written by PowerInfer?)"}, ${layers.reduce((s, L) => s + L.hot.length, 0)} hot neurons, ${mib(neuronBytes)} within the ${mib(o.budgetBytes)} budget` +
              (attBytes ? `; attention of ${nAtt} layers placed by the rule (the last layers that fit)` : ""),
      );
      // the expected shares come from the statistics the plan was solved with, when they are still there
      const stats = statsNow();
      const statsFit =
        stats &&
        stats.counts.length === cfg.n_layer &&
        stats.counts.every((c) => c.length === nNeurons) &&
        stats.nExpert === moe?.n_expert;
      const hot = layers.map((L) => L.hot);
      const plan = statsFit
        ? evaluatePlacement(
            { ...baseInput, counts: plannerCounts(stats, expertRanking), tokenCount: stats.tokenCount },
            hot,
            attention,
          )
        : unknownPlan(layers, attention, attBytes, o.budgetBytes, o.throughput);
      plan.solver = String(idx.extra?.find((e) => e.key === "powerinfer.plan.solver")?.value ?? "ilp") as "ilp";
      return { plan, reused: true, gpuIndexPath, notes, ...expertsOf(statsFit ? stats : undefined) };
    }
    notes.push(
      !shapeOk
        ? `${gpuIndexPath} does not fit this model (${layers.length} layers of ${idx.layers[0]?.gpuIdx.length ?? 0} neurons${provenance?.expertCount ? ` in ${provenance.expertCount} experts` : ""}; the model has ${cfg.n_layer} of ${nNeurons}${moe ? ` in ${moe.n_expert} experts` : ""}); solving again`
        : provenance
          ? `${gpuIndexPath} was solved for another budget, backend, solver, statistics (file or contents), attention sizes or expert ranking (--sparse); solving again`
          : neuronBytes > o.budgetBytes
            ? `${gpuIndexPath} (written by PowerInfer?) holds ${(neuronBytes / 2 ** 20).toFixed(2)} MiB of hot neurons, more than the ${(o.budgetBytes / 2 ** 20).toFixed(2)} MiB budget; solving again`
            : `${gpuIndexPath} (written by PowerInfer?) leaves no room for the attention of the last ${nGpuLayers} layers (nGpuLayers); solving again`,
    );
  }
  if (!existsSync(statsPath)) {
    throw new EngineError(
      "NO_STATS",
      `no activation statistics at ${statsPath}: run \`powerinfer profile -m ${path} -f TEXT\` first`,
    );
  }
  const stats: ActivationStats = statsNow()!;
  checkStatsForModel(stats, cfg, modelFingerprint(model.file));
  const input: PlannerInput = {
    ...baseInput,
    counts: plannerCounts(stats, expertRanking),
    tokenCount: stats.tokenCount,
  };
  let plan: PlacementPlan;
  try {
    plan = await planPlacement(input, { solver: o.solver });
  } catch (e) {
    if ((e as { code?: string }).code === "BAD_PLANNER_INPUT") throw new EngineError("BAD_INPUT", (e as Error).message);
    throw e;
  }
  // A GPU index the user named, or one written by PowerInfer, is kept: replaced only on --reset-gpu-index; a
  // new plan goes to the default path beside the model instead (when that is another file holding nothing or
  // a plan of ours), or stays in memory. The model, its statistics and a file that is not a GPU index are never
  // replaced.
  let writePath: string | undefined = gpuIndexPath;
  const keep = kind === "foreign" ? !o.reset : kind === "ours" && userNamed && !o.reset;
  if (keep) {
    const fallback = defaultGpuIndexPath(path);
    const fk = indexFileKind(fallback);
    writePath = !same(fallback, gpuIndexPath) && (fk === "absent" || fk === "ours") ? fallback : undefined;
    notes.push(
      `${gpuIndexPath} is kept as it is${kind === "foreign" ? " (written by PowerInfer?)" : ""} (--reset-gpu-index replaces it); ${writePath ? `the new plan goes to ${writePath}` : "the new plan is not saved"}`,
    );
  }
  if (!o.noWrite && writePath) {
    const idx: GpuIndex = planToGpuIndex(plan, nNeurons, {
      budgetBytes: o.budgetBytes,
      backend: o.backend,
      statsFile: statsPath,
      statsDigest: digestNow,
      attentionBytes: attTotal,
      nGpuLayers,
      exactGpuLayers: o.exactGpuLayers,
      ...(moe ? { expertCount: moe.n_expert, expertRanking } : {}),
    });
    try {
      writeGpuIndex(writePath, idx);
      notes.push(`wrote ${writePath}`);
    } catch (e) {
      // a read-only model folder: use the plan without saving it
      notes.push(
        `could not write ${writePath} (${(e as Error).message}); using the plan unsaved${userNamed ? "" : " — pass --gpu-index PATH to keep it"}`,
      );
      writePath = undefined;
    }
  }
  return { plan, reused: false, gpuIndexPath: writePath ?? gpuIndexPath, notes, ...expertsOf(stats) };
}

/** A digest of statistics' counts, selections and token count (sha256, hex, 32 characters). */
function statsDigest(st: ActivationStats): string {
  const h = createHash("sha256");
  h.update(`${st.tokenCount}:${st.nFf}:${st.nExpert ?? 0}`);
  for (const c of st.counts) h.update(new Uint8Array(c.buffer, c.byteOffset, c.byteLength));
  for (const c of st.selections ?? []) h.update(new Uint8Array(c.buffer, c.byteOffset, c.byteLength));
  return h.digest("hex").slice(0, 32);
}

/**
 * The planner's per-layer counts: the statistics' firing counts, or (dense experts, "selections") each
 * (expert, neuron) pair's expert selection count — every neuron of a chosen expert is read.
 */
function plannerCounts(stats: ActivationStats, ranking: "activations" | "selections" | undefined): Int32Array[] {
  if (ranking !== "selections") return stats.counts;
  return stats.counts.map((c, l) => {
    const sel = stats.selections![l]!;
    const out = new Int32Array(c.length);
    for (let e = 0; e < sel.length; e++) out.fill(sel[e]!, e * stats.nFf, (e + 1) * stats.nFf);
    return out;
  });
}

/**
 * What a file at a GPU index path holds: nothing ("absent"), a GPU index with powerinfer-ts's provenance keys
 * ("ours"), one without them (PowerInfer's, "foreign"), or something else ("other": a model, statistics, text).
 */
function indexReadError(p: string): string {
  try {
    readGpuIndex(p);
    return "";
  } catch (e) {
    return (e as Error).message;
  }
}

function indexFileKind(p: string): "absent" | "ours" | "foreign" | "other" {
  if (!existsSync(p)) return "absent";
  try {
    const idx = readGpuIndex(p);
    return gpuIndexToPlan(
      idx,
      idx.layers.map(() => 0),
    ).provenance
      ? "ours"
      : "foreign";
  } catch {
    return "other";
  }
}

/** A plan read from a GPU index without usable statistics: bytes known, shares and tokens/s unknown (NaN). */
function unknownPlan(
  layers: { hot: Int32Array; bytes: number }[],
  attention: readonly boolean[],
  attBytes: readonly number[] | undefined,
  budgetBytes: number,
  throughput: Throughput | undefined,
): PlacementPlan {
  const out = layers.map((L, l) => ({
    ...L,
    attention: attention[l] === true,
    attentionBytes: attention[l] ? (attBytes?.[l] ?? 0) : 0,
    deviceShare: Number.NaN,
    readBytes: { device: Number.NaN, cpu: Number.NaN },
  }));
  const neuronBytes = out.reduce((s, L) => s + L.bytes, 0);
  const attentionBytes = out.reduce((s, L) => s + L.attentionBytes, 0);
  return {
    layers: out,
    totalBytes: neuronBytes + attentionBytes,
    neuronBytes,
    attentionBytes,
    budgetBytes,
    deviceShare: Number.NaN,
    deviceReadShare: Number.NaN,
    attentionPlanned: attBytes !== undefined,
    solver: "ilp",
    method: "index",
    bound: Number.NaN,
    gap: Number.NaN,
    throughput: throughput ?? DEFAULT_THROUGHPUT,
    expectedTokensPerSecond: Number.NaN,
  };
}
