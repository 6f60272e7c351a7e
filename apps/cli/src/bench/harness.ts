/**
 * The benchmark harness behind `powerinfer bench` and `pnpm bench`: llama-bench's protocol (random
 * tokens; ppN = N tokens from an empty context of N tokens, evaluated in batches of 512, logits of the
 * last; tgN = N tokens one at a time from an empty context of N tokens, logits of each; t/s mean ± sd
 * and median over repetitions after one warm-up) for llama.cpp and for powerinfer-ts in each FFN mode,
 * with the repetitions interleaved (every engine runs each test once per round, in alternating order)
 * so machine drift hits them alike.
 *
 * The llama.cpp peer is, by preference, llama.cpp built natively for this machine (native-llama-cpp.ts):
 * each of its measurements is one `llama-bench -r 1 -o json` process on the same file with the same
 * thread count (llama-bench warms up inside that process before its one measured repetition, so it sits
 * out the harness's warm-up round). Without that build the peer is node-llama-cpp's prebuilt binary in
 * this process (llama-cpp.ts), which is slower than native llama.cpp; rows say which peer ran.
 *
 * Each decode row also gets the bytes of weights a token reads (sparse modes: from the kernels' row
 * counters) and the share of this machine's measured memory bandwidth that implies.
 */
import { execFileSync } from "node:child_process";
import { existsSync, statSync } from "node:fs";
import { availableParallelism, freemem, loadavg, totalmem } from "node:os";
import { basename, dirname } from "node:path";
import { cpuBackend, cpuModelName, loadAddon } from "@powerinfer/backend-cpu-avx2";
import type { Backend, NeuronCacheStats } from "@powerinfer/core";
import {
  defaultGpuIndexPath,
  defaultStatsPath,
  formatBytes,
  Model,
  resolvePlan,
  type Session,
  type SparseMode,
} from "@powerinfer/engine";
import { loadDeviceBackend } from "../backends.js";
import { cacheDelta, hiddenShare } from "../commands/common.js";
import {
  type ActivationStats,
  type GgufFile,
  getOptionalNumber,
  getOptionalString,
  ggmlTypeName,
  openGguf,
  parseModelConfig,
  readActivationStats,
} from "@powerinfer/gguf";
import { bytesPerToken, expertsPerToken } from "./bytes.js";
import { type LlamaCppInfo, type LlamaCppPeer, type LlamaCppRunner, loadLlamaCpp } from "./llama-cpp.js";
import {
  findNativeLlamaCpp,
  type LlamaBenchRow,
  type NativeLlamaCpp,
  NativeLlamaCppError,
  resolveLlamaCppDir,
  runLlamaBench,
  startLlamaBenchSpawner,
  stopLlamaBenchSpawner,
} from "./native-llama-cpp.js";

/** Which llama.cpp runs as the peer: native when built (else prebuilt), only native, or only prebuilt. */
export type LlamaCppPeerChoice = "auto" | "native" | "prebuilt";

/** The llama.cpp peer that ran: the native llama-bench build or node-llama-cpp's prebuilt binary. */
export type PeerInfo =
  | (Omit<NativeLlamaCpp, "kind"> & { kind: "native" })
  | (LlamaCppInfo & { kind: "prebuilt"; label: string });

/** One model to benchmark. */
export interface BenchModel {
  path: string;
  /**
   * A GGUF with the same weights (e.g. the `--format gguf` twin of a generated PWRI file, or a generated
   * expert model without `--predictors`): llama.cpp and our dense mode run it, since llama.cpp cannot load
   * PWRI files or tensors it does not know.
   */
  twin?: string;
}

export interface BenchOptions {
  models: BenchModel[];
  /** Prompt sizes (ppN tests); [] for none. */
  nPrompt: number[];
  /** Generation sizes (tgN tests); [] for none. */
  nGen: number[];
  /**
   * Depths (llama-bench `-d`): every pp/tg test runs once per depth, after that many random tokens were
   * evaluated into the KV cache (not timed). Default [0].
   */
  nDepth?: number[];
  threads: number[];
  /** Measured repetitions (after one warm-up round). */
  repetitions: number;
  /** Our FFN modes; "auto": off, plus predictor for files with predictors. */
  sparse: "auto" | SparseMode[];
  /** Run llama.cpp. Default true. */
  llamaCpp?: boolean;
  /** Bytes: our sparse modes run with this RAM budget (neuron cache; see ModelLoadOptions.ramBudget). */
  ramBudget?: number;
  /**
   * Hybrid rows: each of our modes also runs with hot neurons (and the planner's attention layers) on this
   * device backend within `budgetBytes` (a GPU; "cpu" stands in for one), from `<model>.activations.gguf`
   * or a matching `<model>.generated.gpuidx` (never written by the bench).
   */
  device?: { backend: string; budgetBytes?: number };
  /** Which llama.cpp (see LlamaCppPeerChoice). Default "auto". */
  llamaCppPeer?: LlamaCppPeerChoice;
  /** Folder of the native build (default: resolveLlamaCppDir()). */
  llamaCppDir?: string;
  /** Run powerinfer-ts. Default true. */
  ours?: boolean;
  /** MiB read by the bandwidth probe (0: no probe). Default 512. */
  bandwidthMiB?: number;
  /** Bandwidth already measured (GB/s by thread count): no probe for these thread counts. */
  bandwidth?: Record<number, number>;
  /** Seed of the random token ids. Default 1. */
  seed?: number;
  /** CPU backend: repack Q4_0/Q4_K weights at first dense use (BackendLoadOptions.repack). Default true. */
  repack?: boolean;
  /**
   * CPU backend: every weight read through the file mapping (BackendLoadOptions.hugePageCopyBytes 0), as
   * always under `ramBudget`. Default false: weights of 2 MiB or more copied into huge-page memory.
   */
  mmap?: boolean;
  /** Progress lines (to stderr). */
  log?: (line: string) => void;
}

