/**
 * The device kit's checks, bundled into `.device-kit/js/checks.mjs` and run by `run.sh` with the kit's
 * own Node (no node_modules, no vitest). One subcommand per check; each prints its findings and ends with
 * one line `RESULT <ok|FAIL|skip> <detail>` that run.sh puts in its table, and exits 0 unless it failed.
 *
 *   env                                    backends found (probe), devices, Node, OS
 *   conformance --backend NAME [--warp N]  core's conformance kit: every op × dtype the backend claims
 *   gpu-suite --backend NAME [--warp N]    the shared GPU suite (packages/backend-cuda/test/gpu-suite.ts):
 *                                          conformance, claims, OUT_OF_MEMORY, device KV cache, sparse-op
 *                                          row counters, whole model on the device, hybrid
 *   logits --device NAME --models DIR [--cases N] [--steps N]
 *                                          CPU vs device logits on stories260K (F32/F16/BF16/Q8_0/Q4_0)
 *                                          and the PowerInfer fixtures, both against llama.cpp's reference ids
 *   serve-load --url URL [--n 8] [--pid P --log FILE]
 *                                          N concurrent completions against a running `powerinfer serve`
 *                                          (P: its process, to stop waiting when it has exited)
 *
 * Backend names: cpu, cuda, rocm, gpu-emu (the SIMT emulator: the GPU kernels on the CPU, for `run.sh --cpu`).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { cudaBackend, gpuEmulatorBackend } from "@powerinfer/backend-cuda";
import { rocmBackend } from "@powerinfer/backend-rocm";
import { type Backend, type BackendDescriptor, formatConformanceReport, runConformance } from "@powerinfer/core";
import { argmax, Model } from "@powerinfer/engine";
import { describeGpuBackend } from "../../../packages/backend-cuda/test/gpu-suite.ts";
import { runRegistered } from "./vitest-shim.ts";

const DESCRIPTORS: Record<string, BackendDescriptor> = {
  cpu: cpuBackend,
  cuda: cudaBackend,
  rocm: rocmBackend,
  "gpu-emu": gpuEmulatorBackend,
};

function result(status: "ok" | "FAIL" | "skip", detail: string): void {
  console.log(`RESULT ${status} ${detail}`);
  if (status === "FAIL") process.exitCode = 1;
}

function descriptor(name: string | undefined): BackendDescriptor {
  const d = name ? DESCRIPTORS[name] : undefined;
  if (!d) throw new Error(`unknown backend "${name}" (one of ${Object.keys(DESCRIPTORS).join(", ")})`);
  return d;
}

/** Loads a backend, or reports why it is unusable (status skip) and returns undefined. */
async function load(name: string | undefined, warp?: number): Promise<Backend | undefined> {
  const d = descriptor(name);
  const probe = await d.probe();
  if (!probe.usable) {
    result("skip", `${d.name}: ${probe.reason}`);
    return undefined;
  }
  return d.load(warp ? ({ emuWarpSize: warp } as Record<string, unknown>) : {});
}

async function env(): Promise<void> {
  console.log(`node ${process.version} (${process.platform} ${process.arch}), ${process.execPath}`);
  const usable: string[] = [];
  for (const [name, d] of Object.entries(DESCRIPTORS)) {
    const p = await d.probe();
    console.log(`${name}: ${p.usable ? "usable" : "not usable"} — ${p.reason}`);
    for (const dev of p.devices) {
      console.log(
        `  ${dev.kind} ${dev.name}: ${(dev.freeMemory / 2 ** 30).toFixed(1)} GiB free / ${(dev.totalMemory / 2 ** 30).toFixed(1)} GiB`,
      );
    }
    if (p.usable)
      usable.push(
        p.devices.some((x) => x.kind === "gpu") ? `${name} (${p.devices.map((x) => x.name).join(", ")})` : name,
      );
  }
  result("ok", `backends usable: ${usable.join(", ")}`);
}

