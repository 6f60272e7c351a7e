/**
 * A backend written outside the workspace, as a third party would: @powerinfer/core is packed
 * (`pnpm pack`), installed with `npm install --offline <tarball>` into an empty folder under the system's
 * temporary directory, next to a plain-JavaScript backend (test/fixtures/third-party-backend) that
 * implements its ops itself. Its own test script runs the conformance kit with plain `node`; then the CLI
 * finds it through POWERINFER_BACKENDS and through a configuration file, lists it, and generates with it
 * the CPU backend's greedy text.
 */
import { spawnSync } from "node:child_process";
import { cpSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const bin = fileURLToPath(new URL("../dist/bin.js", import.meta.url));
const coreDir = fileURLToPath(new URL("../../../packages/core", import.meta.url));
const fixture = fileURLToPath(new URL("./fixtures/third-party-backend", import.meta.url));
const model = join(process.env.POWERINFER_TEST_MODELS!, "stories260K.gguf");

let dir: string;
let backendDir: string;

function sh(cmd: string, args: string[], cwd: string, env: Record<string, string> = {}) {
  const r = spawnSync(cmd, args, { cwd, encoding: "utf8", timeout: 240_000, env: { ...process.env, ...env } });
  return { status: r.status, stdout: r.stdout ?? "", stderr: r.stderr ?? "", error: r.error };
}

const cli = (args: string[], cwd: string, env: Record<string, string> = {}) =>
  sh(process.execPath, [bin, ...args], cwd, { POWERINFER_BACKEND: "", POWERINFER_CONFIG: "", ...env });

beforeAll(() => {
  dir = mkdtempSync(join(tmpdir(), "powerinfer-third-party-"));
  const pack = sh("pnpm", ["pack", "--pack-destination", dir], coreDir);
  expect(pack.status, pack.stderr + pack.stdout).toBe(0);
  const tarball = readdirSync(dir).find((f) => f.endsWith(".tgz"));
  expect(tarball).toBeDefined();
  backendDir = join(dir, "mini");
  cpSync(fixture, backendDir, { recursive: true });
  const install = sh("npm", ["install", "--offline", "--no-audit", "--no-fund", join(dir, tarball!)], backendDir);
  expect(install.status, install.stderr + install.stdout).toBe(0);
}, 300_000);

afterAll(() => {
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe("a third-party backend built on the packed contract alone", () => {
  it("installs with no runtime dependency: the tarball brings nothing else", () => {
    const modules = readdirSync(join(backendDir, "node_modules")).filter((n) => !n.startsWith("."));
    expect(modules).toEqual(["@powerinfer"]);
    expect(readdirSync(join(backendDir, "node_modules", "@powerinfer"))).toEqual(["core"]);
  });

  it("passes the conformance kit from its own test script with plain node", () => {
    const r = sh("npm", ["test", "--silent"], backendDir);
    expect(r.status, r.stdout + r.stderr).toBe(0);
    expect(r.stdout).toMatch(/conformance of backend "mini" .*: 16\/16 claimed op×dtype pairs passed/);
    expect(r.stdout).toMatch(/attention\s+ok: f32 f16/);
  });

  it("POWERINFER_BACKENDS lists it (and an entry that cannot be imported, with the error)", () => {
    const r = cli(["backends", "--json"], dir, { POWERINFER_BACKENDS: `${backendDir},no-such-backend-pkg` });
    expect(r.status, r.stderr).toBe(0);
    const list = JSON.parse(r.stdout) as { name: string; probe: { usable: boolean; reason: string } }[];
    const mini = list.find((b) => b.name === "mini");
    expect(mini?.probe).toMatchObject({ usable: true, reason: "plain JavaScript, always available" });
    const bad = list.find((b) => b.name === "no-such-backend-pkg");
    expect(bad?.probe.usable).toBe(false);
    expect(bad?.probe.reason).toMatch(/cannot import no-such-backend-pkg .*not installed/);
    expect(list.map((b) => b.name)).toContain("cpu");
  });

  it("a discovered entry never replaces a built-in backend (POWERINFER_BACKENDS=cpu, a typo of POWERINFER_BACKEND)", () => {
    const r = cli(["backends", "--json"], dir, { POWERINFER_BACKENDS: "cpu" });
    expect(r.status, r.stderr).toBe(0);
    const list = JSON.parse(r.stdout) as { name: string; probe: { usable: boolean; reason: string } }[];
    expect(list.find((b) => b.name === "cpu")?.probe.usable).toBe(true);
    expect(list.find((b) => b.name === "cpu (POWERINFER_BACKENDS)")?.probe.reason).toMatch(/cannot import cpu/);
  });

  it("`run --backend mini` prints the CPU backend's greedy text", () => {
    const args = ["run", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0"];
    const cpu = cli([...args, "--backend", "cpu"], dir);
    expect(cpu.status, cpu.stderr).toBe(0);
    const mini = cli([...args, "--backend", "mini"], dir, { POWERINFER_BACKENDS: "./mini" });
    expect(mini.status, mini.stderr).toBe(0);
    expect(mini.stderr).toMatch(/backend: mini/);
    expect(mini.stdout).toBe(cpu.stdout);
    expect(cpu.stdout).toMatch(/^Once upon a time, there was a little girl named Lily/);
  });

  it("a configuration file's `backends` list finds it; a malformed file is a one-line error", () => {
    const cfgDir = join(dir, "project");
    mkdirSync(cfgDir, { recursive: true });
    writeFileSync(join(cfgDir, "powerinfer.json"), JSON.stringify({ backends: ["../mini"] }));
    const r = cli(["backends"], cfgDir);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^mini: usable/m);
    const cfg = join(dir, "bad.json");
    writeFileSync(cfg, JSON.stringify({ backends: "mini" }));
    const bad = cli(["backends"], dir, { POWERINFER_CONFIG: cfg });
    expect(bad.status).toBe(1);
    expect(bad.stderr).toMatch(/bad\.json: "backends" must be a list of package names or folder paths/);
    const missing = cli(["backends"], dir, { POWERINFER_CONFIG: join(dir, "nope.json") });
    expect(missing.status).toBe(1);
    expect(missing.stderr).toMatch(/POWERINFER_CONFIG names .*nope\.json, which does not exist/);
  });
});