/** One result row; llama-bench's JSON fields plus ours. */
export interface BenchRow {
  model: string;
  model_filename: string;
  model_type: string;
  model_size: number;
  model_n_params: number;
  engine: "llama.cpp" | "powerinfer-ts";
  /** Which build ran, e.g. "llama.cpp v0.5.0 de3ff81 native (avx2)" or "powerinfer-ts CPU". */
  engine_label: string;
  backend: string;
  n_threads: number;
  /** Our FFN mode; null for llama.cpp. */
  sparse: SparseMode | null;
  /** Neurons computed / n_ff (routed experts: / n_expert_used · n_ff_exp) over the measured tokens (sparse modes), else null. */
  active_fraction: number | null;
  /** llama-bench's name of the test: ppN or tgN, with " @ dD" at a depth D > 0. */
  test: string;
  n_prompt: number;
  n_gen: number;
  /** Tokens in the KV cache before the test (llama-bench `-d`). */
  n_depth: number;
  samples_ns: number[];
  samples_ts: number[];
  avg_ns: number;
  stddev_ns: number;
  avg_ts: number;
  stddev_ts: number;
  /** Median of samples_ts (tokens/s). */
  median_ts: number;
  /** Weight bytes read per decoded token (tg rows). */
  bytes_per_token: number | null;
  /** bytes_per_token × t/s / measured bandwidth at this thread count (tg rows). */
  bandwidth_fraction: number | null;
  /** median_ts / llama.cpp's median_ts for the same model, threads and test. */
  vs_llama_cpp: number | null;
  /**
   * With --ram-budget (tg rows): the neuron/expert cache over the measured repetitions — MiB read from the
   * file per token, read calls per token, hit rate (rows or experts asked for that were in memory) and the
   * share of read time hidden behind compute (1 − compute threads' wait per thread ÷ time with a read in
   * flight) and how the reads were issued ("io_uring" or "pread"); else absent.
   */
  neuron_cache?: { mib_per_token: number; reads_per_token: number; hit_rate: number; hidden: number; io: string };
}

/** Sparse decode vs llama.cpp: the speed-up and what the bytes read predict. */
export interface SparseSummary {
  model: string;
  n_threads: number;
  test: string;
  sparse: SparseMode;
  speedup: number;
  bytes_ratio: number;
  /** speedup / bytes_ratio (issue 6's target: ≥ 0.9). */
  efficiency: number;
}

export interface BenchResult {
  date: string;
  commit: string;
  machine: {
    cpu: string;
    logicalCpus: number;
    memoryGiB: number;
    kernels: string;
    /** 1-minute load average when the run started and ended (other processes share the CPUs). */
    loadAverage: [number, number];
  };
  /** The peer that ran, why none ran, or null when not asked for. */
  llamaCpp: PeerInfo | { unavailable: string } | null;
  /** The first llama-bench result row of the native peer (its build, batch sizes, flash attention). */
  llamaBench?: Omit<LlamaBenchRow, "samples_ns" | "samples_ts">;
  /** GB/s by thread count. */
  bandwidth: Record<number, number>;
  rows: BenchRow[];
  sparseSummary: SparseSummary[];
  notes: string[];
}

const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
/** Median (mean of the middle two for an even count); NaN for none. */
export const median = (xs: number[]) => {
  if (xs.length === 0) return Number.NaN;
  const s = [...xs].sort((a, b) => a - b);
  const h = s.length >> 1;
  return s.length % 2 ? s[h]! : (s[h - 1]! + s[h]!) / 2;
};
const sd = (xs: number[]) => {
  if (xs.length < 2) return 0;
  const m = mean(xs);
  return Math.sqrt(xs.reduce((a, b) => a + (b - m) ** 2, 0) / (xs.length - 1));
};

/** The repository's commit (with "+dirty" when tracked files differ), or "unknown". */
export function gitCommit(cwd = dirname(new URL(import.meta.url).pathname)): string {
  try {
    const head = execFileSync("git", ["rev-parse", "--short", "HEAD"], { cwd, encoding: "utf8" }).trim();
    // --no-optional-locks: `git status` would otherwise refresh and rewrite the repository's index
    const dirty = execFileSync("git", ["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], {
      cwd,
      encoding: "utf8",
    }).trim();
    return dirty ? `${head}+dirty` : head;
  } catch {
    return "unknown";
  }
}