async function conformance(backendName: string, warp?: number): Promise<void> {
  const b = await load(backendName, warp);
  if (!b) return;
  try {
    const start = performance.now();
    const report = await runConformance(b);
    console.log(formatConformanceReport(report));
    const secs = ((performance.now() - start) / 1000).toFixed(1);
    result(
      report.ok ? "ok" : "FAIL",
      `${b.name}: ${report.passed.length}/${report.claimed.length} op×dtype pairs, ${report.cases} cases, ${secs} s`,
    );
  } finally {
    b.dispose();
  }
}

async function gpuSuite(backendName: string, warp?: number): Promise<void> {
  const d = descriptor(backendName);
  await describeGpuBackend(`GPU suite on ${d.name}${warp ? ` (warp ${warp})` : ""}`, d, {
    ...(warp ? { load: { emuWarpSize: warp } } : {}),
  });
  const results = await runRegistered((r) => {
    console.log(`${r.status.padEnd(4)} ${(r.ms / 1000).toFixed(1).padStart(6)} s  ${r.title}`);
    if (r.error) console.log(`       ${r.error.split("\n").slice(0, 6).join("\n       ")}`);
  });
  const n = (s: string) => results.filter((r) => r.status === s).length;
  const skipped = results.find((r) => r.status === "skip");
  if (n("ok") === 0 && skipped) return result("skip", skipped.title);
  result(n("FAIL") ? "FAIL" : "ok", `${n("ok")} passed, ${n("FAIL")} failed, ${n("skip")} skipped`);
}

// ---- logits: CPU vs device, both against llama.cpp's reference ----

interface RefCase {
  prompt: string;
  prompt_token_ids: number[];
  greedy_token_ids: number[];
  greedy_margin_to_runner_up: number[];
}

/**
 * The golden test's known divergences (apps/cli/test/golden.test.ts): the references were made by an
 * AVX-512 llama.cpp, and llama.cpp built for AVX2 (as our CPU kernels are) parts from them at these
 * steps of the Q4_0 file.
 */
const KNOWN_CPU_DIVERGENCE: Record<string, Record<string, number>> = {
  "stories260K-Q4_0-ffn_down-F16.gguf": { "One day, a little dog": 31, "The sun was": 21 },
};

/**
 * The largest max|Δlogit| / max|logit| accepted between the device and the CPU with a dense FFN. They do
 * not compute the same rounding: the CPU rounds activations to F16 or Q8_0 before its dot products, as
 * llama.cpp does, the GPU kernels keep them in F32 (measured on the emulator, whose arithmetic is the
 * kernels': 0.3 % for F32, F16 and BF16 weights, 0.9 % for Q8_0, 1.6 % for Q4_0). A wrong kernel gives
 * errors of the order of the logits. With predictors, a neuron whose predictor logit lies near the
 * threshold may fire on one and not the other, so no bound is set there; the greedy-id check still holds.
 */
const DENSE_REL_TOL = 0.05;

const STORIES: { file: string; ref: string }[] = [
  { file: "stories260K.gguf", ref: "stories260K.greedy32.json" },
  { file: "stories260K-F16.gguf", ref: "stories260K-F16.greedy32.json" },
  { file: "stories260K-BF16.gguf", ref: "stories260K-BF16.greedy32.json" },
  { file: "stories260K-Q8_0-ffn_down-F16.gguf", ref: "stories260K-Q8_0-ffn_down-F16.greedy32.json" },
  { file: "stories260K-Q4_0-ffn_down-F16.gguf", ref: "stories260K-Q4_0-ffn_down-F16.greedy32.json" },
];

interface Lockstep {
  cpuIds: number[];
  cpuMargins: number[];
  devIds: number[];
  /** max |Δlogit| per step */
  delta: number[];
  /** max |logit| over the run (CPU) */
  scale: number;
}

