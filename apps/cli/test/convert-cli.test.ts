/**
 * `powerinfer convert` on PowerInfer's own files and with the threshold option, and a few input checks a
 * new user met (fresh-user pass, 2026-12-05):
 * - a PWRI llama file (PowerInfer writes no `llama.hidden_act`: PWRI means ReLU) converted to GGUF keeps
 *   its ReLU FFN (the key is written), so the GGUF is the same model: dense greedy ids over 12 steps equal
 *   the source's; converting it back to PWRI is accepted;
 * - `--sparse-threshold` rewrites only the metadata: every tensor (the Q4_0 predictors included) keeps its
 *   bytes; a value beyond f32 is refused while parsing; with routed experts it sets the experts' threshold;
 * - a missing input is named before an existing output; an output path ending in a slash is refused;
 *   per-expert predictors offered to a dense model are named as such;
 * - `run --stats` names a missing statistics file, and says when a run does not use one.
 */
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, Model } from "@powerinfer/engine";
import { openGguf, parseModelConfig, readTensorBytes } from "@powerinfer/gguf";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const pi = (n: string) => join(models, "powerinfer", n);
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const dir = mkdtempSync(join(tmpdir(), "convert-cli-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const probe = await cpuBackend.probe();

function cli(...args: string[]) {
  return spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 120_000 });
}

async function greedy(backend: Backend, path: string, n: number): Promise<number[]> {
  const m = await Model.load(path, { backend, sparse: "off" });
  const s = m.createSession({ nCtx: 64, kvType: "f32" });
  try {
    let l = s.evaluate([1, 259, 260, 261, 262]);
    const ids: number[] = [];
    for (let i = 0; i < n; i++) {
      ids.push(argmax(l));
      l = s.evaluate([ids[i]!]);
    }
    return ids;
  } finally {
    s.dispose();
    m.dispose();
  }
}

describe.skipIf(!probe.usable)(`convert (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());

  it("a PowerInfer file converted to GGUF stays ReLU (llama.hidden_act written) and gives the same greedy ids", async () => {
    const src = pi("tiny-f32.powerinfer.gguf");
    expect(openGguf(src).metadata.has("llama.hidden_act")).toBe(false);
    const out = join(dir, "tiny.gguf");
    const r = cli("convert", src, out, "--to", "gguf");
    expect(r.status, r.stderr).toBe(0);
    const g = openGguf(out);
    expect(g.metadata.get("llama.hidden_act")).toBe("relu");
    expect(parseModelConfig(g).ffn.activation).toBe("relu");
    expect(await greedy(backend, out, 12)).toEqual(await greedy(backend, src, 12));
    const back = cli("convert", out, join(dir, "tiny-back.pwri.gguf"), "--to", "pwri");
    expect(back.status, back.stderr).toBe(0);
  });

  it("--sparse-threshold rewrites the metadata only; beyond f32 it is refused; expert models take it too", () => {
    const src = pi("tiny-q4_0.powerinfer.gguf");
    const out = join(dir, "th.pwri.gguf");
    const r = cli("convert", src, out, "--sparse-threshold", "0.5");
    expect(r.status, r.stderr).toBe(0);
    const [a, b] = [openGguf(src), openGguf(out)];
    expect(b.metadata.get("powerinfer.sparse_threshold")).toBe(0.5);
    expect(b.tensors.map((t) => [t.name, t.type])).toEqual(a.tensors.map((t) => [t.name, t.type]));
    for (const t of a.tensors)
      expect(Buffer.compare(readTensorBytes(a, t.name), readTensorBytes(b, t.name)), t.name).toBe(0);
    const big = cli("convert", src, join(dir, "big.gguf"), "--sparse-threshold", "1e40");
    expect(big.status).toBe(1);
    expect(big.stderr).toMatch(/--sparse-threshold/);
    const moe = join(dir, "st.gguf");
    generateSyntheticMoeModel(moe, { arch: "smallthinker", shape: TINY_MOE_SHAPE, design: {}, predictors: {} });
    const m = cli("convert", moe, join(dir, "st-th.pwri.gguf"), "--sparse-threshold", "-0.25");
    expect(m.status, m.stderr).toBe(0);
    expect(openGguf(join(dir, "st-th.pwri.gguf")).metadata.get("powerinfer.sparse_threshold")).toBe(-0.25);
    // predictors of another file are rewritten from their values (Q4_0 → F32), and the note says so
    const g = join(dir, "tiny-q4.gguf");
    expect(cli("convert", src, g, "--to", "gguf").status).toBe(0);
    const w = cli("convert", g, join(dir, "tiny-q4-p.pwri.gguf"), "--predictors", src);
    expect(w.status, w.stderr).toBe(0);
    expect(w.stderr).toMatch(/note: the predictors of .*tiny-q4_0\.powerinfer\.gguf \(Q4_0\) are written as F32/);
    // per-expert predictors offered to a dense model
    const p = cli("convert", src, join(dir, "x.gguf"), "--predictors", moe);
    expect(p.status).toBe(1);
    expect(p.stderr).toMatch(/holds per-expert predictors .* has dense FFNs/);
  });

  it("a missing input is named before an existing output; an output ending in a slash is refused", () => {
    const existing = join(dir, "exists.gguf");
    writeFileSync(existing, "x");
    const r = cli("convert", join(dir, "nope.gguf"), existing);
    expect(r.status).toBe(1);
    expect(r.stderr).toMatch(/nope\.gguf does not exist/);
    const s = cli("convert", pi("tiny-f32.powerinfer.gguf"), join(dir, "sub") + "/");
    expect(s.status).toBe(1);
    expect(s.stderr).toMatch(/names a folder; give a file name/);
  });

  it("run --stats: a missing file is an error, an unused one a note", () => {
    const src = pi("tiny-f32.powerinfer.gguf");
    const miss = cli("run", "-m", src, "-p", "Once", "-n", "2", "--stats", join(dir, "none.gguf"));
    expect(miss.status).toBe(1);
    expect(miss.stderr).toMatch(/activation statistics file \(--stats\) .*none\.gguf does not exist/);
    const stats = join(dir, "tiny.activations.gguf");
    const p = cli(
      "profile",
      "-m",
      src,
      "-f",
      join(models, "relu", "tinystories-relu-llama-7m.eval.txt"),
      "--tokens",
      "16",
      "-o",
      stats,
    );
    expect(p.status, p.stderr).toBe(0);
    const r = cli("run", "-m", src, "-p", "Once", "-n", "2", "--stats", stats);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/--stats .* not used/);
  });
});