/** A short description of the model: synthetic ones by their recipe, others by architecture and file type. */
export function describeModel(file: GgufFile, path: string, twin = false): { model: string; type: string } {
  const arch = getOptionalString(file, "general.architecture") ?? "?";
  const counts = new Map<string, number>();
  for (const t of file.tensors) {
    if (t.shape.length < 2) continue;
    const n = ggmlTypeName(t.type);
    counts.set(n, (counts.get(n) ?? 0) + t.byteLength);
  }
  const ftype = [...counts].sort((a, b) => b[1] - a[1])[0]?.[0] ?? "?";
  const synth = getOptionalString(file, "powerinfer.synthetic.arch");
  const fmt = file.format === "PWRI" && !twin ? " PWRI" : "";
  if (synth) {
    const preset = getOptionalString(file, "powerinfer.synthetic.preset") ?? "";
    const layers = getOptionalNumber(file, `${arch}.block_count`);
    const full = getOptionalNumber(file, "powerinfer.synthetic.full_block_count");
    const slice = layers !== undefined && full !== undefined && layers < full ? ` ${layers}/${full}L` : "";
    const active = getOptionalNumber(file, "powerinfer.synthetic.active_fraction");
    const act = active !== undefined ? ` ${Math.round(active * 100)}%act` : "";
    return { model: `${synth} ${preset}${slice} ${ftype}${act}${fmt}`, type: `${arch} ${preset} ${ftype}` };
  }
  return { model: `${arch} ${basename(path).replace(/\.gguf$/, "")}${fmt}`, type: `${arch} ${ftype}` };
}

/**
 * Bytes of an F16 KV cache of n_ctx positions for the file's attention shape (GGUF `<arch>.block_count`,
 * `.embedding_length`, `.attention.head_count`, `.attention.head_count_kv`, `.attention.key_length`); 0 when
 * the file does not say.
 */
export function kvCacheBytes(file: GgufFile, nCtx: number): number {
  const arch = getOptionalString(file, "general.architecture") ?? "";
  const num = (k: string) => {
    try {
      return getOptionalNumber(file, `${arch}.${k}`);
    } catch {
      return undefined; // e.g. a per-layer array: no estimate
    }
  };
  const nLayer = num("block_count") ?? 0;
  const nHead = num("attention.head_count") ?? 0;
  const nEmbd = num("embedding_length") ?? 0;
  const nHeadKv = num("attention.head_count_kv") ?? nHead;
  const headDim = num("attention.key_length") ?? (nHead > 0 ? nEmbd / nHead : 0);
  return 2 * nLayer * nHeadKv * headDim * nCtx * 2;
}

/** Seeded random token ids in [3, nVocab) (llama-bench uses random tokens). */
export function randomTokens(n: number, nVocab: number, seed: number): number[] {
  let s = seed >>> 0 || 1;
  return Array.from({ length: n }, () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return 3 + ((s >>> 0) % Math.max(1, nVocab - 3));
  });
}

interface Engine {
  label: string;
  engine: BenchRow["engine"];
  engineLabel: string;
  /** The row's backend field (default "CPU"). */
  backendName?: string;
  /** Warms itself up before every measurement (llama-bench): skipped in the warm-up round. */
  selfWarming?: boolean;
  sparse: SparseMode | null;
  file: GgufFile;
  path: string;
  /** Runs depth tests (`-d`); false: those tests are skipped for this engine, with a note. */
  depth?: boolean;
  /** `depth`: tokens evaluated first, untimed (llama-bench `-d`); their count is the test's depth. */
  pp(tokens: number[], depth: number[]): Promise<{ ms: number; active?: number }>;
  tg(
    tokens: number[],
    depth: number[],
  ): Promise<{
    ms: number;
    active?: number;
    sparseBytesPerToken?: number[];
    cache?: NeuronCacheStats;
  }>;
  dispose(): Promise<void>;
}

/** llama-bench's default n_ubatch: prompts longer than this are evaluated in batches of this many tokens. */
export const LLAMA_BENCH_UBATCH = 512;

/**
 * Our engine with llama-bench's context per test: llama-bench gives each test a context of
 * n_depth + n_prompt + n_gen tokens (ppN: N, tgN: N) and evaluates prompts in ubatches of 512, so each
 * test here gets its own session with nCtx = depth + N and nBatch = 512; the depth's tokens are evaluated
 * before the clock starts.
 */