/** Greedy-decodes `n` tokens on the CPU and feeds the same tokens to the device, step by step. */
function lockstep(cpu: Model, dev: Model, prompt: number[], n: number): Lockstep {
  const a = cpu.createSession({ nCtx: 256 });
  const b = dev.createSession({ nCtx: 256 });
  const out: Lockstep = { cpuIds: [], cpuMargins: [], devIds: [], delta: [], scale: 0 };
  try {
    let la = a.evaluate(prompt);
    let lb = b.evaluate(prompt);
    for (let i = 0; i < n; i++) {
      let d = 0;
      for (let j = 0; j < la.length; j++) {
        const x = Math.abs(la[j]! - lb[j]!);
        d = Number.isNaN(x) ? Number.POSITIVE_INFINITY : Math.max(d, x);
        out.scale = Math.max(out.scale, Math.abs(la[j]!));
      }
      const id = argmax(la);
      let second = Number.NEGATIVE_INFINITY;
      for (let j = 0; j < la.length; j++) if (j !== id) second = Math.max(second, la[j]!);
      out.cpuIds.push(id);
      out.cpuMargins.push(la[id]! - second);
      out.devIds.push(argmax(lb));
      out.delta.push(d);
      if (i < n - 1) {
        la = a.evaluate([id]);
        lb = b.evaluate([id]);
      }
    }
  } finally {
    a.dispose();
    b.dispose();
  }
  return out;
}

/**
 * Compares greedy ids with llama.cpp's: the first differing step must be a known divergence or a step where
 * llama.cpp's own margin to the runner-up is below `tieBelow`. Returns a problem, or undefined.
 */
function againstReference(ids: number[], c: RefCase, tieBelow: number, known?: number): string | undefined {
  const diff = ids.findIndex((id, i) => id !== c.greedy_token_ids[i]);
  if (diff < 0) return undefined;
  if (known === diff) return undefined;
  const margin = c.greedy_margin_to_runner_up[diff]!;
  if (margin < tieBelow) return undefined;
  return `"${c.prompt}" parts from llama.cpp at step ${diff} (llama.cpp's margin ${margin.toFixed(4)})`;
}

/**
 * @param maxCases prompts per reference file (all 5 when undefined)
 * @param maxSteps greedy steps per prompt (all 32 when undefined)
 */
