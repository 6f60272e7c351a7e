import { join } from "node:path";

/** Root of the shared test models (set by vitest.shared.ts). */
export const MODELS = process.env.POWERINFER_TEST_MODELS ?? join(import.meta.dirname, "../../../../shared/models");

export const model = (rel: string): string => join(MODELS, rel);

/** Seeded PRNG (mulberry32): deterministic uint32 stream. */
export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (t ^ (t >>> 14)) >>> 0;
  };
}

/**
 * Byte builder for hand-crafted GGUF buffers; `mark(name)` records the offset of the next field so
 * tests can check the offsets errors report.
 */
export class Craft {
  private bytes: number[] = [];
  readonly marks: Record<string, number> = {};

  mark(name: string): this {
    this.marks[name] = this.bytes.length;
    return this;
  }
  raw(...b: number[]): this {
    this.bytes.push(...b);
    return this;
  }
  ascii(s: string): this {
    for (const ch of s) this.bytes.push(ch.charCodeAt(0));
    return this;
  }
  u32(v: number): this {
    for (let i = 0; i < 4; i++) this.bytes.push((v >>> (8 * i)) & 0xff);
    return this;
  }
  u64(v: number | bigint): this {
    let b = BigInt(v);
    for (let i = 0; i < 8; i++) {
      this.bytes.push(Number(b & 0xffn));
      b >>= 8n;
    }
    return this;
  }
  str(s: string): this {
    const b = new TextEncoder().encode(s);
    this.u64(b.length);
    this.bytes.push(...b);
    return this;
  }
  /** Zero bytes up to the next multiple of `a`. */
  align(a = 32): this {
    while (this.bytes.length % a !== 0) this.bytes.push(0);
    return this;
  }
  zeros(n: number): this {
    for (let i = 0; i < n; i++) this.bytes.push(0);
    return this;
  }
  get length(): number {
    return this.bytes.length;
  }
  build(): Uint8Array {
    return Uint8Array.from(this.bytes);
  }
}

/** Header of a GGUF file: magic, version, tensor and kv counts. */
export function header(nTensors: number | bigint, nKv: number | bigint, magic = "GGUF", version = 3): Craft {
  return new Craft().ascii(magic).u32(version).mark("tensorCount").u64(nTensors).mark("kvCount").u64(nKv);
}