function ourEngine(model: Model, path: string, sparse: SparseMode, hybrid?: string): Engine {
  const sessions = new Map<number, Session>();
  const sessionFor = (n: number) => {
    let s = sessions.get(n);
    if (!s) {
      s = model.createSession({ nCtx: n, nBatch: LLAMA_BENCH_UBATCH });
      sessions.set(n, s);
    }
    return s;
  };
  const cfg = model.config;
  const snapshot = (session: Session) => ({
    tokens: session.stats.tokens,
    rows: [...session.stats.activeRows],
    bytes: [...session.stats.sparseBytes],
    layerTokens: [...session.stats.layerTokens],
  });
  const delta = (session: Session, a: ReturnType<typeof snapshot>) => {
    const b = snapshot(session);
    const n = b.tokens - a.tokens;
    if (n === 0) return {};
    const perToken = (x: number[], y: number[]) =>
      x.map((r, l) => (r - (y[l] ?? 0)) / Math.max(1, (b.layerTokens[l] ?? 0) - (a.layerTokens[l] ?? 0)));
    const rowsPerToken = perToken(b.rows, a.rows);
    const bytesPerTokenL = perToken(b.bytes, a.bytes);
    // routed experts: the neurons of the chosen experts (n_expert_used · n_ff_exp per layer)
    const perLayer = cfg.moe ? cfg.moe.n_expert_used * cfg.moe.n_ff_exp : cfg.n_ff;
    return {
      active: rowsPerToken.reduce((x, y) => x + y, 0) / (perLayer * cfg.n_layer),
      sparseBytesPerToken: bytesPerTokenL,
    };
  };
  // with a device each step's pieces run off the JavaScript thread, device and CPU at once
  const evaluate = (s: Session, t: number[]) => (model.placement ? s.evaluateAsync(t) : s.evaluate(t));
  return {
    label: `powerinfer-ts ${sparse}${hybrid ? " hybrid" : ""}`,
    engine: "powerinfer-ts",
    engineLabel: hybrid ? `powerinfer-ts CPU + ${hybrid} (hybrid)` : "powerinfer-ts CPU",
    backendName: hybrid ? `CPU+${hybrid}` : undefined,
    sparse,
    file: model.file,
    path,
    depth: true,
    async pp(tokens, depth) {
      const session = sessionFor(depth.length + tokens.length);
      session.reset();
      if (depth.length > 0) await evaluate(session, depth);
      const s0 = snapshot(session);
      const t0 = performance.now();
      await evaluate(session, tokens);
      const ms = performance.now() - t0;
      return { ms, active: delta(session, s0).active };
    },
    async tg(tokens, depth) {
      const session = sessionFor(depth.length + tokens.length);
      session.reset();
      if (depth.length > 0) await evaluate(session, depth);
      const s0 = snapshot(session);
      // --ram-budget: the cache counters' change over the timed tokens
      const c0 = model.ramPlan ? model.backend.neuronCacheStats?.() : undefined;
      const t0 = performance.now();
      for (const t of tokens) await evaluate(session, [t]);
      const ms = performance.now() - t0;
      const c1 = c0 ? model.backend.neuronCacheStats?.() : undefined;
      const cache = c0 && c1 ? cacheDelta(c0, c1) : undefined;
      return { ms, ...delta(session, s0), ...(cache ? { cache } : {}) };
    },
    async dispose() {
      for (const s of sessions.values()) s.dispose();
      const device = model.placement?.device;
      model.dispose();
      device?.dispose();
    },
  };
}

/** Cache counters over a test's repetitions, per token (see BenchRow.neuron_cache). */
function cacheSummary(cs: NeuronCacheStats[], tokens: number, threads: number): NonNullable<BenchRow["neuron_cache"]> {
  const sum = (k: "hits" | "misses" | "reads" | "bytesRead" | "stallMs" | "ioBusyMs") =>
    cs.reduce((x, c) => x + c[k], 0);
  const n = tokens * cs.length;
  const asked = sum("hits") + sum("misses");
  return {
    mib_per_token: sum("bytesRead") / 2 ** 20 / n,
    reads_per_token: sum("reads") / n,
    hit_rate: asked > 0 ? sum("hits") / asked : 1,
    hidden: hiddenShare({ ...cs[0]!, stallMs: sum("stallMs"), ioBusyMs: sum("ioBusyMs") }, threads),
    io: cs[0]!.ioDepth ? "io_uring" : "pread",
  };
}

/**
 * Our engine with a device: hot neurons and the planner's attention layers on the device backend. Undefined
 * (with a note) when no plan can be made: no statistics, a dense FFN, or a budget that holds nothing.
 */
