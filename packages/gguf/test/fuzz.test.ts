import { openSync, readSync, closeSync } from "node:fs";
import { describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  type GgufErrorCode,
  type GgufFile,
  GgufTypes,
  GgufValueType,
  metadataEntries,
  openGguf,
  parseGgufBuffer,
  parseModelConfig,
  readTensorBytes,
  serializeGguf,
} from "../src/index.js";
import { model, rng } from "./helpers.js";

const CODES = new Set<GgufErrorCode>([
  "BAD_MAGIC",
  "UNSUPPORTED_VERSION",
  "TRUNCATED",
  "LENGTH_PAST_END",
  "TENSOR_OUT_OF_BOUNDS",
  "MISALIGNED",
  "TENSOR_OVERLAP",
  "UNKNOWN_TYPE",
  "DUPLICATE_TENSOR",
  "DUPLICATE_KEY",
  "BAD_KEY",
  "TOO_MANY_DIMS",
  "ELEMENT_OVERFLOW",
  "BAD_SHAPE",
  "BAD_VALUE",
]);

/** First `max` bytes of a file (the header plus some data is all the parser looks at). */
function head(rel: string, max: number): Uint8Array {
  const fd = openSync(model(rel), "r");
  try {
    const buf = new Uint8Array(max);
    const n = readSync(fd, buf, 0, max, 0);
    return buf.subarray(0, n);
  } finally {
    closeSync(fd);
  }
}

/** A small file exercising every value type, nested arrays and several tensor types. */
function synthetic(): Uint8Array {
  return serializeGguf({
    metadata: [
      { key: "general.architecture", type: GgufTypes.string, value: "llama" },
      { key: "general.alignment", type: GgufTypes.u32, value: 64 },
      { key: "llama.context_length", type: GgufTypes.u32, value: 64 },
      { key: "llama.embedding_length", type: GgufTypes.u32, value: 32 },
      { key: "llama.block_count", type: GgufTypes.u32, value: 1 },
      { key: "llama.feed_forward_length", type: GgufTypes.u32, value: 64 },
      { key: "llama.attention.head_count", type: GgufTypes.u32, value: 4 },
      { key: "llama.attention.layer_norm_rms_epsilon", type: GgufTypes.f32, value: 1e-5 },
      { key: "b", type: GgufTypes.bool, value: true },
      { key: "i64", type: GgufTypes.i64, value: -3n },
      { key: "f64", type: GgufTypes.f64, value: 2.5 },
      { key: "i8", type: GgufTypes.i8, value: -1 },
      { key: "u16", type: GgufTypes.u16, value: 9 },
      { key: "bools", type: GgufTypes.array(GgufValueType.BOOL), value: [true, false] },
      { key: "u64s", type: GgufTypes.array(GgufValueType.UINT64), value: BigUint64Array.of(1n, 2n) },
      {
        key: "nested",
        type: {
          type: GgufValueType.ARRAY,
          itemType: GgufValueType.ARRAY,
          items: [
            { type: GgufValueType.ARRAY, itemType: GgufValueType.STRING },
            { type: GgufValueType.ARRAY, itemType: GgufValueType.INT16 },
          ],
        },
        value: [["x", "yz"], Int16Array.of(1, -2, 3)],
      },
      { key: "tokenizer.ggml.tokens", type: GgufTypes.array(GgufValueType.STRING), value: ["a", "b", "c", "d"] },
    ],
    tensors: [
      { name: "token_embd.weight", type: GGMLType.F16, shape: [32, 4], data: new Uint8Array(256) },
      { name: "blk.0.attn_norm.weight", type: GGMLType.F32, shape: [32], data: new Uint8Array(128) },
      { name: "blk.0.ffn_up.weight", type: GGMLType.Q4_0, shape: [32, 64], data: new Uint8Array(64 * 18) },
      { name: "blk.0.ffn_gate.weight", type: GGMLType.Q8_0, shape: [32, 64], data: new Uint8Array(64 * 34) },
      { name: "blk.0.ffn_down.weight", type: GGMLType.Q6_K, shape: [256, 8], data: new Uint8Array(8 * 210) },
    ],
  });
}

