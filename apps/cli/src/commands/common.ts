/** Options and helpers shared by the commands that load a model. */
import { accessSync, closeSync, constants, existsSync, openSync, readSync, type Stats, statSync } from "node:fs";
import { dirname, resolve } from "node:path";
import { availableParallelism } from "node:os";
import { cgroupMemoryLimit } from "@powerinfer/backend-cpu-avx2";
import type { Backend, NeuronCacheStats } from "@powerinfer/core";
import {
  defaultStatsPath,
  EngineError,
  formatBytes,
  type GenerateOptions,
  Model,
  type SparseMode,
  servesExperts,
} from "@powerinfer/engine";
import {
  type ActivationStats,
  GgufError,
  type GgufFileKind,
  ggufFileKind,
  openGguf,
  readActivationStats,
} from "@powerinfer/gguf";
import cliProgress from "cli-progress";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";

/**
 * A rule an option's number must satisfy, checked by commander while it parses the command line — so a
 * bad value is refused, in one line naming the option, the rule and the value, before any file is opened.
 */
export interface NumberRule {
  /** Smallest value allowed (inclusive). */
  min?: number;
  /** Largest value allowed (inclusive). */
  max?: number;
  /** Values must be greater than this (exclusive lower bound). */
  above?: number;
  /** Values must be less than this (exclusive upper bound). */
  below?: number;
  /** Values allowed besides the range, e.g. −1 meaning "unlimited". */
  also?: number[];
  /** What the extra values mean, e.g. "-1 = until end of text". */
  alsoMeans?: string;
}

/** The rule in words: "≥ 1", "in (0, 1]", "≥ 0 (or -1 = random)". */
export function describeRule(r: NumberRule): string {
  const lo =
    r.above !== undefined ? { v: r.above, open: true } : r.min !== undefined ? { v: r.min, open: false } : undefined;
  const hi =
    r.below !== undefined ? { v: r.below, open: true } : r.max !== undefined ? { v: r.max, open: false } : undefined;
  let range = "";
  if (lo && hi) range = `in ${lo.open ? "(" : "["}${lo.v}, ${hi.v}${hi.open ? ")" : "]"}`;
  else if (lo) range = `${lo.open ? ">" : "≥"} ${lo.v}`;
  else if (hi) range = `${hi.open ? "<" : "≤"} ${hi.v}`;
  if (!r.also?.length) return range;
  const extra = r.alsoMeans ?? r.also.join(", ");
  return range ? `${range} (or ${extra})` : extra;
}

function satisfies(n: number, r: NumberRule): boolean {
  if (r.also?.includes(n)) return true;
  if (r.above !== undefined && !(n > r.above)) return false;
  if (r.min !== undefined && !(n >= r.min)) return false;
  if (r.below !== undefined && !(n < r.below)) return false;
  if (r.max !== undefined && !(n <= r.max)) return false;
  return true;
}

/**
 * Checks a number against a rule.
 * @param name the option as the user types it, e.g. "--n-predict"
 * @throws InvalidArgumentError "--name must be <rule>, got <value>"
 */
export function checkNumber(name: string, n: number, rule: NumberRule, kind = "a number"): number {
  if (!satisfies(n, rule)) {
    const words = describeRule(rule);
    throw new InvalidArgumentError(`${name} must be ${words ? `${kind} ${words}` : kind}, got ${n}`);
  }
  return n;
}

const dashed = (name: string) => (name.startsWith("-") ? name : `--${name}`);

/** Commander argument parser: an integer satisfying `rule` (see {@link NumberRule}). */
export function int(name: string, rule: NumberRule = {}) {
  return (v: string): number => {
    const n = Number(v);
    const words = describeRule(rule);
    // decimal digits only: Number() also reads "0x10", "0b11", "1e1" and "2.0"
    if (!/^\s*[+-]?\d+\s*$/.test(v))
      throw new InvalidArgumentError(`${dashed(name)} must be an integer${words ? ` ${words}` : ""}, got "${v}"`);
    if (!Number.isSafeInteger(n))
      throw new InvalidArgumentError(
        `${dashed(name)} must be an integer${words ? ` ${words}` : ""}; "${v.trim()}" is beyond ±(2^53 − 1), the largest integer held exactly`,
      );
    return checkNumber(dashed(name), n, rule, "an integer");
  };
}

/**
 * Commander argument parser for -t/--threads: an integer from 1 to 512, or −1 (llama.cpp's default value)
 * for the default, the number of CPUs this process may use (os.availableParallelism(), at most 512).
 */
