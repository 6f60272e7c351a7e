import {
  closeSync,
  mkdtempSync,
  openSync,
  readdirSync,
  rmSync,
  statSync,
  truncateSync,
  writeFileSync,
  writeSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join, relative } from "node:path";
import { describe, expect, it } from "vitest";
import {
  GGMLType,
  type GgufFile,
  GgufValueType,
  getArray,
  getNumber,
  getString,
  ggmlTypeName,
  openGguf,
  readGpuIndex,
  readTensorBytes,
} from "../src/index.js";
import { Craft, MODELS, model } from "./helpers.js";

/** Every GGUF-container file in the shared models directory (walked, so new files get noticed). */
function allContainerFiles(dir = MODELS): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) out.push(...allContainerFiles(p));
    else if (name.endsWith(".gguf") || name.endsWith(".gpuidx")) out.push(relative(MODELS, p));
  }
  return out.sort();
}

const STORIES = [
  "stories260K.gguf",
  "stories260K-ggml-org.gguf",
  "stories260K-F16.gguf",
  "stories260K-BF16.gguf",
  "stories260K-Q8_0-ffn_down-F16.gguf",
  "stories260K-Q4_0-ffn_down-F16.gguf",
];
const PWRI = [
  "powerinfer/tiny-f16.powerinfer.gguf",
  "powerinfer/tiny-f32.powerinfer.gguf",
  "powerinfer/tiny-q4_0.powerinfer.gguf",
];
const VOCAB = ["vocab/ggml-vocab-bert-bge.gguf", "vocab/ggml-vocab-gpt-2.gguf", "vocab/ggml-vocab-llama-spm.gguf"];
const RELU = "relu/tinystories-relu-llama-7m.f32.gguf";
const GPUIDX = "powerinfer/tiny.generated.gpuidx";

/** Sizes from the READMEs. */
const SIZES: Record<string, number> = {
  "stories260K.gguf": 1185376,
  "stories260K-ggml-org.gguf": 1185376,
  "stories260K-F16.gguf": 601248,
  "stories260K-BF16.gguf": 601248,
  "stories260K-Q8_0-ffn_down-F16.gguf": 379168,
  "stories260K-Q4_0-ffn_down-F16.gguf": 277024,
  "vocab/ggml-vocab-llama-spm.gguf": 723869,
  "vocab/ggml-vocab-gpt-2.gguf": 1766807,
  "vocab/ggml-vocab-bert-bge.gguf": 627549,
  [RELU]: 27850304,
};

function typeCounts(f: GgufFile): Record<string, number> {
  const out: Record<string, number> = {};
  for (const t of f.tensors) out[ggmlTypeName(t.type)] = (out[ggmlTypeName(t.type)] ?? 0) + 1;
  return out;
}

describe("shared models directory", () => {
  it("holds exactly the files these tests know about", () => {
    expect(allContainerFiles()).toEqual([...STORIES, ...PWRI, GPUIDX, RELU, ...VOCAB].sort());
  });

  it.each(allContainerFiles())("%s parses, and every tensor lies inside the file", (rel) => {
    const f = openGguf(model(rel));
    expect(f.fileSize).toBe(statSync(model(rel)).size);
    if (SIZES[rel]) expect(f.fileSize).toBe(SIZES[rel]);
    expect(f.version).toBe(3);
    expect(f.alignment).toBe(32);
    for (const t of f.tensors) {
      expect(t.fileOffset % 32).toBe(0);
      expect(t.fileOffset).toBe(f.dataOffset + t.offset);
      expect(t.fileOffset + t.byteLength).toBeLessThanOrEqual(f.fileSize);
      expect(f.tensorMap.get(t.name)).toBe(t);
    }
  });
});

