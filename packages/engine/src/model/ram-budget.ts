/**
 * Models larger than memory (`--ram-budget`): which weights stay resident and how the rest of each
 * sparse FFN is served from the model file through a neuron cache (PowerInfer-2, Xue et al. 2024;
 * SmallThinker's offloading follows the same idea).
 *
 * The budget is the bytes held for weights plus the neuron caches. Resident (mapped, counted in full):
 * embeddings, attention, norms, the output head, predictors and any FFN tensor that is not cached. Cached
 * (file-backed): per layer the up, gate and neuron-major down projection (`ffn_down_t`) of a sparse ReLU
 * FFN; what is left of the budget after the resident part is split over them in proportion to their
 * bytes, as a pinned hot region (the neurons that fire most often in `powerinfer profile` statistics)
 * and an LRU region filled on demand. The KV cache and the process's own memory are not part of the
 * budget (they are reported beside it).
 *
 * Routed experts (any mode): the expert is the unit of caching (SmallThinker's engine; PowerInfer-2 reads
 * neurons). Each layer's `ffn_{gate,up,down}_exps` stack is cached one whole expert per row (contiguous in
 * a GGUF); the most often selected experts (`expert_selection_count` of the statistics) are pinned. In a
 * sparse mode an F16/F32 down stack is transposed as it is read (neuron-major, as the unlimited run's
 * in-memory copy), so the computation is the unlimited run's.
 *
 * Tiers with a device (`--vram-budget`): the device holds the planner's hot neurons; the RAM budget
 * applies to what stays on the CPU backend, so the three tiers are VRAM (hottest) → RAM budget (resident
 * + neuron cache) → storage (the model file, read on demand).
 */
import { type ActivationStats, GGMLType, type GgufFile, type ModelConfig } from "@powerinfer/gguf";
import type { Backend, TensorHandle } from "@powerinfer/core";
import { EngineError } from "../errors.js";
import type { LlamaWeights } from "./llama.js";
import { type BundleLayout, bundleLayout, isBundled } from "./bundle.js";
import { dtypeOfTensor, expertDownNeuronMajor } from "./weights.js";

/**
 * A byte count in the largest binary unit it reaches — GiB, MiB or KiB, else bytes — with `decimals`
 * places, so that a small amount shows its value ("2.427 MiB", not "0.002 GiB").
 */
export function formatBytes(bytes: number, decimals = 3): string {
  for (const [size, unit] of [
    [2 ** 30, "GiB"],
    [2 ** 20, "MiB"],
    [2 ** 10, "KiB"],
  ] as const) {
    if (Math.abs(bytes) >= size) return `${(bytes / size).toFixed(decimals)} ${unit}`;
  }
  const n = Math.round(bytes);
  return `${n} ${n === 1 ? "byte" : "bytes"}`;
}

/** One FFN tensor served from the file. */
export interface CachedTensorPlan {
  layer: number;
  /**
   * "up" | "gate" | "down_t", "bundle": a layer's neuron records (bundled layout, all parts), or a stacked
   * expert tensor cached one expert per row ("gate_exps" | "up_exps" | "down_exps", or "down_exps_t": the
   * down stack a PowerInfer-layout file stores neuron-major).
   */
  role: "up" | "gate" | "down_t" | "bundle" | "gate_exps" | "up_exps" | "down_exps" | "down_exps_t";
  /** The bundle's layout (role "bundle"). */
  bundle?: BundleLayout;
  name: string;
  /** Neurons, or experts for an expert stack (a row is then one expert's whole matrix). */
  rows: number;
  rowBytes: number;
  /**
   * An F16/F32 expert down stack in a sparse mode: cached neuron-major, each expert transposed as it is
   * read (NeuronCacheOptions.transposeRows), so the sparse down reads only active neurons.
   */
  transposed?: boolean;
  /** Rows pinned (the hottest by profile counts; experts: the most selected). */
  hot: Int32Array;
  /** LRU rows. */
  coldRows: number;
}

/** What `--ram-budget` does to a model, decided before anything is mapped. */
export interface RamPlan {
  /** The budget (bytes). */
  budget: number;
  /** Bytes of weights that stay resident (mapped or copied in memory). */
  residentBytes: number;
  /** Bytes of the FFN tensors served from the file. */
  ffnBytes: number;
  /** Bytes of neuron-cache slots (pinned + LRU) = budget − resident, at most ffnBytes. */
  cacheBytes: number;
  /** cacheBytes / ffnBytes. */
  cachedShare: number;
  /** Whether hot rows came from activation statistics. */
  fromStats: boolean;
  tensors: CachedTensorPlan[];
}

/** Whether a plan serves routed experts (its rows are whole experts) rather than neurons. */
export function servesExperts(plan: RamPlan): boolean {
  return plan.tensors.some(isExpertStack);
}