export function threadsArg(name = "threads") {
  const parse = int(name, { min: 1, max: 512 });
  return (v: string): number => {
    if (/^\s*-1\s*$/.test(v)) return Math.min(512, availableParallelism());
    try {
      return parse(v);
    } catch {
      throw new InvalidArgumentError(`${dashed(name)} must be an integer in [1, 512] or -1 (the default), got "${v}"`);
    }
  };
}

/**
 * Most sequences decoded together (`serve -np`, `batched -np`): llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h),
 * beyond which its context refuses n_seq_max.
 */
export const MAX_SEQUENCES = 256;

/** What `--n-gpu-layers all` (or a value ≤ −2) stands for: more layers than any model has (clamped to n_layer). */
export const ALL_GPU_LAYERS = 2 ** 31 - 1;

/**
 * Commander argument parser for -ngl/--n-gpu-layers, with llama.cpp's values (common/arg.cpp): an integer
 * N ≥ 0; `auto` or −1 (llama.cpp's default), the same as leaving the option out (here: the planner
 * decides which layers' attention goes to the device); `all` or any value ≤ −2, every layer
 * ({@link ALL_GPU_LAYERS}, clamped to the model's layers where it is used).
 * @returns undefined for auto, else the layer count.
 * @throws InvalidArgumentError naming the option and the accepted values.
 */
export function gpuLayersArg(name = "n-gpu-layers") {
  const parse = int(name);
  return (v: string): number | undefined => {
    const t = v.trim().toLowerCase();
    if (t === "auto") return undefined;
    if (t === "all") return ALL_GPU_LAYERS;
    let n: number;
    try {
      n = parse(v);
    } catch {
      throw new InvalidArgumentError(
        `${dashed(name)} must be an integer, auto (-1: the default) or all (<= -2: every layer), got "${v}"`,
      );
    }
    if (n === -1) return undefined;
    return n < -1 ? ALL_GPU_LAYERS : n;
  };
}

/** Commander argument parser: a finite number satisfying `rule` (see {@link NumberRule}). */
export function float(name: string, rule: NumberRule = {}) {
  return (v: string): number => {
    const n = Number(v);
    const words = describeRule(rule);
    // decimal only: Number() also reads "0x10" (16) and "0b1"
    if (v.trim() === "" || !Number.isFinite(n) || /^\s*[+-]?0[xob]/i.test(v))
      throw new InvalidArgumentError(`${dashed(name)} must be a number${words ? ` ${words}` : ""}, got "${v}"`);
    return checkNumber(dashed(name), n, rule);
  };
}

/** Commander argument parser: one of `values` (any case; the value is returned as `values` spells it). */
export function choice(name: string, values: readonly string[]) {
  return (v: string): string => {
    const hit = values.find((c) => c.toLowerCase() === v.toLowerCase());
    if (hit === undefined) throw new InvalidArgumentError(`${dashed(name)} must be ${oneOf(values)}, got "${v}"`);
    return hit;
  };
}

/** "a, b or c". */
export function oneOf(values: readonly string[]): string {
  return values.length <= 1 ? (values[0] ?? "") : `${values.slice(0, -1).join(", ")} or ${values[values.length - 1]}`;
}

/** Adds -m, -c, -t, --backend, -b. */
export function modelOptions(cmd: Command): Command {
  return cmd
    .requiredOption("-m, --model <file>", "GGUF or PowerInfer GGUF model file")
    .option(
      "-c, --ctx-size <n>",
      "context size in tokens (default: the model's trained context, at most 4096; 0: the trained context)",
      int("ctx-size", { min: 0 }),
    )
    .option("-t, --threads <n>", "CPU threads (default, or -1: number of cores)", threadsArg())
    .option("-b, --batch-size <n>", "prompt tokens per graph", int("batch-size", { min: 1 }), 512)
    .option("--backend <names>", 'backend: "auto" or a comma-separated list (env POWERINFER_BACKEND overrides)', "auto")
    .option("--kv-type <type>", "KV cache type: f16 or f32", choice("kv-type", ["f16", "f32"]), "f16")
    .option("-v, --verbose", "also report every backend skipped and why; error lines name the error's class and code")
    .option(
      "--sparse <mode>",
      "FFN mode: predictor (default when the model has predictors), oracle (true mask from the gate; testing) or off (dense)",
      choice("sparse", ["predictor", "oracle", "off"]),
    )
    .option(
      "--sparse-threshold <x>",
      "predictor threshold (default: the model's powerinfer.sparse_threshold)",
      // logits are float32: a threshold beyond its range would become ±infinity
      float("sparse-threshold", { min: -3.4e38, max: 3.4e38 }),
    )
    .option(
      "--ram-budget <GiB>",
      "GiB held for weights + the neuron cache (default: no limit); below the model's size the sparse FFN's rows — or, for routed experts in any --sparse mode, whole experts — are read from the file on demand (O_DIRECT), the hottest (from `profile` statistics) pinned; the KV cache is not counted",
      float("ram-budget", { above: 0, max: 2 ** 20 }),
    )
    .option("--no-repack", REPACK_HELP)
    .option("--mmap", MMAP_HELP);
}