/** Offsets of the u64 length/count fields and u32 type/dims fields of a parsed buffer's header. */
function fieldOffsets(buf: Uint8Array, f: GgufFile): { u64: number[]; u32: number[]; keys: number[][] } {
  const u64 = [8, 16];
  const u32: number[] = [];
  const keys: number[][] = [];
  const enc = new TextEncoder();
  let from = 24;
  const find = (s: string) => {
    const b = enc.encode(s);
    outer: for (let i = from; i + b.length <= buf.length; i++) {
      for (let j = 0; j < b.length; j++) if (buf[i + j] !== b[j]) continue outer;
      return i;
    }
    return -1;
  };
  for (const [key, info] of f.metadataTypes) {
    const at = find(key);
    if (at < 0) continue;
    const end = at + enc.encode(key).length;
    u64.push(at - 8);
    u32.push(end);
    keys.push([at, end - at]);
    if (info.type === GgufValueType.STRING) u64.push(end + 4);
    if (info.type === GgufValueType.ARRAY) {
      u32.push(end + 4);
      u64.push(end + 8);
    }
    from = end;
  }
  for (const t of f.tensors) {
    const at = find(t.name);
    if (at < 0) continue;
    const end = at + enc.encode(t.name).length;
    u64.push(at - 8);
    u32.push(end); // n_dims
    for (let d = 0; d < t.shape.length; d++) u64.push(end + 4 + 8 * d);
    u32.push(end + 4 + 8 * t.shape.length); // type
    u64.push(end + 8 + 8 * t.shape.length); // offset
    from = end;
  }
  return { u64, u32, keys };
}

/** [label, bytes, the whole file's header (for field offsets when `bytes` is only a prefix)]. */
const SOURCES: Array<[string, () => Uint8Array, string?]> = [
  ["stories260K-Q4_0 (whole file)", () => head("stories260K-Q4_0-ffn_down-F16.gguf", 1 << 20)],
  ["tiny-q4_0 PWRI (whole file)", () => head("powerinfer/tiny-q4_0.powerinfer.gguf", 1 << 20)],
  ["tiny.generated.gpuidx", () => head("powerinfer/tiny.generated.gpuidx", 1 << 20)],
  [
    "relu model header + 8 KiB",
    () => head("relu/tinystories-relu-llama-7m.f32.gguf", 49728 + 8192),
    "relu/tinystories-relu-llama-7m.f32.gguf",
  ],
  ["gpt-2 vocab, first 96 KiB", () => head("vocab/ggml-vocab-gpt-2.gguf", 96 * 1024), "vocab/ggml-vocab-gpt-2.gguf"],
  ["synthetic", synthetic],
];
const PER_SOURCE = 500;

