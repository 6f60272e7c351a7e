/**
 * `powerinfer bench -m FILE [-m FILE…] [--twin GGUF…] [-p 512] [-n 128] [-t 2] [-r 5] [--sparse …] [--json]`:
 * llama-bench-style speed comparison of powerinfer-ts (each FFN mode) and llama.cpp on the same files,
 * with bytes of weights per token and the share of the machine's memory bandwidth for every decode row.
 * The llama.cpp peer is the native build's llama-bench when it has been built (`--llama-cpp-dir`, see
 * native-llama-cpp.ts), else node-llama-cpp's slower prebuilt binary (`--llama-cpp-peer`).
 */
import { availableParallelism } from "node:os";
import { EngineError, type SparseMode } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { formatHeader, formatJson, formatMarkdown } from "../bench/format.js";
import { type BenchOptions, type LlamaCppPeerChoice, runBench } from "../bench/harness.js";
import { LLAMA_CPP_DIR_ENV } from "../bench/native-llama-cpp.js";
import { action } from "../errors.js";
import { checkInputFile, checkIoEnv, float, int, MMAP_HELP, REPACK_HELP } from "./common.js";

/**
 * "512,1024" → [512, 1024] (llama-bench's list syntax); with `none`, "" or "0" → [] (no such tests).
 * @throws InvalidArgumentError on anything else than decimal integers ≥ min
 */
/** Values a list option may expand to (a range like 1-1000000 would otherwise build a huge list). */
const MAX_LIST = 1000;

/**
 * A llama-bench-style list option: comma-separated values, each a number or a range (llama-bench's
 * syntax: `first-last` in steps of 1, `first-last+step`, or `first-last*mult` — first, first·mult, … up
 * to last), every value in [min, max]; with `none`, "0" or "" means no tests; with `minusOne`, "-1" stands for
 * its value (clamped to [min, max]: -t -1 is the CPU count).
 * @throws InvalidArgumentError naming the option, the rule and the value
 */
export function intList(name: string, min = 1, none = true, max = Number.MAX_SAFE_INTEGER, minusOne?: () => number) {
  const rule = `${name} takes integers from ${min} to ${max === Number.MAX_SAFE_INTEGER ? "2^53" : max}${none ? " (or 0 for none)" : ""}, comma-separated, or ranges first-last[+step|*mult]${minusOne ? "; -1 is the CPU count" : ""}`;
  // a repeated option adds to the list, as llama-bench's do (commander passes the previous value; the
  // option's default array is replaced, not extended)
  return (v: string, previous?: number[]): number[] => {
    const prior = previous && !DEFAULTS.has(previous) ? previous : [];
    if (none && (v.trim() === "" || v.trim() === "0")) return prior;
    const out = [...prior];
    for (const x of v.split(",")) {
      if (minusOne && x.trim() === "-1") {
        out.push(Math.min(max, Math.max(min, minusOne())));
        continue;
      }
      const m = /^(\d+)(?:-(\d+)(?:([+*])(\d+))?)?$/.exec(x.trim());
      const nums = m ? [m[1], m[2], m[4]].map((d) => (d === undefined ? undefined : Number(d))) : [];
      const [first, last, by] = nums;
      const bad = (why: string) => new InvalidArgumentError(`${rule}; got "${v}"${why ? ` (${why})` : ""}`);
      if (!m || nums.some((n) => n !== undefined && !Number.isSafeInteger(n))) throw bad("");
      const check = (n: number) => {
        if (n < min || n > max) throw bad(`${n} is out of range`);
        return n;
      };
      if (last === undefined) {
        out.push(check(first!));
        continue;
      }
      if (last < first!) throw bad(`range ${first}-${last} runs backwards`);
      const op = m[3] ?? "+";
      const step = by ?? 1;
      if (op === "+" ? step < 1 : step < 2 || first === 0) throw bad(`${op}${step} does not advance from ${first}`);
      for (let n = first!; n <= last; n = op === "+" ? n + step : n * step) {
        if (out.length >= MAX_LIST) throw bad(`more than ${MAX_LIST} values`);
        out.push(check(n));
      }
    }
    return out;
  };
}

