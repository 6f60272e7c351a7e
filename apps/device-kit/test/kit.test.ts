/**
 * The device kit as a GPU machine gets it: built by scripts/build-kit.mjs, copied to a folder with no
 * node_modules above it, and run with a `node` on PATH that fails loudly if anything calls it, so the
 * kit can only use its own Node. `run.sh --cpu --quick` must pass every step it runs (the CPU backend's
 * conformance, the kernels under the emulator against the CPU, one hybrid row on a 1-layer 7B slice with
 * the CPU standing in for the device). The full `run.sh --cpu` (every step, 4-layer 7B and 13B slices)
 * takes minutes longer: BENCHMARKS.md records it.
 */
import { spawnSync } from "node:child_process";
import {
  chmodSync,
  cpSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const pkgDir = join(dirname(fileURLToPath(import.meta.url)), "..");
const work = mkdtempSync(join(tmpdir(), "powerinfer-kit-test-"));
const built = join(work, "built");

function walk(d: string): string[] {
  return readdirSync(d, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? walk(join(d, e.name)) : [join(d, e.name)],
  );
}

describe("the device kit", () => {
  let buildLog = "";
  beforeAll(() => {
    const r = spawnSync(process.execPath, [join(pkgDir, "scripts/build-kit.mjs"), "--out", built], {
      encoding: "utf8",
      maxBuffer: 64 * 2 ** 20,
    });
    buildLog = `${r.stdout}\n${r.stderr}`;
    if (r.status !== 0) throw new Error(`build-kit failed (exit ${r.status}):\n${buildLog.slice(-3000)}`);
  }, 1_200_000); // a fresh clone compiles the addons (CUDA too) and compresses Node: minutes on 2 cores
  afterAll(() => rmSync(work, { recursive: true, force: true }));

  it("holds node, the bundles, the addons, the native tests and the models in at most 56 MiB", () => {
    const files = walk(built);
    const total = files.reduce((s, f) => s + statSync(f).size, 0);
    expect(total).toBeLessThanOrEqual(56 * 2 ** 20);
    for (const f of [
      "run.sh",
      "node.xz",
      "js/powerinfer.mjs",
      "js/checks.mjs",
      "js/glpk.wasm",
      "build/Release/powerinfer_cpu.node",
      "build/Release/powerinfer_gpu_emu.node",
      "build/Release/native-status.json",
      "bin/powerinfer_gpu_tests",
      "models/stories260K.gguf",
      "models/reference/stories260K.greedy32.json",
      "models/powerinfer/tiny-q4_0.powerinfer.gguf",
      "text/profile.txt",
    ]) {
      expect(existsSync(join(built, f)), f).toBe(true);
    }
    const kit = JSON.parse(readFileSync(join(built, "kit.json"), "utf8")) as {
      node: string;
      glibc_needed: string;
      files: Record<string, number>;
    };
    expect(kit.node).toBe(process.version);
    expect(kit.glibc_needed).toMatch(/^2\.\d+$/);
    expect(Object.keys(kit.files).length).toBe(files.length - 1); // every file but kit.json itself
    // no bundle may reach for a package at run time (node-llama-cpp, the benchmark peer, is left out on purpose)
    const bundle = readFileSync(join(built, "js/powerinfer.mjs"), "utf8");
    const imports = [...bundle.matchAll(/^import .* from "([^"]+)";$/gm)].map((m) => m[1]!);
    expect(imports.filter((m) => !m.startsWith("node:") && m !== "node-llama-cpp")).toEqual([]);
  });

  it("fails clearly on a bad --out, TMPDIR or KIT_* value, and on a kit without node.xz", () => {
    const sh = (args: string[], env: Record<string, string> = {}) =>
      spawnSync("bash", [join(built, "run.sh"), ...args], { encoding: "utf8", env: { ...process.env, ...env } });
    const file = join(work, "a-file");
    writeFileSync(file, "");
    for (const [args, env, msg] of [
      [["--cpu", "--out", file], {}, "cannot create the output folder"],
      [["--out", "--quick"], {}, "--out needs a folder"],
      [["--cpu"], { TMPDIR: join(work, "missing") }, "does not exist or is not writable"],
      [["--cpu"], { KIT_BUDGET_S: "abc" }, "KIT_BUDGET_S must be a positive whole number"],
    ] as const) {
      const r = sh([...args], env);
      expect(r.status, `${args.join(" ")}: ${r.stderr}`).toBe(2);
      expect(r.stderr).toContain(msg);
    }
    const damaged = join(work, "damaged");
    cpSync(built, damaged, { recursive: true });
    rmSync(join(damaged, "node.xz"));
    const out = join(work, "damaged-out");
    const r = spawnSync("bash", [join(damaged, "run.sh"), "--cpu", "--quick", "--out", out], { encoding: "utf8" });
    expect(r.status).toBe(1);
    expect(readFileSync(join(out, "rows.tsv"), "utf8")).toMatch(/^0 node\tFAIL\t.*node\.xz is missing/);
  });

  it("refuses an unknown option with exit 2", () => {
    const r = spawnSync("bash", [join(built, "run.sh"), "--bogus"], { encoding: "utf8" });
    expect(r.status).toBe(2);
    expect(r.stderr).toContain("unknown option '--bogus'");
  });

  it("runs `run.sh --cpu --quick` from a copy, with its own Node only and no node_modules", () => {
    const copy = join(work, "elsewhere", "kit");
    cpSync(built, copy, { recursive: true });
    for (let d = copy; d !== dirname(d); d = dirname(d)) expect(existsSync(join(d, "node_modules")), d).toBe(false);
    // a `node` first on PATH that records any use and fails
    const fakeBin = join(work, "fake-bin");
    const marker = join(work, "path-node-used");
    mkdirSync(fakeBin);
    writeFileSync(join(fakeBin, "node"), `#!/bin/sh\necho "$0 $*" >> "${marker}"\nexit 99\n`);
    chmodSync(join(fakeBin, "node"), 0o755);
    const out = join(work, "out");
    const env: Record<string, string> = {
      PATH: `${fakeBin}:${process.env.PATH}`,
      HOME: work,
      TMPDIR: work,
      KIT_LAYERS: "1",
    };
    const r = spawnSync("bash", ["run.sh", "--cpu", "--quick", "--out", out], {
      cwd: copy,
      env,
      encoding: "utf8",
      maxBuffer: 64 * 2 ** 20,
    });
    const table = existsSync(join(out, "table.md")) ? readFileSync(join(out, "table.md"), "utf8") : r.stdout;
    expect(r.status, `${table}\n${r.stderr}`).toBe(0);
    expect(existsSync(marker), "the kit called the node on PATH").toBe(false);
    const rows = readFileSync(join(out, "rows.tsv"), "utf8")
      .trim()
      .split("\n")
      .map((l) => l.split("\t"));
    const names = rows.map((x) => x[0]!);
    for (const prefix of [
      "1 machine",
      "2 native tests",
      "3a conformance kit: cpu",
      "4 logits",
      "5 7b×1 slice",
      "5 7b hybrid",
    ]) {
      expect(
        names.some((n) => n.startsWith(prefix)),
        `${prefix} in ${names.join(", ")}`,
      ).toBe(true);
    }
    for (const [name, status, detail] of rows) expect(status, `${name}: ${detail}`).toBe("ok");
    const hybrid = rows.find((x) => x[0]!.startsWith("5 7b hybrid"))!;
    expect(hybrid[2]).toMatch(/^[0-9.]+ tokens per second; hybrid: \d+ hot neurons/);
    expect(table).toContain("| step | status | detail | seconds |");
    expect(readdirSync(join(out, "logs")).length).toBeGreaterThanOrEqual(rows.length);
  });
});
