/**
 * Op-by-op agreement with llama.cpp (issue 16): our forward graph for the prompt "Once upon a time" (ids
 * 1 403 407 261 378, one batch), dumped node by node under llama.cpp's names, against llama.cpp's own
 * `llama-eval-callback` output (shared/models/reference/trace, llama.cpp 34af94cd, AVX2 CPU build, 1 thread)
 * on stories260K F16, BF16 and Q8_0-ffn_down-F16. Every printed value (first/last 3 per row, 4 decimals)
 * and every sum (6 decimals) must be within ±2 in its last digit. Also: the dump's text format, the
 * parser, and the CLI command.
 */
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import {
  cFixed,
  compareTrace,
  EngineError,
  evalCallback,
  formatEvalCallback,
  Model,
  parseEvalCallback,
  type TraceEntry,
  type TraceNode,
} from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const traces = join(models, "reference", "trace");
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const IDS = [1, 403, 407, 261, 378];
const VARIANTS = ["F16", "BF16", "Q8_0-ffn_down-F16"] as const;

/** The nodes llama.cpp names in a layer, in its graph order, each compared (Qcur/Kcur: MUL_MAT, then ROPE). */
const LAYER_NODES = [
  "norm",
  "attn_norm",
  "Qcur",
  "Kcur",
  "Vcur",
  "Qcur",
  "Kcur",
  "kqv_out",
  "attn_out",
  "ffn_inp",
  "norm",
  "ffn_norm",
  "ffn_up",
  "ffn_gate",
  "ffn_swiglu",
  "ffn_out",
  "l_out",
];

const reference = (v: string): TraceEntry[] =>
  parseEvalCallback(readFileSync(join(traces, `stories260K-${v}.once-upon-a-time.eval-callback.txt`), "utf8"));

const probe = await cpuBackend.probe();

describe("eval-callback text format", () => {
  it("prints numbers as C's printf %.Nf: exact ties to even, the sign of −0", () => {
    expect(cFixed(0.03125, 4)).toBe("0.0312"); // exact tie: JavaScript's toFixed would give 0.0313
    expect(cFixed(0.09375, 4)).toBe("0.0938");
    expect(cFixed(-0.03125, 4)).toBe("-0.0312");
    expect(cFixed(-1e-7, 4)).toBe("-0.0000");
    expect(cFixed(-3.353049, 6)).toBe("-3.353049");
    expect(cFixed(12.00699996948242, 4)).toBe("12.0070");
  });

  it("round-trips llama.cpp's layout: first/last 3 per axis, '...' between, the float sum", () => {
    const values = Float32Array.from({ length: 8 * 8 * 5 }, (_, i) => Math.sin(i) * 3);
    const node: TraceNode = {
      name: "Qcur-0",
      op: "ROPE",
      srcs: [
        { name: "Qcur-0", ne: [8, 8, 5, 1] },
        { name: "inp_pos", ne: [5, 1, 1, 1] },
      ],
      ne: [8, 8, 5, 1],
      values,
    };
    const text = formatEvalCallback([node]);
    expect(text.split("\n")[0]).toBe(
      "common_debug_cb_eval:                   Qcur-0 = (f32)       ROPE(Qcur-0{8, 8, 5, 1}, inp_pos{5, 1, 1, 1}}) = {8, 8, 5, 1}",
    );
    expect(text).toContain("            ..., \n");
    const [e] = parseEvalCallback(text);
    expect(e!.ne).toEqual([8, 8, 5, 1]);
    expect(e!.rows.length).toBe(5 * 6); // 5 heads-blocks × (3 + 3) printed rows
    expect(e!.rows[0]!.length).toBe(7); // 3 values, "...", 3 values
    expect(e!.rows[0]![3]).toBeNull();
    expect(e!.rows[0]![0]).toBe(Number(cFixed(values[0]!, 4).replace(".", "")));
  });

  it("parses llama.cpp's own files: 161 nodes, the header fields and the sums", () => {
    const ref = reference("F16");
    expect(ref.length).toBe(161);
    expect(ref[0]).toMatchObject({ name: "embd", type: "f32", op: "GET_ROWS", ne: [64, 5, 1, 1], sum: -3353049 });
    expect(ref[0]!.rows[0]).toEqual([-1271, -5239, 6064, null, 3501, -3054, 385]);
    expect(ref.at(-1)).toMatchObject({ name: "result_output", ne: [512, 1, 1, 1], sum: -2257334961 });
  });

  it("refuses a malformed dump with a typed error naming the line", () => {
    const bad = "common_debug_cb_eval:                     embd = (f32)   GET_ROWS(a{1, 1, 1, 1}, }) = {1, 1, 1, 1}\n";
    expect(() => parseEvalCallback(bad)).toThrow(EngineError);
    expect(() => parseEvalCallback(bad)).toThrow(/line 1: node embd has no sum line/);
  });
});

