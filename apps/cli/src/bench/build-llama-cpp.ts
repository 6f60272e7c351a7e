/**
 * `pnpm --filter @powerinfer/cli llama-cpp:build [--dir DIR] [--jobs N] [--force]`: builds the native
 * llama.cpp benchmark peer once, from the source bundled in node-llama-cpp (`llama/gitRelease.bundle`,
 * no network): `git clone` into DIR/src, CMake Release with GGML_NATIVE=ON, CPU only (no CUDA, HIP,
 * Vulkan, Metal, SYCL, OpenCL, RPC; no OpenSSL), static libraries, and only the targets
 * llama-bench, llama-simple, llama-quantize and llama-eval-callback, into DIR/build/bin, where
 * `powerinfer-llama-cpp.json` records the tag, commit, build number, compiler, the ISA that
 * `-march=native` enables, and the CMake arguments.
 *
 * DIR: `--dir`, else `$POWERINFER_LLAMA_CPP_DIR`, else `~/.cache/powerinfer-ts/llama.cpp/<tag>`
 * (`$XDG_CACHE_HOME` replaces `~/.cache`). A second run with a finished build of the same commit and
 * arguments only says where it is (`--force` rebuilds; an interrupted build resumes incrementally).
 */
import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { availableParallelism } from "node:os";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { cpuModelName } from "@powerinfer/backend-cpu-avx2";
import { Command } from "commander";
import { describeError } from "../errors.js";
import {
  BUILD_INFO_FILE,
  binDir,
  bundledLlamaCppSource,
  defaultLlamaCppDir,
  findNativeLlamaCpp,
  LLAMA_CPP_DIR_ENV,
  NATIVE_TARGETS,
  type NativeBuildInfo,
  NativeLlamaCppError,
  nativeLabel,
} from "./native-llama-cpp.js";

/** CMake configure arguments (besides -S/-B/-G): Release, native ISA, CPU only, static, no network code. */
export const CMAKE_ARGS = [
  "-DCMAKE_BUILD_TYPE=Release",
  "-DGGML_NATIVE=ON",
  "-DGGML_CUDA=OFF",
  "-DGGML_HIP=OFF",
  "-DGGML_VULKAN=OFF",
  "-DGGML_METAL=OFF",
  "-DGGML_SYCL=OFF",
  "-DGGML_OPENCL=OFF",
  "-DGGML_RPC=OFF",
  "-DLLAMA_OPENSSL=OFF",
  "-DLLAMA_BUILD_TESTS=OFF",
  "-DLLAMA_BUILD_SERVER=OFF",
  "-DLLAMA_BUILD_APP=OFF",
  "-DBUILD_SHARED_LIBS=OFF",
];

const log = (line: string) => process.stderr.write(`llama-cpp:build: ${line}\n`);

function run(cmd: string, args: string[], cwd?: string): void {
  const r = spawnSync(cmd, args, { cwd, stdio: ["ignore", "inherit", "inherit"] });
  if (r.error) throw new NativeLlamaCppError(`${cmd} could not be started (${r.error.message})`);
  if (r.status !== 0) throw new NativeLlamaCppError(`${cmd} ${args.slice(0, 3).join(" ")} … exited with ${r.status}`);
}