/** Help of `--no-repack`, on every command that loads a model for the CPU backend. */
export const REPACK_HELP =
  "keep Q4_0 and Q4_K matrices as the file stores them: by default the CPU backend repacks them into 8-row groups at first use (faster decode and prompt; same results, the copy replaces the mapped pages)";

/** Help of `--mmap`, beside `--no-repack`. */
export const MMAP_HELP =
  "read every weight through the model file's mapping (zero-copy; with --no-repack nothing is copied): by default the CPU backend copies weights of 2 MiB or more into transparent-huge-page memory while they fit in 75 % of the available memory (fewer TLB misses for the sparse rows; same results; never with --ram-budget)";

export interface ModelCliOptions {
  model: string;
  ctxSize?: number;
  threads?: number;
  batchSize: number;
  backend: string;
  kvType: string;
  verbose?: boolean;
  sparse?: string;
  sparseThreshold?: number;
  /** GiB (see --ram-budget). */
  ramBudget?: number;
  /** Activation statistics (`profile` output) used to pin hot neurons under --ram-budget. */
  stats?: string;
  /** false with --no-repack (commander's default for a --no- option is true). */
  repack?: boolean;
  /** --mmap: no huge-page copies of mapped weights. */
  mmap?: boolean;
  /** Set by `profile`: no note that statistics are missing (it is what writes them). */
  profiling?: boolean;
}

/**
 * Checks the options {@link loadModelFromCli} takes, before anything is loaded.
 * @throws InvalidArgumentError naming the option.
 */
export function checkModelOptions(o: Omit<ModelCliOptions, "model">): void {
  if (o.kvType !== "f16" && o.kvType !== "f32")
    throw new InvalidArgumentError(`--kv-type must be f16 or f32, got "${o.kvType}"`);
  if (o.sparse !== undefined && !["predictor", "oracle", "off"].includes(o.sparse)) {
    throw new InvalidArgumentError(`--sparse must be predictor, oracle or off, got "${o.sparse}"`);
  }
  if (o.sparseThreshold !== undefined && (o.sparse === "off" || o.sparse === "oracle")) {
    // the predictor's threshold: off computes every neuron, oracle keeps the neurons whose gate is > 0
    throw new InvalidArgumentError(`--sparse-threshold applies to --sparse predictor only, not --sparse ${o.sparse}`);
  }
  if (!(o.batchSize >= 1)) throw new InvalidArgumentError(`--batch-size must be ≥ 1, got ${o.batchSize}`);
  if (o.threads !== undefined && o.threads < 1)
    throw new InvalidArgumentError(`--threads must be ≥ 1, got ${o.threads}`);
  if (o.ctxSize !== undefined && o.ctxSize < 0)
    throw new InvalidArgumentError(`--ctx-size must be ≥ 0 (0: the model's trained context), got ${o.ctxSize}`);
  checkIoEnv();
}

/**
 * The neuron cache's reader settings from the environment, checked wherever a model is loaded (a bundled
 * file reads through the cache even without --ram-budget): POWERINFER_IO_THREADS (the native side would
 * fall back to 16 without a word) and POWERINFER_IO (the native side reads anything but "pread" as io_uring).
 * @throws InvalidArgumentError naming the variable and its value.
 */
export function checkIoEnv(): void {
  const io = process.env.POWERINFER_IO_THREADS?.trim();
  if (io && !(/^\d+$/.test(io) && Number(io) >= 1 && Number(io) <= 256))
    throw new InvalidArgumentError(`POWERINFER_IO_THREADS must be a whole number from 1 to 256, got "${io}"`);
  const engine = process.env.POWERINFER_IO;
  if (engine !== undefined && engine !== "" && engine !== "io_uring" && engine !== "pread")
    throw new InvalidArgumentError(`POWERINFER_IO must be io_uring (the default) or pread, got "${engine}"`);
}

