/**
 * Stacked expert tensors cached one expert per row (`mapTensorCached` with `expertRows`): the routed-
 * expert ops (mul_mat_id, mul_mat_id_sparse, axpy_id_sparse) over the cache give bit-identical results
 * to the same ops over the mapped stack — every expert pinned, one LRU slot (a round per expert), a few
 * pinned plus LRU — for 1 and 5 tokens, and an expert larger than the 1 MiB read buffer is read in
 * pieces. A neuron op over an expert cache is BAD_GRAPH.
 */
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Backend, type DType, Graph, type TensorHandle } from "@powerinfer/core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { backend, Rng, randomWeights, usable } from "./helpers.js";

const U = 2; // experts per token

interface Shape {
  K: number;
  M: number;
  E: number;
}

function run(
  b: Backend,
  op: "mul_mat_id" | "mul_mat_id_sparse" | "axpy_id_sparse",
  w: TensorHandle,
  { K, M }: Shape,
  x: Float32Array,
  ids: Int32Array,
  logits: Float32Array,
  T: number,
): Float32Array {
  const g = new Graph();
  const id = g.input("i32", [U, T], ids);
  const sel = { logits: g.input("f32", [M, U, T], logits), threshold: 0 };
  let y: number;
  if (op === "axpy_id_sparse") y = g.axpyIdSparse(g.handle(w), g.input("f32", [M, U, T], x), id, sel);
  else if (op === "mul_mat_id") y = g.mulMatId(g.handle(w), g.input("f32", [K, T], x), id);
  else y = g.mulMatIdSparse(g.handle(w), g.input("f32", [K, T], x), id, sel);
  const out = g.output(y);
  b.compute(g);
  return out;
}

