/**
 * llama.cpp built natively for this machine as the benchmark peer: its own `llama-bench` binary, built
 * once (`pnpm --filter @powerinfer/cli llama-cpp:build`, see build-llama-cpp.ts) from the llama.cpp
 * source that ships inside the `node-llama-cpp` package (`llama/gitRelease.bundle`), Release, CPU only,
 * GGML_NATIVE=ON, into a cache folder outside the repository. Nothing of llama.cpp is part of this
 * repository: this module only finds that build, runs its `llama-bench -o json` and reads the output.
 */
import { type ChildProcess, execFile, fork } from "node:child_process";
import { accessSync, constants, existsSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { homedir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

/** A one-line error about the native llama.cpp build or its llama-bench output. */
export class NativeLlamaCppError extends Error {
  override name = "NativeLlamaCppError";
}

/** Environment variable naming the native build's folder (same as `--llama-cpp-dir`). */
export const LLAMA_CPP_DIR_ENV = "POWERINFER_LLAMA_CPP_DIR";
/** The file, beside the binaries (`<dir>/build/bin/`), that records what was built. */
export const BUILD_INFO_FILE = "powerinfer-llama-cpp.json";
/** The targets the build script builds. */
export const NATIVE_TARGETS = ["llama-bench", "llama-simple", "llama-quantize", "llama-eval-callback"] as const;
/** How to build it, for messages. */
export const BUILD_HINT = "pnpm --filter @powerinfer/cli llama-cpp:build";

/** What the build script built, as recorded in BUILD_INFO_FILE. */
export interface NativeBuildInfo {
  schema: 1;
  /** node-llama-cpp's release tag of the bundled source (e.g. "v0.5.0"). */
  tag: string;
  /** Full commit of the bundled source. */
  commit: string;
  /** llama.cpp's build number as compiled in (commits counted in the clone; 1 for a squashed bundle). */
  buildNumber: number;
  /** Compiler as llama.cpp's build info names it (e.g. "GNU 12.2.0"). */
  compiler: string;
  /** Instruction-set extensions `-march=native` enables on the build machine (e.g. ["avx", "avx2", "fma"]). */
  isa: string[];
  /** CPU model of the build machine. */
  cpu: string;
  /** CMake configure arguments. */
  cmakeArgs: string[];
  targets: string[];
  /** The git bundle cloned. */
  bundle: string;
  /** ISO time the build finished. */
  builtAt: string;
  /** Wall-clock seconds of configure + build (0 when only re-checked). */
  buildSeconds: number;
}

/** The native peer, found and usable. */
export interface NativeLlamaCpp {
  kind: "native";
  dir: string;
  /** Path of the llama-bench binary. */
  llamaBench: string;
  build: NativeBuildInfo;
  /** Row label, e.g. "llama.cpp v0.5.0 de3ff81 native (avx2)". */
  label: string;
}

/** The llama.cpp source bundled with node-llama-cpp: the git bundle and its release tag. */
export function bundledLlamaCppSource(): { bundle: string; tag: string } | { unavailable: string } {
  let root: string | undefined;
  try {
    // its exports map hides package.json: resolve the entry point and walk up to the package folder
    const require = createRequire(import.meta.url);
    let dir = dirname(require.resolve("node-llama-cpp"));
    for (let i = 0; i < 6 && !root; i++, dir = dirname(dir)) {
      try {
        if (JSON.parse(readFileSync(join(dir, "package.json"), "utf8")).name === "node-llama-cpp") root = dir;
      } catch {
        // no package.json here: go up
      }
    }
  } catch (e) {
    return { unavailable: `node-llama-cpp is not installed (${(e as Error).message.split("\n")[0]})` };
  }
  if (!root) return { unavailable: "node-llama-cpp's package folder was not found above its entry point" };
  const bundle = join(root, "llama", "gitRelease.bundle");
  if (!existsSync(bundle)) return { unavailable: `node-llama-cpp has no llama.cpp source bundle at ${bundle}` };
  let tag = "bundled";
  for (const f of ["llama.cpp.info.json", "binariesGithubRelease.json"]) {
    try {
      const j = JSON.parse(readFileSync(join(root, "llama", f), "utf8")) as { tag?: unknown; release?: unknown };
      const t = typeof j.tag === "string" ? j.tag : typeof j.release === "string" ? j.release : undefined;
      if (t && /^[\w.-]+$/.test(t)) {
        tag = t;
        break;
      }
    } catch {
      // try the next file
    }
  }
  return { bundle, tag };
}

/** `$XDG_CACHE_HOME` or `~/.cache`, then `powerinfer-ts/llama.cpp/<tag>`. */
export function defaultLlamaCppDir(tag: string, env: NodeJS.ProcessEnv = process.env): string {
  const cache = env.XDG_CACHE_HOME || join(homedir(), ".cache");
  return join(cache, "powerinfer-ts", "llama.cpp", tag);
}

/** The native build's folder: the given one, else `$POWERINFER_LLAMA_CPP_DIR`, else the default cache folder. */
export function resolveLlamaCppDir(explicit?: string, env: NodeJS.ProcessEnv = process.env): string {
  if (explicit) return resolve(explicit);
  if (env[LLAMA_CPP_DIR_ENV]) return resolve(env[LLAMA_CPP_DIR_ENV]);
  const src = bundledLlamaCppSource();
  return defaultLlamaCppDir("unavailable" in src ? "bundled" : src.tag, env);
}

/** Folder of the binaries and the build info inside a native build folder. */
export const binDir = (dir: string) => join(dir, "build", "bin");

/** "llama.cpp v0.5.0 de3ff81 native (avx2)": tag, short commit, and the widest SIMD extension enabled. */
export function nativeLabel(b: Pick<NativeBuildInfo, "tag" | "commit" | "isa">): string {
  const order = ["avx512f", "avx2", "avx", "sse3"];
  const simd = order.find((x) => b.isa.includes(x));
  return `llama.cpp ${b.tag} ${b.commit.slice(0, 7)} native${simd ? ` (${simd})` : ""}`;
}

/** Validates a parsed BUILD_INFO_FILE; throws NativeLlamaCppError naming the first bad field. */
export function parseBuildInfo(text: string, where = BUILD_INFO_FILE): NativeBuildInfo {
  let j: unknown;
  try {
    j = JSON.parse(text);
  } catch (e) {
    throw new NativeLlamaCppError(`${where}: not JSON (${(e as Error).message.split("\n")[0]})`);
  }
  if (typeof j !== "object" || j === null || Array.isArray(j)) throw new NativeLlamaCppError(`${where}: not an object`);
  const o = j as Record<string, unknown>;
  const str = (k: string) => {
    if (typeof o[k] !== "string") throw new NativeLlamaCppError(`${where}: "${k}" must be a string`);
    return o[k] as string;
  };
  const strs = (k: string) => {
    const v = o[k];
    if (!Array.isArray(v) || !v.every((x) => typeof x === "string"))
      throw new NativeLlamaCppError(`${where}: "${k}" must be an array of strings`);
    return v as string[];
  };
  const num = (k: string) => {
    if (typeof o[k] !== "number" || !Number.isFinite(o[k]))
      throw new NativeLlamaCppError(`${where}: "${k}" must be a number`);
    return o[k] as number;
  };
  if (o.schema !== 1) throw new NativeLlamaCppError(`${where}: unknown schema ${JSON.stringify(o.schema)}`);
  return {
    schema: 1,
    tag: str("tag"),
    commit: str("commit"),
    buildNumber: num("buildNumber"),
    compiler: str("compiler"),
    isa: strs("isa"),
    cpu: str("cpu"),
    cmakeArgs: strs("cmakeArgs"),
    targets: strs("targets"),
    bundle: str("bundle"),
    builtAt: str("builtAt"),
    buildSeconds: num("buildSeconds"),
  };
}

/**
 * Finds the native build in `dir` (see resolveLlamaCppDir), or says why it cannot be used and how to
 * build it (never throws).
 */
export function findNativeLlamaCpp(dir: string): NativeLlamaCpp | { unavailable: string } {
  const bin = binDir(dir);
  const infoPath = join(bin, BUILD_INFO_FILE);
  const llamaBench = join(bin, "llama-bench");
  if (!existsSync(infoPath) || !existsSync(llamaBench)) {
    return { unavailable: `no native llama.cpp build in ${dir} (build it with \`${BUILD_HINT}\`)` };
  }
  try {
    accessSync(llamaBench, constants.X_OK);
  } catch {
    return { unavailable: `${llamaBench} is not executable (rebuild with \`${BUILD_HINT}\`)` };
  }
  try {
    const build = parseBuildInfo(readFileSync(infoPath, "utf8"), infoPath);
    return { kind: "native", dir, llamaBench, build, label: nativeLabel(build) };
  } catch (e) {
    return { unavailable: `${(e as Error).message} (rebuild with \`${BUILD_HINT}\`)` };
  }
}

/** One result of `llama-bench -o json` (the fields this harness reads). */
export interface LlamaBenchRow {
  build_commit: string;
  build_number: number;
  cpu_info: string;
  backends: string;
  model_filename: string;
  model_type: string;
  model_size: number;
  model_n_params: number;
  n_batch: number;
  n_ubatch: number;
  n_threads: number;
  /** llama-bench's flash-attention setting: its number -1/0/1 as "auto"/"off"/"on", else as printed. */
  flash_attn: string;
  n_prompt: number;
  n_gen: number;
  n_depth: number;
  /** Nanoseconds per repetition (the whole test: all n_prompt or n_gen tokens). */
  samples_ns: number[];
  /** Tokens per second per repetition. */
  samples_ts: number[];
  avg_ns: number;
  stddev_ns: number;
  avg_ts: number;
  stddev_ts: number;
}

/**
 * Parses llama-bench's `-o json` output (a JSON array with one object per test); throws
 * NativeLlamaCppError naming the row and field when it is not what llama-bench writes.
 */
export function parseLlamaBenchJson(text: string): LlamaBenchRow[] {
  let j: unknown;
  try {
    j = JSON.parse(text);
  } catch (e) {
    const head = text.trim().slice(0, 60);
    throw new NativeLlamaCppError(
      `llama-bench output is not JSON (${(e as Error).message.split("\n")[0]}; starts with ${JSON.stringify(head)})`,
    );
  }
  if (!Array.isArray(j)) throw new NativeLlamaCppError("llama-bench output is not a JSON array");
  return j.map((x, i) => {
    if (typeof x !== "object" || x === null) throw new NativeLlamaCppError(`llama-bench row ${i} is not an object`);
    const o = x as Record<string, unknown>;
    const bad = (k: string, what: string) => new NativeLlamaCppError(`llama-bench row ${i}: "${k}" must be ${what}`);
    const str = (k: string) => {
      if (typeof o[k] !== "string") throw bad(k, "a string");
      return o[k] as string;
    };
    const num = (k: string) => {
      if (typeof o[k] !== "number" || !Number.isFinite(o[k])) throw bad(k, "a number");
      return o[k] as number;
    };
    const nums = (k: string) => {
      const v = o[k];
      if (!Array.isArray(v) || !v.every((n) => typeof n === "number" && Number.isFinite(n)))
        throw bad(k, "an array of numbers");
      return v as number[];
    };
    const fa = o.flash_attn;
    if (typeof fa !== "string" && typeof fa !== "number" && typeof fa !== "boolean")
      throw bad("flash_attn", "a string, number or boolean");
    const row: LlamaBenchRow = {
      build_commit: str("build_commit"),
      build_number: num("build_number"),
      cpu_info: str("cpu_info"),
      backends: str("backends"),
      model_filename: str("model_filename"),
      model_type: str("model_type"),
      model_size: num("model_size"),
      model_n_params: num("model_n_params"),
      n_batch: num("n_batch"),
      n_ubatch: num("n_ubatch"),
      n_threads: num("n_threads"),
      flash_attn:
        typeof fa === "number"
          ? (({ "-1": "auto", "0": "off", "1": "on" } as Record<string, string>)[fa] ?? String(fa))
          : String(fa),
      n_prompt: num("n_prompt"),
      n_gen: num("n_gen"),
      n_depth: typeof o.n_depth === "number" ? o.n_depth : 0,
      samples_ns: nums("samples_ns"),
      samples_ts: nums("samples_ts"),
      avg_ns: num("avg_ns"),
      stddev_ns: num("stddev_ns"),
      avg_ts: num("avg_ts"),
      stddev_ts: num("stddev_ts"),
    };
    if (row.samples_ns.length === 0) throw bad("samples_ns", "non-empty");
    return row;
  });
}

/** What one llama-bench test asks for: ppN (`-p N -n 0`) or tgN (`-p 0 -n N`). */
export interface LlamaBenchTest {
  kind: "pp" | "tg";
  n: number;
  threads: number;
  /** Measured repetitions (`-r`); llama-bench runs its own warm-up before them. */
  repetitions: number;
  /** Tokens in the KV cache before the test (`-d`, passed only when > 0). Default 0. */
  depth?: number;
}

/** The llama-bench arguments for one test on one file. */
export function llamaBenchArgs(model: string, t: LlamaBenchTest): string[] {
  return [
    "-m",
    model,
    "-p",
    String(t.kind === "pp" ? t.n : 0),
    "-n",
    String(t.kind === "tg" ? t.n : 0),
    "-t",
    String(t.threads),
    "-r",
    String(t.repetitions),
    ...(t.depth ? ["-d", String(t.depth)] : []),
    "-o",
    "json",
  ];
}

type ExecDone = (err: { message: string } | null, stdout: string, stderr: string) => void;

let spawner: { child: ChildProcess; pending: Map<number, ExecDone>; next: number } | undefined;

/**
 * Starts a small process that runs llama-bench for this one, so that the measuring process itself never
 * forks while it holds a model. A fork write-protects the parent's writable memory, and every page it
 * writes afterwards (the JavaScript heap, buffers) takes a fault. With a fork per llama-bench round, our
 * decode on the 4-layer SmallThinker-4B slice ran ~10 % slower. Our own allocations from 2 MiB up are
 * MADV_DONTFORK, but the JavaScript heap is not. Call it before loading models; a no-op when the
 * spawner script is missing (a bundled CLI) or already running. llama-bench then runs as before.
 * @param script the compiled spawner (default: llama-bench-spawner.js beside this module)
 * @returns the spawner's pid, or undefined when there is no spawner script
 */
export function startLlamaBenchSpawner(
  script = fileURLToPath(new URL("./llama-bench-spawner.js", import.meta.url)),
): number | undefined {
  if (spawner) return spawner.child.pid;
  if (!existsSync(script)) return undefined;
  const child = fork(script, [], { stdio: ["ignore", "ignore", "inherit", "ipc"] });
  const s = { child, pending: new Map<number, ExecDone>(), next: 0 };
  child.on("message", (m: { id: number; error: string | null; stdout: string; stderr: string }) => {
    const done = s.pending.get(m.id);
    s.pending.delete(m.id);
    done?.(m.error === null ? null : { message: m.error }, m.stdout, m.stderr);
  });
  child.on("exit", () => {
    if (spawner === s) spawner = undefined;
    for (const done of s.pending.values()) done({ message: "the llama-bench spawner process exited" }, "", "");
    s.pending.clear();
  });
  // neither the process nor its channel keeps the bench alive
  child.unref();
  child.channel?.unref();
  spawner = s;
  return child.pid;
}

/** Stops the process of startLlamaBenchSpawner (runs still pending get an error). */
export function stopLlamaBenchSpawner(): void {
  const s = spawner;
  spawner = undefined;
  if (s) {
    s.child.kill();
    for (const done of s.pending.values()) done({ message: "the llama-bench spawner was stopped" }, "", "");
    s.pending.clear();
  }
}

/** Runs a program to its end, through the spawner process when one runs (execFile's callback otherwise). */
function execProgram(file: string, args: string[], done: ExecDone): void {
  const maxBuffer = 64 * 2 ** 20;
  const s = spawner;
  if (!s) {
    execFile(file, args, { maxBuffer, encoding: "utf8" }, (err, stdout, stderr) => done(err, stdout, stderr));
    return;
  }
  const id = s.next++;
  // a pending run keeps the bench alive until it answers
  s.child.channel?.ref();
  s.pending.set(id, (e, out, errOut) => {
    if (s.pending.size === 0) s.child.channel?.unref();
    done(e, out, errOut);
  });
  s.child.send({ id, file, args, maxBuffer }, (err) => {
    const pending = s.pending.get(id);
    if (err && pending) {
      s.pending.delete(id);
      pending({ message: err.message }, "", "");
    }
  });
}

/**
 * Runs the native llama-bench once for one test and returns its single result row; throws
 * NativeLlamaCppError with llama-bench's last stderr line when it fails.
 */
export function runLlamaBench(peer: NativeLlamaCpp, model: string, t: LlamaBenchTest): Promise<LlamaBenchRow> {
  const args = llamaBenchArgs(model, t);
  return new Promise((resolvePromise, reject) => {
    execProgram(peer.llamaBench, args, (err, stdout, stderr) => {
      if (err) {
        const last = stderr.trim().split("\n").filter(Boolean).at(-1) ?? err.message.split("\n")[0];
        reject(new NativeLlamaCppError(`llama-bench ${t.kind}${t.n} on ${model} failed: ${last}`));
        return;
      }
      try {
        const rows = parseLlamaBenchJson(stdout);
        if (rows.length !== 1) throw new NativeLlamaCppError(`llama-bench printed ${rows.length} rows, expected 1`);
        resolvePromise(rows[0]!);
      } catch (e) {
        reject(e);
      }
    });
  });
}