/**
 * `stat` of a file the user named.
 * @throws InvalidArgumentError "<what> X does not exist" / "cannot read <what> X (code)"
 */
function statInput(path: string, what: string): Stats {
  try {
    return statSync(path);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new InvalidArgumentError(
      code === "ENOENT" ? `${what} ${path} does not exist` : `cannot read ${what} ${path} (${code ?? String(e)})`,
    );
  }
}

/**
 * Checks that a model file the user named is there and is a regular file, before anything else is done
 * with it (a backend loaded, a server started, a benchmark probe run).
 * @param what how the message names it, e.g. "model file"
 * @throws InvalidArgumentError "model file X does not exist" / "X is a directory, not a model file" / …
 */
export function checkInputFile(path: string, what = "model file"): void {
  const st = statInput(path, what);
  if (st.isDirectory())
    throw new InvalidArgumentError(`${path} is a directory, not ${/^[aeiou]/i.test(what) ? "an" : "a"} ${what}`);
  if (!st.isFile()) throw new InvalidArgumentError(`${path} is not a regular file (${what})`);
}

/**
 * Names the option behind an activation statistics file that cannot be read or does not fit the model: a
 * GgufError about the file at `path` (not a GGUF, truncated, not statistics) becomes "activation statistics
 * file (--stats) PATH …" — or, for the default path next to the model, "activation statistics file PATH (the
 * default of --stats) …" — with its class and code kept. An EngineError 'STATS_MISMATCH' (statistics of
 * another model) is named the same way, with the fix: profile this model, or pass --stats. Any other error is
 * returned unchanged.
 * @param model the model's path, for the `powerinfer profile` command line in the fix
 */
export function annotateStatsError(e: unknown, path: string, given: boolean, model?: string): unknown {
  const what = given ? `(--stats) ${path}` : `${path} (the default of --stats)`;
  if (e instanceof GgufError && e.path === path && e.message.startsWith(path)) {
    e.message = `activation statistics file ${what}${e.message.slice(path.length)}`;
  } else if (e instanceof EngineError && e.code === "STATS_MISMATCH") {
    const profile = `\`powerinfer profile -m ${model ?? "MODEL"} -f TEXT${given ? "" : " --force"}\``;
    e.message = `activation statistics file ${what} does not fit this model (${e.message}): ${given ? `pass --stats with this model's statistics (${profile} measures them)` : `run ${profile} to replace it with this model's, or pass --stats with this model's statistics`}`;
  }
  return e;
}

/** What run and batched print when generation stopped because the context (-c, n_ctx tokens) is full. */
export function contextFullNote(nCtx: number): string {
  return `context full (n_ctx ${nCtx}): generation stopped`;
}

