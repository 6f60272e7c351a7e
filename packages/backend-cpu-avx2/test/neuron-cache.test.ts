/**
 * File-backed weights (`mapTensorCached`): the sparse ops over a neuron cache give bit-identical
 * results to the same ops over the mapped tensor — with every row pinned, with a tiny LRU region that
 * forces several rounds per op, with a shared pool, and for the parts of a bundled record — and the
 * counters say what was read. Misuse is a typed error.
 */
import { copyFileSync, mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from "node:fs";
import { release, tmpdir } from "node:os";
import { join } from "node:path";
import { type Backend, BackendError, type DType, Graph, type TensorHandle } from "@powerinfer/core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { cpuBackend } from "../src/index.js";
import { Rng, randomWeights, usable } from "./helpers.js";

const K = 256;
const ROWS = 512;

function sparse(
  b: Backend,
  op: "mul_mat_sparse" | "axpy_sparse",
  w: TensorHandle,
  x: Float32Array,
  logits: Float32Array,
  T: number,
): Float32Array {
  const g = new Graph();
  const xi = g.input("f32", [op === "mul_mat_sparse" ? K : ROWS, T], x);
  const opts = { logits: g.input("f32", [ROWS, T], logits), threshold: 0, nOut: ROWS };
  const y = g.output(
    op === "mul_mat_sparse" ? g.mulMatSparse(g.handle(w), xi, opts) : g.axpySparse(g.handle(w), xi, opts),
  );
  b.compute(g);
  return y;
}

/** Whether this kernel lets a process set up an io_uring (5.6+ for IORING_OP_READ; not disabled by sysctl). */
function kernelAllowsIoUring(): boolean {
  const [major, minor] = release()
    .split(".")
    .map((x) => Number.parseInt(x, 10));
  if (!(major! > 5 || (major === 5 && minor! >= 6))) return false;
  try {
    return readFileSync("/proc/sys/kernel/io_uring_disabled", "utf8").trim() === "0";
  } catch {
    return true; // (kernels before 6.6 have no such switch)
  }
}

// every case twice: io_uring (the default where the kernel allows it) and the pread pool (POWERINFER_IO=pread)
describe.skipIf(!usable).each(["io_uring", "pread"] as const)(
  "neuron cache (file-backed sparse weights), %s reads",
  (io) => {
    let b: Backend;
    let dir: string;
    let path: string;
    const rng = new Rng(7);
    const dtypes: DType[] = ["f16", "q4_0", "f32"];
    const bytes = new Map<DType, Uint8Array>();
    const offset = new Map<DType, number>();
    const saved = process.env.POWERINFER_IO;
    beforeAll(async () => {
      // read by the backend when it binds its first file-backed tensor
      process.env.POWERINFER_IO = io;
      b = await cpuBackend.load({ threads: 2 }); // (a backend of its own: the engine is chosen once per backend)
      dir = mkdtempSync(join(tmpdir(), "pi-nc-"));
      path = join(dir, "w.bin");
      // the tensors at odd (32-byte aligned, not 4 KiB aligned) offsets, as in a GGUF
      let at = 96;
      const parts: Uint8Array[] = [new Uint8Array(96)];
      for (const d of dtypes) {
        const w = randomWeights(d, K, ROWS, rng).bytes;
        bytes.set(d, w);
        offset.set(d, at);
        parts.push(w, new Uint8Array(32));
        at += w.length + 32;
      }
      const all = new Uint8Array(at);
      let o = 0;
      for (const p of parts) {
        all.set(p, o);
        o += p.length;
      }
      writeFileSync(path, all);
    });
    afterAll(() => {
      b?.dispose();
      if (dir) rmSync(dir, { recursive: true, force: true });
      if (saved === undefined) delete process.env.POWERINFER_IO;
      else process.env.POWERINFER_IO = saved;
    });

    for (const d of ["f16", "q4_0", "f32"] as DType[]) {
      for (const [what, cache] of [
        ["every row pinned", { hot: Int32Array.from({ length: ROWS }, (_, i) => i), coldRows: 0 }],
        ["8 LRU rows (rounds)", { coldRows: 8 }],
        ["a few pinned + 64 LRU rows", { hot: Int32Array.from([0, 3, 9, 100, 511]), coldRows: 64 }],
      ] as const) {
        it(`${d}, ${what}: mul_mat_sparse and axpy_sparse equal the mapped tensor's, 1 and 5 tokens`, () => {
          const src = { path, fileOffset: offset.get(d)!, byteLength: bytes.get(d)!.length };
          const mapped = b.mapTensor(d, [K, ROWS], src);
          const cached = b.mapTensorCached!(d, [K, ROWS], src, cache);
          try {
            for (const T of [1, 5]) {
              const logits = Float32Array.from({ length: ROWS * T }, () => (rng.next() < 0.3 ? 1 : -1));
              const x = new Float32Array(K * T).map(() => rng.next() * 2 - 1);
              const a = new Float32Array(ROWS * T).map(() => rng.next());
              for (let rep = 0; rep < 2; rep++) {
                const before = b.neuronCacheStats!();
                expect(sparse(b, "mul_mat_sparse", cached, x, logits, T)).toEqual(
                  sparse(b, "mul_mat_sparse", mapped, x, logits, T),
                );
                expect(sparse(b, "axpy_sparse", cached, a, logits, T)).toEqual(
                  sparse(b, "axpy_sparse", mapped, a, logits, T),
                );
                const after = b.neuronCacheStats!();
                expect(after.ioErrors).toBe(before.ioErrors);
                if (cache.coldRows === 0) expect(after.misses).toBe(before.misses);
                else expect(after.hits + after.misses).toBeGreaterThan(before.hits + before.misses);
              }
            }
          } finally {
            b.freeTensor(cached);
            b.freeTensor(mapped);
          }
        });
      }
    }

    it("readTensor of a cached tensor returns the file's bytes; the counters report direct I/O", () => {
      const src = { path, fileOffset: offset.get("f16")!, byteLength: bytes.get("f16")!.length };
      const t = b.mapTensorCached!("f16", [K, ROWS], src, { coldRows: 4 });
      expect(Buffer.compare(b.readTensor(t), bytes.get("f16")!)).toBe(0);
      const st = b.neuronCacheStats!();
      expect(typeof st.direct).toBe("boolean");
      if (io === "pread" || !kernelAllowsIoUring()) {
        // (a kernel that refuses a ring: the pread pool, as with POWERINFER_IO=pread)
        expect(st.ioDepth).toBe(0);
        expect(st.ioThreads).toBe(Number(process.env.POWERINFER_IO_THREADS || 16));
      } else {
        expect(st.ioDepth).toBe(64);
        expect(st.ioThreads).toBe(4);
      }
      b.freeTensor(t);
    });

    it("a dense op over a cached tensor is BAD_GRAPH naming the rule; a hot row out of range is BAD_TENSOR", () => {
      const src = { path, fileOffset: offset.get("f32")!, byteLength: bytes.get("f32")!.length };
      const t = b.mapTensorCached!("f32", [K, ROWS], src, { coldRows: 4 });
      try {
        const g = new Graph();
        g.output(g.mulMat(g.handle(t), g.input("f32", [K, 1], new Float32Array(K))));
        expect(() => b.compute(g)).toThrow(/file-backed \(neuron cache\) and only mul_mat_sparse\/axpy_sparse/);
        try {
          b.compute(g);
        } catch (e) {
          expect(e).toBeInstanceOf(BackendError);
          expect((e as BackendError).code).toBe("BAD_GRAPH");
        }
      } finally {
        b.freeTensor(t);
      }
      expect(() => b.mapTensorCached!("f32", [K, ROWS], src, { coldRows: 4, hot: Int32Array.from([ROWS]) })).toThrow(
        /hot row 512 out of range/,
      );
      expect(() => b.mapTensorCached!("f32", [K, ROWS], { ...src, fileOffset: 10 ** 9 }, { coldRows: 4 })).toThrow(
        /beyond the file size/,
      );
    });

    it("a row that cannot be read (the file shortened after mapping) is an IO error naming the file", () => {
      const short = join(dir, "short.bin");
      copyFileSync(path, short);
      const d: DType = "q4_0";
      const src = { path: short, fileOffset: offset.get(d)!, byteLength: bytes.get(d)!.length };
      const cached = b.mapTensorCached!(d, [K, ROWS], src, { coldRows: 8 });
      try {
        truncateSync(short, offset.get(d)! + 4096);
        const logits = new Float32Array(ROWS).fill(1);
        let err: unknown;
        try {
          sparse(b, "mul_mat_sparse", cached, new Float32Array(K).fill(0.5), logits, 1);
        } catch (e) {
          err = e;
        }
        expect(err).toBeInstanceOf(BackendError);
        expect((err as BackendError).code).toBe("IO");
        expect((err as Error).message).toContain(short);
      } finally {
        b.freeTensor(cached);
      }
    });
  },
);