async function logits(deviceName: string, models: string, maxCases?: number, maxSteps?: number): Promise<void> {
  const cpu = await cpuBackend.load({ threads: 1 });
  const dev = await load(deviceName);
  if (!dev) return cpu.dispose();
  const problems: string[] = [];
  const rows: string[] = [];
  let worstRel = 0;
  try {
    const variants = [
      ...STORIES.map((v) => ({ ...v, sparse: undefined as "off" | "predictor" | undefined })),
      // PowerInfer fixtures: the prompt ids of the fixture's own reference run; dense and with predictors
      ...["tiny-f32", "tiny-f16", "tiny-q4_0"].flatMap((f) =>
        (["off", "predictor"] as const).map((sparse) => ({
          file: join("powerinfer", `${f}.powerinfer.gguf`),
          ref: "",
          sparse,
        })),
      ),
    ];
    for (const v of variants) {
      const path = join(models, v.file);
      const opts = v.sparse ? { sparse: v.sparse } : {};
      const mc = await Model.load(path, { backend: cpu, ...opts });
      const md = await Model.load(path, { backend: dev, ...opts });
      try {
        const cases: RefCase[] = v.ref
          ? (JSON.parse(readFileSync(join(models, "reference", v.ref), "utf8")) as { results: RefCase[] }).results
          : [
              {
                prompt: "[1, 259, 260, 261]",
                prompt_token_ids: [1, 259, 260, 261],
                greedy_token_ids: [],
                greedy_margin_to_runner_up: [],
              },
            ];
        if (maxCases !== undefined) cases.splice(maxCases);
        if (maxSteps !== undefined)
          for (const c of cases) {
            c.greedy_token_ids = c.greedy_token_ids.slice(0, maxSteps);
            c.greedy_margin_to_runner_up = c.greedy_margin_to_runner_up.slice(0, maxSteps);
          }
        let maxDelta = 0;
        let scale = 0;
        let checked = 0;
        let ties = 0;
        let idsEqual = 0;
        const runs: { c: RefCase; r: Lockstep }[] = [];
        for (const c of cases) {
          const r = lockstep(mc, md, c.prompt_token_ids, c.greedy_token_ids.length || (maxSteps ?? 16));
          runs.push({ c, r });
          maxDelta = Math.max(maxDelta, ...r.delta);
          scale = Math.max(scale, r.scale);
        }
        for (const { c, r } of runs) {
          // the device must pick the CPU's token wherever the CPU's top-2 margin exceeds the measured difference
          for (let i = 0; i < r.cpuIds.length; i++) {
            if (r.cpuMargins[i]! > maxDelta) {
              checked++;
              if (r.devIds[i] === r.cpuIds[i]) idsEqual++;
              else problems.push(`${v.file} "${c.prompt}" step ${i}: device ${r.devIds[i]}, CPU ${r.cpuIds[i]}`);
            } else ties++;
          }
          if (v.ref) {
            const known = KNOWN_CPU_DIVERGENCE[v.file]?.[c.prompt];
            const p = againstReference(r.cpuIds, c, 1e-2, known);
            if (p) problems.push(`${v.file} CPU: ${p}`);
            // the device's own greedy run equals the CPU ids up to its first deviation
            const firstDev = r.devIds.findIndex((id, i) => id !== r.cpuIds[i]);
            const devIds = firstDev < 0 ? r.devIds : r.devIds.slice(0, firstDev + 1);
            const q = againstReference(devIds, c, Math.max(1e-2, 2 * maxDelta), known);
            if (q) problems.push(`${v.file} device: ${q}`);
          }
        }
        const rel = maxDelta / (scale || 1);
        const dense = v.sparse !== "predictor";
        if (!Number.isFinite(maxDelta)) problems.push(`${v.file}: NaN or infinite logits`);
        else if (dense && rel > DENSE_REL_TOL)
          problems.push(
            `${v.file}: max|Δlogit| ${maxDelta.toFixed(4)} is ${(rel * 100).toFixed(1)} % of max|logit| (limit ${DENSE_REL_TOL * 100} %)`,
          );
        if (dense) worstRel = Math.max(worstRel, rel);
        rows.push(
          `${v.file.padEnd(40)} ${(v.sparse ?? "").padEnd(9)} max|Δlogit| ${maxDelta.toExponential(2)} (${(rel * 100).toFixed(2)} % of max|logit| ${scale.toFixed(1)}); ` +
            `ids equal ${idsEqual}/${checked} steps with margin > Δ (${ties} near-ties not compared)` +
            (v.ref ? "; vs llama.cpp: CPU and device checked" : ""),
        );
        console.log(rows.at(-1));
      } finally {
        mc.dispose();
        md.dispose();
      }
    }
  } finally {
    dev.dispose();
    cpu.dispose();
  }
  for (const p of problems) console.log(`PROBLEM ${p}`);
  result(
    problems.length ? "FAIL" : "ok",
    `${dev.name} vs cpu on ${rows.length} model runs: worst dense max abs Δlogit relative to max abs logit: ${(worstRel * 100).toFixed(2)} %` +
      (problems.length
        ? `; ${problems.length} problems, first: ${problems[0]}`
        : "; greedy ids and llama.cpp ids agree"),
  );
}

// ---- serve-load: concurrent completions against a running server ----

/** The first line of a server log that says what went wrong, else its last line. */
function serverError(log: string | undefined): string {
  if (!log) return "no log";
  let text = "";
  try {
    text = readFileSync(log, "utf8");
  } catch {
    return `no log at ${log}`;
  }
  const lines = text.split("\n").filter((l) => l.trim());
  return (lines.find((l) => /error|powerinfer:|cannot|unavailable/i.test(l)) ?? lines.at(-1) ?? "nothing logged").slice(
    0,
    300,
  );
}