describe("stories260K variants", () => {
  const layout: Record<string, number[]> = {
    "token_embd.weight": [64, 512],
    "output.weight": [64, 512],
    "output_norm.weight": [64],
  };
  for (let l = 0; l < 5; l++) {
    Object.assign(layout, {
      [`blk.${l}.attn_q.weight`]: [64, 64],
      [`blk.${l}.attn_k.weight`]: [64, 32],
      [`blk.${l}.attn_v.weight`]: [64, 32],
      [`blk.${l}.attn_output.weight`]: [64, 64],
      [`blk.${l}.attn_norm.weight`]: [64],
      [`blk.${l}.ffn_gate.weight`]: [64, 172],
      [`blk.${l}.ffn_up.weight`]: [64, 172],
      [`blk.${l}.ffn_down.weight`]: [172, 64],
      [`blk.${l}.ffn_norm.weight`]: [64],
    });
  }

  it.each(STORIES)("%s: 48 tensors with the README's shapes and hyper-parameters", (rel) => {
    const f = openGguf(model(rel));
    expect(f.format).toBe("GGUF");
    expect(f.tensors).toHaveLength(48);
    expect(Object.fromEntries(f.tensors.map((t) => [t.name, t.shape]))).toEqual(layout);
    expect(getString(f, "general.architecture")).toBe("llama");
    expect(getNumber(f, "llama.embedding_length")).toBe(64);
    expect(getNumber(f, "llama.feed_forward_length")).toBe(172);
    expect(getNumber(f, "llama.block_count")).toBe(5);
    expect(getNumber(f, "llama.attention.head_count")).toBe(8);
    expect(getNumber(f, "llama.attention.head_count_kv")).toBe(4);
    expect(getNumber(f, "llama.rope.dimension_count")).toBe(8);
    expect(f.metadata.has("llama.rope.freq_base")).toBe(false);
    expect(getNumber(f, "llama.attention.layer_norm_rms_epsilon")).toBe(Math.fround(1e-5));
    expect(getNumber(f, "llama.context_length")).toBe(rel === "stories260K-ggml-org.gguf" ? 2048 : 128);
    const tokens = getArray(f, "tokenizer.ggml.tokens") as string[];
    expect(tokens).toHaveLength(512);
    expect(tokens.slice(0, 3)).toEqual(["<unk>", "<s>", "</s>"]);
    expect(tokens[3]).toBe("<0x00>");
    expect(tokens[258]).toBe("<0xFF>");
    expect(f.metadataTypes.get("tokenizer.ggml.tokens")).toEqual({
      type: GgufValueType.ARRAY,
      itemType: GgufValueType.STRING,
    });
    expect(getArray(f, "tokenizer.ggml.scores")).toBeInstanceOf(Float32Array);
    expect(getArray(f, "tokenizer.ggml.token_type")).toBeInstanceOf(Int32Array);
    expect(getNumber(f, "tokenizer.ggml.bos_token_id")).toBe(1);
    expect(getNumber(f, "tokenizer.ggml.eos_token_id")).toBe(2);
    expect(getNumber(f, "tokenizer.ggml.unknown_token_id")).toBe(0);
    // 292,800 floats in total (README).
    expect(f.tensors.reduce((s, t) => s + t.nElements, 0)).toBe(292800);
  });

  it("tensor types per variant match the README", () => {
    expect(typeCounts(openGguf(model("stories260K.gguf")))).toEqual({ F32: 48 });
    expect(typeCounts(openGguf(model("stories260K-F16.gguf")))).toEqual({ F16: 37, F32: 11 });
    expect(typeCounts(openGguf(model("stories260K-BF16.gguf")))).toEqual({ BF16: 37, F32: 11 });
    const q8 = openGguf(model("stories260K-Q8_0-ffn_down-F16.gguf"));
    expect(typeCounts(q8)).toEqual({ Q8_0: 32, F16: 5, F32: 11 });
    expect(q8.tensorMap.get("token_embd.weight")!.type).toBe(GGMLType.Q8_0);
    expect(q8.tensorMap.get("blk.3.ffn_down.weight")!.type).toBe(GGMLType.F16);
    expect(getNumber(q8, "general.file_type")).toBe(7);
    const q4 = openGguf(model("stories260K-Q4_0-ffn_down-F16.gguf"));
    expect(typeCounts(q4)).toEqual({ Q4_0: 31, Q8_0: 1, F16: 5, F32: 11 });
    expect(q4.tensorMap.get("output.weight")!.type).toBe(GGMLType.Q8_0);
    expect(getNumber(q4, "general.file_type")).toBe(2);
    expect(getNumber(openGguf(model("stories260K-F16.gguf")), "general.file_type")).toBe(1);
    expect(getNumber(openGguf(model("stories260K-BF16.gguf")), "general.file_type")).toBe(32);
  });

  it("byte sizes follow the block geometry (Q4_0: 18 bytes per 32, Q8_0: 34 per 32)", () => {
    const q4 = openGguf(model("stories260K-Q4_0-ffn_down-F16.gguf"));
    expect(q4.tensorMap.get("blk.0.ffn_up.weight")!.byteLength).toBe((64 * 172 * 18) / 32);
    expect(q4.tensorMap.get("output.weight")!.byteLength).toBe((64 * 512 * 34) / 32);
    expect(q4.tensorMap.get("blk.0.ffn_down.weight")!.byteLength).toBe(172 * 64 * 2);
  });
});

