/**
 * `powerinfer inspect FILE [--json]`: what a GGUF / PowerInfer GGUF file holds — container format,
 * architecture and hyper-parameters, the tensor table, sizes — and whether it can run sparse.
 */
import {
  type ActivationStats,
  GgufError,
  type GgufFile,
  type GgufValue,
  GgufValueType,
  type GgufValueTypeInfo,
  ggmlTypeName,
  ggufFileKind,
  keyConventionProblem,
  type ModelConfig,
  openGguf,
  openGgufModel,
  parseModelConfig,
  readActivationStats,
  splitInfo,
  valueTypeName,
} from "@powerinfer/gguf";
import { existsSync } from "node:fs";
import {
  checkStatsForModel,
  defaultStatsPath,
  type SparseVerdict,
  sparseVerdict,
  summarizeSparsity,
} from "@powerinfer/engine";
import type { Command } from "commander";
import { action } from "../errors.js";
import { checkInputFile } from "./common.js";

export interface InspectTensor {
  name: string;
  type: string;
  /** ggml order, ne0 first. */
  shape: number[];
  bytes: number;
  /** Absolute file offset of the data (in its shard, for a split model). */
  offset: number;
  /** 1-based shard holding the tensor, for a split model. */
  shard?: number;
}

/** Everything `inspect` reports; JSON-serializable (64-bit integers are given as decimal strings). */
export interface InspectReport {
  file: string;
  format: "GGUF" | "PWRI";
  version: number;
  alignment: number;
  /** Bytes in the file. */
  fileSize: number;
  /** Absolute offset of the tensor data section. */
  dataOffset: number;
  architecture: string | null;
  name: string | null;
  /** Validated hyper-parameters, when the file is a model of a supported architecture. */
  config: ModelConfig | null;
  /** Why there is no config (missing key, unsupported architecture, …). */
  configError: string | null;
  /** What the file holds: a model, or a file of another kind (vocabulary-only, GPU index, …). */
  kind: string;
  /** A GPU index for a model with routed experts: its n_expert (`powerinfer.plan.expert_count`). */
  gpuIndexExperts?: number;
  /**
   * How the sparse FFN rows are laid out: "tensors" (ffn_up/ffn_gate/ffn_down(_t) matrices, as
   * llama.cpp/PowerInfer write them) or "bundled" (convert --bundle: per-neuron records in 4 KiB-aligned
   * buckets), with the bucket size and parts.
   */
  ffnLayout: { kind: "tensors" } | { kind: "bundled"; bucketSize: number; parts: string[]; type: string };
  /**
   * For a split model (or one shard of it): the shard number (1-based) of this file, the shard count,
   * the shards found (path, bytes, tensors) and, when the model cannot be opened from this file, why.
   */
  split?: {
    shard: number;
    count: number;
    shards: Array<{ path: string; fileSize: number; tensorCount: number }>;
    error?: string;
  };
  /** Warnings: metadata keys that break the GGUF naming convention. */
  warnings: string[];
  tensors: InspectTensor[];
  /** Sum of the tensors' data bytes. */
  tensorBytes: number;
  /** Sum of the tensors' elements. */
  parameters: number;
  /** Tensor count per ggml type name. */
  typeCounts: Record<string, number>;
  /** Metadata in file order: stored type and value (arrays summarised by length and first items). */
  metadata: Array<{ key: string; type: string; value: string | number | boolean }>;
  sparse: { verdict: SparseVerdict; reason: string };
  /**
   * Models with routed experts: expert count, experts per token, neurons per expert, and the parameters
   * one token reads — every tensor but token_embd (a row lookup, counted when it is also the output), with
   * only n_expert_used / n_expert of each stacked expert tensor (`ffn_*_exps`); predictors are not counted.
   */
  experts?: {
    n_expert: number;
    n_expert_used: number;
    n_ff_exp: number;
    gating: string;
    router_input: string;
    activeParametersPerToken: number;
  };
  /** Summary of `<model>.activations.gguf` when it exists (from `powerinfer profile`). */
  activationStats?:
    | {
        path: string;
        tokens: number;
        corpus: string;
        /** With experts: of the chosen experts' neurons. */
        meanActive: number;
        hot80: number;
        /** With experts: the mean share of experts receiving 80 % of the routed tokens. */
        hotExperts80?: number;
        layers: { mean: number; hot80: number; dead: number; hotExperts80?: number }[];
      }
    | { path: string; error: string };
}

function typeLabel(t: GgufValueTypeInfo): string {
  return t.type === GgufValueType.ARRAY ? `array<${valueTypeName(t.itemType)}>` : valueTypeName(t.type);
}