async function serveLoad(
  url: string,
  n: number,
  prompt: string,
  tokens: number,
  serverPid?: number,
  serverLog?: string,
): Promise<void> {
  const start = performance.now();
  // wait for the server to answer /health, as long as it is alive
  for (let i = 0; ; i++) {
    try {
      const h = await fetch(`${url}/health`);
      if (h.ok) break;
    } catch {
      // not listening yet
    }
    if (serverPid !== undefined) {
      try {
        process.kill(serverPid, 0);
      } catch {
        return result("FAIL", `the server exited before answering: ${serverError(serverLog)}`);
      }
    }
    if (i > 600) return result("FAIL", `${url}/health did not answer within 60 s: ${serverError(serverLog)}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  const ready = performance.now();
  const one = async (i: number) => {
    const t0 = performance.now();
    const r = await fetch(`${url}/v1/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ prompt, max_tokens: tokens, temperature: 0, seed: i }),
    });
    const body = (await r.json()) as { choices?: { text: string }[]; usage?: { completion_tokens: number } };
    return {
      status: r.status,
      text: body.choices?.[0]?.text,
      tokens: body.usage?.completion_tokens ?? 0,
      ms: performance.now() - t0,
    };
  };
  const single = await one(0);
  const t1 = performance.now();
  const all = await Promise.all(Array.from({ length: n }, (_, i) => one(i + 1)));
  const wall = performance.now() - t1;
  const bad = all.filter((r) => r.status !== 200 || r.text !== single.text);
  const genTokens = all.reduce((s, r) => s + r.tokens, 0);
  console.log(
    `server ready after ${((ready - start) / 1000).toFixed(1)} s; one request: ${single.tokens} tokens in ${single.ms.toFixed(0)} ms`,
  );
  console.log(`greedy text: ${JSON.stringify(single.text)}`);
  for (const [i, r] of all.entries())
    console.log(`request ${i + 1}: ${r.status}, ${r.tokens} tokens, ${r.ms.toFixed(0)} ms`);
  if (single.status !== 200 || !single.text) return result("FAIL", `a single request got ${single.status}`);
  result(
    bad.length ? "FAIL" : "ok",
    `${n} concurrent requests: ${n - bad.length}/${n} gave the single request's greedy text; ${genTokens} tokens in ${(wall / 1000).toFixed(2)} s (${((genTokens * 1000) / wall).toFixed(1)} tokens/s aggregate)`,
  );
}

async function main(): Promise<void> {
  const [cmd, ...rest] = process.argv.slice(2);
  const { values } = parseArgs({
    args: rest,
    options: {
      backend: { type: "string" },
      device: { type: "string" },
      warp: { type: "string" },
      models: { type: "string" },
      url: { type: "string" },
      n: { type: "string", default: "8" },
      prompt: { type: "string", default: "Once upon a time" },
      tokens: { type: "string", default: "32" },
      cases: { type: "string" },
      pid: { type: "string" },
      log: { type: "string" },
      steps: { type: "string" },
    },
  });
  const warp = values.warp ? Number(values.warp) : undefined;
  switch (cmd) {
    case "env":
      return env();
    case "conformance":
      return conformance(values.backend ?? "cpu", warp);
    case "gpu-suite":
      return gpuSuite(values.backend ?? "cuda", warp);
    case "logits":
      if (!values.models) throw new Error("logits needs --models DIR");
      return logits(
        values.device ?? "cuda",
        values.models,
        values.cases ? Number(values.cases) : undefined,
        values.steps ? Number(values.steps) : undefined,
      );
    case "serve-load":
      if (!values.url) throw new Error("serve-load needs --url");
      return serveLoad(
        values.url,
        Number(values.n),
        values.prompt,
        Number(values.tokens),
        values.pid ? Number(values.pid) : undefined,
        values.log,
      );
    default:
      throw new Error(`unknown check "${cmd}" (env, conformance, gpu-suite, logits, serve-load)`);
  }
}

main().catch((e: unknown) => {
  const err = e instanceof Error ? e : new Error(String(e));
  console.log(err.stack ?? err.message);
  result("FAIL", err.message.split("\n")[0]!);
});