/** Loads the backend and the model, with a progress bar on a terminal. */
export async function loadModelFromCli(o: ModelCliOptions, quiet = false): Promise<{ backend: Backend; model: Model }> {
  checkModelOptions(o);
  checkInputFile(o.model);
  const threads = o.threads ?? availableParallelism();
  // under --ram-budget the weights held stay mapped (page cache, reclaimable) as the budget planned them
  const hugePageCopyBytes = o.mmap || o.ramBudget !== undefined ? 0 : undefined;
  // the huge-page copies are made off the JS thread (Model.load waits for them): serve answers meanwhile
  const backend = await loadBackend(
    o.backend,
    { threads, repack: o.repack ?? true, hugePageCopyBytes, deferHugePageCopies: true },
    (line) => {
      if (!quiet && o.verbose) process.stderr.write(`backend skipped: ${line}\n`);
    },
  );
  const bar =
    process.stderr.isTTY && !quiet
      ? new cliProgress.SingleBar(
          { format: "loading [{bar}] {percentage}% {what}", stream: process.stderr, hideCursor: true },
          cliProgress.Presets.shades_classic,
        )
      : undefined;
  bar?.start(100, 0, { what: "" });
  const budget = o.ramBudget !== undefined ? o.ramBudget * 2 ** 30 : undefined;
  let ramStats: ActivationStats | undefined;
  let noStats: string | undefined; // the statistics path looked for, when there was none
  const statsPath = o.stats ?? defaultStatsPath(o.model);
  if (budget !== undefined) {
    // a file the user named must be there (the default one is optional)
    if (o.stats !== undefined) checkInputFile(o.stats, "activation statistics file (--stats)");
    if (existsSync(statsPath)) {
      try {
        ramStats = readActivationStats(statsPath);
      } catch (e) {
        throw annotateStatsError(e, statsPath, o.stats !== undefined, o.model);
      }
    } else noStats = statsPath;
  } else if (!quiet) {
    const limit = cgroupMemoryLimit();
    const size = statSync(o.model).size;
    if (limit !== undefined && limit < size) {
      process.stderr.write(
        `note: this process runs under a memory limit of ${formatBytes(limit, 2)}, below the model's ${formatBytes(size, 2)}: the mapped weights will be re-read from storage over and over; --ram-budget ${Math.max(0.01, (limit * 0.8) / 2 ** 30).toFixed(2)} keeps the hot part in memory and reads the rest on demand\n`,
      );
    }
  }
  try {
    const model = await Model.load(o.model, {
      backend,
      sparse: o.sparse as SparseMode | undefined,
      threshold: o.sparseThreshold,
      onProgress: (f, what) => bar?.update(Math.round(f * 100), { what }),
      ramBudget: budget,
      ramStats,
    }).catch((e: unknown) => {
      // statistics of another model (checked by the engine): named with the option that chose the file
      throw ramStats ? annotateStatsError(e, statsPath, o.stats !== undefined, o.model) : e;
    });
    bar?.stop();
    if (o.sparseThreshold !== undefined && model.sparse !== "predictor") {
      model.dispose();
      backend.dispose();
      throw new InvalidArgumentError(
        `--sparse-threshold applies to the predictor mode; this model runs ${model.sparse === "off" ? "dense (no predictors or not ReLU)" : `--sparse ${model.sparse}`}`,
      );
    }
    if (model.ramPlan && !quiet) {
      // without statistics nothing is pinned by rank (unless everything fits); profile is what makes them
      if (noStats && model.ramPlan.cachedShare < 1 && !o.profiling) {
        const experts = servesExperts(model.ramPlan);
        process.stderr.write(
          `note: no activation statistics (${noStats}): the ${experts ? "expert cache is all LRU, no expert is pinned by how often the router chooses it" : "neuron cache is all LRU, no neuron is pinned"}; ${model.file.metadata.has("powerinfer.bundle.version") ? "profile the PowerInfer file this bundled model was made from (`powerinfer convert MODEL OUT --to pwri` makes one) and pass its statistics with --stats" : "run `powerinfer profile` first"}\n`,
        );
      }
      process.stderr.write(`${describeRamPlan(model)}\n`);
    }
    return { backend, model };
  } finally {
    bar?.stop();
  }
}

/** One line: how --ram-budget split the weights. */
export function describeRamPlan(model: Model): string {
  const p = model.ramPlan;
  if (!p) return "";
  const size = (b: number) => formatBytes(b);
  const hot = p.tensors.reduce((s, t) => s + t.hot.length * t.rowBytes, 0);
  const st = model.backend.neuronCacheStats?.();
  const engine = st?.ioDepth
    ? `io_uring: ${plural(st.ioThreads, "thread")}, ${st.ioDepth} reads in flight`
    : `pread: ${plural(st?.ioThreads ?? 0, "reader thread")}`;
  const io = st ? `${st.direct ? "O_DIRECT" : "page cache dropped after each read (fadvise DONTNEED)"}, ${engine}` : "";
  const budget =
    p.budget >= Number.MAX_SAFE_INTEGER ? "none (bundled layout: every neuron record pinned)" : size(p.budget);
  if (servesExperts(p)) {
    const experts = p.tensors.reduce((s, t) => s + t.hot.length, 0);
    const reads =
      p.cachedShare >= 1
        ? "every expert pinned at load: nothing is read while generating"
        : `whole experts read from the file on demand (${io})`;
    return `ram budget ${budget}: resident ${size(p.residentBytes)} + expert cache ${size(p.cacheBytes)} (${(p.cachedShare * 100).toFixed(1)} % of ${size(p.ffnBytes)} of expert stacks; ${experts} experts pinned (${size(hot)})${p.fromStats ? " by profile selection counts" : ""}) — ${reads}; the KV cache is not counted`;
  }
  if (p.tensors.length === 0) {
    // a dense FFN (or --sparse off): nothing is served from the file
    return `ram budget ${budget}: every weight resident (${size(p.residentBytes)}); no FFN row is read from the file (a dense FFN cannot be); the KV cache is not counted`;
  }
  const reads =
    p.cachedShare >= 1
      ? "every row fits the cache: nothing is read from the file once it is warm"
      : `rows read from the file on demand (${io})`;
  return `ram budget ${budget}: resident ${size(p.residentBytes)} + neuron cache ${size(p.cacheBytes)} (${(p.cachedShare * 100).toFixed(1)} % of ${size(p.ffnBytes)} FFN rows; pinned hot ${size(hot)}${p.fromStats ? " from profile statistics" : ""}) — ${reads}; the KV cache is not counted`;
}