function isExpertStack(t: CachedTensorPlan): boolean {
  return t.role === "gate_exps" || t.role === "up_exps" || t.role === "down_exps" || t.role === "down_exps_t";
}

/** Rows each cached tensor needs at the least (an LRU region of a few rows makes every token re-read). */
const MIN_ROWS = 16;

/** Largest share of the cache slots pinned for the hottest neurons when statistics are given. */
export const DEFAULT_HOT_SHARE = 0.8;

/**
 * Plans the split for `budget` bytes.
 * @param sparse the FFN mode ("off" cannot serve FFN rows from the file).
 * @throws EngineError 'RAM_BUDGET' when the resident part (plus a minimal cache) exceeds the budget,
 *   naming the bytes needed; 'BAD_INPUT' when the model or mode cannot use a budget.
 */
export function planRamBudget(
  file: GgufFile,
  cfg: ModelConfig,
  budget: number,
  sparse: string,
  stats?: ActivationStats,
  hotShare = DEFAULT_HOT_SHARE,
): RamPlan {
  if (!(budget > 0) || !Number.isFinite(budget))
    throw new EngineError("BAD_INPUT", `RAM budget must be a positive number of bytes, got ${budget}`);
  let total = 0;
  for (const t of file.tensors) total += t.byteLength;
  const tensors: CachedTensorPlan[] = [];
  let ffnBytes = 0;
  let extra = 0; // resident copies made at load (down transposed in memory)
  const cacheable = sparse !== "off" && !cfg.moe && cfg.ffn.activation === "relu";
  // routed experts are cached one expert per row in any mode (experts are the unit of caching; a
  // sparse mode then computes only the predicted neurons of each loaded expert): the stacks are
  // contiguous per expert in a GGUF; an F16/F32 down stack is transposed as it is read (`transposed`)
  const bundled = isBundled(file);
  if (bundled && sparse !== "predictor") {
    throw new EngineError(
      "BAD_INPUT",
      `a bundled model (convert --bundle) runs in predictor mode only (sparse mode "${sparse}" reads FFN tensors densely); convert it back with \`powerinfer convert IN OUT --to pwri\``,
    );
  }
  for (let l = 0; l < cfg.n_layer; l++) {
    const p = `blk.${l}.`;
    if (cfg.moe) {
      const nx = cfg.moe.n_expert;
      // a PowerInfer-layout file stores the down stack neuron-major already (ffn_down_exps_t)
      const downRole = file.tensorMap.has(`${p}ffn_down_exps_t.weight`) ? "down_exps_t" : "down_exps";
      for (const role of ["gate_exps", "up_exps", downRole] as const) {
        const name = `${p}ffn_${role}.weight`;
        const t = file.tensorMap.get(name);
        if (!t) throw new EngineError("BAD_INPUT", `--ram-budget: the model has no ${name}`);
        dtypeOfTensor(t);
        const transposed =
          role === "down_exps" && sparse !== "off" && cfg.ffn.activation === "relu" && expertDownNeuronMajor(t.type);
        tensors.push({
          layer: l,
          role,
          name,
          rows: nx,
          rowBytes: t.byteLength / nx,
          hot: new Int32Array(0),
          coldRows: 0,
          ...(transposed ? { transposed } : {}),
        });
        ffnBytes += t.byteLength;
      }
      continue;
    }
    const b = bundleLayout(file, l, cfg.n_embd, cfg.n_ff);
    if (b) {
      tensors.push({
        layer: l,
        role: "bundle",
        name: b.info.name,
        rows: b.nFf,
        rowBytes: b.recordBytes,
        hot: new Int32Array(0),
        coldRows: 0,
        bundle: b,
      });
      ffnBytes += b.info.byteLength;
      continue;
    }
    const downT = file.tensorMap.get(`${p}ffn_down_t.weight`);
    const down = file.tensorMap.get(`${p}ffn_down.weight`);
    if (sparse !== "off" && !downT && down && !cfg.moe) {
      // a plain GGUF: sparse mode keeps a neuron-major copy in memory (F16 stays F16, the rest F32)
      extra += down.type === GGMLType.F16 ? down.byteLength : down.nElements * 4;
      extra -= down.byteLength; // the mapped original is freed
    }
    if (!cacheable) continue;
    const gated = file.tensorMap.has(`${p}ffn_gate.weight`);
    const roles: [CachedTensorPlan["role"], string][] = [];
    // oracle mode computes its mask densely (from the gate, or from up without a gate): that tensor stays resident
    if (sparse === "predictor" || gated) roles.push(["up", `${p}ffn_up.weight`]);
    if (sparse === "predictor" && gated) roles.push(["gate", `${p}ffn_gate.weight`]);
    if (downT) roles.push(["down_t", `${p}ffn_down_t.weight`]);
    for (const [role, name] of roles) {
      const t = file.tensorMap.get(name)!;
      dtypeOfTensor(t);
      const rows = t.shape[1] ?? 1;
      tensors.push({ layer: l, role, name, rows, rowBytes: t.byteLength / rows, hot: new Int32Array(0), coldRows: 0 });
      ffnBytes += t.byteLength;
    }
  }
  const residentBytes = total + extra - ffnBytes;
  // an expert stack needs at least one token's experts (n_expert_used); a neuron tensor MIN_ROWS
  const minRows = (t: CachedTensorPlan) => Math.min(t.rows, isExpertStack(t) ? cfg.moe!.n_expert_used : MIN_ROWS);
  const minCache = tensors.reduce((s, t) => s + minRows(t) * t.rowBytes, 0);
  if (residentBytes + minCache > budget) {
    const need = residentBytes + minCache;
    // each in a unit that shows it, with as many decimals as it takes for the budget and the need to differ
    let d = 3;
    while (d < 9 && formatBytes(budget, d) === formatBytes(need, d)) d++;
    const g = (b: number) => formatBytes(b, d);
    // and the exact count beside a rounded one
    const exact = (b: number) => (b < 2 ** 10 ? g(b) : `${g(b)} (${Math.floor(b)} bytes)`);
    const parts = `embeddings, attention, norms, output${cfg.moe ? ", routers" : ""}${cfg.has_predictors ? " and predictors" : ""}`;
    const copy =
      extra > 0
        ? `, of which ${g(extra)} is the neuron-major copy of the down projections a plain GGUF needs in sparse mode (\`powerinfer convert IN OUT --to pwri\` stores them so and saves it)`
        : "";
    const why =
      tensors.length === 0
        ? sparse === "off"
          ? " (the FFN runs dense, so every weight stays resident; a budget below the model needs a sparse FFN: --sparse predictor or oracle on a ReLU model)"
          : " (no FFN tensor of this model can be served from the file)"
        : ` (resident: ${parts} take ${g(residentBytes)}${copy}; the ${cfg.moe ? "expert" : "neuron"} cache needs at least ${g(minCache)})`;
    throw new EngineError(
      "RAM_BUDGET",
      `RAM budget ${exact(budget)} is too small for this model: it needs at least ${exact(need)}${why}`,
    );
  }
  const cacheBytes = Math.min(ffnBytes, budget - residentBytes);
  const share = ffnBytes > 0 ? Math.min(1, cacheBytes / ffnBytes) : 1;
  // Rows each tensor may hold, then how many of them are pinned. The LRU region is one pool per row size
  // (all layers), and it must hold one layer's working set — the rows one token reads in a layer, every
  // part of the FFN — or the parts of a layer evict each other and are read again within the token. So
  // only what is left above that working set (with a 1.3× margin for mispredicted rows) is pinned.
  const caps = tensors.map((t) => Math.min(t.rows, Math.max(minRows(t), Math.floor(share * t.rows))));
  const pools = new Map<number, number[]>(); // row bytes → tensor indices
  tensors.forEach((t, i) => {
    if (!pools.has(t.rowBytes)) pools.set(t.rowBytes, []);
    pools.get(t.rowBytes)!.push(i);
  });
  const activeRows = (l: number): number => {
    if (cfg.moe) return cfg.moe.n_expert_used; // a token's experts, in every stack of the layer
    const c = stats?.counts[l];
    if (!c || !(stats!.tokenCount > 0)) return 0.15 * cfg.n_ff; // no statistics: assume 15 % fire
    let s = 0;
    for (const v of c) s += v;
    return s / stats!.tokenCount;
  };
  for (const idx of pools.values()) {
    const slots = idx.reduce((s, i) => s + caps[i]!, 0);
    const perLayer = new Map<number, number>();
    for (const i of idx) {
      const t = tensors[i]!;
      perLayer.set(t.layer, (perLayer.get(t.layer) ?? 0) + Math.ceil(1.3 * activeRows(t.layer)));
    }
    const working = Math.max(0, ...perLayer.values());
    const pinnable = stats ? Math.max(0, Math.min(slots * hotShare, slots - working)) : 0;
    for (const i of idx) {
      const t = tensors[i]!;
      const cap = caps[i]!;
      // experts ranked by how often the router chose them; neurons by how often they fired
      const counts = isExpertStack(t) ? stats?.selections?.[t.layer] : stats?.counts[t.layer];
      const nHot = cap >= t.rows ? t.rows : counts && slots > 0 ? Math.floor((cap * pinnable) / slots) : 0;
      if (nHot > 0) {
        const order = Int32Array.from({ length: t.rows }, (_, r) => r);
        if (counts && nHot < t.rows) order.sort((a, b) => counts[b]! - counts[a]! || a - b);
        t.hot = order.slice(0, nHot).sort();
      }
      t.coldRows = cap - nHot;
    }
  }
  return { budget, residentBytes, ffnBytes, cacheBytes, cachedShare: share, fromStats: !!stats, tensors };
}