describe("fuzz: mutated headers parse or throw a typed GgufError", () => {
  it(`${SOURCES.length * PER_SOURCE} seeded mutations (byte flips, truncations, length-field overwrites)`, () => {
    const rand = rng(0x5eed_2024);
    const pick = <T>(a: readonly T[]): T => a[rand() % a.length];
    const outcomes = new Map<string, number>();
    let slowest = 0;
    let total = 0;
    for (const [label, load, whole] of SOURCES) {
      const orig = load();
      // Prefixes of big files fail to parse (tensors past the end, or the header cut short), so
      // their field offsets come from the whole file's header.
      const base = whole ? openGguf(model(whole)) : parseGgufBuffer(orig);
      const fields = fieldOffsets(orig, base);
      const headerEnd = Math.min(base.dataOffset, orig.length);
      for (let iter = 0; iter < PER_SOURCE; iter++) {
        let buf = orig.slice();
        const nMut = 1 + (rand() % 3);
        const kinds: string[] = [];
        for (let m = 0; m < nMut; m++) {
          const kind = rand() % 6;
          const dv = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
          if (kind === 0) {
            // flip 1-8 random bits in the header region
            for (let k = 1 + (rand() % 8); k > 0; k--) {
              const at = rand() % Math.min(buf.length, headerEnd + 64);
              buf[at] ^= 1 << (rand() % 8);
            }
            kinds.push("flip");
          } else if (kind === 1) {
            buf = buf.subarray(0, rand() % (buf.length + 1));
            kinds.push("truncate");
          } else if (kind === 2 || kind === 3) {
            const at = pick(fields.u64);
            if (at + 8 > buf.length) continue;
            const old = dv.getBigUint64(at, true);
            const vals = [
              0n,
              1n,
              old + 1n,
              old - 1n,
              1n << 31n,
              (1n << 32n) - 1n,
              1n << 32n,
              1n << 53n,
              1n << 63n,
              (1n << 64n) - 1n,
              BigInt(buf.length - at),
              BigInt(rand()) * BigInt(rand()),
            ];
            dv.setBigUint64(at, BigInt.asUintN(64, pick(vals)), true);
            kinds.push("len64");
          } else if (kind === 5) {
            // a key byte becomes a control character, invalid UTF-8, or (a length of 0) the key empty
            const [at, len] = pick(fields.keys);
            const v = pick([0x00, 0x01, 0x0a, 0x1f, 0x7f, 0x80, 0xc3, 0xff, -1]);
            if (v < 0) {
              if (at - 8 + 8 > buf.length) continue;
              dv.setBigUint64(at - 8, 0n, true);
            } else {
              const i = at + (rand() % len);
              if (i >= buf.length) continue;
              buf[i] = v;
            }
            kinds.push("key");
          } else {
            const at = pick(fields.u32);
            if (at + 4 > buf.length) continue;
            dv.setUint32(at, pick([0, 1, 5, 9, 12, 13, 16, 18, 19, 24, 30, 31, 41, 99, 0xffffffff, rand()]), true);
            kinds.push("u32");
          }
        }
        const t0 = performance.now();
        let outcome: string;
        try {
          const f = parseGgufBuffer(buf, label);
          outcome = "parsed";
          for (const t of f.tensors) expect(t.fileOffset + t.byteLength).toBeLessThanOrEqual(buf.length);
          if (f.tensors.length > 0) expect(readTensorBytes(f, f.tensors[0]).length).toBe(f.tensors[0].byteLength);
          try {
            parseModelConfig(f);
          } catch (e) {
            if (!(e instanceof GgufError)) throw e;
          }
          if (iter % 8 === 0) {
            // Whatever parsed can be written back, and re-reads to the same metadata.
            try {
              const again = parseGgufBuffer(
                serializeGguf({
                  format: f.format,
                  metadata: metadataEntries(f),
                  tensors: f.tensors.map((t) => ({ ...t, data: readTensorBytes(f, t) })),
                }),
              );
              expect(again.metadata).toEqual(f.metadata);
              expect(again.tensors.map((t) => [t.name, t.type, t.shape])).toEqual(
                f.tensors.map((t) => [t.name, t.type, t.shape]),
              );
            } catch (e) {
              if (!(e instanceof GgufError)) throw e;
            }
          }
        } catch (e) {
          if (!(e instanceof GgufError)) {
            throw new Error(`${label} #${iter} (${kinds.join("+")}): non-GgufError ${(e as Error)?.stack ?? e}`);
          }
          expect(CODES.has(e.code), `${label}: unexpected code ${e.code}`).toBe(true);
          if (e.offset !== undefined) {
            expect(e.offset).toBeGreaterThanOrEqual(0);
            expect(e.offset).toBeLessThanOrEqual(buf.length);
          }
          outcome = e.code;
        }
        slowest = Math.max(slowest, performance.now() - t0);
        outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1);
        total++;
      }
    }
    if (process.env.FUZZ_VERBOSE) console.log(total, slowest.toFixed(1), [...outcomes]);
    expect(total).toBeGreaterThanOrEqual(2500);
    // The mutations reach deep into the parser: successes and many different typed errors.
    // (39 parse here; 19 mutations that used to parse — a type or offset changed so that two tensors share
    // bytes — are TENSOR_OVERLAP since the reader checks it)
    expect(outcomes.get("parsed") ?? 0).toBeGreaterThan(25);
    expect(outcomes.get("TENSOR_OVERLAP") ?? 0).toBeGreaterThan(0);
    for (const code of [
      "TRUNCATED",
      "LENGTH_PAST_END",
      "UNKNOWN_TYPE",
      "TENSOR_OUT_OF_BOUNDS",
      "BAD_MAGIC",
      "BAD_KEY",
      "BAD_SHAPE",
    ]) {
      expect(outcomes.get(code) ?? 0, `${code} in ${JSON.stringify([...outcomes])}`).toBeGreaterThan(0);
    }
    expect(slowest).toBeLessThan(1000);
  });
});