/** Differences of two neuron-cache counter snapshots. */
export function cacheDelta(a: NeuronCacheStats, b: NeuronCacheStats): NeuronCacheStats {
  return {
    hits: b.hits - a.hits,
    misses: b.misses - a.misses,
    reads: b.reads - a.reads,
    bytesRead: b.bytesRead - a.bytesRead,
    stallMs: b.stallMs - a.stallMs,
    ioBusyMs: b.ioBusyMs - a.ioBusyMs,
    ioErrors: b.ioErrors - a.ioErrors,
    cacheBytes: b.cacheBytes,
    ioThreads: b.ioThreads,
    ioDepth: b.ioDepth,
    direct: b.direct,
  };
}

/** "1 thread", "2 threads": a count with its noun, plural unless it is 1. */
export const plural = (n: number, one: string, many = `${one}s`): string => `${n} ${n === 1 ? one : many}`;

/**
 * Share of read time hidden behind computation: 1 − (time compute threads waited, per thread) / (wall
 * time with a read in flight), in [0, 1]; 1 when nothing was read.
 */
export function hiddenShare(d: NeuronCacheStats, threads: number): number {
  if (d.ioBusyMs <= 0) return 1;
  return Math.min(1, Math.max(0, 1 - d.stallMs / Math.max(1, threads) / d.ioBusyMs));
}

/**
 * One line of per-token neuron-cache counters over `tokens` tokens; `what` names the cache as the RAM plan's
 * line does ("expert cache" where whole experts are its rows).
 */
export function describeCacheStats(
  d: NeuronCacheStats,
  tokens: number,
  threads: number,
  what: "neuron cache" | "expert cache" = "neuron cache",
): string {
  const n = Math.max(1, tokens);
  const rows = d.hits + d.misses;
  return `${what} over ${tokens} tokens: ${(d.bytesRead / n / 2 ** 20).toFixed(2)} MiB read per token in ${(d.reads / n).toFixed(1)} reads, hit rate ${rows ? ((d.hits / rows) * 100).toFixed(1) : "100.0"} %, read time hidden ${(hiddenShare(d, threads) * 100).toFixed(1)} % (stall ${(d.stallMs / Math.max(1, threads) / n).toFixed(2)} ms per token per thread, reads in flight ${(d.ioBusyMs / n).toFixed(2)} ms per token)${d.ioErrors ? `, ${d.ioErrors} failed reads` : ""}`;
}

/** The memory limit of this process's cgroups (the backend's reader: v2 memory.max, v1 memory.limit_in_bytes). */
export { cgroupMemoryLimit };

const TEXT_MAX = 2 ** 30;

/**
 * A text file of up to 1 GiB as UTF-8: a regular file, `-` (standard input), or a pipe or character device
 * (`/dev/stdin`, `<(cmd)`, `/dev/null`), read until its end. A directory, a socket, a larger file or one with
 * NUL bytes (a binary file, `/dev/zero`) is refused with a clear message.
 * @throws InvalidArgumentError naming the file and the problem
 */
export function readTextFile(path: string): string {
  const stdin = path === "-";
  const st = stdin ? undefined : statInput(path, "text file");
  if (st?.isDirectory()) throw new InvalidArgumentError(`${path} is a directory, not a text file`);
  if (st && !st.isFile() && !st.isFIFO() && !st.isCharacterDevice())
    throw new InvalidArgumentError(`${path} is not a regular file, a pipe or standard input`);
  const what = stdin ? "standard input" : path;
  if (st?.isFile() && st.size > TEXT_MAX)
    throw new InvalidArgumentError(`${path} is ${st.size} bytes; text files up to 1 GiB are read`);
  // a pipe or device has no size: read it in pieces, up to the same limit
  const chunks: Buffer[] = [];
  let total = 0;
  let fd: number;
  try {
    fd = stdin ? 0 : openSync(path, "r");
  } catch (e) {
    throw new InvalidArgumentError(`cannot read text file ${path} (${(e as NodeJS.ErrnoException).code ?? String(e)})`);
  }
  try {
    for (;;) {
      const buf = Buffer.allocUnsafe(1 << 20);
      let n: number;
      try {
        n = readSync(fd, buf, 0, buf.length, null);
      } catch (e) {
        const code = (e as NodeJS.ErrnoException).code;
        if (code === "EAGAIN") {
          // a non-blocking standard input with nothing yet: wait 10 ms for more
          Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10);
          continue;
        }
        if (code === "EOF") break;
        throw new InvalidArgumentError(`cannot read ${what} (${code ?? String(e)})`);
      }
      if (n === 0) break;
      // a binary file (a model given as the text, say) would tokenize into millions of tokens
      if (buf.subarray(0, n).includes(0))
        throw new InvalidArgumentError(`${what} is not a text file (it contains NUL bytes)`);
      total += n;
      if (total > TEXT_MAX)
        throw new InvalidArgumentError(`${what} holds more than 1 GiB; text files up to 1 GiB are read`);
      chunks.push(buf.subarray(0, n));
    }
  } finally {
    if (!stdin) closeSync(fd);
  }
  return Buffer.concat(chunks).toString("utf8");
}