/**
 * A float32 value as the shortest decimal that reads back as the same float32 (0.2, not the
 * 0.20000000298023224 of its exact double). A value that is not a float32 (or not finite) is given as it
 * is.
 */
export function formatF32(x: number): string {
  if (Number.isFinite(x) && Math.fround(x) === x) {
    for (let p = 1; p <= 9; p++) {
      const d = Number(x.toPrecision(p));
      if (Math.fround(d) === x) return String(d);
    }
  }
  return String(x);
}

/** {@link formatF32} as a number: the double nearest the shortest decimal (same float32). */
const shortF32 = (x: number): number => Number(formatF32(x));

function summarize(v: GgufValue, t: GgufValueTypeInfo): string | number | boolean {
  const f32 = (t.type === GgufValueType.ARRAY ? t.itemType : t.type) === GgufValueType.FLOAT32;
  if (typeof v === "bigint") return v.toString();
  if (typeof v === "string") return v.length > 120 ? `${v.slice(0, 117)}...` : v;
  if (typeof v === "number") return f32 ? shortF32(v) : v;
  if (typeof v === "boolean") return v;
  const arr = Array.from(v as ArrayLike<unknown>);
  const head = arr
    .slice(0, 5)
    .map((x) =>
      typeof x === "string"
        ? JSON.stringify(x)
        : Array.isArray(x)
          ? "[…]"
          : typeof x === "number" && f32
            ? formatF32(x)
            : String(x),
    );
  return `[${arr.length} items${arr.length ? `: ${head.join(", ")}${arr.length > 5 ? ", …" : ""}` : ""}]`;
}

/**
 * Inspect a model file (header only: tensor data is not read).
 * @throws GgufError when the file cannot be read or is not a valid GGUF / PWRI container
 */
export function inspectFile(path: string): InspectReport {
  checkInputFile(path, "file");
  let file: GgufFile;
  let splitError: string | undefined;
  try {
    file = openGgufModel(path);
  } catch (e) {
    // a shard that does not open as a model (not the first, others missing) is still shown on its own
    if (!(e instanceof GgufError) || e.code !== "BAD_SPLIT") throw e;
    file = openGguf(path);
    splitError = e.message;
  }
  const si = splitInfo(file);
  let config: ModelConfig | null = null;
  let configError: string | null = null;
  try {
    if (splitError) throw new Error(splitError);
    config = parseModelConfig(file);
  } catch (e) {
    configError = e instanceof Error ? e.message.replace(`${path}: `, "") : String(e);
  }
  const shardNo = new Map((file.splits ?? []).map((s, i) => [s.path, i + 1]));
  const tensors = file.tensors.map((t) => ({
    name: t.name,
    type: ggmlTypeName(t.type),
    shape: t.shape,
    bytes: t.byteLength,
    offset: t.fileOffset,
    ...(t.path !== undefined && shardNo.has(t.path) ? { shard: shardNo.get(t.path) } : {}),
  }));
  const warnings: string[] = [];
  for (const key of file.metadata.keys()) {
    const w = keyConventionProblem(key);
    if (w) warnings.push(w);
  }
  // the hyper-parameters read from float32 keys, as shown: their shortest decimals (the same float32 values)
  const f32 = (key: string) => file.metadataTypes.get(key)?.type === GgufValueType.FLOAT32;
  const archKey = (k: string) => `${String(file.metadata.get("general.architecture"))}.${k}`;
  const shown: ModelConfig | null = config && {
    ...config,
    sparse_threshold: f32("powerinfer.sparse_threshold") ? shortF32(config.sparse_threshold) : config.sparse_threshold,
    rope: {
      ...config.rope,
      freq_base: f32(archKey("rope.freq_base")) ? shortF32(config.rope.freq_base) : config.rope.freq_base,
    },
    norm: {
      ...config.norm,
      eps: f32(archKey(`attention.layer_norm${config.norm.type === "rms" ? "_rms" : ""}_epsilon`))
        ? shortF32(config.norm.eps)
        : config.norm.eps,
    },
  };
  const typeCounts: Record<string, number> = {};
  for (const t of tensors) typeCounts[t.type] = (typeCounts[t.type] ?? 0) + 1;
  const arch = file.metadata.get("general.architecture");
  const name = file.metadata.get("general.name");
  return {
    file: path,
    format: file.format,
    version: file.version,
    alignment: file.alignment,
    fileSize: file.fileSize,
    dataOffset: file.dataOffset,
    architecture: typeof arch === "string" ? arch : null,
    name: typeof name === "string" ? name : null,
    config: shown,
    configError,
    kind: ggufFileKind(file),
    ...(file.metadata.has("powerinfer.plan.expert_count")
      ? { gpuIndexExperts: Number(file.metadata.get("powerinfer.plan.expert_count")) }
      : {}),
    ffnLayout: file.metadata.has("powerinfer.bundle.version")
      ? {
          kind: "bundled",
          bucketSize: Number(file.metadata.get("powerinfer.bundle.bucket_size")),
          parts: (file.metadata.get("powerinfer.bundle.parts") as string[]) ?? [],
          type: ggmlTypeName(Number(file.metadata.get("powerinfer.bundle.type"))),
        }
      : { kind: "tensors" },
    ...(si
      ? {
          split: {
            shard: si.no + 1,
            count: si.count,
            shards: file.splits ?? [{ path, fileSize: file.fileSize, tensorCount: file.tensors.length }],
            ...(splitError ? { error: splitError.replace(`${path}: `, "") } : {}),
          },
        }
      : {}),
    warnings,
    tensors,
    tensorBytes: tensors.reduce((s, t) => s + t.bytes, 0),
    parameters: file.tensors.reduce((s, t) => s + t.nElements, 0),
    typeCounts,
    metadata: [...file.metadata].map(([key, v]) => ({
      key,
      type: typeLabel(file.metadataTypes.get(key)!),
      value: summarize(v, file.metadataTypes.get(key)!),
    })),
    sparse: splitError
      ? { verdict: "not-a-model", reason: `cannot run this file: ${splitError.replace(`${path}: `, "")}` }
      : sparseVerdict(file, shown, configError),
    activationStats: statsSummary(path, config),
    ...(config?.moe ? { experts: expertSummary(file, config) } : {}),
  };
}