async function hybridEngine(
  backend: Backend,
  path: string,
  mode: SparseMode,
  d: { backend: string; budgetBytes?: number },
  note: (line: string) => void,
  ram?: { budget: number; stats?: ActivationStats },
): Promise<Engine | undefined> {
  let device: Backend | undefined;
  let model: Model | undefined;
  try {
    device = await loadDeviceBackend(d.backend, { threads: 1, memoryBudget: d.budgetBytes || undefined }, () => {});
    if (!device) {
      note(`hybrid rows: no device backend is usable (${d.backend})`);
      return undefined;
    }
    // the CPU side holds what --ram-budget allows, as in the CPU rows
    model = await Model.load(path, { backend, sparse: mode, ramBudget: ram?.budget, ramStats: ram?.stats });
    // default: 90 % of the device's free memory
    const budgetBytes = d.budgetBytes ?? Math.floor((device.devices[0]?.freeMemory ?? 0) * 0.9);
    const has = existsSync(defaultStatsPath(path)) || existsSync(defaultGpuIndexPath(path));
    // a hot/cold split: ReLU FFNs, and routed experts (dense ones placed by how often they are chosen)
    if (!has || (model.config.ffn.activation !== "relu" && !model.config.moe)) {
      note(
        `hybrid rows: ${basename(path)} has no activation statistics or is neither a ReLU model nor one with routed experts; run \`powerinfer profile\``,
      );
      model.dispose();
      device.dispose();
      return undefined;
    }
    const r = await resolvePlan(model, {
      budgetBytes,
      backend: device.name,
      noWrite: true,
      nCtx: 1024,
      kvType: "f16",
    });
    if (r.plan.layers.every((L) => L.hot.length === 0 && !L.attention)) {
      note(`hybrid rows: the ${formatBytes(budgetBytes, 2)} budget holds nothing of ${basename(path)}`);
      model.dispose();
      device.dispose();
      return undefined;
    }
    model.offload(device, { layers: r.plan.layers.map((L) => ({ hot: L.hot, attention: L.attention })) });
    return ourEngine(model, path, mode, device.name);
  } catch (e) {
    note(`hybrid rows: ${basename(path)} --sparse ${mode}: ${(e as Error).message.split("\n")[0]}`);
    model?.dispose();
    device?.dispose();
    return undefined;
  }
}

function peerEngine(r: LlamaCppRunner, file: GgufFile, path: string, engineLabel: string): Engine {
  return {
    label: "llama.cpp (prebuilt)",
    engine: "llama.cpp",
    engineLabel,
    sparse: null,
    file,
    path,
    depth: false,
    pp: async (t) => ({ ms: await r.pp(t) }),
    tg: async (t) => ({ ms: await r.tg(t) }),
    dispose: () => r.dispose(),
  };
}

/**
 * A twin must hold the same model: architecture, sizes, layers, vocabulary and experts (its FFN down
 * projection may be stored the other way, and it has no predictors).
 * @throws Error naming the first field that differs
 */
export function checkTwin(file: GgufFile, path: string, twin: GgufFile, twinPath: string): void {
  const a = parseModelConfig(file);
  const b = parseModelConfig(twin);
  const fields: [string, unknown, unknown][] = [
    ["architecture", a.arch, b.arch],
    ["n_embd", a.n_embd, b.n_embd],
    ["n_ff", a.n_ff, b.n_ff],
    ["n_layer", a.n_layer, b.n_layer],
    ["n_head", a.n_head, b.n_head],
    ["n_vocab", a.n_vocab, b.n_vocab],
    ["n_expert", a.moe?.n_expert ?? 0, b.moe?.n_expert ?? 0],
    ["n_ff_exp", a.moe?.n_ff_exp ?? 0, b.moe?.n_ff_exp ?? 0],
  ];
  const bad = fields.find(([, x, y]) => x !== y);
  if (bad) {
    throw new Error(
      `--twin ${twinPath} is not the same model as ${path}: ${bad[0]} ${String(bad[2])} vs ${String(bad[1])}`,
    );
  }
}

/** llama-bench repetitions per measurement: 2 for a model with routed experts (the second counts), else 1. */
export function llamaBenchRepetitions(file: GgufFile): number {
  return expertsPerToken(file) < 1 ? 2 : 1;
}

/**
 * The native peer: every measurement is one `llama-bench -r 1` process on `path` (its own random
 * tokens, its own warm-up in the process); the time is llama-bench's measured repetition. A model with
 * routed experts gets `-r 2` and the second repetition counts: llama-bench's warm-up decodes one token,
 * which maps only that token's experts into the fresh process, so its first repetition pays page faults
 * on the others (measured on the 4-layer SmallThinker-4B F16 slice, tg128: 182 then 231, 236 t/s).
 */
function nativeEngine(
  peer: NativeLlamaCpp,
  file: GgufFile,
  path: string,
  threads: number,
  onRow: (row: LlamaBenchRow) => void,
): Engine {
  const reps = llamaBenchRepetitions(file);
  const once = async (kind: "pp" | "tg", n: number, depth: number) => {
    const row = await runLlamaBench(peer, path, { kind, n, threads, repetitions: reps, depth });
    if (row.n_threads !== threads || (kind === "pp" ? row.n_prompt : row.n_gen) !== n || row.n_depth !== depth) {
      throw new NativeLlamaCppError(
        `llama-bench ran ${row.n_threads} threads p${row.n_prompt} n${row.n_gen} d${row.n_depth}, asked ${threads} ${kind}${n} d${depth}`,
      );
    }
    onRow(row);
    return { ms: row.samples_ns.at(-1)! / 1e6 };
  };
  return {
    label: "llama.cpp (native)",
    engine: "llama.cpp",
    engineLabel: peer.label,
    selfWarming: true,
    sparse: null,
    file,
    path,
    depth: true,
    pp: (t, d) => once("pp", t.length, d.length),
    tg: (t, d) => once("tg", t.length, d.length),
    dispose: async () => {},
  };
}