/**
 * A prompt file as llama.cpp's `-f` reads it ({@link readTextFile}, then one trailing newline removed:
 * common/arg.cpp's `-f` does `prompt.pop_back()` on a final `\n`), so `-f` and `-p` with the file's line give
 * the same tokens.
 */
export function readPromptFile(path: string): string {
  const text = readTextFile(path);
  return text.endsWith("\n") ? text.slice(0, -1) : text;
}

/** Refuses an output path that is one of the inputs (the input would be lost). */
export function checkOutputPath(out: string, ...inputs: (string | undefined)[]): void {
  // the same file by path, or through a symbolic link (the writers follow links) or another hard link
  const same = (a: string, b: string): boolean => {
    if (resolve(a) === resolve(b)) return true;
    try {
      const x = statSync(a);
      const y = statSync(b);
      return x.dev === y.dev && x.ino === y.ino;
    } catch {
      return false;
    }
  };
  for (const i of inputs) {
    if (i && same(i, out)) throw new InvalidArgumentError(`output ${out} is also an input; choose another path`);
  }
  // where it goes, before any work: a missing folder or a folder in place of the file is one line now, not
  // an ENOENT/EISDIR on a temporary file after the work is done
  if (/[/\\]$/.test(out)) throw new InvalidArgumentError(`output ${out} names a folder; give a file name`);
  const dir = dirname(resolve(out));
  let d: Stats;
  try {
    d = statSync(dir);
  } catch {
    throw new InvalidArgumentError(`output ${out}: the folder ${dir} does not exist`);
  }
  if (!d.isDirectory()) throw new InvalidArgumentError(`output ${out}: ${dir} is not a folder`);
  // the writers create a temporary file beside the output: a folder we cannot write is one line now too
  try {
    accessSync(dir, constants.W_OK);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new InvalidArgumentError(
      `output ${out}: cannot write to the folder ${dir} (${code === "EROFS" ? "read-only file system" : "permission denied"})`,
    );
  }
  let o: Stats | undefined;
  try {
    o = statSync(out);
  } catch {
    o = undefined;
  }
  if (o?.isDirectory()) throw new InvalidArgumentError(`output ${out} is a folder; give a file name`);
  // the writers rename a finished temporary file over the output: a FIFO or device there would be replaced
  if (o && !o.isFile())
    throw new InvalidArgumentError(`output ${out} is not a regular file (a FIFO or device?); give a file path`);
}

/**
 * Refuses to replace an existing file unless the user asked (`--force`), as gen-model does: a file the user
 * gave us is never overwritten by accident.
 * @throws InvalidArgumentError when `out` exists and `force` is not set
 */
export function refuseOverwrite(out: string, force: boolean | undefined): void {
  if (!force && existsSync(out)) throw new InvalidArgumentError(`${out} exists (use --force to overwrite)`);
}

/**
 * Like {@link refuseOverwrite}, except that an existing GGUF of `kind` (this command's own kind of output,
 * e.g. the activation statistics `profile` rewrites) is replaced without --force.
 * @returns true when an existing file of that kind will be replaced
 * @throws InvalidArgumentError "X exists and is a model, not …; use --force to overwrite" (or "X exists …")
 */
export function refuseOverwriteUnlessKind(out: string, force: boolean | undefined, kind: GgufFileKind): boolean {
  if (force || !existsSync(out)) return false;
  let found: GgufFileKind | undefined;
  try {
    found = ggufFileKind(openGguf(out));
  } catch {
    found = undefined; // not a GGUF at all
  }
  if (found === kind) return true;
  throw new InvalidArgumentError(
    `${out} exists${found ? ` and is ${found === "model" ? "a model" : `a ${found} file`}` : ""}, not ${kind === "activation-stats" ? "activation statistics" : kind}: choose another output or use --force to overwrite it`,
  );
}