function capture(cmd: string, args: string[], cwd?: string): string {
  try {
    return execFileSync(cmd, args, { cwd, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  } catch (e) {
    const err = e as { stderr?: string; message: string };
    const why = (err.stderr ?? "").trim().split("\n").at(-1) || err.message.split("\n")[0];
    throw new NativeLlamaCppError(`${cmd} ${args.join(" ")} failed: ${why}`);
  }
}

/** Lower-case ISA extensions the compiler enables with -march=native (from its predefined macros). */
export function nativeIsa(compiler: string): string[] {
  const macros = capture(compiler, ["-march=native", "-dM", "-E", "-x", "c++", "/dev/null"]);
  const found = new Set<string>();
  for (const m of macros.matchAll(/^#define __(AVX\w*|AMX\w*|FMA|F16C|BMI2|SSE3|SSSE3|SSE4_1|SSE4_2)__ /gm)) {
    found.add(m[1]!.toLowerCase());
  }
  return [...found].sort();
}

/** Build number, short commit and compiler from llama.cpp's generated build-info.cpp. */
export function parseBuildInfoCpp(text: string): { buildNumber: number; commit: string; compiler: string } {
  const num = /LLAMA_BUILD_NUMBER\s*=\s*(\d+)/.exec(text)?.[1];
  const commit = /LLAMA_COMMIT\s*=\s*"([^"]*)"/.exec(text)?.[1];
  const compiler = /LLAMA_COMPILER\s*=\s*"([^"]*)"/.exec(text)?.[1];
  if (num === undefined || commit === undefined || compiler === undefined)
    throw new NativeLlamaCppError(
      "build/common/build-info.cpp lacks LLAMA_BUILD_NUMBER, LLAMA_COMMIT or LLAMA_COMPILER",
    );
  return { buildNumber: Number(num), commit, compiler };
}

/**
 * Compiler flags that keep ggml's AMX kernels out of the build. On the 2-vCPU Intel Xeon VM this project
 * measured on (AMX advertised and usable after arch_prctl), llama.cpp's AMX path (ggml-cpu/amx, the
 * prompt GEMM of Q4_0/Q8_0 weights) stops with an illegal instruction (`tileloadd` on a thread without a
 * loaded tile configuration) in llama-bench pp512, so the peer is built without it unless `--amx`.
 */
export const NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";

/** CMAKE_ARGS plus, when -march=native enables AMX and `amx` is false, flags that turn it off. */
export function cmakeArgsFor(nativeIsaList: readonly string[], amx: boolean): string[] {
  if (amx || !nativeIsaList.some((f) => f.startsWith("amx"))) return [...CMAKE_ARGS];
  return [...CMAKE_ARGS, `-DCMAKE_C_FLAGS=${NO_AMX_FLAGS}`, `-DCMAKE_CXX_FLAGS=${NO_AMX_FLAGS}`];
}

interface Options {
  dir?: string;
  jobs: number;
  force?: boolean;
  amx?: boolean;
}