describe("PowerInfer fixtures", () => {
  it.each(PWRI)("%s: PWRI magic, 2 layers, predictors and ffn_down_t as the README says", (rel) => {
    const f = openGguf(model(rel));
    expect(f.format).toBe("PWRI");
    expect(getString(f, "general.architecture")).toBe("llama");
    expect(getNumber(f, "llama.embedding_length")).toBe(128);
    expect(getNumber(f, "llama.feed_forward_length")).toBe(1024);
    expect(getNumber(f, "llama.block_count")).toBe(2);
    expect(getNumber(f, "llama.attention.head_count")).toBe(4);
    expect(getNumber(f, "llama.attention.head_count_kv")).toBe(4);
    expect(getNumber(f, "llama.context_length")).toBe(256);
    expect(getNumber(f, "powerinfer.sparse_threshold")).toBe(0);
    expect(f.metadataTypes.get("powerinfer.sparse_threshold")).toEqual({ type: GgufValueType.FLOAT32 });
    const tokens = getArray(f, "tokenizer.ggml.tokens") as string[];
    expect(tokens).toHaveLength(265);
    expect(tokens.slice(259)).toEqual(["▁Once", "▁upon", "▁a", "▁time", "▁the", "▁cat"]);
    for (let l = 0; l < 2; l++) {
      expect(f.tensorMap.get(`blk.${l}.ffn_down_t.weight`)!.shape).toEqual([128, 1024]);
      expect(f.tensorMap.get(`blk.${l}.fc1.weight`)!.shape).toEqual([128, 32]);
      expect(f.tensorMap.get(`blk.${l}.fc2.weight`)!.shape).toEqual([32, 1024]);
      expect(f.tensorMap.has(`blk.${l}.ffn_down.weight`)).toBe(false);
    }
  });

  it("tensor types: F16 2-D / F32 1-D; all F32; Q4_0 except output Q8_0", () => {
    const f16 = openGguf(model("powerinfer/tiny-f16.powerinfer.gguf"));
    for (const t of f16.tensors) expect(t.type).toBe(t.shape.length === 1 ? GGMLType.F32 : GGMLType.F16);
    expect(typeCounts(openGguf(model("powerinfer/tiny-f32.powerinfer.gguf")))).toEqual({ F32: 25 });
    const q4 = openGguf(model("powerinfer/tiny-q4_0.powerinfer.gguf"));
    for (const t of q4.tensors) {
      const want = t.shape.length === 1 ? GGMLType.F32 : t.name === "output.weight" ? GGMLType.Q8_0 : GGMLType.Q4_0;
      expect(t.type, t.name).toBe(want);
    }
  });

  it("tiny.generated.gpuidx: old type id 18 is read as I32, keys and tensor order as documented", () => {
    const f = openGguf(model(GPUIDX));
    expect(f.format).toBe("PWRI");
    expect(getString(f, "general.architecture")).toBe("generic.gpu_index");
    expect(getNumber(f, "generic.gpu_index.block_count")).toBe(2);
    expect(f.metadata.get("split.vram_capacity")).toBe(123456n);
    expect(f.tensors.map((t) => [t.name, t.type, t.shape])).toEqual([
      ["blk.0.gpu_idx", GGMLType.I32, [1024]],
      ["blk.0.gpu_bucket", GGMLType.I32, [512]],
      ["blk.1.gpu_idx", GGMLType.I32, [1024]],
      ["blk.1.gpu_bucket", GGMLType.I32, [256]],
    ]);
    // The stored id really is PowerInfer's 18 (current ggml: IQ3_XXS).
    const idx = readGpuIndex(model(GPUIDX));
    expect(idx.layers.map((l) => l.gpuBucket.length)).toEqual([512, 256]);
  });
});

describe("ReLU model", () => {
  it("has the README's 57 F32 tensors, shapes and metadata", () => {
    const f = openGguf(model(RELU));
    expect(f.format).toBe("GGUF");
    expect(f.tensors).toHaveLength(57);
    expect(typeCounts(f)).toEqual({ F32: 57 });
    const shape = (n: string) => f.tensorMap.get(n)!.shape;
    expect(shape("token_embd.weight")).toEqual([256, 2048]);
    expect(shape("output.weight")).toEqual([256, 2048]);
    expect(shape("output_norm.weight")).toEqual([256]);
    for (let l = 0; l < 6; l++) {
      expect(shape(`blk.${l}.attn_q.weight`)).toEqual([256, 256]);
      expect(shape(`blk.${l}.attn_output.weight`)).toEqual([256, 256]);
      expect(shape(`blk.${l}.attn_k.weight`)).toEqual([256, 128]);
      expect(shape(`blk.${l}.attn_v.weight`)).toEqual([256, 128]);
      expect(shape(`blk.${l}.ffn_gate.weight`)).toEqual([256, 1024]);
      expect(shape(`blk.${l}.ffn_up.weight`)).toEqual([256, 1024]);
      expect(shape(`blk.${l}.ffn_down.weight`)).toEqual([1024, 256]);
      expect(shape(`blk.${l}.attn_norm.weight`)).toEqual([256]);
      expect(shape(`blk.${l}.ffn_norm.weight`)).toEqual([256]);
    }
    expect(f.tensors.reduce((s, t) => s + t.nElements, 0)).toBe(6950144);
    expect(getNumber(f, "llama.context_length")).toBe(256);
    expect(getNumber(f, "llama.embedding_length")).toBe(256);
    expect(getNumber(f, "llama.block_count")).toBe(6);
    expect(getNumber(f, "llama.feed_forward_length")).toBe(1024);
    expect(getNumber(f, "llama.attention.head_count")).toBe(8);
    expect(getNumber(f, "llama.attention.head_count_kv")).toBe(4);
    expect(getNumber(f, "llama.rope.dimension_count")).toBe(32);
    expect(getNumber(f, "llama.rope.freq_base")).toBe(10000);
    expect(getNumber(f, "llama.vocab_size")).toBe(2048);
    expect(getNumber(f, "general.file_type")).toBe(0);
    expect(getNumber(f, "general.alignment")).toBe(32);
    expect(getString(f, "llama.hidden_act")).toBe("relu");
    expect(getString(f, "tokenizer.ggml.model")).toBe("llama");
    expect(f.metadata.get("tokenizer.ggml.add_bos_token")).toBe(true);
    expect(f.metadata.get("tokenizer.ggml.add_eos_token")).toBe(false);
    expect((getArray(f, "tokenizer.ggml.tokens") as string[])[13]).toBe("<0x0A>");
  });
});