describe.skipIf(!probe.usable)(`eval-callback against llama.cpp's traces (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
  });
  afterAll(() => backend?.dispose());

  for (const v of VARIANTS) {
    it(`stories260K-${v}: every named node within ±2 in the last printed digit`, async () => {
      const model = await Model.load(join(models, `stories260K-${v}.gguf`), { backend });
      try {
        expect(model.tokenizer.tokenize("Once upon a time")).toEqual(IDS);
        const nodes = evalCallback(model, IDS, { nCtx: 256 });
        const cmp = compareTrace(nodes, reference(v));
        // every node llama.cpp names was found and compared, in llama.cpp's order
        const expected = [
          "embd",
          ...[0, 1, 2, 3, 4].flatMap((l) => LAYER_NODES.map((n) => `${n}-${l}`)),
          "norm",
          "result_norm",
          "result_output",
        ];
        expect(cmp.map((c) => c.name)).toEqual(expected);
        // the last layer's FFN runs on the last token only, in both: every node compares whole
        expect(cmp.filter((c) => c.lastColumn).map((c) => c.name)).toEqual([]);
        const beyond = cmp.filter((c) => c.maxDiff > 2 || c.sumDiff > 2);
        expect(beyond, JSON.stringify(beyond[0])).toEqual([]);
        // the printed values and the sums are equal outright (the last layer's FFN too, now that it runs on
        // the last token alone, in llama.cpp's matrix × vector arithmetic)
        expect(cmp.filter((c) => c.maxDiff !== 0)).toEqual([]);
        expect(Math.max(...cmp.map((c) => c.sumDiff))).toBe(0);
      } finally {
        model.dispose();
      }
    });
  }

  it("names our nodes as llama.cpp does, and those without a counterpart as node_N", async () => {
    const model = await Model.load(join(models, "stories260K-F16.gguf"), { backend });
    try {
      const all = evalCallback(model, IDS);
      const named = evalCallback(model, IDS, { nodes: "named" });
      expect(named.every((n) => !/^node_\d+$/.test(n.name))).toBe(true);
      expect(all.length).toBeGreaterThan(named.length);
      // our SiLU of the gate has no llama.cpp node (it fuses SiLU and the product into SWIGLU)
      expect(named.filter((n) => n.name.startsWith("ffn_silu-")).length).toBe(5);
      const q = named.find((n) => n.name === "Qcur-0" && n.op === "ROPE")!;
      expect(q.ne).toEqual([8, 8, 5, 1]);
      expect(q.srcs.map((s) => s.name)).toEqual(["Qcur-0", "inp_pos"]);
      expect(named.find((n) => n.name === "embd")!.srcs.map((s) => s.name)).toEqual([
        "token_embd.weight",
        "inp_tokens",
      ]);
      expect(() => evalCallback(model, [])).toThrow(/no tokens/);
      expect(() => evalCallback(model, [1, 99999])).toThrow(EngineError);
      expect(() => evalCallback(model, IDS, { nCtx: 2 })).toThrow(/n_ctx 2 is smaller/);
    } finally {
      model.dispose();
    }
  });
});

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe.skipIf(!probe.usable)("powerinfer eval-callback", () => {
  const model = join(models, "stories260K-Q8_0-ffn_down-F16.gguf");
  const ref = join(traces, "stories260K-Q8_0-ffn_down-F16.once-upon-a-time.eval-callback.txt");

  it("writes the dump in llama-eval-callback's format, and compares it with llama.cpp's", () => {
    const out = join(mkdtempSync(join(tmpdir(), "pi-evalcb-")), "ours.txt");
    const r = cli("eval-callback", "-m", model, "-p", "Once upon a time", "-t", "1", "-c", "256", "--out", out);
    expect(r.stderr).toBe("");
    expect(r.code).toBe(0);
    const ours = parseEvalCallback(readFileSync(out, "utf8"));
    expect(ours.find((n) => n.name === "result_output")!.sum).toBe(reference("Q8_0-ffn_down-F16").at(-1)!.sum);
    const c = cli("eval-callback", "-m", model, "-p", "Once upon a time", "-t", "1", "--compare", ref);
    expect(c.code).toBe(0);
    expect(c.stdout).toMatch(/^ +embd {2}max Δ +0 \(1e-4\)/m);
    expect(c.stdout).toMatch(/all 89 compared nodes within ±2 in the last printed digit \(values and sums\)\n$/);
    // the same dump with embd's printed sum 1e-5 off: the report says the sum failed, not a value
    const refText = readFileSync(ref, "utf8");
    const sumLine = /^( +sum = )(-?\d+\.\d{6})$/m.exec(refText)!;
    const offSum = join(dirname(out), "ref-sum-off.txt");
    writeFileSync(offSum, refText.replace(sumLine[0], `${sumLine[1]}${(Number(sumLine[2]) + 1e-5).toFixed(6)}`));
    const s = cli("eval-callback", "-m", model, "-p", "Once upon a time", "-t", "1", "--compare", offSum);
    expect(s.code).toBe(1);
    expect(s.stdout).toMatch(
      /first node beyond ±2 in the last printed digit: embd \(its values within ±2 \(max Δ 0e-4\), its printed sum off by (9|10|11) in the 6th decimal\)\n$/,
    );
    // another model's trace: the report names the first node beyond ±2 and the exit status is 1 (as diff)
    const other = join(traces, "stories260K-F16.once-upon-a-time.eval-callback.txt");
    const d = cli("eval-callback", "-m", model, "-p", "Once upon a time", "-t", "1", "--compare", other);
    expect(d.stdout).toMatch(/first node beyond ±2 in the last printed digit: /);
    expect(d.code).toBe(1);
    // a dump of another prompt (5 tokens there, 2 here) is refused, not compared on its last column
    const e = cli("eval-callback", "-m", model, "-p", "Once", "-t", "1", "--compare", ref);
    expect(e.code).toBe(1);
    expect(e.stdout).toBe("");
    expect(e.stderr).toBe(
      `powerinfer: ${ref} is a dump of 5 tokens (its embd node), and this prompt tokenizes to 2 tokens: compare the same model and prompt\n`,
    );
    // an existing --out file is replaced only with --force
    const again = cli("eval-callback", "-m", model, "-p", "Once upon a time", "-t", "1", "--out", out);
    expect(again.code).toBe(1);
    expect(again.stderr).toBe(`powerinfer: ${out} exists (use --force to overwrite)\n`);
    expect(parseEvalCallback(readFileSync(out, "utf8")).length).toBe(ours.length);
    const forced = cli("eval-callback", "-m", model, "-p", "Once", "-t", "1", "--out", out, "--force");
    expect(forced.code, forced.stderr).toBe(0);
  });

  it("refuses a missing prompt or a file that is no dump, in one line", () => {
    const a = cli("eval-callback", "-m", model);
    expect(a.code).toBe(1);
    expect(a.stderr).toBe("powerinfer: give a prompt with -p or -f\n");
    const b = cli("eval-callback", "-m", model, "-p", "x", "--compare", join(models, "README.md"));
    expect(b.code).toBe(1);
    expect(b.stderr).toMatch(/^powerinfer: .*README\.md holds no llama-eval-callback node\n$/);
  });

  it("lists itself with examples in --help", () => {
    const h = cli("eval-callback", "--help");
    expect(h.code).toBe(0);
    expect(h.stdout).toContain("$ powerinfer eval-callback -m model.gguf -p");
  });
});