/** The list options' defaults (a repeated option starts from [] instead of these). */
const DEFAULTS = new Set<number[]>();
function listDefault(v: number[]): number[] {
  DEFAULTS.add(v);
  return v;
}

export function sparseList(v: string): "auto" | SparseMode[] {
  if (v === "auto") return "auto";
  return v.split(",").map((x) => {
    const m = x.trim();
    if (m !== "off" && m !== "predictor" && m !== "oracle") {
      throw new InvalidArgumentError(`--sparse must be auto or a list of off, predictor, oracle; got "${v}"`);
    }
    return m;
  });
}

const collect = (v: string, prev: string[] = []) => [...prev, v];

/** "auto" | "native" | "prebuilt" (--llama-cpp-peer). */
export function peerChoice(v: string): LlamaCppPeerChoice {
  if (v === "auto" || v === "native" || v === "prebuilt") return v;
  throw new InvalidArgumentError(`--llama-cpp-peer must be auto, native or prebuilt; got "${v}"`);
}

export interface BenchCliOptions {
  model: string[];
  twin?: string[];
  nPrompt: number[];
  nGen: number[];
  nDepth?: number[];
  threads: number[];
  repetitions: number;
  sparse: "auto" | SparseMode[];
  llamaCpp: boolean;
  llamaCppPeer: LlamaCppPeerChoice;
  llamaCppDir?: string;
  ours: boolean;
  bandwidthMib: number;
  seed: number;
  json?: boolean;
  quiet?: boolean;
  /** GiB (see run --ram-budget). */
  ramBudget?: number;
  /** Hybrid rows: the device backend and its budget in GiB. */
  deviceBackend?: string;
  vramBudget?: number;
  /** false with --no-repack. */
  repack?: boolean;
  /** --mmap. */
  mmap?: boolean;
}

export function benchOptions(o: BenchCliOptions, log?: (line: string) => void): BenchOptions {
  if (o.twin && o.twin.length > o.model.length) throw new InvalidArgumentError("more --twin files than models");
  if (o.repetitions < 1) throw new InvalidArgumentError("--repetitions must be ≥ 1");
  checkIoEnv();
  return {
    models: o.model.map((path, i) => ({ path, twin: o.twin?.[i] || undefined })),
    nPrompt: o.nPrompt,
    nGen: o.nGen,
    nDepth: o.nDepth,
    threads: o.threads,
    repetitions: o.repetitions,
    sparse: o.sparse,
    llamaCpp: o.llamaCpp,
    llamaCppPeer: o.llamaCppPeer,
    llamaCppDir: o.llamaCppDir,
    ours: o.ours,
    bandwidthMiB: o.bandwidthMib,
    seed: o.seed,
    repack: o.repack ?? true,
    mmap: o.mmap ?? false,
    ramBudget: o.ramBudget !== undefined ? o.ramBudget * 2 ** 30 : undefined,
    device:
      o.deviceBackend !== undefined || o.vramBudget !== undefined
        ? {
            backend: o.deviceBackend ?? "auto",
            budgetBytes: o.vramBudget === undefined ? undefined : Math.floor(o.vramBudget * 2 ** 30),
          }
        : undefined,
    log,
  };
}