let nextGroup = 1;

/**
 * Rebinds the planned FFN tensors of mapped weights as file-backed tensors of `backend` (freeing the
 * mapped ones), one cache group per layer.
 * @throws EngineError 'UNSUPPORTED_OP' when the backend has no neuron cache; BackendError from binding.
 */
export function bindNeuronCaches(file: GgufFile, weights: LlamaWeights, backend: Backend, plan: RamPlan): void {
  if (!plan.tensors.length) return;
  if (!backend.mapTensorCached) {
    throw new EngineError(
      "UNSUPPORTED_OP",
      `backend ${backend.name} cannot serve FFN rows from the model file (no neuron cache); --ram-budget needs the cpu backend`,
    );
  }
  const groups = new Map<number, number>();
  // one LRU region per row size for the whole model (see NeuronCacheOptions.pool)
  const pool = nextGroup++;
  for (const t of plan.tensors) {
    const info = file.tensorMap.get(t.name)!;
    if (!groups.has(t.layer)) groups.set(t.layer, nextGroup++);
    const L = weights.layers[t.layer]!;
    if (t.bundle) {
      // one cache of whole neuron records; up is its owner (the first op of the FFN, which counts), the
      // other parts share it at their offsets
      const b = t.bundle;
      const dtype = dtypeOfTensor({ ...info, type: b.type });
      const ne = [b.nEmbd, b.nFf];
      const src = { path: info.path ?? file.path, fileOffset: info.fileOffset, byteLength: info.byteLength };
      const owner = backend.mapTensorCached(dtype, ne, src, {
        recordBytes: b.recordBytes,
        rowStride: b.recordBytes,
        bucketRows: b.bucketRows,
        bucketStride: b.bucketStride,
        hot: t.hot,
        coldRows: t.coldRows,
        pool,
      });
      b.parts.forEach((part, j) => {
        const h =
          j === 0
            ? owner
            : backend.mapTensorCached!(dtype, ne, src, { coldRows: 0, shareWith: owner, partOffset: j * b.rowBytes });
        if (part === "ffn_up") L.ffnUp = h;
        else if (part === "ffn_gate") L.ffnGate = h;
        else L.ffnDownT = h;
      });
      continue;
    }
    if (isExpertStack(t)) {
      const X = L.experts!;
      weights.expertsFromFile = true;
      const key =
        t.role === "gate_exps"
          ? "gateExps"
          : t.role === "up_exps"
            ? "upExps"
            : t.role === "down_exps_t"
              ? "downExpsT"
              : "downExps";
      const prev = X[key];
      const src = { path: info.path ?? file.path, fileOffset: info.fileOffset, byteLength: info.byteLength };
      const opts = { hot: t.hot, coldRows: t.coldRows, group: groups.get(t.layer), pool, expertRows: true };
      if (t.transposed) {
        // an F16/F32 down stack is read neuron-major (transposed as each expert is read), as the
        // in-memory copy of an unlimited sparse run is: the same axpy_id_sparse, the same results
        const [nFf, nEmbd, nExp] = [info.shape[0]!, info.shape[1]!, info.shape[2] ?? 1];
        X.downExpsT = backend.mapTensorCached(dtypeOfTensor(info), [nEmbd, nFf, nExp], src, {
          ...opts,
          transposeRows: nEmbd,
        });
        if (X.downExps) backend.freeTensor(X.downExps);
        X.downExps = undefined;
        continue;
      }
      const h = backend.mapTensorCached(dtypeOfTensor(info), prev?.ne ?? info.shape, src, opts);
      if (prev) backend.freeTensor(prev);
      X[key] = h;
      continue;
    }
    const old: TensorHandle | undefined = t.role === "up" ? L.ffnUp : t.role === "gate" ? L.ffnGate : L.ffnDownT;
    const h = backend.mapTensorCached(
      dtypeOfTensor(info),
      old?.ne ?? info.shape,
      { path: info.path ?? file.path, fileOffset: info.fileOffset, byteLength: info.byteLength },
      { hot: t.hot, coldRows: t.coldRows, group: groups.get(t.layer), pool },
    );
    if (old) backend.freeTensor(old);
    if (t.role === "up") L.ffnUp = h;
    else if (t.role === "gate") L.ffnGate = h;
    else L.ffnDownT = h;
  }
}
