import { describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  type GgufErrorCode,
  GgufValueType,
  getArray,
  getNumber,
  getOptionalNumber,
  getOptionalString,
  getString,
  keyConventionProblem,
  openGguf,
  parseGgufBuffer,
  readTensorBytes,
  serializeGguf,
} from "../src/index.js";
import { type Craft, header } from "./helpers.js";

function catchGguf(fn: () => unknown): GgufError {
  try {
    fn();
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError, but nothing was thrown");
}

function expectError(buf: Uint8Array, code: GgufErrorCode, offset: number | undefined, message?: RegExp): GgufError {
  const e = catchGguf(() => parseGgufBuffer(buf, "crafted.gguf"));
  expect(e.code).toBe(code);
  expect(e.offset).toBe(offset);
  if (offset !== undefined) expect(e.message).toContain(`at byte ${offset}`);
  expect(e.message).toContain("crafted.gguf");
  if (message) expect(e.message).toMatch(message);
  return e;
}

/** A file with one u32 kv and the given tensor infos, padded and followed by `dataBytes` of data. */
function withTensors(
  tensors: Array<{ name: string; dims: Array<number | bigint>; type: number; offset: number | bigint }>,
  dataBytes: number,
  opts: { magic?: string; kv?: (c: Craft) => Craft; nKv?: number } = {},
): Craft {
  const c = header(tensors.length, opts.nKv ?? 0, opts.magic ?? "GGUF");
  if (opts.kv) opts.kv(c);
  tensors.forEach((t, i) => {
    c.mark(`name${i}`).str(t.name).mark(`ndims${i}`).u32(t.dims.length);
    t.dims.forEach((d, j) => {
      c.mark(`ne${i}_${j}`).u64(d);
    });
    c.mark(`type${i}`).u32(t.type).mark(`offset${i}`).u64(t.offset);
  });
  return c.align(32).zeros(dataBytes);
}

describe("typed parse errors name the byte offset", () => {
  it("BAD_MAGIC at 0", () => {
    const e = expectError(
      new Uint8Array([0x47, 0x47, 0x55, 0x58, 3, 0, 0, 0]),
      "BAD_MAGIC",
      0,
      /GGUF.*PWRI.*47 47 55 58/,
    );
    expect(e).toBeInstanceOf(Error);
    expect(e.name).toBe("GgufError");
  });

  it("UNSUPPORTED_VERSION at 4 (v1, v4, big-endian)", () => {
    expectError(header(0, 0, "GGUF", 1).build(), "UNSUPPORTED_VERSION", 4, /found 1 .*v1/);
    expectError(header(0, 0, "GGUF", 4).build(), "UNSUPPORTED_VERSION", 4, /expected GGUF version 2 or 3, found 4/);
    expectError(header(0, 0, "GGUF", 0x03000000).build(), "UNSUPPORTED_VERSION", 4, /big-endian/);
    // v2 has the same layout and is accepted.
    expect(parseGgufBuffer(header(0, 0, "GGUF", 2).build()).version).toBe(2);
  });

  it("TRUNCATED: inside the header, inside a value", () => {
    expectError(new Uint8Array([0x47, 0x47]), "TRUNCATED", 0, /expected 4 bytes of magic/);
    const short = header(0, 0).build().subarray(0, 12);
    expectError(short, "TRUNCATED", 8, /tensor count/);
    const c = header(0, 1).str("a.key").u32(GgufValueType.UINT32).mark("value").raw(1, 2);
    expectError(c.build(), "TRUNCATED", c.marks.value, /"a\.key"/);
  });

  it("LENGTH_PAST_END: string length, array count, kv count, tensor count", () => {
    const key = header(0, 1).mark("len").u64(1_000_000).ascii("abcdefghijklmnop");
    expectError(key.build(), "LENGTH_PAST_END", key.marks.len, /1000000 bytes/);
    const str = header(0, 1).str("s").u32(GgufValueType.STRING).mark("len").u64(0xffff_ffff_ffff_ffffn).raw(1);
    expectError(str.build(), "LENGTH_PAST_END", str.marks.len, /18446744073709551615 bytes/);
    const arr = header(0, 1)
      .str("a")
      .u32(GgufValueType.ARRAY)
      .u32(GgufValueType.UINT32)
      .mark("n")
      .u64(1n << 60n);
    expectError(arr.zeros(64).build(), "LENGTH_PAST_END", arr.marks.n, /items of at least 4 bytes/);
    const strs = header(0, 1).str("a").u32(GgufValueType.ARRAY).u32(GgufValueType.STRING).mark("n").u64(100);
    expectError(strs.zeros(64).build(), "LENGTH_PAST_END", strs.marks.n);
    const kv = header(0, 1n << 62n);
    expectError(kv.zeros(100).build(), "LENGTH_PAST_END", kv.marks.kvCount, /metadata kv count/);
    const tc = header(1n << 40n, 0);
    expectError(tc.zeros(100).build(), "LENGTH_PAST_END", tc.marks.tensorCount, /tensor count/);
  });

  it("TENSOR_OUT_OF_BOUNDS: data past the end of the file", () => {
    const c = withTensors([{ name: "w", dims: [8], type: GGMLType.F32, offset: 0 }], 16);
    expectError(c.build(), "TENSOR_OUT_OF_BOUNDS", c.marks.offset0, /"w".*extends past the end/);
    const far = withTensors([{ name: "w", dims: [8], type: GGMLType.F32, offset: 1n << 62n }], 32);
    expectError(far.build(), "TENSOR_OUT_OF_BOUNDS", far.marks.offset0);
    // The same file with its 32 data bytes is fine.
    const ok = parseGgufBuffer(withTensors([{ name: "w", dims: [8], type: GGMLType.F32, offset: 0 }], 32).build());
    expect(ok.tensors[0].byteLength).toBe(32);
  });

  it("TENSOR_OVERLAP: two tensors' data ranges share bytes (a type or offset changed in the header)", () => {
    // b starts inside a (a: 16 F32 = 64 bytes at 0; b at 32)
    const c = withTensors(
      [
        { name: "a", dims: [16], type: GGMLType.F32, offset: 0 },
        { name: "b", dims: [8], type: GGMLType.F32, offset: 32 },
      ],
      128,
    );
    expectError(c.build(), "TENSOR_OVERLAP", c.marks.offset1, /"b": data at offset 32 overlaps tensor "a" \[0, 64\)/);
    // listed in the other order: the later offset is the one named
    const r = withTensors(
      [
        { name: "b", dims: [8], type: GGMLType.F32, offset: 32 },
        { name: "a", dims: [16], type: GGMLType.F32, offset: 0 },
      ],
      128,
    );
    expectError(r.build(), "TENSOR_OVERLAP", r.marks.offset0, /"b": data at offset 32 overlaps tensor "a"/);
    // back to back is fine
    const ok = withTensors(
      [
        { name: "a", dims: [16], type: GGMLType.F32, offset: 0 },
        { name: "b", dims: [8], type: GGMLType.F32, offset: 64 },
      ],
      128,
    );
    expect(parseGgufBuffer(ok.build()).tensors).toHaveLength(2);
  });

  it("MISALIGNED: tensor offset not a multiple of general.alignment", () => {
    const c = withTensors(
      [
        { name: "a", dims: [4], type: GGMLType.F32, offset: 0 },
        { name: "b", dims: [4], type: GGMLType.F32, offset: 16 },
      ],
      64,
    );
    expectError(c.build(), "MISALIGNED", c.marks.offset1, /offset 16 is not a multiple of the alignment 32/);
    // With general.alignment = 16 the same offsets are fine.
    const kv = (x: Craft) => x.str("general.alignment").u32(GgufValueType.UINT32).u32(16);
    const ok = withTensors(
      [
        { name: "a", dims: [4], type: GGMLType.F32, offset: 0 },
        { name: "b", dims: [4], type: GGMLType.F32, offset: 16 },
      ],
      64,
      { kv, nKv: 1 },
    );
    const f = parseGgufBuffer(ok.build());
    expect(f.alignment).toBe(16);
    expect(f.dataOffset % 16).toBe(0);
  });

  it("UNKNOWN_TYPE: removed / future tensor type ids, PWRI ids past 18, unknown value types", () => {
    const removed = withTensors([{ name: "w", dims: [32], type: 4, offset: 0 }], 64);
    expectError(removed.build(), "UNKNOWN_TYPE", removed.marks.type0, /unknown ggml type id 4/);
    const pwri = withTensors([{ name: "w", dims: [32], type: 24, offset: 0 }], 64, { magic: "PWRI" });
    expectError(pwri.build(), "UNKNOWN_TYPE", pwri.marks.type0, /PowerInfer/);
    const value = header(0, 1).str("k").mark("t").u32(13).u32(0);
    expectError(value.build(), "UNKNOWN_TYPE", value.marks.t, /unknown value type 13/);
    const item = header(0, 1).str("k").u32(GgufValueType.ARRAY).mark("t").u32(99).u64(0);
    expectError(item.build(), "UNKNOWN_TYPE", item.marks.t, /unknown array item type 99/);
  });

  it("PWRI ids 16-18 are I8/I16/I32; in GGUF the same ids are IQ types", () => {
    const mk = (magic: string) =>
      withTensors(
        [
          { name: "a", dims: [4], type: 16, offset: 0 },
          { name: "b", dims: [4], type: 17, offset: 32 },
          { name: "c", dims: [4], type: 18, offset: 64 },
        ],
        96,
        { magic },
      ).build();
    expect(parseGgufBuffer(mk("PWRI")).tensors.map((t) => t.type)).toEqual([GGMLType.I8, GGMLType.I16, GGMLType.I32]);
    // In a GGUF file id 16 is IQ2_XXS, whose 256-element blocks a 4-element row cannot hold.
    expectError(mk("GGUF"), "BAD_SHAPE", 24 + 8 + 1, /IQ2_XXS block size 256/);
  });

  it("DUPLICATE_TENSOR and DUPLICATE_KEY", () => {
    const c = withTensors(
      [
        { name: "w", dims: [8], type: GGMLType.F32, offset: 0 },
        { name: "w", dims: [8], type: GGMLType.F32, offset: 32 },
      ],
      64,
    );
    expectError(c.build(), "DUPLICATE_TENSOR", c.marks.name1, /duplicate tensor name "w"/);
    const k = header(0, 2)
      .str("k")
      .u32(GgufValueType.UINT8)
      .raw(1)
      .mark("second")
      .str("k")
      .u32(GgufValueType.UINT8)
      .raw(2);
    expectError(k.build(), "DUPLICATE_KEY", k.marks.second, /duplicate metadata key "k"/);
  });

  it("BAD_KEY: empty, control characters, invalid UTF-8; a naming-convention break is only reported", () => {
    const kv = (key: number[]) => {
      const c = header(0, 1)
        .mark("key")
        .u64(key.length)
        .raw(...key);
      return c.u32(GgufValueType.UINT8).raw(7);
    };
    const ascii = (s: string) => Array.from(s, (ch) => ch.charCodeAt(0));
    let c = kv([]);
    expectError(c.build(), "BAD_KEY", c.marks.key, /metadata key #0 is empty/);
    c = kv([...ascii("general."), 0x01, ...ascii("name")]);
    expectError(c.build(), "BAD_KEY", c.marks.key, /"general\.\\u0001name" contains the control character U\+0001/);
    c = kv([...ascii("a"), 0x7f]);
    expectError(c.build(), "BAD_KEY", c.marks.key, /control character U\+007F/);
    c = kv([...ascii("general.na"), 0xff, 0xfe]);
    expectError(c.build(), "BAD_KEY", c.marks.key, /metadata key #0 is not valid UTF-8 \(bytes 67 65 6e .* ff fe\)/);
    // A C1 control character encoded as valid UTF-8 (U+0085) is refused too.
    c = kv([...ascii("k"), 0xc2, 0x85]);
    expectError(c.build(), "BAD_KEY", c.marks.key, /U\+0085/);
    // Upper case, dashes and non-ASCII letters break only the convention: the file reads.
    for (const key of ["General.Name", "my-key", "général.nom", "a..b"]) {
      const f = parseGgufBuffer(kv(Array.from(new TextEncoder().encode(key))).build());
      expect(f.metadata.get(key)).toBe(7);
      expect(keyConventionProblem(key)).toMatch(/does not follow the GGUF naming convention/);
    }
    expect(keyConventionProblem("tokenizer.ggml.bos_token_id")).toBeUndefined();
    // The writer refuses what the reader refuses.
    for (const key of ["", "a\u0000b", "x\u0085"]) {
      const e = catchGguf(() =>
        serializeGguf({ metadata: [{ key, type: { type: GgufValueType.UINT8 }, value: 1 }], tensors: [] }),
      );
      expect(e.code).toBe("BAD_KEY");
    }
  });

  it("BAD_SHAPE for a zero-sized dimension, except a GPU index's empty gpu_bucket", () => {
    const c = withTensors([{ name: "w", dims: [8, 0], type: GGMLType.F32, offset: 0 }], 32);
    expectError(c.build(), "BAD_SHAPE", c.marks.ne0_1, /tensor "w" has a zero-sized dimension \(ne\[1\] = 0\)/);
    const arch = (k: Craft) => k.str("general.architecture").u32(GgufValueType.STRING).str("generic.gpu_index");
    const ok = withTensors([{ name: "blk.0.gpu_bucket", dims: [0], type: GGMLType.F32, offset: 0 }], 0, {
      kv: arch,
      nKv: 1,
    });
    expect(parseGgufBuffer(ok.build()).tensors[0].nElements).toBe(0);
    const notBucket = withTensors([{ name: "blk.0.gpu_idx", dims: [0], type: GGMLType.F32, offset: 0 }], 0, {
      kv: arch,
      nKv: 1,
    });
    expectError(notBucket.build(), "BAD_SHAPE", notBucket.marks.ne0_0, /zero-sized/);
    // the writer refuses what the reader refuses
    const w = catchGguf(() =>
      serializeGguf({
        metadata: [],
        tensors: [{ name: "w", type: GGMLType.F32, shape: [8, 0], data: new Uint8Array(0) }],
      }),
    );
    expect(w.code).toBe("BAD_SHAPE");
    expect(w.message).toBe('tensor "w" has a zero-sized dimension [8,0]');
  });

  it("TOO_MANY_DIMS", () => {
    const c = withTensors([{ name: "w", dims: [1, 1, 1, 1, 1], type: GGMLType.F32, offset: 0 }], 32);
    expectError(c.build(), "TOO_MANY_DIMS", c.marks.ndims0, /5 dimensions, expected at most 4/);
  });

  it("ELEMENT_OVERFLOW: product past 2^53 - 1, dimension past int64", () => {
    const c = withTensors([{ name: "w", dims: [1n << 30n, 1n << 30n], type: GGMLType.F32, offset: 0 }], 32);
    expectError(c.build(), "ELEMENT_OVERFLOW", c.marks.ne0_1, /more than 2\^53-1 elements/);
    const neg = withTensors([{ name: "w", dims: [1n << 63n], type: GGMLType.F32, offset: 0 }], 32);
    expectError(neg.build(), "ELEMENT_OVERFLOW", neg.marks.ne0_0, /does not fit in int64/);
  });

  it("BAD_SHAPE: row not a multiple of the block size", () => {
    const c = withTensors([{ name: "w", dims: [16, 2], type: GGMLType.Q4_0, offset: 0 }], 64);
    expectError(c.build(), "BAD_SHAPE", c.marks.ndims0, /row length 16 is not a multiple of the Q4_0 block size 32/);
  });

  it("BAD_VALUE: bad alignment, alignment of the wrong type, bool not 0/1", () => {
    const a = header(0, 1).str("general.alignment").u32(GgufValueType.UINT32).mark("v").u32(24);
    expectError(a.build(), "BAD_VALUE", a.marks.v, /power of two, found 24/);
    const t = header(0, 1).str("general.alignment").mark("t").u32(GgufValueType.UINT64).u64(32);
    expectError(t.build(), "BAD_VALUE", t.marks.t, /must be a uint32/);
    const b = header(0, 1).str("flag").u32(GgufValueType.BOOL).mark("v").raw(2);
    expectError(b.build(), "BAD_VALUE", b.marks.v, /expected a bool/);
  });

  it("IO: a missing file names the path", () => {
    const e = catchGguf(() => openGguf("/nonexistent/model.gguf"));
    expect(e.code).toBe("IO");
    expect(e.message).toContain("/nonexistent/model.gguf");
    expect(e.offset).toBeUndefined();
  });

  it("openGguf reports the same errors with the same offsets as parseGgufBuffer", async () => {
    const { mkdtempSync, writeFileSync, rmSync } = await import("node:fs");
    const { join } = await import("node:path");
    const { tmpdir } = await import("node:os");
    const dir = mkdtempSync(join(tmpdir(), "gguf-err-"));
    try {
      const c = withTensors([{ name: "w", dims: [8], type: GGMLType.F32, offset: 0 }], 16);
      writeFileSync(join(dir, "x.gguf"), c.build());
      const e = catchGguf(() => openGguf(join(dir, "x.gguf")));
      expect([e.code, e.offset]).toEqual(["TENSOR_OUT_OF_BOUNDS", c.marks.offset0]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe("metadata accessors", () => {
  const file = parseGgufBuffer(
    serializeGguf({
      metadata: [
        { key: "s", type: { type: GgufValueType.STRING }, value: "hi" },
        { key: "n", type: { type: GgufValueType.UINT16 }, value: 7 },
        { key: "big", type: { type: GgufValueType.UINT64 }, value: 1n << 60n },
        { key: "i64", type: { type: GgufValueType.INT64 }, value: -5n },
        { key: "arr", type: { type: GgufValueType.ARRAY, itemType: GgufValueType.INT32 }, value: Int32Array.of(1, 2) },
      ],
      tensors: [],
    }),
    "meta.gguf",
  );

  it("return typed values", () => {
    expect(getString(file, "s")).toBe("hi");
    expect(getNumber(file, "n")).toBe(7);
    expect(getNumber(file, "i64")).toBe(-5);
    expect(getOptionalNumber(file, "nope")).toBeUndefined();
    expect(getOptionalString(file, "nope")).toBeUndefined();
    expect(getArray(file, "arr")).toEqual(Int32Array.of(1, 2));
  });

  it("throw MISSING_KEY / BAD_VALUE naming the key", () => {
    const missing = catchGguf(() => getString(file, "general.architecture"));
    expect(missing.code).toBe("MISSING_KEY");
    expect(missing.message).toContain('"general.architecture"');
    expect(missing.message).toContain("meta.gguf");
    const wrong = catchGguf(() => getNumber(file, "s"));
    expect(wrong.code).toBe("BAD_VALUE");
    expect(wrong.message).toContain('"s"');
    expect(catchGguf(() => getNumber(file, "big")).message).toMatch(/"big".*2\^53/);
    expect(catchGguf(() => getString(file, "n")).code).toBe("BAD_VALUE");
    expect(catchGguf(() => getArray(file, "n")).code).toBe("BAD_VALUE");
    expect(catchGguf(() => getOptionalNumber(file, "s")).code).toBe("BAD_VALUE");
  });

  it("readTensorBytes: MISSING_TENSOR for an unknown name", () => {
    const e = catchGguf(() => readTensorBytes(file, "nope.weight"));
    expect(e.code).toBe("MISSING_TENSOR");
    expect(e.message).toContain('"nope.weight"');
  });
});