function main(): void {
  const o = new Command("llama-cpp:build")
    .description("build llama.cpp natively (CPU, Release, GGML_NATIVE) from node-llama-cpp's bundled source")
    .option("--dir <dir>", `build folder (default: $${LLAMA_CPP_DIR_ENV}, else ~/.cache/powerinfer-ts/llama.cpp/<tag>)`)
    .option("-j, --jobs <n>", "parallel compile jobs", (v) => Number(v), availableParallelism())
    .option("--force", "delete the folder's build and build again")
    .option("--amx", "keep ggml's AMX kernels when the CPU has AMX (default: built without them; see NO_AMX_FLAGS)")
    // `pnpm … llama-cpp:build -- …` hands the script a literal "--" first
    .parse(process.argv.filter((a, i) => !(i === 2 && a === "--")))
    .opts<Options>();
  if (!Number.isInteger(o.jobs) || o.jobs < 1) throw new NativeLlamaCppError(`--jobs must be an integer ≥ 1`);
  const src = bundledLlamaCppSource();
  if ("unavailable" in src) throw new NativeLlamaCppError(src.unavailable);
  const dir = o.dir ?? process.env[LLAMA_CPP_DIR_ENV] ?? defaultLlamaCppDir(src.tag);
  const head = capture("git", ["bundle", "list-heads", src.bundle]).trim().split(/\s+/)[0] ?? "";
  if (!/^[0-9a-f]{40}$/.test(head)) throw new NativeLlamaCppError(`${src.bundle}: no head commit in the bundle`);

  const cmakeArgs = cmakeArgsFor(nativeIsa(process.env.CXX ?? "c++"), o.amx ?? false);
  const existing = findNativeLlamaCpp(dir);
  if (!o.force && !("unavailable" in existing)) {
    const b = existing.build;
    const sameArgs = b.cmakeArgs.join(" ") === cmakeArgs.join(" ");
    const allTargets = NATIVE_TARGETS.every((t) => existsSync(join(binDir(dir), t)));
    if (b.commit === head && sameArgs && allTargets) {
      log(`up to date: ${existing.label} in ${binDir(dir)} (built ${b.builtAt}; --force rebuilds)`);
      process.stdout.write(`${binDir(dir)}\n`);
      return;
    }
    log(`the build in ${dir} is for another commit or other arguments: building again`);
  }
  const srcDir = join(dir, "src");
  const buildDir = join(dir, "build");
  if (o.force) rmSync(buildDir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  if (existsSync(join(srcDir, ".git"))) {
    const have = capture("git", ["rev-parse", "HEAD"], srcDir).trim();
    if (have !== head) {
      log(`${srcDir} holds ${have.slice(0, 7)}, not ${head.slice(0, 7)}: cloning again`);
      rmSync(srcDir, { recursive: true, force: true });
      rmSync(buildDir, { recursive: true, force: true });
    }
  } else if (existsSync(srcDir)) {
    rmSync(srcDir, { recursive: true, force: true });
  }
  if (!existsSync(srcDir)) {
    log(`cloning ${src.bundle} (${src.tag}, ${head.slice(0, 7)}) into ${srcDir}`);
    run("git", ["-c", "advice.detachedHead=false", "clone", "--quiet", src.bundle, srcDir]);
    run("git", ["-c", "advice.detachedHead=false", "checkout", "--quiet", head], srcDir);
  }
  const t0 = performance.now();
  let generator: string[] = [];
  try {
    capture("ninja", ["--version"]);
    generator = ["-G", "Ninja"];
  } catch {
    // cmake's default generator (make)
  }
  const cache = join(buildDir, "CMakeCache.txt");
  if (generator.length && existsSync(cache) && !/CMAKE_GENERATOR:INTERNAL=Ninja/.test(readFileSync(cache, "utf8"))) {
    generator = []; // an existing build folder keeps its generator
  }
  log(`configuring: cmake ${cmakeArgs.join(" ")}`);
  run("cmake", ["-S", srcDir, "-B", buildDir, ...generator, ...cmakeArgs]);
  log(`building ${NATIVE_TARGETS.join(", ")} with ${o.jobs} job(s) (several minutes on 2 cores)`);
  run("cmake", ["--build", buildDir, "--config", "Release", "-j", String(o.jobs), "--target", ...NATIVE_TARGETS]);
  for (const t of NATIVE_TARGETS) {
    if (!existsSync(join(binDir(dir), t)))
      throw new NativeLlamaCppError(`the build produced no ${join(binDir(dir), t)}`);
  }
  const compilerPath = /^CMAKE_CXX_COMPILER:FILEPATH=(.+)$/m.exec(readFileSync(cache, "utf8"))?.[1] ?? "c++";
  const bi = parseBuildInfoCpp(readFileSync(join(buildDir, "common", "build-info.cpp"), "utf8"));
  if (!head.startsWith(bi.commit)) {
    throw new NativeLlamaCppError(`the build reports commit ${bi.commit}, the bundle's head is ${head.slice(0, 7)}`);
  }
  const info: NativeBuildInfo = {
    schema: 1,
    tag: src.tag,
    commit: head,
    buildNumber: bi.buildNumber,
    compiler: bi.compiler,
    isa: nativeIsa(compilerPath).filter((f) => !f.startsWith("amx") || cmakeArgs.length === CMAKE_ARGS.length),
    cpu: cpuModelName(),
    cmakeArgs,
    targets: [...NATIVE_TARGETS],
    bundle: src.bundle,
    builtAt: new Date().toISOString(),
    buildSeconds: Math.round((performance.now() - t0) / 1000),
  };
  writeFileSync(join(binDir(dir), BUILD_INFO_FILE), `${JSON.stringify(info, null, 2)}\n`);
  log(`built ${nativeLabel(info)} (${info.isa.join(" ")}) in ${info.buildSeconds} s: ${binDir(dir)}`);
  process.stdout.write(`${binDir(dir)}\n`);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  try {
    main();
  } catch (e) {
    process.stderr.write(`llama-cpp:build: ${describeError(e)}\n`);
    process.exitCode = 1;
  }
}
