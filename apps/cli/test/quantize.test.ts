/**
 * `powerinfer quantize IN OUT TYPE` and `powerinfer convert` on real files: the container (GGUF/PWRI),
 * predictors and metadata survive; rows that do not fit the block fall back to F16 with a note.
 */
import { spawnSync } from "node:child_process";
import { existsSync, lstatSync, mkdtempSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { GGMLType, GgufTypes, openGguf, quantize, readTensorBytes, writeGguf } from "@powerinfer/gguf";
import { randomPredictor, rewriteModel } from "@powerinfer/predictor";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

const probe = await cpuBackend.probe();

describe("powerinfer quantize", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-quantize-"));
  const pwri = join(dir, "relu.pwri.gguf");

  beforeAll(() => {
    // a PWRI file with predictors (random ones: what matters here is that they are carried over), threshold
    // −1e30 so that every neuron runs and the output is the dense model's
    const layers = Array.from({ length: 6 }, (_, l) => randomPredictor(32, 256, 1024, l));
    rewriteModel(relu, pwri, { format: "PWRI", predictors: { layers, type: "f16", threshold: -1e30 } });
  });

  for (const [type, id, fileType] of [
    ["Q8_0", GGMLType.Q8_0, 7],
    ["q4_0", GGMLType.Q4_0, 2],
  ] as const) {
    it(`PWRI → ${type}: format, predictors and metadata kept, weight matrices ${type}`, () => {
      const out = join(dir, `relu.${type}.gguf`);
      const r = cli("quantize", pwri, out, type);
      expect(r.code, r.stderr).toBe(0);
      // most tensors are the matrices of the type asked for; vectors stay F32, predictors keep their type
      expect(r.stderr).toMatch(new RegExp(`wrote .* \\(PWRI, 69 tensors: \\d+ ${type.toUpperCase()}(, \\d+ \\w+)+\\)`));
      const a = openGguf(pwri);
      const b = openGguf(out);
      expect(b.format).toBe("PWRI");
      for (const [k, v] of a.metadata) if (k !== "general.file_type") expect(b.metadata.get(k), k).toEqual(v);
      expect(b.metadata.get("general.file_type")).toBe(fileType);
      expect(b.metadata.get("general.quantization_version")).toBe(2);
      expect(b.tensors.map((t) => t.name)).toEqual(a.tensors.map((t) => t.name));
      for (const t of b.tensors) {
        if (/fc[12]\.weight$/.test(t.name)) {
          expect(t.type).toBe(GGMLType.F16);
          expect(Buffer.from(readTensorBytes(b, t)).equals(Buffer.from(readTensorBytes(a, t.name)))).toBe(true);
        } else if (t.shape.length === 1) {
          expect(t.type, t.name).toBe(GGMLType.F32);
        } else {
          expect(t.type, t.name).toBe(id);
        }
      }
    });
  }

  it.skipIf(!probe.usable)("the quantized PWRI file runs in predictor mode like the F32 one", () => {
    const run = (m: string) => cli("run", "-m", m, "-p", "once upon a time", "-n", "12", "--temp", "0", "-t", "2");
    const q8file = join(dir, "run.q8.gguf");
    expect(cli("quantize", pwri, q8file, "Q8_0").code).toBe(0);
    const f32 = run(pwri);
    const q8 = run(q8file);
    expect(q8.code, q8.stderr).toBe(0);
    expect(q8.stderr).toMatch(
      /sparse: predictor mode, threshold -1(\.\d+)?e\+30; neurons computed per token: 100\.0 %/,
    );
    expect(q8.stdout).toBe(f32.stdout);
  });

  it("BF16 in a GGUF, then to Q8_0; a PWRI file cannot hold BF16 and gets F16 with a note", () => {
    const bf = join(dir, "relu.bf16.gguf");
    expect(cli("quantize", relu, bf, "BF16").code).toBe(0);
    const b = openGguf(bf);
    expect(b.format).toBe("GGUF");
    expect(b.tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.BF16);
    expect(b.metadata.get("general.file_type")).toBe(32);
    const q = join(dir, "relu.bf16.q8.gguf");
    expect(cli("quantize", bf, q, "Q8_0").code).toBe(0);
    expect(openGguf(q).tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.Q8_0);
    const r = cli("quantize", pwri, join(dir, "x.gguf"), "BF16");
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/note: blk\.0\.ffn_up\.weight: PWRI files cannot hold BF16, stored as F16/);
    expect(openGguf(join(dir, "x.gguf")).tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.F16);
  });

  it("rows that are not a multiple of the 32-element block fall back to F16, with a note", () => {
    const src = join(dir, "odd.gguf");
    const w = Float32Array.from({ length: 40 * 3 }, (_, i) => Math.sin(i));
    writeGguf(src, {
      metadata: [{ key: "general.architecture", type: GgufTypes.string, value: "llama" }],
      tensors: [
        { name: "blk.0.ffn_up.weight", type: GGMLType.F32, shape: [40, 3], data: quantize(GGMLType.F32, w) },
        {
          name: "blk.0.ffn_gate.weight",
          type: GGMLType.F32,
          shape: [64, 2],
          data: quantize(GGMLType.F32, new Float32Array(128)),
        },
      ],
    });
    const out = join(dir, "odd.q4.gguf");
    const r = cli("quantize", src, out, "Q4_0");
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(
      /note: blk\.0\.ffn_up\.weight: rows of 40 are not a multiple of the Q4_0 block \(32\), stored as F16/,
    );
    const f = openGguf(out);
    expect(f.tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.F16);
    expect(f.tensorMap.get("blk.0.ffn_gate.weight")!.type).toBe(GGMLType.Q4_0);
  });

  it("an existing output is replaced only with --force; a symlink is followed, a FIFO refused; the summary counts types", () => {
    const out = join(dir, "precious.gguf");
    writeFileSync(out, "precious");
    const r = cli("quantize", relu, out, "Q8_0");
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/precious\.gguf exists \(use --force to overwrite\)/);
    expect(readFileSync(out, "utf8")).toBe("precious");
    const c = cli("convert", relu, out);
    expect(c.code).toBe(1);
    expect(c.stderr).toMatch(/exists \(use --force to overwrite\)/);
    const f = cli("quantize", relu, out, "Q8_0", "--force");
    expect(f.code, f.stderr).toBe(0);
    // the file holds Q8_0 matrices and F32 vectors: the summary says so instead of "Q8_0"
    expect(f.stderr).toMatch(/wrote .*precious\.gguf \(GGUF, \d+ tensors: \d+ Q8_0, \d+ F32\)/);
    expect(openGguf(out).tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.Q8_0);
    // a symlink: its target gets the file and the link stays a link
    const target = join(dir, "target.gguf");
    const link = join(dir, "link.gguf");
    symlinkSync(target, link);
    const l = cli("quantize", relu, link, "Q8_0");
    expect(l.code, l.stderr).toBe(0);
    expect(lstatSync(link).isSymbolicLink()).toBe(true);
    expect(openGguf(target).tensorMap.get("blk.0.ffn_up.weight")!.type).toBe(GGMLType.Q8_0);
    // a FIFO in place of the output is refused before anything is written (and stays a FIFO)
    const fifo = join(dir, "fifo.gguf");
    expect(spawnSync("mkfifo", [fifo]).status).toBe(0);
    const p = cli("quantize", relu, fifo, "Q8_0", "--force");
    expect(p.code).toBe(1);
    expect(p.stderr).toMatch(/fifo\.gguf is not a regular file/);
    expect(lstatSync(fifo).isFIFO()).toBe(true);
  });

  it("convert --bundle refuses a model without predictors (a bundled model runs in predictor mode only)", () => {
    const pw = join(dir, "nopred.pwri.gguf");
    expect(cli("convert", relu, pw).code).toBe(0);
    const r = cli("convert", pw, join(dir, "nopred.bundle.gguf"), "--bundle");
    expect(r.code).toBe(1);
    expect(r.stderr).toMatch(/has no predictors, and a bundled model runs only in predictor mode/);
    expect(existsSync(join(dir, "nopred.bundle.gguf"))).toBe(false);
  });

  it("a model with matrices quantized to another type is refused (llama.cpp needs --allow-requantize); an expert router stays F32", () => {
    const q8 = join(dir, "already-q8.gguf");
    expect(cli("quantize", relu, q8, "Q8_0").code).toBe(0);
    const r = cli("quantize", q8, join(dir, "requant.gguf"), "Q4_0");
    expect(r.code).toBe(1);
    expect(r.stderr.trim().split("\n")).toEqual([
      `powerinfer: ${q8}'s weight matrices are already quantized (Q8_0): this command converts F32/F16/BF16 matrices only, so they would stay Q8_0 in a file asked to be Q4_0 (requantizing loses precision, and llama.cpp's llama-quantize refuses it too); start from the F32/F16/BF16 model`,
    ]);
    expect(existsSync(join(dir, "requant.gguf"))).toBe(false);
    // some matrices quantized, some not (Q8_0 with an F16 down projection): refused for another type, the
    // float ones converted for the same type
    const mixed = join(models, "stories260K-Q8_0-ffn_down-F16.gguf");
    const m4 = cli("quantize", mixed, join(dir, "mixed-q4.gguf"), "Q4_0");
    expect(m4.code).toBe(1);
    expect(m4.stderr).toMatch(/already quantized \(Q8_0\) \(\d+ of its \d+ weight matrices\): .* asked to be Q4_0/);
    const m8 = cli("quantize", mixed, join(dir, "mixed-q8.gguf"), "Q8_0");
    expect(m8.code, m8.stderr).toBe(0);
    // its F16 ffn_down rows (172) are not whole Q8_0 blocks: they stay F16, with a note
    expect(m8.stderr).toMatch(/wrote .*mixed-q8\.gguf \(GGUF, 48 tensors: 32 Q8_0, 11 F32, 5 F16\)/);
    // routed experts: ffn_gate_inp is copied as stored, the expert stacks are quantized
    const st = join(dir, "st-f32.gguf");
    generateSyntheticMoeModel(st, {
      arch: "smallthinker",
      shape: { ...TINY_MOE_SHAPE, n_layer: 1, n_ctx: 64 },
      untiedOutput: false,
    });
    const out = join(dir, "st-q4.gguf");
    const q = cli("quantize", st, out, "Q4_0");
    expect(q.code, q.stderr).toBe(0);
    const f = openGguf(out);
    expect(f.tensorMap.get("blk.0.ffn_gate_inp.weight")!.type).toBe(GGMLType.F32);
    expect(f.tensorMap.get("blk.0.ffn_up_exps.weight")!.type).toBe(GGMLType.Q4_0);
  });

  it("takes llama-quantize's numeric types: 7 writes the same file as Q8_0, 2 as Q4_0", () => {
    for (const [num, name] of [
      ["7", "Q8_0"],
      ["2", "Q4_0"],
    ]) {
      const a = join(dir, `num-${num}.gguf`);
      const b = join(dir, `name-${name}.gguf`);
      expect(cli("quantize", relu, a, num).code).toBe(0);
      expect(cli("quantize", relu, b, name.toLowerCase()).code).toBe(0);
      expect(Buffer.compare(readFileSync(a), readFileSync(b))).toBe(0);
    }
  });

  it("an unsupported type or a missing file: one line naming it", () => {
    for (const [args, pattern] of [
      [
        ["quantize", relu, join(dir, "y.gguf"), "Q6_K"],
        /cannot quantize to "Q6_K" \(supported: F32, F16, BF16, Q8_0, Q4_0, or llama-quantize's numbers 0, 1, 2, 7, 32 /,
      ],
      [["quantize", relu, join(dir, "y.gguf"), "8"], /cannot quantize to "8" \(supported: /],
      [["quantize", join(dir, "nope.gguf"), join(dir, "y.gguf"), "Q8_0"], /nope\.gguf/],
    ] as const) {
      const r = cli(...args);
      expect(r.code).not.toBe(0);
      expect(r.stderr).toMatch(pattern);
      expect(r.stderr.trim().split("\n")).toHaveLength(1);
    }
  });
});

describe("powerinfer convert", () => {
  it("GGUF → PWRI → GGUF gives back every tensor byte for byte", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-convert-"));
    const pw = join(dir, "a.pwri.gguf");
    const gg = join(dir, "a.gguf");
    expect(cli("convert", relu, pw).code).toBe(0);
    const p = openGguf(pw);
    expect(p.format).toBe("PWRI");
    expect(p.tensorMap.get("blk.3.ffn_down_t.weight")?.shape).toEqual([256, 1024]);
    expect(cli("convert", pw, gg, "--to", "gguf").code).toBe(0);
    const a = openGguf(relu);
    const c = openGguf(gg);
    expect(c.tensors.map((t) => t.name)).toEqual(a.tensors.map((t) => t.name));
    for (const t of a.tensors)
      expect(Buffer.from(readTensorBytes(c, t.name)).equals(Buffer.from(readTensorBytes(a, t)))).toBe(true);
    const r = cli("convert", relu, join(dir, "b.gguf"), "--to", "onnx");
    expect(r.stderr).toMatch(/--to must be pwri or gguf/);
  });
});