function expertSummary(file: GgufFile, config: ModelConfig): NonNullable<InspectReport["experts"]> {
  const moe = config.moe!;
  const tied = !file.tensorMap.has("output.weight");
  let active = 0;
  for (const t of file.tensors) {
    if (t.name === "token_embd.weight" && !tied) continue;
    // predictors are not the model's parameters (a dense run reads none; predictor mode the chosen experts')
    if (/\.fc[12](_exps)?\.weight$/.test(t.name)) continue;
    active += /\.ffn_(gate|up|down)_exps(_t)?\./.test(t.name)
      ? (t.nElements * moe.n_expert_used) / moe.n_expert
      : t.nElements;
  }
  return {
    n_expert: moe.n_expert,
    n_expert_used: moe.n_expert_used,
    n_ff_exp: moe.n_ff_exp,
    gating: moe.gating,
    router_input: moe.router_input,
    activeParametersPerToken: active,
  };
}

/**
 * How statistics made on another model differ from this one, both named ("statistics of another model: they
 * have 6 layers of 32 experts with 768 neurons each, this model 2 layers of n_ff 1024 without experts");
 * undefined when their layers, experts and neurons per layer (or expert) are this model's.
 */
export function statsShapeMismatch(stats: ActivationStats, config: ModelConfig): string | undefined {
  const moe = config.moe;
  const nFf = moe ? moe.n_ff_exp : config.n_ff;
  if (stats.counts.length === config.n_layer && stats.nExpert === moe?.n_expert && stats.nFf === nFf) return undefined;
  const layers = (n: number) => (n === 1 ? "1 layer" : `${n} layers`);
  const ffn = (nExpert: number | undefined, n: number) =>
    nExpert === undefined ? `n_ff ${n} without experts` : `${nExpert} experts with ${n} neurons each`;
  return `statistics of another model: they have ${layers(stats.counts.length)} of ${ffn(stats.nExpert, stats.nFf)}, this model ${layers(config.n_layer)} of ${ffn(moe?.n_expert, nFf)}; run \`powerinfer profile\` on this model`;
}