export function register(program: Command): void {
  program
    .command("bench")
    .description(
      "llama-bench-style speed comparison with llama.cpp (native llama-bench build, else node-llama-cpp), bytes per token and bandwidth share",
    )
    .requiredOption("-m, --model <file>", "model file (repeat for several)", collect)
    .option(
      "--twin <file>",
      "GGUF with the same weights as the -m file at the same position (a PWRI file, or an expert model with predictors), for llama.cpp and our dense mode",
      collect,
    )
    .option(
      "-p, --n-prompt <n,…>",
      "prompt sizes (ppN tests; 0 for none; lists and llama-bench ranges, e.g. 64-512*2 or 0-4096+1024)",
      intList("--n-prompt"),
      listDefault([512]),
    )
    .option("-n, --n-gen <n,…>", "generated tokens (tgN tests; 0 for none)", intList("--n-gen"), listDefault([128]))
    .option(
      "-d, --n-depth <n,…>",
      "tokens already in the KV cache when each test starts (llama-bench's -d; the prefill is not timed)",
      intList("--n-depth", 0, false),
      listDefault([0]),
    )
    .option(
      "-t, --threads <n,…>",
      "thread counts (-1: the CPU count)",
      intList("--threads", 1, false, 512, availableParallelism),
      listDefault([2]),
    )
    .option("-r, --repetitions <n>", "measured repetitions after one warm-up", int("repetitions", { min: 1 }), 5)
    .option(
      "--sparse <modes>",
      "our FFN modes: auto (off, plus predictor when the file has predictors) or a list of off, predictor, oracle",
      sparseList,
      "auto",
    )
    .option("--no-llama-cpp", "do not run llama.cpp")
    .option(
      "--llama-cpp-peer <which>",
      "auto (the native build when there is one, else node-llama-cpp's slower prebuilt binary), native or prebuilt",
      peerChoice,
      "auto",
    )
    .option(
      "--llama-cpp-dir <dir>",
      `native llama.cpp build folder (default: $${LLAMA_CPP_DIR_ENV}, else ~/.cache/powerinfer-ts/llama.cpp/<tag>)`,
    )
    .option("--no-ours", "do not run powerinfer-ts")
    .option(
      "--bandwidth-mib <n>",
      "MiB read by the memory-bandwidth probe (0: skip)",
      int("bandwidth-mib", { min: 0 }),
      512,
    )
    .option("--seed <n>", "seed of the random token ids", int("seed", { min: 0, max: 2 ** 32 - 1 }), 1)
    .option(
      "--ram-budget <GiB>",
      "our sparse modes (and every mode of a routed-expert model): GiB held for weights + the neuron/expert cache (rows beyond it are read from the file on demand; see run --ram-budget); a dense FFN runs without it",
      float("ram-budget", { above: 0, max: 2 ** 20 }),
    )
    .option(
      "--device-backend <name>",
      'hybrid rows too: hot neurons and attention layers on this backend ("auto": a usable GPU; "cpu" stands in), planned from <model>.activations.gguf',
    )
    .option(
      "--vram-budget <GiB>",
      "device memory for the hybrid rows in GiB (default: 90 % of the device's free memory)",
      float("vram-budget", { min: 0, max: 2 ** 20 }),
    )
    .option("--no-repack", REPACK_HELP)
    .option("--mmap", MMAP_HELP)
    .option("--json", "print llama-bench-style JSON rows")
    .option("-q, --quiet", "no progress lines on stderr")
    .action(
      action(async (o: BenchCliOptions) => {
        if (o.nPrompt.length === 0 && o.nGen.length === 0)
          throw new InvalidArgumentError("nothing to measure: -p 0 and -n 0 leave no test");
        if (!o.llamaCpp && !o.ours) throw new InvalidArgumentError("nothing to measure: --no-llama-cpp and --no-ours");
        for (const m of [...o.model, ...(o.twin ?? []).filter(Boolean)]) checkInputFile(m);
        const log = o.quiet ? undefined : (line: string) => process.stderr.write(`bench: ${line}\n`);
        const res = await runBench(benchOptions(o, log));
        if (o.json) {
          process.stdout.write(`${formatJson(res)}\n`);
          for (const n of res.notes) process.stderr.write(`bench: note: ${n}\n`);
        } else {
          const cmd = `powerinfer ${process.argv.slice(2).join(" ")}`;
          process.stdout.write(`${formatHeader(res, cmd)}\n\n${formatMarkdown(res)}\n`);
        }
        // every row skipped (each with its note): a failure, not an empty result
        if (res.rows.length === 0)
          throw new EngineError("BAD_INPUT", "no test ran: every row was skipped (see the notes above)");
      }),
    );
}
