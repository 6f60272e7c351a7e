import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  type GgufFile,
  GgufTypes,
  GgufValueType,
  type GgufWriteSpec,
  metadataEntries,
  openGguf,
  parseGgufBuffer,
  readTensorBytes,
  serializeGguf,
  writeGguf,
} from "../src/index.js";
import { model } from "./helpers.js";

const dir = mkdtempSync(join(tmpdir(), "gguf-writer-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function specOf(f: GgufFile): GgufWriteSpec {
  return {
    format: f.format,
    version: f.version,
    metadata: f,
    tensors: f.tensors.map((t) => ({ name: t.name, type: t.type, shape: t.shape, data: () => readTensorBytes(f, t) })),
  };
}

function catchGguf(fn: () => unknown): GgufError {
  try {
    fn();
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError");
}

describe("re-writing the shared models gives byte-identical files", () => {
  // Every file here round-trips exactly: ggml, gguf-py and PowerInfer's gguf-py all write metadata
  // and tensor infos in order, tensors back to back each padded to the alignment with zeros, and
  // (vocab-only files) nothing after the header when there are no tensors — which is what we write.
  it.each([
    "stories260K.gguf",
    "stories260K-ggml-org.gguf",
    "stories260K-F16.gguf",
    "stories260K-BF16.gguf",
    "stories260K-Q8_0-ffn_down-F16.gguf",
    "stories260K-Q4_0-ffn_down-F16.gguf",
    "powerinfer/tiny-f16.powerinfer.gguf",
    "powerinfer/tiny-f32.powerinfer.gguf",
    "powerinfer/tiny-q4_0.powerinfer.gguf",
    "powerinfer/tiny.generated.gpuidx",
    "vocab/ggml-vocab-llama-spm.gguf",
    "vocab/ggml-vocab-gpt-2.gguf",
    "vocab/ggml-vocab-bert-bge.gguf",
    "relu/tinystories-relu-llama-7m.f32.gguf",
  ])("%s", (rel) => {
    const src = openGguf(model(rel));
    const out = join(dir, rel.replaceAll("/", "_"));
    writeGguf(out, specOf(src));
    const a = readFileSync(model(rel));
    const b = readFileSync(out);
    expect(b.length).toBe(a.length);
    expect(b.equals(a)).toBe(true);
    // The in-memory serializer gives the same bytes.
    if (a.length < 5_000_000) expect(Buffer.from(serializeGguf(specOf(src))).equals(a)).toBe(true);
    rmSync(out);
  });
});

describe("write → read round-trip", () => {
  const metadata: GgufWriteSpec["metadata"] = [
    { key: "general.architecture", type: GgufTypes.string, value: "llama" },
    { key: "u8", type: GgufTypes.u8, value: 255 },
    { key: "i8", type: GgufTypes.i8, value: -128 },
    { key: "u16", type: GgufTypes.u16, value: 65535 },
    { key: "i16", type: GgufTypes.i16, value: -32768 },
    { key: "u32", type: GgufTypes.u32, value: 4294967295 },
    { key: "i32", type: GgufTypes.i32, value: -2147483648 },
    { key: "f32", type: GgufTypes.f32, value: Math.fround(0.1) },
    { key: "f64", type: GgufTypes.f64, value: 0.1 },
    { key: "bool", type: GgufTypes.bool, value: true },
    { key: "u64", type: GgufTypes.u64, value: (1n << 64n) - 1n },
    { key: "i64", type: GgufTypes.i64, value: -(1n << 63n) },
    { key: "unicode ключ ✓", type: GgufTypes.string, value: "▁Once 🦙 \u0000 end" },
    { key: "a.u8", type: GgufTypes.array(GgufValueType.UINT8), value: Uint8Array.of(1, 2, 3) },
    { key: "a.i8", type: GgufTypes.array(GgufValueType.INT8), value: Int8Array.of(-1, 2) },
    { key: "a.u16", type: GgufTypes.array(GgufValueType.UINT16), value: Uint16Array.of(65535) },
    { key: "a.i16", type: GgufTypes.array(GgufValueType.INT16), value: Int16Array.of(-2) },
    { key: "a.u32", type: GgufTypes.array(GgufValueType.UINT32), value: Uint32Array.of(7, 8) },
    { key: "a.i32", type: GgufTypes.array(GgufValueType.INT32), value: Int32Array.of(-7) },
    { key: "a.f32", type: GgufTypes.array(GgufValueType.FLOAT32), value: Float32Array.of(1.5, -0) },
    { key: "a.f64", type: GgufTypes.array(GgufValueType.FLOAT64), value: Float64Array.of(Math.PI) },
    { key: "a.u64", type: GgufTypes.array(GgufValueType.UINT64), value: BigUint64Array.of(1n << 63n) },
    { key: "a.i64", type: GgufTypes.array(GgufValueType.INT64), value: BigInt64Array.of(-1n) },
    { key: "a.bool", type: GgufTypes.array(GgufValueType.BOOL), value: [true, false, true] },
    { key: "a.str", type: GgufTypes.array(GgufValueType.STRING), value: ["x", "", "ü"] },
    { key: "a.empty", type: GgufTypes.array(GgufValueType.FLOAT32), value: new Float32Array(0) },
    {
      key: "a.nested",
      type: {
        type: GgufValueType.ARRAY,
        itemType: GgufValueType.ARRAY,
        items: [
          { type: GgufValueType.ARRAY, itemType: GgufValueType.STRING },
          { type: GgufValueType.ARRAY, itemType: GgufValueType.UINT16 },
          {
            type: GgufValueType.ARRAY,
            itemType: GgufValueType.ARRAY,
            items: [{ type: GgufValueType.ARRAY, itemType: GgufValueType.BOOL }],
          },
        ],
      },
      value: [["p", "q"], Uint16Array.of(3), [[false]]],
    },
    // A plain number[] is accepted for a numeric array and read back as the typed array.
    { key: "a.plain", type: GgufTypes.array(GgufValueType.INT16), value: [1, -1] as unknown as Int16Array },
  ];
  const tensors: GgufWriteSpec["tensors"] = [
    { name: "f32", type: GGMLType.F32, shape: [3], data: new Uint8Array(new Float32Array([1, 2, 3]).buffer) },
    { name: "q8", type: GGMLType.Q8_0, shape: [32, 2], data: Uint8Array.from({ length: 68 }, (_, i) => i) },
    { name: "scalar", type: GGMLType.I32, shape: [], data: Uint8Array.of(1, 0, 0, 0) },
    { name: "4d", type: GGMLType.F16, shape: [2, 1, 1, 2], data: Uint8Array.of(0, 60, 0, 64, 0, 0, 0, 188) },
  ];

  it("keeps every value type, nested arrays, tensor bytes and shapes", () => {
    const buf = serializeGguf({ metadata, tensors });
    const f = parseGgufBuffer(buf);
    expect(f.format).toBe("GGUF");
    expect(f.version).toBe(3);
    expect([...f.metadata.keys()]).toEqual(metadata.map((e) => e.key));
    for (const e of metadata) {
      if (e.key === "a.plain") continue;
      expect(f.metadata.get(e.key), e.key).toEqual(e.value);
      expect(f.metadataTypes.get(e.key), e.key).toEqual(e.type);
    }
    expect(f.metadata.get("a.plain")).toEqual(Int16Array.of(1, -1));
    expect(Object.is((f.metadata.get("a.f32") as Float32Array)[1], -0)).toBe(true);
    expect(f.tensors.map((t) => [t.name, t.type, t.shape, t.offset])).toEqual([
      ["f32", GGMLType.F32, [3], 0],
      ["q8", GGMLType.Q8_0, [32, 2], 32],
      ["scalar", GGMLType.I32, [], 128],
      ["4d", GGMLType.F16, [2, 1, 1, 2], 160],
    ]);
    for (const t of tensors) expect(readTensorBytes(f, t.name)).toEqual(t.data);
    expect(f.dataOffset % 32).toBe(0);
    expect(buf.length).toBe(f.dataOffset + 192);
    // Writing the parsed file again is byte-identical.
    const again = serializeGguf({
      metadata: metadataEntries(f),
      tensors: f.tensors.map((t) => ({ ...t, data: readTensorBytes(f, t) })),
    });
    expect(Buffer.from(again).equals(Buffer.from(buf))).toBe(true);
  });

  it("alignment: spec value is added as general.alignment; a contradiction is refused", () => {
    const f = parseGgufBuffer(serializeGguf({ alignment: 64, metadata: [], tensors }));
    expect(f.alignment).toBe(64);
    expect(f.metadata.get("general.alignment")).toBe(64);
    expect(f.tensors.map((t) => t.offset)).toEqual([0, 64, 192, 256]);
    const e = catchGguf(() =>
      serializeGguf({
        alignment: 64,
        metadata: [{ key: "general.alignment", type: GgufTypes.u32, value: 32 }],
        tensors: [],
      }),
    );
    expect(e.code).toBe("BAD_VALUE");
    expect(e.message).toContain("general.alignment");
    expect(catchGguf(() => serializeGguf({ alignment: 48, metadata: [], tensors: [] })).code).toBe("BAD_VALUE");
  });

  it("refuses values that do not fit their type, naming the key", () => {
    const bad = (key: string, type: (typeof metadata)[number]["type"], value: unknown) =>
      catchGguf(() => serializeGguf({ metadata: [{ key, type, value: value as never }], tensors: [] }));
    expect(bad("k.u8", GgufTypes.u8, 256).message).toMatch(/"k\.u8".*\[0, 255\]/);
    expect(bad("k.i32", GgufTypes.i32, 1.5).code).toBe("BAD_VALUE");
    expect(bad("k.u64", GgufTypes.u64, -1n).message).toMatch(/"k\.u64"/);
    expect(bad("k.s", GgufTypes.string, 3).code).toBe("BAD_VALUE");
    expect(bad("k.b", GgufTypes.bool, 1).code).toBe("BAD_VALUE");
    expect(bad("k.a", GgufTypes.array(GgufValueType.STRING), [1]).code).toBe("BAD_VALUE");
    expect(bad("k.a", GgufTypes.array(GgufValueType.UINT8), "no").code).toBe("BAD_VALUE");
    const dup = catchGguf(() =>
      serializeGguf({
        metadata: [
          { key: "k", type: GgufTypes.u8, value: 1 },
          { key: "k", type: GgufTypes.u8, value: 1 },
        ],
        tensors: [],
      }),
    );
    expect(dup.code).toBe("DUPLICATE_KEY");
  });

  it("refuses bad tensors", () => {
    const t = (over: Partial<GgufWriteSpec["tensors"][number]>) =>
      catchGguf(() =>
        serializeGguf({
          metadata: [],
          tensors: [{ name: "w", type: GGMLType.F32, shape: [2], data: new Uint8Array(8), ...over }],
        }),
      );
    expect(t({ data: new Uint8Array(7) }).message).toMatch(/needs 8 bytes of data, got 7/);
    expect(t({ shape: [1, 1, 1, 1, 2] }).code).toBe("TOO_MANY_DIMS");
    expect(t({ type: GGMLType.Q4_0, shape: [16] }).code).toBe("BAD_SHAPE");
    expect(t({ type: 31 as GGMLType }).code).toBe("UNKNOWN_TYPE");
    expect(t({ name: "x".repeat(64) }).message).toMatch(/at most 63/);
    const dup = catchGguf(() =>
      serializeGguf({
        metadata: [],
        tensors: [
          { name: "w", type: GGMLType.F32, shape: [1], data: new Uint8Array(4) },
          { name: "w", type: GGMLType.F32, shape: [1], data: new Uint8Array(4) },
        ],
      }),
    );
    expect(dup.code).toBe("DUPLICATE_TENSOR");
  });
});

describe("PWRI output", () => {
  it("writes PowerInfer's ids 16/17/18 for I8/I16/I32 and reads them back", () => {
    const buf = serializeGguf({
      format: "PWRI",
      metadata: [],
      tensors: [
        { name: "a", type: GGMLType.I8, shape: [4], data: new Uint8Array(4) },
        { name: "b", type: GGMLType.I16, shape: [4], data: new Uint8Array(8) },
        { name: "c", type: GGMLType.I32, shape: [4], data: new Uint8Array(16) },
        { name: "d", type: GGMLType.Q6_K, shape: [256], data: new Uint8Array(210) },
      ],
    });
    expect(String.fromCharCode(...buf.subarray(0, 4))).toBe("PWRI");
    // Tensor infos start at 24; each is name (8 + 1) + n_dims 4 + ne 8 + type 4 + offset 8.
    const dv = new DataView(buf.buffer);
    expect([0, 1, 2, 3].map((i) => dv.getUint32(24 + i * 33 + 21, true))).toEqual([16, 17, 18, 14]);
    const f = parseGgufBuffer(buf);
    expect(f.tensors.map((t) => t.type)).toEqual([GGMLType.I8, GGMLType.I16, GGMLType.I32, GGMLType.Q6_K]);
  });

  it.each([
    ["BF16", GGMLType.BF16],
    ["IQ2_XXS", GGMLType.IQ2_XXS],
    ["I64", GGMLType.I64],
    ["F64", GGMLType.F64],
    ["MXFP4", GGMLType.MXFP4],
  ])("refuses %s, which PowerInfer lacks", (name, type) => {
    const data = new Uint8Array(256 * 8);
    const e = catchGguf(() =>
      serializeGguf({
        format: "PWRI",
        metadata: [],
        tensors: [{ name: "w", type, shape: [256], data: data.subarray(0, 0) }],
      }),
    );
    expect(e.code).toBe("UNSUPPORTED_TYPE");
    expect(e.message).toContain(`PowerInfer's ggml has no ${name} type`);
  });
});

describe("writeGguf is atomic", () => {
  it("leaves the old file and no temporary file when a tensor is bad", () => {
    const target = join(dir, "atomic.gguf");
    writeFileSync(target, "old content");
    const e = catchGguf(() =>
      writeGguf(target, {
        metadata: [{ key: "k", type: GgufTypes.u8, value: 1 }],
        tensors: [
          { name: "ok", type: GGMLType.F32, shape: [1], data: new Uint8Array(4) },
          { name: "bad", type: GGMLType.F32, shape: [2], data: () => new Uint8Array(3) },
        ],
      }),
    );
    expect(e.code).toBe("BAD_VALUE");
    expect(readFileSync(target, "utf8")).toBe("old content");
    expect(readdirSync(dir).filter((n) => n.includes("atomic"))).toEqual(["atomic.gguf"]);
  });

  it("reports IO for a directory that does not exist", () => {
    const e = catchGguf(() => writeGguf(join(dir, "no/such/dir/x.gguf"), { metadata: [], tensors: [] }));
    expect(e.code).toBe("IO");
  });
});