/** What `<model>.activations.gguf` next to the model says, when it exists and fits the model. */
function statsSummary(path: string, config: ModelConfig | null): InspectReport["activationStats"] {
  const statsPath = defaultStatsPath(path);
  if (!config || !existsSync(statsPath)) return undefined;
  try {
    const stats = readActivationStats(statsPath);
    // statistics of another model: say how they differ (layers, experts, neurons), both sides named
    const mismatch = statsShapeMismatch(stats, config);
    if (mismatch) return { path: statsPath, error: mismatch };
    checkStatsForModel(stats, config);
    const layers = summarizeSparsity({ counts: stats.counts, tokens: stats.tokenCount, selections: stats.selections });
    const avg = (f: (L: (typeof layers)[number]) => number) => layers.reduce((a, L) => a + f(L), 0) / layers.length;
    return {
      path: statsPath,
      tokens: stats.tokenCount,
      corpus: stats.corpusName,
      meanActive: avg((L) => L.mean),
      hot80: avg((L) => L.hot80),
      ...(stats.selections ? { hotExperts80: avg((L) => L.hotExperts80 ?? 0) } : {}),
      layers: layers.map((L) => ({ mean: L.mean, hot80: L.hot80, dead: L.dead, hotExperts80: L.hotExperts80 })),
    };
  } catch (e) {
    return { path: statsPath, error: (e as Error).message };
  }
}

