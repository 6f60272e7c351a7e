import { mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  type GgufStreamSpec,
  GgufTypes,
  GgufValueType,
  type GgufWriteSpec,
  ggufStreamSize,
  openGguf,
  readTensorBytes,
  serializeGguf,
  tensorByteLength,
  writeGgufStreaming,
} from "../src/index.js";
import { model, rng } from "./helpers.js";

const dir = mkdtempSync(join(tmpdir(), "gguf-stream-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Random bytes for a tensor (valid F32/F16 bit patterns are not needed by the writer). */
function bytes(n: number, seed: number): Uint8Array {
  const r = rng(seed);
  return Uint8Array.from({ length: n }, () => r() & 0xff);
}

/** Yields `data` in chunks of `size` bytes, refilling one buffer (as a generator would). */
function* chunked(data: Uint8Array, size: number): Generator<Uint8Array> {
  const buf = new Uint8Array(size);
  for (let o = 0; o < data.length; o += size) {
    const n = Math.min(size, data.length - o);
    buf.set(data.subarray(o, o + n));
    yield buf.subarray(0, n);
  }
}

const TENSORS = [
  { name: "a.weight", type: GGMLType.F32, shape: [7, 3] },
  { name: "b.weight", type: GGMLType.F16, shape: [64, 5] },
  { name: "c.weight", type: GGMLType.Q4_0, shape: [64, 9] },
  { name: "d.weight", type: GGMLType.Q8_0, shape: [32] },
];

function specs(format: "GGUF" | "PWRI", alignment?: number) {
  const data = TENSORS.map((t, i) => bytes(tensorByteLength(t.type, t.shape), i + 1));
  const metadata = [
    { key: "general.architecture", type: GgufTypes.string, value: "llama" },
    { key: "x.list", type: GgufTypes.array(GgufValueType.INT32), value: Int32Array.of(1, 2, 3) },
  ];
  const whole: GgufWriteSpec = {
    format,
    alignment,
    metadata,
    tensors: TENSORS.map((t, i) => ({ ...t, data: data[i]! })),
  };
  const stream: GgufStreamSpec = {
    format,
    alignment,
    metadata,
    tensors: TENSORS.map((t, i) => ({ ...t, data: () => chunked(data[i]!, 5 + i) })),
  };
  return { whole, stream };
}

async function rejects(p: Promise<unknown>): Promise<GgufError> {
  try {
    await p;
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError");
}

const leftovers = (name: string) => readdirSync(dir).filter((f) => f.includes(name));

describe("writeGgufStreaming", () => {
  it.each([
    ["GGUF", undefined],
    ["PWRI", undefined],
    ["GGUF", 64],
  ] as const)(
    "%s (alignment %s): the same bytes as serializeGguf, data in small reused chunks",
    async (format, align) => {
      const { whole, stream } = specs(format, align);
      const path = join(dir, `same-${format}-${align}.gguf`);
      const progress: number[] = [];
      const n = await writeGgufStreaming(path, stream, { onProgress: (w) => progress.push(w), fsync: false });
      const expected = serializeGguf(whole);
      expect(n).toBe(expected.length);
      expect(ggufStreamSize(stream)).toBe(expected.length);
      expect(Buffer.from(readFileSync(path)).equals(Buffer.from(expected))).toBe(true);
      expect(progress.at(-1)).toBe(expected.length);
      expect(progress).toEqual([...progress].sort((a, b) => a - b));
    },
  );

  it("re-writes a shared PowerInfer model byte for byte from async producers", async () => {
    const f = openGguf(model("powerinfer/tiny-q4_0.powerinfer.gguf"));
    const path = join(dir, "tiny.powerinfer.gguf");
    await writeGgufStreaming(path, {
      format: f.format,
      version: f.version,
      metadata: f,
      tensors: f.tensors.map((t) => ({
        name: t.name,
        type: t.type,
        shape: t.shape,
        data: async function* () {
          const b = readTensorBytes(f, t);
          for (let o = 0; o < b.length; o += 1000) yield b.subarray(o, o + 1000);
        },
      })),
    });
    expect(Buffer.from(readFileSync(path)).equals(readFileSync(f.path))).toBe(true);
  });

  it("refuses to write when the disk lacks room, leaving nothing behind", async () => {
    const { stream } = specs("GGUF");
    const path = join(dir, "nospace.gguf");
    const size = ggufStreamSize(stream);
    const e = await rejects(writeGgufStreaming(path, stream, { freeBytes: () => size + 100, reserveBytes: 1000 }));
    expect(e.code).toBe("IO");
    expect(e.message).toMatch(/not enough disk space.*nothing was written/);
    expect(leftovers("nospace")).toEqual([]);
    // the real statfs: no file system has 2^60 bytes free
    const e2 = await rejects(writeGgufStreaming(path, stream, { reserveBytes: 2 ** 60 }));
    expect(e2.message).toMatch(/not enough disk space/);
    expect(leftovers("nospace")).toEqual([]);
  });

  it("a producer yielding too few or too many bytes, a non-Uint8Array, an abort or a throwing producer leave nothing", async () => {
    const base = specs("GGUF").stream;
    const cases: Array<[string, GgufStreamSpec["tensors"][number]["data"], RegExp]> = [
      ["short", () => [new Uint8Array(10)], /needs 84 bytes of data, got 10/],
      ["long", () => [new Uint8Array(80), new Uint8Array(80)], /needs 84 bytes of data, got more/],
      ["notbytes", () => [[1, 2, 3] as unknown as Uint8Array], /must be Uint8Arrays/],
    ];
    for (const [name, data, re] of cases) {
      const path = join(dir, `${name}.gguf`);
      const spec = { ...base, tensors: [{ ...base.tensors[0]!, data }, ...base.tensors.slice(1)] };
      const e = await rejects(writeGgufStreaming(path, spec));
      expect(e.code).toBe("BAD_VALUE");
      expect(e.message).toMatch(re);
      expect(leftovers(name)).toEqual([]);
    }
    const ac = new AbortController();
    const path = join(dir, "aborted.gguf");
    const spec = {
      ...base,
      tensors: base.tensors.map((t, i) => ({
        ...t,
        data: function* () {
          if (i === 2) ac.abort();
          yield* t.data() as Iterable<Uint8Array>;
        },
      })),
    };
    const e = await rejects(writeGgufStreaming(path, spec, { signal: ac.signal }));
    expect(e.message).toMatch(/aborted/);
    expect(leftovers("aborted")).toEqual([]);
    const thrown = join(dir, "thrown.gguf");
    const bad = {
      ...base,
      tensors: [
        {
          ...base.tensors[0]!,
          data: function* (): Generator<Uint8Array> {
            yield new Uint8Array(4);
            throw new RangeError("producer failed");
          },
        },
      ],
    };
    await expect(writeGgufStreaming(thrown, bad)).rejects.toThrow(RangeError);
    expect(leftovers("thrown")).toEqual([]);
  });

  it("validates the spec like serializeGguf before touching the disk", async () => {
    const { stream } = specs("PWRI");
    const path = join(dir, "invalid.gguf");
    const dup = { ...stream, tensors: [stream.tensors[0]!, stream.tensors[0]!] };
    expect((await rejects(writeGgufStreaming(path, dup))).code).toBe("DUPLICATE_TENSOR");
    const bf16 = { ...stream, tensors: [{ ...stream.tensors[0]!, type: GGMLType.BF16 }] };
    expect((await rejects(writeGgufStreaming(path, bf16))).code).toBe("UNSUPPORTED_TYPE");
    const shape = { ...stream, format: "GGUF" as const, tensors: [{ ...stream.tensors[2]!, shape: [33, 2] }] };
    expect((await rejects(writeGgufStreaming(path, shape))).code).toBe("BAD_SHAPE");
    const long = { ...stream, tensors: [{ ...stream.tensors[0]!, name: "x".repeat(64) }] };
    expect((await rejects(writeGgufStreaming(path, long))).message).toMatch(/at most 63/);
    expect(leftovers("invalid")).toEqual([]);
  });
});