/** Sampling options as llama.cpp names them (`--temp`, `--top-k`, …) with its defaults. */
export interface SamplingCliOptions {
  temp: number;
  topK: number;
  topP: number;
  minP: number;
  repeatPenalty: number;
  repeatLastN: number;
  presencePenalty: number;
  frequencyPenalty: number;
  seed?: number;
  ignoreEos?: boolean;
  stop?: string[];
}

/** --temp's help: a temperature ≤ 0 is greedy, as in llama.cpp. */
export const TEMP_HELP = "temperature (0 or less = greedy: always the most likely token, as llama.cpp)";

/** A seed: an integer in [0, 2^32), or -1 = random (llama.cpp). */
export const SEED_RULE: NumberRule = { min: 0, max: 2 ** 32 - 1, also: [-1], alsoMeans: "-1 = random" };

/**
 * Commander argument parser for run's and batched's -n/--n-predict: an integer ≥ 0, -1 (until end of text
 * or a full context) or llama.cpp's -2 (until the context is full), read as -1, which stops there too.
 */
export function nPredictArg() {
  const parse = int("n-predict", {
    min: 0,
    also: [-1, -2],
    alsoMeans: "-1 = until end of text or context full, -2 = until the context is full (the same here)",
  });
  return (v: string): number => {
    const n = parse(v);
    return n === -2 ? -1 : n;
  };
}

/**
 * Commander argument parser for -s/--seed: {@link SEED_RULE}, with 4294967295 read as −1 (random): it is
 * llama.cpp's LLAMA_DEFAULT_SEED, which its samplers replace by a random seed, as the server does here.
 */
export function seedArg() {
  const parse = int("seed", SEED_RULE);
  return (v: string): number => {
    const n = parse(v);
    return n === 0xffffffff ? -1 : n;
  };
}

/** --repeat-last-n: a window ≥ 0 (0 = off), or -1 = the context size n_ctx (llama.cpp). */
export const REPEAT_LAST_N_RULE: NumberRule = { min: 0, also: [-1], alsoMeans: "-1 = the context size" };

/** Adds the sampling options; `seedHelp` describes -s for the command. */
export function samplingOptions(cmd: Command, seedHelp = "RNG seed (default: random)"): Command {
  return (
    cmd
      .option("--temp <t>", TEMP_HELP, float("temp"), 0.8)
      // llama.cpp: k ≤ 0 turns top-k off
      .option("--top-k <k>", "top-k sampling (≤ 0 = off)", (v: string) => Math.max(0, int("top-k")(v)), 40)
      .option("--top-p <p>", "top-p sampling (1 = off)", float("top-p", { min: 0, max: 1 }), 0.95)
      .option("--min-p <p>", "min-p sampling (0 = off)", float("min-p", { min: 0, max: 1 }), 0.05)
      .option("--repeat-penalty <x>", "repetition penalty (1 = off)", float("repeat-penalty", { above: 0 }), 1)
      .option(
        "--repeat-last-n <n>",
        "tokens the penalties look back over (0 = off, -1 = the context size, as llama.cpp)",
        int("repeat-last-n", REPEAT_LAST_N_RULE),
        64,
      )
      .option("--presence-penalty <x>", "presence penalty", float("presence-penalty"), 0)
      .option("--frequency-penalty <x>", "frequency penalty", float("frequency-penalty"), 0)
      .option("-s, --seed <n>", `${seedHelp}; -1 (or 4294967295) = random`, seedArg())
      .option("--ignore-eos", "keep generating after end of text")
      .option("--stop <text...>", "stop strings")
  );
}

/**
 * The engine's generation options from the CLI's sampling options.
 * @param nCtx the session's context size, the penalty window of --repeat-last-n -1 (llama.cpp)
 */
export function generateOptionsFromCli(o: SamplingCliOptions, nCtx: number): GenerateOptions {
  return {
    temperature: o.temp,
    topK: o.topK,
    topP: o.topP,
    minP: o.minP,
    repeatPenalty: o.repeatPenalty,
    penaltyLastN: o.repeatLastN === -1 ? nCtx : o.repeatLastN,
    presencePenalty: o.presencePenalty,
    frequencyPenalty: o.frequencyPenalty,
    seed: o.seed === -1 ? undefined : o.seed, // llama.cpp: -1 = random
    ignoreEos: o.ignoreEos,
    stop: o.stop,
  };
}