function bytesHuman(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v.toFixed(2)} ${units[i]}`;
}

const num = (n: number) => n.toLocaleString("en-US");

/** The report as human-readable text. `metadata`: also list every metadata key. */
export function formatInspect(r: InspectReport, opts: { metadata?: boolean } = {}): string {
  const out: string[] = [];
  const pwri = r.format === "PWRI" ? " (PowerInfer GGUF)" : "";
  out.push(`file:          ${r.file}`);
  out.push(
    `format:        ${r.format}${pwri} v${r.version}, alignment ${r.alignment}, tensor data at byte ${num(r.dataOffset)}`,
  );
  // a file that is not a model has no FFN to lay out
  if (r.kind === "model")
    out.push(
      r.ffnLayout.kind === "bundled"
        ? `FFN layout:    bundled (${r.ffnLayout.parts.join(" + ")} rows of each neuron together, ${r.ffnLayout.type}, ${r.ffnLayout.bucketSize} neurons per 4 KiB-aligned bucket; \`convert --to pwri\` unbundles)`
        : "FFN layout:    tensors (one matrix per projection)",
    );
  const sp = r.split;
  if (sp) {
    const total = sp.shards.reduce((n, s) => n + s.fileSize, 0);
    out.push(
      sp.error
        ? `split:         ${sp.error}`
        : `split:         ${sp.count} shards, ${num(total)} bytes in all (${bytesHuman(total)}):`,
    );
    if (!sp.error) {
      sp.shards.forEach((s, i) => {
        out.push(`  ${i + 1}. ${s.path}  ${s.tensorCount} tensors, ${num(s.fileSize)} bytes`);
      });
    }
  }
  out.push(`architecture:  ${r.architecture ?? "(none)"}${r.name ? ` — "${r.name}"` : ""}`);
  const kinds: Record<string, string> = {
    vocabulary: "vocabulary-only (a tokenizer, no weights)",
    "gpu-index": "PowerInfer GPU index (neuron placement plan)",
    "activation-stats": "activation statistics (from powerinfer profile)",
    empty: "no tensors and no tokenizer",
  };
  if (r.kind !== "model")
    out.push(
      `kind:          ${kinds[r.kind] ?? r.kind}${r.gpuIndexExperts ? `, for routed experts: ${r.gpuIndexExperts} experts, entries are (expert, neuron) pairs e·n_ff_exp + i` : ""}`,
    );
  for (const w of r.warnings) out.push(`warning:       ${w}`);
  const c = r.config;
  if (c) {
    out.push("hyper-parameters:");
    out.push(
      `  n_vocab ${c.n_vocab}, n_ctx_train ${c.n_ctx_train}, n_embd ${c.n_embd}, n_layer ${c.n_layer}, n_ff ${c.n_ff}`,
    );
    out.push(`  n_head ${c.n_head}, n_head_kv ${c.n_head_kv}, head_dim ${c.head_dim}, n_rot ${c.n_rot}`);
    const rope =
      c.rope.type === "none"
        ? "no RoPE (learned positions)"
        : `RoPE ${c.rope.type}, θ ${c.rope.freq_base}, scale ${c.rope.freq_scale}`;
    out.push(`  ${rope}; ${c.norm.type === "rms" ? "RMSNorm" : "LayerNorm"} eps ${Number(c.norm.eps.toPrecision(6))}`);
    const ffn = c.ffn.up_activation
      ? "ReLU(gate)·ReLU(up)"
      : c.ffn.gated
        ? `${c.ffn.activation}(gate)·up`
        : `${c.ffn.activation}(up), no gate`;
    out.push(`  FFN ${ffn}${c.parallel_attn ? ", attention and FFN in parallel" : ""}`);
    if (r.experts) {
      const x = r.experts;
      out.push(
        `  experts: ${x.n_expert}, ${x.n_expert_used} used per token, ${x.n_ff_exp} neurons each; ${x.gating} gating of the ${x.router_input === "layer_input" ? "layer input (before attention)" : "FFN input"}; ${num(Math.round(x.activeParametersPerToken))} of ${num(r.parameters)} parameters read per token`,
      );
    }
    if (c.format === "PWRI" || c.has_predictors || c.down_transposed) {
      const pred = c.has_predictors ? `predictors rank ${[...new Set(c.predictor_ranks)].join("/")}` : "no predictors";
      out.push(
        `  ${pred}, sparse_threshold ${c.sparse_threshold}, ffn_down ${r.ffnLayout.kind === "bundled" ? "transposed, in the bundle" : c.down_transposed ? (c.moe ? "transposed (ffn_down_exps_t)" : "transposed (ffn_down_t)") : "as stored"}`,
      );
    }
    for (const w of c.warnings) out.push(`  warning: ${w}`);
  } else if (r.configError && (r.kind === "model" || r.kind === "vocabulary")) {
    // a GPU index or statistics file has no hyper-parameters to miss
    out.push(`hyper-parameters: not available (${r.configError})`);
  }
  if (opts.metadata) {
    out.push(`metadata (${r.metadata.length}):`);
    for (const m of r.metadata)
      out.push(`  ${m.key} [${m.type}] = ${typeof m.value === "string" ? m.value : String(m.value)}`);
  }
  if (r.tensors.length > 0) {
    out.push(`tensors (${r.tensors.length}):`);
    const sharded = r.tensors.some((t) => t.shard !== undefined);
    const rows = r.tensors.map((t) => [
      t.name,
      t.type,
      t.shape.join(" × "),
      `${num(t.bytes)}${sharded ? ` (shard ${t.shard})` : ""}`,
    ]);
    const head = ["name", "type", "shape", "bytes"];
    const w = head.map((h, i) => Math.max(h.length, ...rows.map((row) => row[i].length)));
    const line = (row: string[]) =>
      `  ${row[0].padEnd(w[0])}  ${row[1].padEnd(w[1])}  ${row[2].padEnd(w[2])}  ${row[3].padStart(w[3])}`.trimEnd();
    out.push(line(head));
    for (const row of rows) out.push(line(row));
  }
  const types = Object.entries(r.typeCounts)
    .map(([t, n]) => `${n} ${t}`)
    .join(", ");
  out.push(
    `total:         ${r.tensors.length} tensors${types ? ` (${types})` : ""}, ${num(r.parameters)} elements, ${num(r.tensorBytes)} bytes of tensor data; ${r.split && !r.split.error ? "first shard" : "file"} ${num(r.fileSize)} bytes (${bytesHuman(r.fileSize)})`,
  );
  out.push(`sparse:        ${r.sparse.reason}`);
  const st = r.activationStats;
  if (st && "error" in st) out.push(`activations:   ${st.path} unusable: ${st.error}`);
  else if (st) {
    const pc = (v: number) => `${(v * 100).toFixed(1)} %`;
    out.push(
      st.hotExperts80 !== undefined
        ? `activations:   ${st.path}: ${num(st.tokens)} positions of ${st.corpus}; ${pc(st.meanActive)} of a chosen expert's neurons fire per token on average, ` +
            `${pc(st.hot80)} of (expert, neuron) pairs carry 80 % of activations, ${pc(st.hotExperts80)} of experts receive 80 % of the routed tokens`
        : `activations:   ${st.path}: ${num(st.tokens)} positions of ${st.corpus}; ${pc(st.meanActive)} of FFN neurons fire per token on average, ` +
            `${pc(st.hot80)} of neurons carry 80 % of activations` +
            (r.sparse.verdict === "dense" ? " — yet this FFN is not ReLU, so sparse inference gains nothing" : ""),
    );
  }
  return out.join("\n");
}

export function register(program: Command): void {
  program
    .command("inspect")
    .description("show a GGUF / PowerInfer GGUF file: format, hyper-parameters, tensors, and whether it can run sparse")
    .argument("<file>", "GGUF or PowerInfer GGUF file")
    .option("--json", "print the report as JSON")
    .option("--metadata", "also list every metadata key (text output)")
    .action(
      action((file: string, o: { json?: boolean; metadata?: boolean }) => {
        const report = inspectFile(file);
        process.stdout.write(o.json ? `${JSON.stringify(report, null, 2)}\n` : `${formatInspect(report, o)}\n`);
      }),
    );
}