describe.skipIf(!usable)("expert cache (file-backed expert stacks)", () => {
  let b: Backend;
  let dir: string;
  const rng = new Rng(11);
  beforeAll(async () => {
    b = await backend({ threads: 2 });
    dir = mkdtempSync(join(tmpdir(), "pi-xc-"));
  });
  afterAll(() => {
    b?.dispose();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  /** Writes the stack at an odd (32-byte aligned) offset, as in a GGUF. */
  function stackFile(d: DType, s: Shape, name: string) {
    const w = randomWeights(d, s.K, s.M * s.E, rng).bytes;
    const all = new Uint8Array(96 + w.length + 32);
    all.set(w, 96);
    const path = join(dir, name);
    writeFileSync(path, all);
    return { path, fileOffset: 96, byteLength: w.length };
  }

  const cases: [DType, Shape, string][] = [
    ["f16", { K: 256, M: 64, E: 8 }, "f16"],
    ["q4_0", { K: 256, M: 64, E: 8 }, "q4_0"],
    ["f32", { K: 256, M: 64, E: 8 }, "f32"],
    // 1.5 MiB per expert: more than one read buffer
    ["f32", { K: 1024, M: 384, E: 4 }, "f32, experts larger than the 1 MiB read buffer"],
  ];
  for (const [d, s, label] of cases) {
    for (const [what, cache] of [
      ["every expert pinned", { hot: Int32Array.from({ length: s.E }, (_, i) => i), coldRows: 0 }],
      ["one LRU slot (a round per expert)", { coldRows: 1 }],
      ["expert 1 pinned + 2 LRU", { hot: Int32Array.from([1]), coldRows: 2 }],
    ] as const) {
      it(`${label}, ${what}: mul_mat_id, mul_mat_id_sparse, axpy_id_sparse equal the mapped stack's`, () => {
        const src = stackFile(d, s, `${label}-${what}.bin`.replace(/[^a-z0-9.-]/gi, "_"));
        const ne = [s.K, s.M, s.E];
        const mapped = b.mapTensor(d, ne, src);
        const cached = b.mapTensorCached!(d, ne, src, { ...cache, expertRows: true });
        const axpyOk = d !== "q4_0" && s.K === 256; // axpy_id_sparse reads [D, M, E] with D = K
        try {
          for (const T of [1, 5]) {
            const ids = Int32Array.from({ length: U * T }, (_, i) => (i * 3 + (i >> 1)) % s.E);
            const logits = Float32Array.from({ length: s.M * U * T }, () => (rng.next() < 0.4 ? 1 : -1));
            const x = new Float32Array(s.K * T).map(() => rng.next() * 2 - 1);
            const a = new Float32Array(s.M * U * T).map(() => rng.next());
            const before = b.neuronCacheStats!();
            for (const op of ["mul_mat_id", "mul_mat_id_sparse"] as const) {
              expect(run(b, op, cached, s, x, ids, logits, T)).toEqual(run(b, op, mapped, s, x, ids, logits, T));
            }
            if (axpyOk) {
              expect(run(b, "axpy_id_sparse", cached, s, a, ids, logits, T)).toEqual(
                run(b, "axpy_id_sparse", mapped, s, a, ids, logits, T),
              );
            }
            const after = b.neuronCacheStats!();
            expect(after.ioErrors).toBe(before.ioErrors);
            if (cache.coldRows === 0) expect(after.misses).toBe(before.misses);
            else expect(after.misses).toBeGreaterThan(before.misses);
          }
          // the file's bytes come back through the cache
          expect(Buffer.compare(b.readTensor(cached), b.readTensor(mapped))).toBe(0);
        } finally {
          b.freeTensor(cached);
          b.freeTensor(mapped);
        }
      });
    }
  }

  for (const [d, s] of [
    ["f16", { K: 256, M: 64, E: 8 }],
    ["f32", { K: 256, M: 64, E: 8 }],
    ["f16", { K: 1024, M: 768, E: 3 }], // 1.5 MiB experts: transposed across read pieces
  ] as [DType, Shape][]) {
    it(`${d} ${s.K}×${s.M}, transposed on read (llama.cpp's down layout → neuron-major): axpy_id_sparse equals the neuron-major stack's`, () => {
      // the file: each expert as D rows of M (ne [M, D, E]); the reference: its transpose, mapped (K is D here)
      const es = d === "f16" ? 2 : 4;
      const stored = randomWeights(d, s.M, s.K * s.E, rng).bytes;
      const nm = new Uint8Array(stored.length);
      for (let e = 0; e < s.E; e++) {
        for (let r = 0; r < s.K; r++) {
          for (let c = 0; c < s.M; c++) {
            const from = ((e * s.K + r) * s.M + c) * es;
            const to = ((e * s.M + c) * s.K + r) * es;
            nm.set(stored.subarray(from, from + es), to);
          }
        }
      }
      const path = join(dir, `tr-${d}-${s.K}.bin`);
      const all = new Uint8Array(96 + stored.length);
      all.set(stored, 96);
      writeFileSync(path, all);
      const ne = [s.K, s.M, s.E];
      const ref = b.createTensor(d, ne, nm);
      for (const cache of [{ coldRows: 1 }, { hot: Int32Array.from([0, s.E - 1]), coldRows: 1 }]) {
        const t = b.mapTensorCached!(
          d,
          ne,
          { path, fileOffset: 96, byteLength: stored.length },
          {
            ...cache,
            expertRows: true,
            transposeRows: s.K,
          },
        );
        try {
          expect(Buffer.compare(b.readTensor(t), nm)).toBe(0);
          for (const T of [1, 5]) {
            const ids = Int32Array.from({ length: U * T }, (_, i) => (i * 5 + 1) % s.E);
            const logits = Float32Array.from({ length: s.M * U * T }, () => (rng.next() < 0.4 ? 1 : -1));
            const a = new Float32Array(s.M * U * T).map(() => rng.next());
            expect(run(b, "axpy_id_sparse", t, s, a, ids, logits, T)).toEqual(
              run(b, "axpy_id_sparse", ref, s, a, ids, logits, T),
            );
          }
        } finally {
          b.freeTensor(t);
        }
      }
      b.freeTensor(ref);
      expect(() =>
        b.mapTensorCached!(
          "q4_0",
          ne,
          { path, fileOffset: 96, byteLength: stored.length },
          {
            coldRows: 1,
            expertRows: true,
            transposeRows: s.K,
          },
        ),
      ).toThrow(/transposeRows needs expertRows and an f16 or f32 tensor|byteLength/);
    });
  }

  it("a top_k over the same router weight that routes nothing queues its experts too (look-ahead)", () => {
    const s = { K: 16, M: 64, E: 8 };
    const src = stackFile("f32", s, "lookahead.bin");
    // router rows: expert e reads input component e, so x picks the experts it is largest at
    const wr = new Float32Array(s.K * s.E);
    for (let e = 0; e < s.E; e++) wr[e * s.K + e] = 1;
    const router = b.createTensor("f32", [s.K, s.E], wr);
    const now = new Float32Array(s.K);
    now[2] = 5;
    now[3] = 4; // routes experts 2 and 3
    const guess = new Float32Array(s.K);
    guess[6] = 5;
    guess[7] = 4; // the look-ahead guesses 6 and 7
    const bytes: number[] = [];
    const outs: Float32Array[] = [];
    for (const lookAhead of [false, true]) {
      const t = b.mapTensorCached!("f32", [s.K, s.M, s.E], src, { coldRows: 4, expertRows: true });
      try {
        const g = new Graph();
        const route = (x: Float32Array) =>
          g.topK(g.softmax(g.mulMat(g.handle(router), g.input("f32", [s.K, 1], x))), U);
        if (lookAhead) route(guess); // its ids are never read
        const ids = route(now);
        const y = g.output(g.mulMatId(g.handle(t), g.input("f32", [s.K, 1], now), ids));
        const before = b.neuronCacheStats!();
        b.compute(g);
        outs.push(y);
        // the look-ahead's reads may still be in flight: wait for them to land
        const deadline = Date.now() + 5000;
        let after = b.neuronCacheStats!();
        while (lookAhead && after.bytesRead - before.bytesRead < 4 * s.K * s.M * 4 && Date.now() < deadline) {
          Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 10);
          after = b.neuronCacheStats!();
        }
        bytes.push(after.bytesRead - before.bytesRead);
      } finally {
        b.freeTensor(t);
      }
    }
    expect(outs[1]).toEqual(outs[0]);
    // two experts read without the look-ahead, four with it (whole 4 KiB blocks: at least the experts' bytes)
    expect(bytes[0]).toBeGreaterThanOrEqual(2 * s.K * s.M * 4);
    expect(bytes[0]).toBeLessThan(4 * s.K * s.M * 4);
    expect(bytes[1]).toBeGreaterThanOrEqual(4 * s.K * s.M * 4);
    b.freeTensor(router);
  });

  it("a neuron op over an expert cache is BAD_GRAPH; a 2-d tensor with expertRows is BAD_TENSOR", () => {
    const s = { K: 256, M: 64, E: 8 };
    const src = stackFile("f32", s, "misuse.bin");
    const t = b.mapTensorCached!("f32", [s.K, s.M, s.E], src, { coldRows: 2, expertRows: true });
    try {
      const g = new Graph();
      g.output(g.relu(g.handle(t)));
      expect(() => b.compute(g)).toThrow(/one expert per row \(expert cache\) and only mul_mat_id/);
    } finally {
      b.freeTensor(t);
    }
    expect(() => b.mapTensorCached!("f32", [s.K, s.M * s.E], src, { coldRows: 2, expertRows: true })).toThrow(
      /cached expert stack is 3-d/,
    );
  });
});