describe("vocab-only files", () => {
  it("llama-spm: 32000 SentencePiece tokens, no tensors", () => {
    const f = openGguf(model("vocab/ggml-vocab-llama-spm.gguf"));
    expect(f.tensors).toHaveLength(0);
    expect(getString(f, "tokenizer.ggml.model")).toBe("llama");
    const tokens = getArray(f, "tokenizer.ggml.tokens") as string[];
    expect(tokens).toHaveLength(32000);
    expect(tokens.slice(0, 3)).toEqual(["<unk>", "<s>", "</s>"]);
    expect((getArray(f, "tokenizer.ggml.scores") as Float32Array).length).toBe(32000);
  });
  it("gpt-2: byte-level BPE with merges", () => {
    const f = openGguf(model("vocab/ggml-vocab-gpt-2.gguf"));
    expect(getString(f, "general.architecture")).toBe("gpt2");
    expect(getString(f, "tokenizer.ggml.model")).toBe("gpt2");
    expect(getArray(f, "tokenizer.ggml.tokens")).toHaveLength(50257);
    const merges = getArray(f, "tokenizer.ggml.merges") as string[];
    expect(merges).toHaveLength(50000);
    expect(merges[0]).toBe("Ġ t");
    expect(getNumber(f, "tokenizer.ggml.eos_token_id")).toBe(50256);
  });
  it("bert-bge: WordPiece", () => {
    const f = openGguf(model("vocab/ggml-vocab-bert-bge.gguf"));
    expect(getString(f, "tokenizer.ggml.model")).toBe("bert");
    const tokens = getArray(f, "tokenizer.ggml.tokens") as string[];
    expect(tokens).toHaveLength(30522);
    expect(tokens[0]).toBe("[PAD]");
    expect(tokens[101]).toBe("[CLS]");
    expect(f.metadata.get("bert.attention.causal")).toBe(false);
    expect(getNumber(f, "bert.attention.layer_norm_epsilon")).toBe(Math.fround(1e-12));
  });
});

describe("openGguf reads only the header", () => {
  it("a file with a 2 GiB tensor (a sparse hole) opens in milliseconds; small tensors are read by range", () => {
    const dir = mkdtempSync(join(tmpdir(), "gguf-big-"));
    try {
      const big = 2 ** 31;
      const c = new Craft().ascii("GGUF").u32(3).u64(2).u64(0);
      c.str("small").u32(1).u64(128).u32(GGMLType.I8).u64(0);
      c.str("huge")
        .u32(1)
        .u64(big / 4)
        .u32(GGMLType.F32)
        .u64(128);
      const head = c.align(32).build();
      const path = join(dir, "big.gguf");
      writeFileSync(path, head);
      truncateSync(path, head.length + 128 + big);
      const fd = openSync(path, "r+");
      writeSync(
        fd,
        Uint8Array.from({ length: 128 }, (_, i) => i),
        0,
        128,
        head.length,
      );
      closeSync(fd);
      const t0 = performance.now();
      const f = openGguf(path);
      expect(performance.now() - t0).toBeLessThan(500);
      expect(f.fileSize).toBe(head.length + 128 + big);
      expect(f.tensorMap.get("huge")).toMatchObject({ byteLength: big, fileOffset: head.length + 128 });
      const small = readTensorBytes(f, "small");
      expect(small.length).toBe(128);
      expect(small[127]).toBe(127);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
