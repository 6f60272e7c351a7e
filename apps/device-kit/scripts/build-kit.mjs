#!/usr/bin/env node
// Builds the device kit: a self-contained folder (default <repo>/.device-kit, git-ignored) that runs the
// project's GPU checks on a machine with a GPU but no Node, no npm and no network. Run after `pnpm build`
// (the root script `pnpm device-kit` does both). Contents:
//   node.xz                the running Node binary, xz -9 (unpacked by run.sh with xz or python3's lzma)
//   js/powerinfer.mjs      the CLI bundled with esbuild (no node_modules); js/glpk.wasm beside it
//   js/checks.mjs          the kit's checks (apps/device-kit/src/checks.ts), the GPU suite included
//   build/Release/         the native addons: cpu, cuda (sm_80/86/89/90 + PTX), gpu-emu; libstdc++ and
//                          libgcc linked statically, the CUDA runtime statically; native-status.json
//   bin/                   native tests: powerinfer_cuda_tests (GPU), powerinfer_gpu_tests (emulator)
//   models/                stories260K variants, the PowerInfer fixtures, llama.cpp's reference ids
//   text/profile.txt       the text the generated slices are profiled on
//   run.sh, README.txt, kit.json (commit, Node, glibc needed, CUDA architectures, sizes)
// The bundles find the addons through the packages' own "../build/Release/<addon>" paths, which from
// js/*.mjs resolve to the kit's build/Release; glpk.js finds its .wasm next to the bundle.
//
// Options: --out DIR (default <repo>/.device-kit; an existing folder is replaced only if it holds a
// kit.json), --models DIR (default $POWERINFER_TEST_MODELS or <repo>/../shared/models),
// --cache DIR (native builds and the compressed Node; default <repo>/node_modules/.cache/device-kit).
// --rocm: also the ROCm addon and its device tests (hipcc needed; the HIP runtime, libamdhip64, is the
// target machine's), for `run.sh --rocm` on an AMD GPU.
// Environment: POWERINFER_NATIVE_JOBS (default: cores), POWERINFER_CUDA_ARCHS (default
// "80-real;86-real;89-real;90"), POWERINFER_BUILD_CUDA=0 (a kit without the CUDA addon).
// Fails (exit 1) when a part is missing or the kit exceeds 56 MiB.
import { execFileSync, spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import {
  chmodSync,
  copyFileSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  renameSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { createRequire } from "node:module";
import { cpus } from "node:os";
import { dirname, join, relative, resolve } from "node:path";
import { parseArgs } from "node:util";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const pkgDir = join(here, "..");
const root = resolve(pkgDir, "../..");
const MAX_BYTES = 56 * 2 ** 20;

const { values: args } = parseArgs({
  options: {
    out: { type: "string", default: join(root, ".device-kit") },
    models: { type: "string", default: process.env.POWERINFER_TEST_MODELS ?? join(root, "..", "shared", "models") },
    cache: { type: "string", default: join(root, "node_modules", ".cache", "device-kit") },
    rocm: { type: "boolean", default: false },
  },
});
const dest = resolve(args.out);
// built beside the destination and renamed at the end: a failed build leaves the old kit (or nothing)
const out = `${dest}.building`;
const models = resolve(args.models);
const cache = resolve(args.cache);
const jobs = process.env.POWERINFER_NATIVE_JOBS ?? String(cpus().length);
const archs = process.env.POWERINFER_CUDA_ARCHS ?? "80-real;86-real;89-real;90";
const started = Date.now();

function die(msg) {
  console.error(`device-kit: ${msg}`);
  process.exit(1);
}
function log(msg) {
  console.log(`device-kit: ${msg} (${((Date.now() - started) / 1000).toFixed(0)} s)`);
}
function has(cmd, a = ["--version"]) {
  const r = spawnSync(cmd, a, { stdio: "ignore" });
  return !r.error && r.status === 0;
}

// ---- the output folder ----
if (existsSync(dest) && !existsSync(join(dest, "kit.json"))) {
  die(`${dest} exists and is not a device kit (no kit.json): not replaced (remove it or give --out)`);
}
rmSync(out, { recursive: true, force: true }); // what a failed build left
for (const d of ["js", "build/Release", "bin", "models/reference", "models/powerinfer", "text"]) {
  mkdirSync(join(out, d), { recursive: true });
}
mkdirSync(cache, { recursive: true });

// ---- 1. JavaScript bundles ----
const cliEntry = join(root, "apps/cli/dist/bin.js");
if (!existsSync(cliEntry)) die(`${relative(root, cliEntry)} is missing: run \`pnpm build\` first`);
const esbuild = await import("esbuild");
// ESM bundles of CommonJS dependencies call require(); give them one.
const banner = {
  js: "import { createRequire as __kitCreateRequire } from 'node:module'; const require = __kitCreateRequire(import.meta.url);",
};
const common = {
  bundle: true,
  platform: "node",
  format: "esm",
  target: "node20",
  banner,
  // the llama.cpp benchmark peer is a development tool, not part of the kit
  external: ["node-llama-cpp"],
  logLevel: "warning",
  legalComments: "none",
};
await esbuild.build({ ...common, entryPoints: [cliEntry], outfile: join(out, "js/powerinfer.mjs") });
await esbuild.build({
  ...common,
  entryPoints: [join(pkgDir, "src/checks.ts")],
  outfile: join(out, "js/checks.mjs"),
  alias: { vitest: join(pkgDir, "src/vitest-shim.ts") },
});
const requireFromCore = createRequire(join(root, "packages/core/package.json"));
const glpkWasm = join(dirname(requireFromCore.resolve("glpk.js/node")), "glpk.wasm");
copyFileSync(glpkWasm, join(out, "js/glpk.wasm"));
log("bundled the CLI and the checks");

// ---- 2. native addons and tests, with the C++ runtime linked statically ----
const staticFlags = "-static-libstdc++ -static-libgcc";
function cmakeJs(pkg, extra) {
  const dir = join(root, "packages", pkg);
  const req = createRequire(join(dir, "package.json"));
  const bin = req.resolve("cmake-js/bin/cmake-js");
  const buildDir = join(cache, `build-${pkg}`);
  const a = [
    bin,
    "build",
    "--directory",
    dir,
    "--out",
    buildDir,
    "--config",
    "Release",
    "--parallel",
    jobs,
    "--log-level",
    "warn",
    `--CDCMAKE_SHARED_LINKER_FLAGS=${staticFlags}`,
    `--CDCMAKE_EXE_LINKER_FLAGS=${staticFlags}`,
    ...extra,
  ];
  const r = spawnSync(process.execPath, a, { cwd: dir, stdio: ["ignore", "inherit", "inherit"] });
  if (r.error || r.status !== 0) die(`native build of ${pkg} failed (exit ${r.status ?? r.error?.message})`);
  return join(buildDir, "Release");
}
if (!has("cmake")) die("cmake not found on PATH");
const cpuOut = cmakeJs("backend-cpu-avx2", []);
copyFileSync(join(cpuOut, "powerinfer_cpu.node"), join(out, "build/Release/powerinfer_cpu.node"));
const cudaOff = process.env.POWERINFER_BUILD_CUDA === "0";
const wantCuda = !cudaOff && (has(process.env.CUDACXX ?? "nvcc") || has("/usr/local/cuda/bin/nvcc"));
const noCuda = cudaOff ? "POWERINFER_BUILD_CUDA=0" : "no CUDA toolkit (nvcc)";
const gpuOut = cmakeJs("backend-cuda", [
  "--CDPOWERINFER_BUILD_TESTS=ON",
  `--CDPOWERINFER_CUDA=${wantCuda ? "ON" : "OFF"}`,
  `--CDPOWERINFER_CUDA_ARCHS=${archs}`,
]);
let cudaTargets = [];
const status = {
  cuda: { built: false, reason: `this kit was built without the CUDA addon (${noCuda})` },
  emu: { built: true, reason: "" },
  rocm: { built: false, reason: "not in this kit (built for NVIDIA GPUs)" },
};
copyFileSync(join(gpuOut, "powerinfer_gpu_emu.node"), join(out, "build/Release/powerinfer_gpu_emu.node"));
// cmake-js puts executables beside the addons (Release/) or in the build folder: find them
function findBuilt(name) {
  for (const d of [gpuOut, dirname(gpuOut)]) if (existsSync(join(d, name))) return join(d, name);
  return undefined;
}
for (const t of ["powerinfer_gpu_tests", ...(wantCuda ? ["powerinfer_cuda_tests"] : [])]) {
  const p = findBuilt(t);
  if (!p) die(`the native build produced no ${t}`);
  copyFileSync(p, join(out, "bin", t));
  chmodSync(join(out, "bin", t), 0o755);
}
if (wantCuda) {
  const p = join(gpuOut, "powerinfer_cuda.node");
  if (!existsSync(p)) die("nvcc was found but the build produced no powerinfer_cuda.node");
  copyFileSync(p, join(out, "build/Release/powerinfer_cuda.node"));
  status.cuda = { built: true, reason: "" };
  // what the driver will find in the addon's fat binary: SASS per architecture, PTX for newer GPUs
  const { fatbinEntries } = await import("@powerinfer/backend-cuda");
  cudaTargets = [...new Set(fatbinEntries(p).map((e) => `${e.kind === "ptx" ? "compute" : "sm"}_${e.sm}`))].sort();
  if (!cudaTargets.includes("sm_90")) die(`the CUDA addon has no sm_90 code (found ${cudaTargets.join(", ")})`);
}
if (args.rocm) {
  if (!has(process.env.HIPCC ?? "hipcc")) die("--rocm needs hipcc (Debian: apt-get install hipcc)");
  const rocmOut = cmakeJs("backend-rocm", [
    "--CDPOWERINFER_BUILD_TESTS=ON",
    `--CDPI_GPU_SRC=${join(root, "packages/backend-cuda/native/gpu")}`,
    ...(process.env.POWERINFER_ROCM_ARCHS ? [`--CDPOWERINFER_ROCM_ARCHS=${process.env.POWERINFER_ROCM_ARCHS}`] : []),
  ]);
  const addon = join(rocmOut, "powerinfer_rocm.node");
  const tests = [join(rocmOut, "powerinfer_rocm_tests"), join(dirname(rocmOut), "powerinfer_rocm_tests")].find((p) =>
    existsSync(p),
  );
  if (!existsSync(addon) || !tests) die("the ROCm build produced no powerinfer_rocm.node or powerinfer_rocm_tests");
  copyFileSync(addon, join(out, "build/Release/powerinfer_rocm.node"));
  copyFileSync(tests, join(out, "bin/powerinfer_rocm_tests"));
  chmodSync(join(out, "bin/powerinfer_rocm_tests"), 0o755);
  status.rocm = { built: true, reason: "" };
  log("built the ROCm addon and its device tests");
}
writeFileSync(join(out, "build/Release/native-status.json"), `${JSON.stringify(status, null, 2)}\n`);
log(`built the native addons${wantCuda ? ` (CUDA ${archs})` : ` (no CUDA addon: ${noCuda})`}`);

// ---- 3. Node, compressed (cached per Node version and binary size) ----
const nodeBin = process.execPath;
const nodeKey = `${process.version}-${process.platform}-${process.arch}-${statSync(nodeBin).size}`;
const nodeXz = join(cache, `node-${nodeKey}.xz`);
if (!existsSync(nodeXz)) {
  if (!has("xz")) die("xz not found on PATH (Debian: apt-get install xz-utils)");
  log(`compressing ${nodeBin} with xz -9 (about a minute and a half, once per Node version)`);
  execFileSync("sh", ["-c", `xz -9 -T1 -c "$0" > "$1.part"`, nodeBin, nodeXz]);
  renameSync(`${nodeXz}.part`, nodeXz);
}
copyFileSync(nodeXz, join(out, "node.xz"));

// ---- 4. models and text ----
const modelFiles = [
  "stories260K.gguf",
  "stories260K-F16.gguf",
  "stories260K-BF16.gguf",
  "stories260K-Q8_0-ffn_down-F16.gguf",
  "stories260K-Q4_0-ffn_down-F16.gguf",
  "reference/stories260K.greedy32.json",
  "reference/stories260K-F16.greedy32.json",
  "reference/stories260K-BF16.greedy32.json",
  "reference/stories260K-Q8_0-ffn_down-F16.greedy32.json",
  "reference/stories260K-Q4_0-ffn_down-F16.greedy32.json",
  "powerinfer/tiny-f32.powerinfer.gguf",
  "powerinfer/tiny-f16.powerinfer.gguf",
  "powerinfer/tiny-q4_0.powerinfer.gguf",
];
for (const f of modelFiles) {
  const src = join(models, f);
  if (!existsSync(src)) die(`${src} is missing (set --models or POWERINFER_TEST_MODELS)`);
  copyFileSync(src, join(out, "models", f));
}
copyFileSync(join(pkgDir, "kit/profile.txt"), join(out, "text/profile.txt"));
copyFileSync(join(pkgDir, "kit/README.txt"), join(out, "README.txt"));
copyFileSync(join(pkgDir, "kit/run.sh"), join(out, "run.sh"));
chmodSync(join(out, "run.sh"), 0o755);

// ---- 5. kit.json: what is in it and what it needs ----
/** Orders "2.28" < "2.34" < "2.34.1". */
function compareVersions(a, b) {
  const x = a.split(".").map(Number);
  const y = b.split(".").map(Number);
  for (let i = 0; i < Math.max(x.length, y.length); i++)
    if ((x[i] ?? 0) !== (y[i] ?? 0)) return (x[i] ?? 0) - (y[i] ?? 0);
  return 0;
}
/** The highest GLIBC_x.y symbol version an ELF file needs (objdump -T), or undefined. */
function glibcNeeded(file) {
  if (!has("objdump")) return undefined;
  const r = spawnSync("objdump", ["-T", file], { encoding: "utf8", maxBuffer: 64 * 2 ** 20 });
  const v = [...(r.stdout ?? "").matchAll(/GLIBC_([0-9]+(?:\.[0-9]+)+)/g)].map((m) => m[1]);
  return v.sort(compareVersions).at(-1);
}
const elves = [
  nodeBin,
  ...readdirSync(join(out, "build/Release"))
    .filter((f) => f.endsWith(".node"))
    .map((f) => join(out, "build/Release", f)),
  ...readdirSync(join(out, "bin")).map((f) => join(out, "bin", f)),
];
const needs = Object.fromEntries(
  elves.map((f) => [relative(out, f).startsWith("..") ? "node" : relative(out, f), glibcNeeded(f)]),
);
const allNeeds = Object.values(needs).filter(Boolean);
// the kit's Node may use only the system libraries every glibc Linux has (a distribution's node built on
// a shared libnode, libuv or OpenSSL would not start on the GPU machine)
const SYSTEM_LIBS = /^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so/;
if (has("objdump")) {
  const dyn = spawnSync("objdump", ["-p", nodeBin], { encoding: "utf8", maxBuffer: 64 * 2 ** 20 }).stdout ?? "";
  const libs = [...dyn.matchAll(/^\s*NEEDED\s+(\S+)/gm)].map((m) => m[1]);
  const foreign = libs.filter((l) => !SYSTEM_LIBS.test(l));
  if (foreign.length) {
    die(
      `${nodeBin} needs ${foreign.join(", ")}: use an official Node build (nodejs.org), which links only system libraries`,
    );
  }
}
const glibc = allNeeds.sort(compareVersions).at(-1);
let commit = "unknown";
try {
  commit = execFileSync("git", ["rev-parse", "--short=12", "HEAD"], { cwd: root, encoding: "utf8" }).trim();
  const dirty = execFileSync("git", ["status", "--porcelain", "--untracked-files=no"], {
    cwd: root,
    encoding: "utf8",
  }).trim();
  if (dirty) commit += "+changes";
} catch {
  // not a git checkout
}
function walk(d) {
  return readdirSync(d, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? walk(join(d, e.name)) : [join(d, e.name)],
  );
}
const files = Object.fromEntries(walk(out).map((f) => [relative(out, f), statSync(f).size]));
const kitJson = {
  commit,
  built: new Date().toISOString(),
  node: process.version,
  glibc_needed: glibc ?? "unknown",
  glibc_needed_by: needs,
  cuda_archs: status.cuda.built ? archs : "none",
  cuda_fatbin: cudaTargets,
  rocm: status.rocm.built,
  sha256_node_xz: createHash("sha256")
    .update(readFileSync(join(out, "node.xz")))
    .digest("hex"),
  files,
};
writeFileSync(join(out, "kit.json"), `${JSON.stringify(kitJson, null, 2)}\n`);
const total = walk(out).reduce((s, f) => s + statSync(f).size, 0);
const mib = (total / 2 ** 20).toFixed(1);
if (total > MAX_BYTES) die(`the kit is ${mib} MiB, over its 56 MiB limit`);
rmSync(dest, { recursive: true, force: true });
renameSync(out, dest);
log(`${dest}: ${mib} MiB (limit 56), commit ${commit}, needs glibc ≥ ${kitJson.glibc_needed}`);