/** Memory read bandwidth (GB/s) with `threads` threads over `mib` MiB, best of 5; undefined without the addon. */
export function measureBandwidth(mib: number, threads: number): number | undefined {
  const { addon } = loadAddon();
  if (!addon || mib <= 0) return undefined;
  return addon.benchReadBandwidth(mib * 2 ** 20, threads, mib >= 256 ? 5 : 2) / 1e9;
}

/** Runs the benchmark. Never throws for an engine that cannot run a model: it says so in `notes`. */
export async function runBench(o: BenchOptions): Promise<BenchResult> {
  const log = o.log ?? (() => {});
  const notes: string[] = [];
  const probe = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;
  const result: BenchResult = {
    date: new Date().toISOString(),
    commit: gitCommit(),
    machine: {
      cpu: cpuModelName(),
      logicalCpus: availableParallelism(),
      memoryGiB: Math.round(totalmem() / 2 ** 30),
      kernels: probe.reason,
      loadAverage: [loadavg()[0]!, Number.NaN],
    },
    llamaCpp: null,
    bandwidth: {},
    rows: [],
    sparseSummary: [],
    notes,
  };
  const bwMiB = o.bandwidthMiB ?? 512;
  for (const t of o.threads) {
    const bw = o.bandwidth?.[t] ?? measureBandwidth(bwMiB, t);
    if (bw !== undefined) {
      result.bandwidth[t] = bw;
      log(`bandwidth: ${bw.toFixed(1)} GB/s with ${t} thread(s)`);
    }
  }
  let peer: LlamaCppPeer | undefined;
  let native: NativeLlamaCpp | undefined;
  if (o.llamaCpp ?? true) {
    const choice = o.llamaCppPeer ?? "auto";
    if (choice !== "prebuilt") {
      const n = findNativeLlamaCpp(resolveLlamaCppDir(o.llamaCppDir));
      if ("unavailable" in n) {
        if (choice === "native") {
          result.llamaCpp = n;
          notes.push(`llama.cpp: ${n.unavailable}`);
        } else {
          notes.push(
            `llama.cpp: ${n.unavailable}; fell back to node-llama-cpp's prebuilt binary, which is slower than llama.cpp built natively`,
          );
          log(`native llama.cpp: ${n.unavailable}; using node-llama-cpp's prebuilt binary (slower)`);
        }
      } else {
        native = n;
        // llama-bench runs are started by a process forked now, while this one holds no model
        startLlamaBenchSpawner();
        const { kind: _, ...rest } = n;
        result.llamaCpp = { kind: "native", ...rest };
        log(`llama.cpp: ${n.label}, ${n.llamaBench}`);
      }
    }
    if (!native && choice !== "native") {
      const p = await loadLlamaCpp();
      if ("unavailable" in p) {
        result.llamaCpp = p;
        notes.push(`llama.cpp: ${p.unavailable}`);
      } else {
        peer = p;
        const label = `llama.cpp ${p.info.release} prebuilt (node-llama-cpp ${p.info.packageVersion}, slower than native)`;
        result.llamaCpp = { kind: "prebuilt", label, ...p.info };
        log(`llama.cpp: node-llama-cpp ${p.info.packageVersion} (${p.info.buildType}), llama.cpp ${p.info.release}`);
      }
    }
  }
  const ours = o.ours ?? true;
  if (ours && !probe.usable) notes.push(`powerinfer-ts: CPU backend ${probe.reason}`);
  try {
    for (const m of o.models) {
      const file = openGguf(m.path);
      const twinFile = m.twin ? openGguf(m.twin) : undefined;
      if (twinFile) checkTwin(file, m.path, twinFile, m.twin!);
      const { model: name, type } = describeModel(file, m.path, !!m.twin);
      const size = statSync(m.path).size;
      const params = file.tensors.reduce((s, t) => s + t.nElements, 0);
      const nVocab = (file.metadata.get("tokenizer.ggml.tokens") as unknown[] | undefined)?.length ?? 0;
      const maxPp = Math.max(0, ...o.nPrompt);
      const maxTg = Math.max(0, ...o.nGen);
      const depths = o.nDepth?.length ? o.nDepth : [0];
      const nCtx = Math.max(...depths) + Math.max(maxPp, maxTg, 1);
      const ctxTrain =
        getOptionalNumber(file, `${getOptionalString(file, "general.architecture")}.context_length`) ?? nCtx;
      if (nCtx > ctxTrain) {
        const note = `${name}: tests use ${nCtx} tokens of context, more than its trained ${ctxTrain}`;
        notes.push(note);
        log(note); // also now: a long test gives no other sign of life until its first row
      }
      // the tests' KV cache (F16, as both engines use) must fit before any token list is made
      const kvBytes = kvCacheBytes(file, nCtx);
      if (kvBytes > freemem()) {
        notes.push(
          `${name}: skipped: its tests need a KV cache for n_ctx ${nCtx} (depth + prompt or generated tokens) of ${formatBytes(kvBytes, 2)}, ${formatBytes(freemem(), 2)} is free; use smaller -d/-p/-n`,
        );
        continue;
      }
      // a token list per repetition (the warm-up round's too): a repetition must not find the rows of the
      // tokens it decodes already in a neuron or expert cache (--ram-budget) from the round before
      const seed = o.seed ?? 1;
      const perRep = (n: number, base: number) =>
        Array.from({ length: o.repetitions + 1 }, (_, rep) => randomTokens(n, nVocab, base + 1000003 * rep));
      const ppTokens = new Map(o.nPrompt.map((n) => [n, perRep(n, seed + n)]));
      const tgTokens = new Map(o.nGen.map((n) => [n, perRep(n, seed + 7919 * n)]));
      const depthTokens = new Map(depths.map((d) => [d, randomTokens(d, nVocab, (o.seed ?? 1) + 104729 * d)]));
      for (const threads of o.threads) {
        const engines: Engine[] = [];
        log(`${name}: loading engines (${threads} thread(s))`);
        if (peer || native) {
          // the twin when given (a PWRI file, or a GGUF with tensors llama.cpp does not know: fc1_exps/fc2_exps)
          const path = m.twin ?? (file.format === "PWRI" ? undefined : m.path);
          if (!path) {
            notes.push(`${name}: llama.cpp cannot load PWRI files and no GGUF twin was given (--twin)`);
          } else if (native) {
            engines.push(
              nativeEngine(native, twinFile ?? file, path, threads, (row) => {
                if (!result.llamaBench) {
                  const { samples_ns: _ns, samples_ts: _ts, ...rest } = row;
                  result.llamaBench = rest;
                }
              }),
            );
          } else if (peer && result.llamaCpp && "label" in result.llamaCpp) {
            try {
              const r = await peer.open(path, { contextSize: nCtx, batchSize: Math.max(1, maxPp), threads });
              engines.push(peerEngine(r, twinFile ?? file, path, result.llamaCpp.label));
            } catch (e) {
              notes.push(`${name}: llama.cpp cannot run ${basename(path)}: ${(e as Error).message.split("\n")[0]}`);
            }
          }
        }
        let backend: Backend | undefined;
        if (ours && probe.usable) {
          const hugePageCopyBytes = o.mmap || o.ramBudget !== undefined ? 0 : undefined;
          backend = await cpuBackend.load({ threads, repack: o.repack ?? true, hugePageCopyBytes });
          const hasPred = file.tensors.some((t) => /\.fc1(_exps)?\.weight$/.test(t.name));
          const modes: SparseMode[] = o.sparse === "auto" ? (hasPred ? ["off", "predictor"] : ["off"]) : o.sparse;
          for (const mode of modes) {
            // dense runs the GGUF twin when there is one (the file llama.cpp runs)
            const path = mode === "off" && m.twin ? m.twin : m.path;
            // a dense FFN cannot be served from the file; routed experts can in every mode
            const experts = file.tensors.some((t) => t.name.endsWith(".ffn_gate_exps.weight"));
            const budget = mode === "off" && !experts ? undefined : o.ramBudget;
            const statsPath = defaultStatsPath(path);
            let ramStats: ActivationStats | undefined;
            try {
              ramStats = budget !== undefined && existsSync(statsPath) ? readActivationStats(statsPath) : undefined;
              const model = await Model.load(path, { backend, sparse: mode, ramBudget: budget, ramStats });
              engines.push(ourEngine(model, path, mode));
            } catch (e) {
              const why = (e as Error).message.split("\n")[0];
              notes.push(`${name}: powerinfer-ts --sparse ${mode} cannot run ${basename(path)}: ${why}`);
            }
            if (o.device) {
              const e = await hybridEngine(
                backend,
                path,
                mode,
                o.device,
                (n) => notes.push(`${name}: ${n}`),
                budget === undefined ? undefined : { budget, stats: ramStats },
              );
              if (e) engines.push(e);
            }
          }
        }
        const tests = depths.flatMap((d) => [
          ...o.nPrompt.map((n) => ({
            kind: "pp" as const,
            n,
            d,
            tokens: ppTokens.get(n)!,
            depth: depthTokens.get(d)!,
          })),
          ...o.nGen.map((n) => ({ kind: "tg" as const, n, d, tokens: tgTokens.get(n)!, depth: depthTokens.get(d)! })),
        ]);
        const testName = (t: (typeof tests)[number]) => `${t.kind}${t.n}${t.d > 0 ? ` @ d${t.d}` : ""}`;
        for (const e of engines) {
          if (!e.depth && depths.some((d) => d > 0))
            notes.push(`${name}: ${e.label} cannot run depth (-d) tests; only its depth-0 rows ran`);
        }
        const samples = engines.map(() =>
          tests.map(() => ({
            ms: [] as number[],
            active: [] as number[],
            bytes: [] as number[][],
            cache: [] as NeuronCacheStats[],
          })),
        );
        for (let rep = 0; rep <= o.repetitions; rep++) {
          for (let ti = 0; ti < tests.length; ti++) {
            const t = tests[ti]!;
            const order = engines.map((_, i) => i);
            if (rep % 2 === 1) order.reverse();
            for (const ei of order) {
              const e = engines[ei]!;
              if (rep === 0 && e.selfWarming) continue;
              if (t.d > 0 && !e.depth) continue;
              let r: {
                ms: number;
                active?: number;
                sparseBytesPerToken?: number[];
                cache?: NeuronCacheStats;
              };
              try {
                const tokens = t.tokens[rep]!;
                r = t.kind === "pp" ? await e.pp(tokens, t.depth) : await e.tg(tokens, t.depth);
              } catch (err) {
                if (!(err instanceof NativeLlamaCppError)) throw err;
                notes.push(`${name}: ${e.label} ${testName(t)} failed: ${(err as Error).message.split("\n")[0]}`);
                continue;
              }
              log(
                `${rep === 0 ? "warm-up" : `rep ${rep}`}: ${e.label} ${testName(t)} ${((t.n * 1000) / r.ms).toFixed(2)} t/s`,
              );
              if (rep === 0) continue;
              const s = samples[ei]![ti]!;
              s.ms.push(r.ms);
              if (r.active !== undefined) s.active.push(r.active);
              if (r.sparseBytesPerToken) s.bytes.push(r.sparseBytesPerToken);
              if (r.cache) s.cache.push(r.cache);
            }
          }
        }
        const rows: BenchRow[] = [];
        engines.forEach((e, ei) => {
          tests.forEach((t, ti) => {
            const s = samples[ei]![ti]!;
            if (s.ms.length === 0) return;
            const ts = s.ms.map((ms) => (t.n * 1000) / ms);
            const nLayer = e.file.tensors.filter((x) => /^blk\.\d+\.attn_norm\.weight$/.test(x.name)).length;
            let bpt: number | null = null;
            if (t.kind === "tg") {
              const mode = e.sparse ?? "off";
              // the bytes the sparse ops read, as the engine counted them (each op's rows × its row bytes)
              const sparseBytes =
                mode === "off"
                  ? undefined
                  : Array.from({ length: nLayer }, (_, l) => mean(s.bytes.map((r) => r[l] ?? 0)));
              bpt = bytesPerToken(e.file, nLayer, mode, undefined, sparseBytes);
            }
            const bw = result.bandwidth[threads];
            const avgTs = mean(ts);
            rows.push({
              model: name,
              model_filename: e.path,
              model_type: type,
              // the file this engine ran: a --twin's own size and parameters (llama.cpp and our dense mode run it)
              model_size: e.path === m.path ? size : statSync(e.path).size,
              model_n_params: e.file === file ? params : e.file.tensors.reduce((n, t) => n + t.nElements, 0),
              engine: e.engine,
              engine_label: e.engineLabel,
              backend: e.backendName ?? "CPU",
              n_threads: threads,
              sparse: e.sparse,
              active_fraction: e.sparse && e.sparse !== "off" && s.active.length ? mean(s.active) : null,
              test: testName(t),
              n_prompt: t.kind === "pp" ? t.n : 0,
              n_gen: t.kind === "tg" ? t.n : 0,
              n_depth: t.d,
              samples_ns: s.ms.map((ms) => Math.round(ms * 1e6)),
              samples_ts: ts,
              avg_ns: Math.round(mean(s.ms) * 1e6),
              stddev_ns: Math.round(sd(s.ms) * 1e6),
              avg_ts: avgTs,
              stddev_ts: sd(ts),
              median_ts: median(ts),
              bytes_per_token: bpt,
              bandwidth_fraction: bpt !== null && bw ? (bpt * avgTs) / (bw * 1e9) : null,
              vs_llama_cpp: null,
              ...(s.cache.length ? { neuron_cache: cacheSummary(s.cache, t.n, threads) } : {}),
            });
          });
        });
        for (const r of rows) {
          const ref = rows.find((x) => x.engine === "llama.cpp" && x.test === r.test);
          if (ref && r !== ref) r.vs_llama_cpp = r.median_ts / ref.median_ts;
          if (ref && r !== ref && r.test.startsWith("tg") && r.sparse && r.sparse !== "off") {
            const bytesRatio = ref.bytes_per_token! / r.bytes_per_token!;
            result.sparseSummary.push({
              model: name,
              n_threads: threads,
              test: r.test,
              sparse: r.sparse,
              speedup: r.vs_llama_cpp!,
              bytes_ratio: bytesRatio,
              efficiency: r.vs_llama_cpp! / bytesRatio,
            });
          }
        }
        result.rows.push(...rows);
        for (const e of engines) await e.dispose();
        backend?.dispose();
      }
      if (getOptionalString(file, "general.architecture") === "falcon" && ours) {
        notes.push(`${name}: powerinfer-ts has no falcon graph yet; only llama.cpp ran it`);
      }
    }
  } finally {
    await peer?.dispose();
    stopLlamaBenchSpawner();
  }
  result.machine.loadAverage[1] = loadavg()[0]!;
  return result;
}
