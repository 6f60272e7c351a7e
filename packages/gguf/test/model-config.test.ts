import { describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  type GgufMetadataEntry,
  GgufTypes,
  GgufValueType,
  type GgufWriteSpec,
  ModelConfigSchema,
  openGguf,
  parseGgufBuffer,
  parseModelConfig,
  serializeGguf,
} from "../src/index.js";
import { model } from "./helpers.js";

function catchGguf(fn: () => unknown): GgufError {
  try {
    fn();
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError");
}

describe("shared models", () => {
  it("stories260K: dense SiLU llama with the README's hyper-parameters", () => {
    const cfg = parseModelConfig(openGguf(model("stories260K.gguf")));
    expect(cfg).toMatchObject({
      arch: "llama",
      format: "GGUF",
      n_vocab: 512,
      n_ctx_train: 128,
      n_ctx: 128,
      n_embd: 64,
      n_layer: 5,
      n_ff: 172,
      n_head: 8,
      n_head_kv: 4,
      head_dim: 8,
      n_rot: 8,
      rope: { type: "normal", freq_base: 10000, freq_scale: 1 },
      norm: { type: "rms" },
      ffn: { activation: "silu", gated: true },
      parallel_attn: false,
      has_predictors: false,
      predictor_ranks: [],
      sparse_threshold: 0,
      down_transposed: false,
      warnings: [],
    });
    expect(cfg.norm.eps).toBeCloseTo(1e-5, 12);
    expect(cfg.ffn.up_activation).toBeUndefined();
    expect(ModelConfigSchema.parse(cfg)).toEqual(cfg);
  });

  it("a context larger than the trained one is allowed with a warning (llama.cpp ran n_ctx 256 on 128)", () => {
    const cfg = parseModelConfig(openGguf(model("stories260K.gguf")), { nCtx: 256 });
    expect(cfg.n_ctx).toBe(256);
    expect(cfg.warnings).toHaveLength(1);
    expect(cfg.warnings[0]).toMatch(/256.*larger than the trained context 128.*llama\.context_length/);
    expect(parseModelConfig(openGguf(model("stories260K-ggml-org.gguf")), { nCtx: 256 }).warnings).toEqual([]);
    expect(catchGguf(() => parseModelConfig(openGguf(model("stories260K.gguf")), { nCtx: 0 })).code).toBe("BAD_VALUE");
  });

  it.each([
    "stories260K-F16.gguf",
    "stories260K-BF16.gguf",
    "stories260K-Q8_0-ffn_down-F16.gguf",
    "stories260K-Q4_0-ffn_down-F16.gguf",
  ])("%s has the same configuration as the F32 file", (rel) => {
    expect(parseModelConfig(openGguf(model(rel)))).toEqual(parseModelConfig(openGguf(model("stories260K.gguf"))));
  });

  it("ReLU model: llama.hidden_act = relu makes a ReLU-gated dense model without predictors", () => {
    const cfg = parseModelConfig(openGguf(model("relu/tinystories-relu-llama-7m.f32.gguf")));
    expect(cfg).toMatchObject({
      arch: "llama",
      format: "GGUF",
      n_vocab: 2048,
      n_ctx_train: 256,
      n_embd: 256,
      n_layer: 6,
      n_ff: 1024,
      n_head: 8,
      n_head_kv: 4,
      head_dim: 32,
      n_rot: 32,
      rope: { type: "normal", freq_base: 10000, freq_scale: 1 },
      ffn: { activation: "relu", gated: true },
      has_predictors: false,
      down_transposed: false,
      warnings: [],
    });
  });

  it.each([
    "powerinfer/tiny-f16.powerinfer.gguf",
    "powerinfer/tiny-f32.powerinfer.gguf",
    "powerinfer/tiny-q4_0.powerinfer.gguf",
  ])("%s: PWRI llama is ReLU(gate)·up with rank-32 predictors, threshold 0, transposed down", (rel) => {
    const cfg = parseModelConfig(openGguf(model(rel)));
    expect(cfg).toMatchObject({
      arch: "llama",
      format: "PWRI",
      name: "tiny-powerinfer-smoke",
      n_vocab: 265,
      n_ctx_train: 256,
      n_embd: 128,
      n_layer: 2,
      n_ff: 1024,
      n_head: 4,
      n_head_kv: 4,
      head_dim: 32,
      n_rot: 32,
      norm: { type: "rms" },
      ffn: { activation: "relu", gated: true },
      has_predictors: true,
      predictor_ranks: [32, 32],
      sparse_threshold: 0,
      down_transposed: true,
      warnings: [],
    });
  });

  it("vocab-only files: llama-spm gives a config (no tensors to cross-check); gpt2/bert are refused", () => {
    const cfg = parseModelConfig(openGguf(model("vocab/ggml-vocab-llama-spm.gguf")));
    expect([cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_ff, cfg.head_dim]).toEqual([32000, 4096, 32, 11008, 128]);
    const e = catchGguf(() => parseModelConfig(openGguf(model("vocab/ggml-vocab-gpt-2.gguf"))));
    expect(e.code).toBe("BAD_VALUE");
    expect(e.message).toMatch(/"general\.architecture".*unsupported architecture "gpt2"/);
  });
});

/** A metadata-only file of architecture `arch` with llama.cpp's standard keys, plus overrides. */
function synth(
  arch: string,
  over: Record<string, GgufMetadataEntry | null> = {},
  opts: { format?: "GGUF" | "PWRI"; tensors?: GgufWriteSpec["tensors"] } = {},
) {
  const base: Record<string, GgufMetadataEntry> = {};
  const add = (key: string, type: GgufMetadataEntry["type"], value: GgufMetadataEntry["value"]) => {
    base[key] = { key, type, value };
  };
  add("general.architecture", GgufTypes.string, arch);
  add(`${arch}.context_length`, GgufTypes.u32, 2048);
  add(`${arch}.embedding_length`, GgufTypes.u32, 64);
  add(`${arch}.block_count`, GgufTypes.u32, 2);
  add(`${arch}.feed_forward_length`, GgufTypes.u32, 256);
  add(`${arch}.attention.head_count`, GgufTypes.u32, 4);
  const rms = arch === "llama" || arch === "bamboo";
  add(`${arch}.attention.layer_norm${rms ? "_rms" : ""}_epsilon`, GgufTypes.f32, Math.fround(1e-6));
  add("tokenizer.ggml.tokens", GgufTypes.array(GgufValueType.STRING), ["a", "b", "c"]);
  for (const [k, v] of Object.entries(over)) {
    if (v === null) delete base[k];
    else base[k] = v;
  }
  return parseGgufBuffer(
    serializeGguf({ format: opts.format, metadata: Object.values(base), tensors: opts.tensors ?? [] }),
    `${arch}.gguf`,
  );
}
const e = (key: string, type: GgufMetadataEntry["type"], value: GgufMetadataEntry["value"]) => ({ key, type, value });

describe("architectures and defaults", () => {
  it("llama defaults: n_head_kv = n_head, head_dim = n_embd / n_head, n_rot = head_dim, θ 10000", () => {
    const cfg = parseModelConfig(synth("llama"));
    expect([cfg.n_head_kv, cfg.head_dim, cfg.n_rot, cfg.n_vocab]).toEqual([4, 16, 16, 3]);
    expect(cfg.rope).toEqual({ type: "normal", freq_base: 10000, freq_scale: 1 });
    expect(cfg.ffn).toEqual({ activation: "silu", gated: true });
  });

  it("rope keys: freq_base, linear scaling factor (and the old scale_linear key)", () => {
    const cfg = parseModelConfig(
      synth("llama", {
        "llama.rope.freq_base": e("llama.rope.freq_base", GgufTypes.f32, 500000),
        "llama.rope.scaling.type": e("llama.rope.scaling.type", GgufTypes.string, "linear"),
        "llama.rope.scaling.factor": e("llama.rope.scaling.factor", GgufTypes.f32, 4),
      }),
    );
    expect(cfg.rope).toEqual({ type: "normal", freq_base: 500000, freq_scale: 0.25 });
    const old = parseModelConfig(
      synth("llama", { "llama.rope.scale_linear": e("llama.rope.scale_linear", GgufTypes.f32, 2) }),
    );
    expect(old.rope.freq_scale).toBe(0.5);
    const yarn = catchGguf(() =>
      parseModelConfig(
        synth("llama", { "llama.rope.scaling.type": e("llama.rope.scaling.type", GgufTypes.string, "yarn") }),
      ),
    );
    expect(yarn.message).toContain('"llama.rope.scaling.type"');
  });

  it("a sparse threshold that is not finite is refused naming its key", () => {
    for (const v of [Number.NaN, Number.POSITIVE_INFINITY]) {
      const err = catchGguf(() =>
        parseModelConfig(
          synth("llama", { "powerinfer.sparse_threshold": e("powerinfer.sparse_threshold", GgufTypes.f32, v) }),
        ),
      );
      expect(err.code).toBe("BAD_VALUE");
      expect(err.message).toMatch(/"powerinfer.sparse_threshold" must be a finite number, found (NaN|Infinity)/);
    }
  });

  it("bamboo: ReLU(gate)·ReLU(up), RMS norm", () => {
    const cfg = parseModelConfig(synth("bamboo", {}, { format: "PWRI" }));
    expect(cfg.ffn).toEqual({ activation: "relu", gated: true, up_activation: "relu" });
    expect(cfg.norm.type).toBe("rms");
    expect(cfg.rope.type).toBe("normal");
  });

  it("falcon: layer norm, NeoX RoPE, parallel attention, ungated GELU dense / ReLU in PWRI", () => {
    const dense = parseModelConfig(synth("falcon"));
    expect(dense).toMatchObject({ norm: { type: "layer" }, rope: { type: "neox" }, parallel_attn: true });
    expect(dense.ffn).toEqual({ activation: "gelu", gated: false });
    expect(parseModelConfig(synth("falcon", {}, { format: "PWRI" })).ffn).toEqual({ activation: "relu", gated: false });
  });

  it("opt: layer norm, learned positions (no RoPE), ungated ReLU", () => {
    const cfg = parseModelConfig(synth("opt"));
    expect(cfg).toMatchObject({ norm: { type: "layer" }, rope: { type: "none" }, n_rot: 0, parallel_attn: false });
    expect(cfg.ffn).toEqual({ activation: "relu", gated: false });
  });

  it("n_vocab comes from {arch}.vocab_size when present", () => {
    const cfg = parseModelConfig(
      synth("llama", { "tokenizer.ggml.tokens": null, "llama.vocab_size": e("llama.vocab_size", GgufTypes.u32, 99) }),
    );
    expect(cfg.n_vocab).toBe(99);
  });

  it("u64 keys and per-layer arrays with equal entries are accepted", () => {
    const cfg = parseModelConfig(
      synth("llama", {
        "llama.context_length": e("llama.context_length", GgufTypes.u64, 4096n),
        "llama.feed_forward_length": e(
          "llama.feed_forward_length",
          GgufTypes.array(GgufValueType.UINT32),
          Uint32Array.of(256, 256),
        ),
      }),
    );
    expect([cfg.n_ctx_train, cfg.n_ff]).toEqual([4096, 256]);
  });
});

describe("missing and contradictory keys are errors naming the key", () => {
  it.each([
    "llama.context_length",
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
    "general.architecture",
  ])("MISSING_KEY %s", (key) => {
    const err = catchGguf(() => parseModelConfig(synth("llama", { [key]: null })));
    expect(err.code).toBe("MISSING_KEY");
    expect(err.message).toContain(`"${key}"`);
  });

  it("no vocabulary at all", () => {
    const err = catchGguf(() => parseModelConfig(synth("llama", { "tokenizer.ggml.tokens": null })));
    expect(err.code).toBe("MISSING_KEY");
    expect(err.message).toContain('"tokenizer.ggml.tokens"');
  });

  const cases: Array<[string, Record<string, GgufMetadataEntry | null>, string, GgufWriteSpec["format"]?]> = [
    [
      "head_count_kv does not divide head_count",
      { k: e("llama.attention.head_count_kv", GgufTypes.u32, 3) },
      "llama.attention.head_count_kv",
    ],
    [
      "head_count does not divide n_embd",
      { k: e("llama.attention.head_count", GgufTypes.u32, 5) },
      "llama.attention.head_count",
    ],
    ["vocab_size vs token list", { k: e("llama.vocab_size", GgufTypes.u32, 4) }, "llama.vocab_size"],
    ["rope dims > head_dim", { k: e("llama.rope.dimension_count", GgufTypes.u32, 32) }, "llama.rope.dimension_count"],
    ["zero block count", { k: e("llama.block_count", GgufTypes.u32, 0) }, "llama.block_count"],
    [
      "string where a number belongs",
      { k: e("llama.embedding_length", GgufTypes.string, "64") },
      "llama.embedding_length",
    ],
    [
      "negative epsilon",
      { k: e("llama.attention.layer_norm_rms_epsilon", GgufTypes.f32, -1) },
      "llama.attention.layer_norm_rms_epsilon",
    ],
    ["unknown activation", { k: e("llama.hidden_act", GgufTypes.string, "tanh") }, "llama.hidden_act"],
    ["SiLU in a PWRI llama", { k: e("llama.hidden_act", GgufTypes.string, "silu") }, "llama.hidden_act", "PWRI"],
    [
      "differing per-layer n_ff",
      { k: e("llama.feed_forward_length", GgufTypes.array(GgufValueType.UINT32), Uint32Array.of(256, 512)) },
      "llama.feed_forward_length",
    ],
  ];
  it.each(cases)("BAD_VALUE: %s", (_, over, key, format) => {
    const fixed = Object.fromEntries(Object.values(over).map((v) => [v!.key, v]));
    const err = catchGguf(() => parseModelConfig(synth("llama", fixed, { format })));
    expect(err.code).toBe("BAD_VALUE");
    expect(err.message).toContain(`"${key}"`);
  });

  it("tensor shapes that contradict the keys", () => {
    const f32 = (name: string, shape: number[]) => ({
      name,
      type: GGMLType.F32,
      shape,
      data: new Uint8Array(shape.reduce((a, b) => a * b, 4)),
    });
    const layer = (l: number, nFf = 256) => [
      f32(`blk.${l}.attn_norm.weight`, [64]),
      f32(`blk.${l}.ffn_gate.weight`, [64, nFf]),
      f32(`blk.${l}.ffn_up.weight`, [64, nFf]),
    ];
    const ok = synth("llama", {}, { tensors: [f32("token_embd.weight", [64, 3]), ...layer(0), ...layer(1)] });
    expect(parseModelConfig(ok).n_layer).toBe(2);
    const embd = synth("llama", {}, { tensors: [f32("token_embd.weight", [32, 3]), ...layer(0), ...layer(1)] });
    expect(catchGguf(() => parseModelConfig(embd)).message).toContain('"llama.embedding_length"');
    const ff = synth("llama", {}, { tensors: [...layer(0, 128), ...layer(1, 128)] });
    expect(catchGguf(() => parseModelConfig(ff)).message).toContain('"llama.feed_forward_length"');
    const blocks = synth("llama", {}, { tensors: [...layer(0), ...layer(1), ...layer(2)] });
    expect(catchGguf(() => parseModelConfig(blocks)).message).toContain('"llama.block_count"');
    const half = synth("llama", {}, { tensors: [...layer(0), ...layer(1), f32("blk.0.fc1.weight", [64, 8])] });
    expect(catchGguf(() => parseModelConfig(half)).message).toContain('"blk.0.fc2.weight"');
    const partial = synth(
      "llama",
      {},
      {
        format: "PWRI",
        tensors: [...layer(0), ...layer(1), f32("blk.0.fc1.weight", [64, 8]), f32("blk.0.fc2.weight", [8, 256])],
      },
    );
    const cfg = parseModelConfig(partial);
    expect(cfg.has_predictors).toBe(false);
    expect(cfg.warnings[0]).toMatch(/only 1 of 2 layers have predictors/);
  });
});
