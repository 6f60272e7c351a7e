import { copyFileSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { writeActivationStats } from "@powerinfer/gguf";
import { afterEach, describe, expect, it, vi } from "vitest";
import { formatF32, formatInspect, inspectFile } from "../src/commands/inspect.js";
import { createProgram } from "../src/program.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const m = (rel: string) => join(models, rel);

/** Runs `powerinfer inspect ...args` in-process; returns stdout, stderr and the exit code it set. */
function cli(...args: string[]): Promise<{ out: string; err: string; code: number }> {
  return command("inspect", ...args);
}

/** Runs `powerinfer ...args` in-process; returns stdout, stderr and the exit code it set. */
async function command(...args: string[]): Promise<{ out: string; err: string; code: number }> {
  const program = createProgram().exitOverride();
  let out = "";
  let err = "";
  const so = vi.spyOn(process.stdout, "write").mockImplementation((s) => {
    out += String(s);
    return true;
  });
  const se = vi.spyOn(process.stderr, "write").mockImplementation((s) => {
    err += String(s);
    return true;
  });
  const before = process.exitCode;
  process.exitCode = undefined;
  try {
    await program.parseAsync(args, { from: "user" });
    return { out, err, code: Number(process.exitCode ?? 0) };
  } finally {
    so.mockRestore();
    se.mockRestore();
    process.exitCode = before;
  }
}

afterEach(() => vi.restoreAllMocks());

describe("inspect", () => {
  it("stories260K.gguf: dense SiLU llama — a dense model gains nothing from sparse inference", () => {
    const r = inspectFile(m("stories260K.gguf"));
    expect(r.format).toBe("GGUF");
    expect(r.architecture).toBe("llama");
    expect(r.config).toMatchObject({ n_vocab: 512, n_embd: 64, n_layer: 5, n_ff: 172, n_head: 8, n_head_kv: 4 });
    expect(r.tensors).toHaveLength(48);
    expect(r.tensors[0]).toEqual({
      name: "token_embd.weight",
      type: "F32",
      shape: [64, 512],
      bytes: 131072,
      offset: 14176,
    });
    expect(r.parameters).toBe(292800);
    expect(r.tensorBytes).toBe(292800 * 4);
    expect(r.fileSize).toBe(1185376);
    expect(r.sparse.verdict).toBe("dense");
    expect(r.sparse.reason).toContain("a dense model gains nothing from sparse inference");
    const text = formatInspect(r);
    expect(text).toMatch(/^format: +GGUF v3/m);
    expect(text).toMatch(/^architecture: +llama/m);
    expect(text).toContain("n_vocab 512, n_ctx_train 128, n_embd 64, n_layer 5, n_ff 172");
    expect(text).toContain("n_head 8, n_head_kv 4, head_dim 8, n_rot 8");
    expect(text).toContain("FFN silu(gate)·up");
    expect(text).toMatch(/^ {2}blk\.0\.ffn_down\.weight +F32 +172 × 64 +44,032$/m);
    expect(text).toContain(
      "48 tensors (48 F32), 292,800 elements, 1,171,200 bytes of tensor data; file 1,185,376 bytes",
    );
    expect(text).toMatch(/^sparse: .*a dense model gains nothing from sparse inference/m);
  });

  it("a PWRI fixture can run sparse", () => {
    const r = inspectFile(m("powerinfer/tiny-q4_0.powerinfer.gguf"));
    expect(r.format).toBe("PWRI");
    expect(r.typeCounts).toEqual({ Q4_0: 19, F32: 5, Q8_0: 1 });
    expect(r.config).toMatchObject({ has_predictors: true, predictor_ranks: [32, 32], down_transposed: true });
    expect(r.sparse.verdict).toBe("sparse");
    expect(r.sparse.reason).toMatch(/can run sparse: ReLU FFN .* predictors in all 2 layers \(rank 32\), threshold 0/);
    const text = formatInspect(r);
    expect(text).toMatch(/^format: +PWRI \(PowerInfer GGUF\) v3/m);
    expect(text).toContain("predictors rank 32, sparse_threshold 0, ffn_down transposed (ffn_down_t)");
    expect(text).toMatch(/^ {2}blk\.1\.fc2\.weight +Q4_0 +32 × 1024 +18,432$/m);
  });

  it("the ReLU model without predictors: sparse after train-predictor or in oracle mode", () => {
    const r = inspectFile(m("relu/tinystories-relu-llama-7m.f32.gguf"));
    expect(r.config).toMatchObject({ ffn: { activation: "relu", gated: true }, has_predictors: false });
    expect(r.sparse.verdict).toBe("needs-predictor");
    expect(r.sparse.reason).toContain("train-predictor");
    expect(r.sparse.reason).toContain("oracle mode");
    expect(r.parameters).toBe(6950144);
  });

  it("non-model files get a verdict too", () => {
    expect(inspectFile(m("powerinfer/tiny.generated.gpuidx")).sparse.verdict).toBe("not-a-model");
    const vocab = inspectFile(m("vocab/ggml-vocab-gpt-2.gguf"));
    expect(vocab.sparse).toEqual({
      verdict: "not-a-model",
      reason: "this is a vocabulary-only file: it holds a tokenizer but no weights",
    });
    expect(vocab.kind).toBe("vocabulary");
    expect(vocab.config).toBeNull();
    expect(vocab.configError).toContain('unsupported architecture "gpt2"');
    expect(formatInspect(vocab)).toContain("hyper-parameters: not available");
  });

  it("the command prints text, or JSON that parses, and --metadata lists the keys", async () => {
    const text = await cli(m("stories260K.gguf"));
    expect(text.code).toBe(0);
    expect(text.err).toBe("");
    expect(text.out).toContain("a dense model gains nothing from sparse inference");
    const json = await cli(m("powerinfer/tiny.generated.gpuidx"), "--json");
    expect(json.code).toBe(0);
    const parsed = JSON.parse(json.out);
    expect(parsed.format).toBe("PWRI");
    expect(parsed.tensors.map((t: { type: string }) => t.type)).toEqual(["I32", "I32", "I32", "I32"]);
    expect(parsed.metadata).toContainEqual({ key: "split.vram_capacity", type: "uint64", value: "123456" });
    const pwri = JSON.parse((await cli(m("powerinfer/tiny-f16.powerinfer.gguf"), "--json")).out);
    expect(pwri.sparse.verdict).toBe("sparse");
    expect(pwri.config.n_ff).toBe(1024);
    const meta = await cli(m("stories260K.gguf"), "--metadata");
    expect(meta.out).toMatch(/^ {2}llama\.context_length \[uint32\] = 128$/m);
    expect(meta.out).toContain('tokenizer.ggml.tokens [array<string>] = [512 items: "<unk>", "<s>", "</s>"');
  });

  it("float32 metadata is printed as its shortest decimal that reads back as the same float32", async () => {
    expect(formatF32(Math.fround(0.2))).toBe("0.2");
    expect(formatF32(Math.fround(-0.28122175))).toBe("-0.28122175");
    expect(formatF32(Math.fround(1e-5))).toBe("0.00001");
    expect(formatF32(10000)).toBe("10000");
    expect(formatF32(0)).toBe("0");
    // not a float32: as it is
    expect(formatF32(0.1)).toBe("0.1");
    expect(formatF32(1 / 3)).toBe(String(1 / 3));
    expect(formatF32(Number.POSITIVE_INFINITY)).toBe("Infinity");
    // a model whose threshold (and other keys) the file stores as float32
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-inspect-"));
    const path = join(dir, "t.pwri.gguf");
    const gen = await command(
      "gen-model",
      "--preset",
      "tiny",
      "--format",
      "pwri",
      "--threshold",
      "0.2",
      "--stats-tokens",
      "0",
      "-o",
      path,
    );
    expect(gen.code, gen.err).toBe(0);
    const r = inspectFile(path);
    expect(r.metadata).toContainEqual({ key: "powerinfer.sparse_threshold", type: "float32", value: 0.2 });
    expect(r.metadata).toContainEqual({ key: "powerinfer.synthetic.active_fraction", type: "float32", value: 0.1 });
    expect(r.config?.sparse_threshold).toBe(0.2);
    expect(r.config?.norm.eps).toBe(0.00001); // llama.attention.layer_norm_rms_epsilon, float32
    expect(r.config?.rope.freq_base).toBe(10000);
    expect(r.sparse.reason).toMatch(/, threshold 0\.2$/);
    const text = formatInspect(r, { metadata: true });
    expect(text).toContain("predictors rank 128, sparse_threshold 0.2, ffn_down transposed (ffn_down_t)");
    expect(text).toMatch(/^ {2}powerinfer\.sparse_threshold \[float32\] = 0\.2$/m);
    expect(text).toMatch(/^ {2}llama\.attention\.layer_norm_rms_epsilon \[float32\] = 0\.00001$/m);
    expect(text).not.toMatch(/0\.2000000029|0\.1000000014|0\.0000099999/);
    // integers and strings are untouched
    expect(text).toMatch(/^ {2}llama\.context_length \[uint32\] = 512$/m);
  });

  it("statistics of another model next to it: the report says how they differ, naming both", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-inspect-stats-"));
    const model = join(dir, "dense.gguf");
    copyFileSync(m("stories260K.gguf"), model); // 5 layers, n_ff 172, no experts
    // a routed-experts model's statistics: 3 layers of 8 experts with 16 neurons each
    writeActivationStats(join(dir, "dense.activations.gguf"), {
      counts: Array.from({ length: 3 }, () => new Int32Array(16 * 8)),
      nFf: 16,
      nExpert: 8,
      selections: Array.from({ length: 3 }, () => new Int32Array(8)),
      tokenCount: 10,
      corpusName: "t",
      corpusSha256: "",
      modelSha256: "",
    });
    const r = inspectFile(model);
    expect(r.activationStats).toEqual({
      path: join(dir, "dense.activations.gguf"),
      error:
        "statistics of another model: they have 3 layers of 8 experts with 16 neurons each, this model 5 layers of n_ff 172 without experts; run `powerinfer profile` on this model",
    });
    const text = formatInspect(r);
    expect(text).toContain(
      `activations:   ${join(dir, "dense.activations.gguf")} unusable: statistics of another model: they have 3 layers`,
    );
    expect(text).not.toMatch(/this model has none|no experts/);
    // a dense model's statistics with other layers and neurons
    writeActivationStats(join(dir, "dense.activations.gguf"), {
      counts: Array.from({ length: 2 }, () => new Int32Array(1024)),
      nFf: 1024,
      tokenCount: 10,
      corpusName: "t",
      corpusSha256: "",
      modelSha256: "",
    });
    expect(inspectFile(model).activationStats).toMatchObject({
      error:
        "statistics of another model: they have 2 layers of n_ff 1024 without experts, this model 5 layers of n_ff 172 without experts; run `powerinfer profile` on this model",
    });
  });

  it("errors are one line on stderr naming the problem, with exit code 1", async () => {
    const missing = await cli(m("no-such-model.gguf"));
    expect(missing.code).toBe(1);
    expect(missing.out).toBe("");
    expect(missing.err.trim().split("\n")).toHaveLength(1);
    expect(missing.err).toMatch(/^powerinfer: .*no-such-model\.gguf (does not exist|.*ENOENT)/);
    const notGguf = await cli(m("powerinfer/README.md"));
    expect(notGguf.code).toBe(1);
    expect(notGguf.err.trim().split("\n")).toHaveLength(1);
    expect(notGguf.err).toMatch(/^powerinfer: .*README\.md at byte 0: expected magic "GGUF" or "PWRI"/);
    expect(notGguf.err).not.toMatch(/GgufError|BAD_MAGIC/); // the class and code only with --verbose
    expect(notGguf.err).not.toMatch(/\n\s+at /);
    const verbose = await cli(m("powerinfer/README.md"), "--verbose");
    expect(verbose.err.trim()).toBe(`${notGguf.err.trim()} [GgufError BAD_MAGIC]`);
  });
});
