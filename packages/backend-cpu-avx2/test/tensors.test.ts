/**
 * Tensors (mapped from a real GGUF file, allocated, budget), the descriptor's probe and load, and
 * malformed graphs: every bad input must throw a BackendError, never crash the process.
 */
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { type Backend, BackendError, type EncodedGraph, Graph, type TensorHandle } from "@powerinfer/core";
import { dequantize, type GgufFile, openGguf, readTensorF32 } from "@powerinfer/gguf";
import { afterAll, describe, expect, it } from "vitest";
import { type CpuBackend, cpuBackend } from "../src/index.js";
import { backend, GGML, usable } from "./helpers.js";

const models = process.env.POWERINFER_TEST_MODELS ?? "/work/shared/models";
const stories = join(models, "stories260K.gguf");
const storiesQ8 = join(models, "stories260K-Q8_0-ffn_down-F16.gguf");

function expectBackendError(f: () => unknown, code: string, pattern?: RegExp): void {
  let err: unknown;
  try {
    f();
  } catch (e) {
    err = e;
  }
  expect(err, "expected a BackendError").toBeInstanceOf(BackendError);
  expect((err as BackendError).code).toBe(code);
  if (pattern) expect((err as BackendError).message).toMatch(pattern);
}

describe("descriptor", () => {
  it("probe is cheap, never throws and describes the CPU", () => {
    const p = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;
    expect(cpuBackend.name).toBe("cpu");
    if (p.usable) {
      expect(p.score).toBe(10);
      expect(p.reason).toMatch(/^(avx2\+fma\+f16c(\+avx512vnni)?|scalar \(.+\))$/);
    } else {
      expect(p.reason).toMatch(/^unavailable: /);
    }
    expect(p.devices[0]!.kind).toBe("cpu");
    expect(p.devices[0]!.totalMemory).toBeGreaterThan(0);
    expect(p.devices[0]!.freeMemory).toBeGreaterThan(0);
    expect(p.devices[0]!.name.length).toBeGreaterThan(0);
  });

  const dist = fileURLToPath(new URL("../dist/index.js", import.meta.url));
  it.skipIf(!existsSync(dist))(
    "a missing or broken addon makes probe() report unavailable, import never throws",
    () => {
      const dir = mkdtempSync(join(tmpdir(), "pi-cpu-"));
      try {
        const broken = join(dir, "broken.node");
        writeFileSync(broken, "not a shared object");
        for (const [path, pattern] of [
          [join(dir, "missing.node"), /^unavailable: native addon not built/],
          [broken, /^unavailable: native addon failed to load/],
        ] as const) {
          const script = `import(${JSON.stringify(dist)}).then(async (m) => { const p = m.cpuBackend.probe(); let e; try { await m.cpuBackend.load(); } catch (x) { e = x.code; } console.log(JSON.stringify({ p, e })); })`;
          const r = spawnSync(process.execPath, ["-e", script], {
            env: { ...process.env, POWERINFER_CPU_ADDON: path },
            encoding: "utf8",
          });
          expect(r.status, r.stderr).toBe(0);
          const out = JSON.parse(r.stdout) as { p: { usable: boolean; reason: string }; e: string };
          expect(out.p.usable).toBe(false);
          expect(out.p.reason).toMatch(pattern);
          expect(out.e).toBe("UNAVAILABLE");
        }
      } finally {
        rmSync(dir, { recursive: true });
      }
    },
  );

  it.skipIf(!usable)("rejects bad load options", async () => {
    await expect(cpuBackend.load({ threads: 0 })).rejects.toMatchObject({ code: "UNAVAILABLE" });
    await expect(cpuBackend.load({ memoryBudget: -1 })).rejects.toMatchObject({ code: "UNAVAILABLE" });
  });
});

describe.skipIf(!usable)("tensors", () => {
  let file: GgufFile | undefined;
  if (existsSync(stories)) file = openGguf(stories);

  it.skipIf(!file)("maps a real GGUF tensor zero-copy; get_rows equals its F32 values", async () => {
    const b = await backend({ threads: 2 });
    const before = b.allocatedBytes();
    const t = file!.tensorMap.get("token_embd.weight")!;
    expect(t.fileOffset % 32).toBe(0);
    const h = b.mapTensor("f32", t.shape, { path: stories, fileOffset: t.fileOffset, byteLength: t.byteLength });
    expect(b.allocatedBytes()).toBe(before); // mapped weights count 0
    const values = readTensorF32(file!, t);
    const [k, rows] = t.shape as [number, number];
    const ids = Int32Array.from([0, 1, rows - 1, 42]);
    const g = new Graph();
    const y = g.output(g.getRows(g.handle(h), g.input("i32", [ids.length], ids)));
    b.compute(g);
    for (let i = 0; i < ids.length; i++) {
      expect(y.subarray(i * k, (i + 1) * k)).toEqual(values.subarray(ids[i]! * k, (ids[i]! + 1) * k));
    }
    // the same file mapped again (another tensor) shares the mapping; bytes read back equal the file
    const n = file!.tensorMap.get("output_norm.weight")!;
    const hn = b.mapTensor("f32", n.shape, { path: stories, fileOffset: n.fileOffset, byteLength: n.byteLength });
    expect(new Float32Array(b.readTensor(hn).buffer)).toEqual(readTensorF32(file!, n));
    // mapped tensors are read-only
    expectBackendError(() => b.writeTensor(h, new Float32Array(4)), "BAD_TENSOR", /read-only/);
    expectBackendError(() => {
      const g2 = new Graph();
      g2.cpy(g2.input("f32", [k, 1], new Float32Array(k)), g2.handle(h), 0);
      b.compute(g2);
    }, "BAD_GRAPH");
    b.freeTensor(h);
    b.freeTensor(hn);
  });

  it.skipIf(!existsSync(storiesQ8))("maps Q8_0 and F16 tensors; get_rows equals gguf's dequantization", async () => {
    const b = await backend({ threads: 1 });
    const f = openGguf(storiesQ8);
    for (const name of ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight"]) {
      const t = f.tensorMap.get(name)!;
      const dtype = (Object.keys(GGML) as (keyof typeof GGML)[]).find((d) => GGML[d] === t.type)!;
      const h = b.mapTensor(dtype, t.shape, { path: storiesQ8, fileOffset: t.fileOffset, byteLength: t.byteLength });
      const [k, rows] = t.shape as [number, number];
      const ids = Int32Array.from({ length: rows }, (_, i) => rows - 1 - i);
      const g = new Graph();
      const y = g.output(g.getRows(g.handle(h), g.input("i32", [rows], ids)));
      b.compute(g);
      const bytes = b.readTensor(h);
      const values = dequantize(t.type, bytes, t.nElements);
      for (let r = 0; r < rows; r++) {
        expect(y.subarray(r * k, (r + 1) * k)).toEqual(values.subarray(ids[r]! * k, (ids[r]! + 1) * k));
      }
      b.freeTensor(h);
    }
  });

  it("mapTensor validates sizes, bounds, alignment and the file", async () => {
    const b = await backend({ threads: 1 });
    const dir = mkdtempSync(join(tmpdir(), "pi-cpu-"));
    try {
      const p = join(dir, "w.bin");
      writeFileSync(p, new Uint8Array(4096));
      expectBackendError(
        () => b.mapTensor("f32", [16, 4], { path: p, fileOffset: 0, byteLength: 100 }),
        "BAD_TENSOR",
        /byteLength/,
      );
      expectBackendError(
        () => b.mapTensor("f32", [16, 64], { path: p, fileOffset: 32, byteLength: 4096 }),
        "BAD_TENSOR",
        /exceed/,
      );
      expectBackendError(
        () => b.mapTensor("f32", [16], { path: p, fileOffset: 2, byteLength: 64 }),
        "BAD_TENSOR",
        /aligned/,
      );
      expectBackendError(
        () => b.mapTensor("f32", [16], { path: join(dir, "nope"), fileOffset: 0, byteLength: 64 }),
        "IO",
      );
      expectBackendError(() => b.mapTensor("q4_0", [33], { path: p, fileOffset: 0, byteLength: 18 }), "BAD_TENSOR");
      const ok = b.mapTensor("q8_0", [32, 2], { path: p, fileOffset: 4096 - 68, byteLength: 68 });
      expect(b.readTensor(ok).length).toBe(68);
      b.freeTensor(ok);
    } finally {
      rmSync(dir, { recursive: true });
    }
  });

  it("createTensor, read/write, free, budget and dispose", async () => {
    const b = await cpuBackend.load({ threads: 1, memoryBudget: 1000 });
    const t = b.createTensor("f16", [8, 2]);
    expect(b.allocatedBytes()).toBe(32);
    expect(b.readTensor(t)).toEqual(new Uint8Array(32));
    b.writeTensor(t, Uint8Array.from([1, 2, 3]), 29);
    expect(Array.from(b.readTensor(t).subarray(28))).toEqual([0, 1, 2, 3]);
    expectBackendError(() => b.writeTensor(t, new Uint8Array(4), 29), "BAD_TENSOR", /exceeds/);
    expectBackendError(() => b.createTensor("f32", [8], new Float32Array(7)), "BAD_TENSOR");
    expectBackendError(() => b.createTensor("q4_0", [16]), "BAD_TENSOR", /block size/);
    expectBackendError(() => b.createTensor("f32", [300]), "OUT_OF_MEMORY", /1200 bytes/);
    const q = b.createTensor("q4_0", [32, 2], new Uint8Array(36));
    expect(b.allocatedBytes()).toBe(68);
    b.freeTensor(q);
    expect(b.allocatedBytes()).toBe(32);
    b.freeTensor(t);
    expectBackendError(() => b.readTensor(t), "BAD_TENSOR");
    expectBackendError(() => b.freeTensor(t), "BAD_TENSOR");
    // a graph that names a freed handle
    const t2 = b.createTensor("f32", [4]);
    const g = new Graph();
    g.output(g.scale(g.handle(t2), 2));
    b.freeTensor(t2);
    expectBackendError(() => b.compute(g), "BAD_GRAPH", /does not exist/);
    b.dispose();
    expectBackendError(() => b.createTensor("f32", [4]), "DISPOSED");
    expectBackendError(() => b.compute(new Graph()), "DISPOSED");
    b.dispose(); // idempotent
  });
});

describe.skipIf(!usable)("malformed graphs throw BackendError 'BAD_GRAPH' and the backend keeps working", () => {
  let b: Backend;
  let w: TensorHandle;
  const k = 64;

  /** A valid graph: y = silu(W·x) + rows of W, then the encoded arrays to mutate. */
  function valid(): { g: Graph; enc: EncodedGraph } {
    const g = new Graph();
    const x = g.input("f32", [k, 2], new Float32Array(2 * k).fill(0.5));
    const ids = g.input("i32", [2], Int32Array.from([0, 3]));
    const h = g.handle(w);
    g.output(g.silu(g.mulMat(h, x)));
    g.output(g.getRows(h, ids));
    return { g, enc: g.encode() };
  }

  function computeEncoded(enc: EncodedGraph): void {
    b.compute({ encode: () => enc } as unknown as Graph);
  }

  afterAll(() => b?.freeTensor(w));

  const cases: [string, (e: EncodedGraph) => void, RegExp][] = [
    [
      "tensors not a multiple of 8",
      (e) => {
        e.tensors = e.tensors.subarray(0, e.tensors.length - 1);
      },
      /multiple of 8/,
    ],
    [
      "nodes not a multiple of 10",
      (e) => {
        e.nodes = e.nodes.subarray(0, 9);
      },
      /multiple of 10/,
    ],
    [
      "unknown op",
      (e) => {
        e.nodes[0] = 99;
      },
      /unknown op/,
    ],
    [
      "source id out of range",
      (e) => {
        e.nodes[2] = 1000;
      },
      /out of range/,
    ],
    [
      "negative source id",
      (e) => {
        e.nodes[3] = -7;
      },
      /out of range/,
    ],
    [
      "destination out of range",
      (e) => {
        e.nodes[1] = 77;
      },
      /out of range/,
    ],
    [
      "unknown dtype",
      (e) => {
        e.tensors[2 * 8 + 1] = 5;
      },
      /dtype/,
    ],
    [
      "input index out of range",
      (e) => {
        e.tensors[0 * 8 + 6] = 9;
      },
      /input index/,
    ],
    [
      "input byte length mismatch",
      (e) => {
        e.inputs[0] = new Float32Array(3);
      },
      /bytes/,
    ],
    [
      "dimension 0",
      (e) => {
        e.tensors[0 * 8 + 3] = 0;
      },
      /dimension/,
    ],
    [
      "shape inconsistent with its node",
      (e) => {
        e.tensors[3 * 8 + 2] = 5;
      },
      /shape/,
    ],
    [
      "handle id unknown",
      (e) => {
        e.tensors[2 * 8 + 6] = 123456;
      },
      /does not exist/,
    ],
    [
      "wrong param count",
      (e) => {
        e.nodes[8] = 3;
      },
      /params/,
    ],
    [
      "params out of range",
      (e) => {
        e.nodes[10 + 7] = 50;
      },
      /params out of range/,
    ],
    [
      "source used before it is computed",
      (e) => {
        e.nodes[10 + 2] = 4;
      },
      /before/,
    ],
    [
      "intermediate computed twice",
      (e) => {
        e.nodes[10 + 1] = 3;
      },
      /twice|destination/,
    ],
    [
      "get_rows id out of range",
      (e) => {
        e.inputs[1] = Int32Array.from([0, 9999]);
      },
      /row id/,
    ],
    [
      "output array of the wrong size",
      (e) => {
        e.outputs[0] = new Float32Array(3);
      },
      /output array/,
    ],
    [
      "output index out of range",
      (e) => {
        e.tensors[4 * 8 + 7] = 8;
      },
      /output index/,
    ],
    [
      "f32 where i32 is required",
      (e) => {
        e.tensors[1 * 8 + 1] = 0;
      },
      /i32/,
    ],
    [
      "intermediate of a non-f32 dtype",
      (e) => {
        e.tensors[3 * 8 + 1] = 1;
      },
      /f32/,
    ],
  ];

  it("builds the fixture", async () => {
    b = await backend({ threads: 2 });
    w = b.createTensor("q8_0", [k, 4], new Uint8Array(4 * 2 * 34));
    const { g } = valid();
    expect(() => b.compute(g)).not.toThrow();
  });

  for (const [name, mutate, pattern] of cases) {
    it(name, () => {
      const { enc } = valid();
      mutate(enc);
      expectBackendError(() => computeEncoded(enc), "BAD_GRAPH", pattern);
      const { g } = valid();
      expect(() => b.compute(g)).not.toThrow();
    });
  }

  it("rejects bad op parameters and sparse row lists", async () => {
    const x = new Float32Array(16 * 2);
    const rope = (p: { headDim: number; nDims: number; mode: number }) => {
      const g = new Graph();
      g.output(
        g.rope(g.input("f32", [16, 2], x), g.input("i32", [2], new Int32Array(2)), {
          ...p,
          freqBase: 1e4,
          freqScale: 1,
        }),
      );
      const enc = g.encode();
      return () => computeEncoded(enc);
    };
    // mode 1 is not a rope mode of the interface
    expectBackendError(rope({ headDim: 8, nDims: 8, mode: 1 }), "BAD_GRAPH", /mode/);
    const g = new Graph();
    g.output(
      g.mulMatSparse(g.handle(w), g.input("f32", [k, 1], new Float32Array(k)), {
        rows: g.input("i32", [2], Int32Array.from([1, 4])),
        nOut: 4,
      }),
    );
    expectBackendError(() => b.compute(g), "BAD_GRAPH", /rows\[1\] = 4/);
    const g2 = new Graph();
    g2.output(g2.axpySparse(g2.handle(w), g2.input("f32", [8, 1], new Float32Array(8)), { nOut: 8 }));
    expectBackendError(() => b.compute(g2), "BAD_GRAPH", /fewer than n_out/);
    // NaN parameter
    const g3 = new Graph();
    g3.output(g3.scale(g3.input("f32", [4], new Float32Array(4)), Number.NaN));
    expectBackendError(() => b.compute(g3), "BAD_GRAPH", /not finite/);
  });

  it("computeAsync rejects with BackendError too", async () => {
    const { enc } = valid();
    enc.nodes[0] = 99;
    await expect(b.computeAsync({ encode: () => enc } as unknown as Graph)).rejects.toMatchObject({
      code: "BAD_GRAPH",
    });
  });

  it("survives random corruption of every word of a valid graph", () => {
    let seed = 12345;
    const rnd = () => {
      seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
      return seed;
    };
    const specials = [-1, 0, 1, 2, 3, 7, 8, 26, 30, 63, 64, 65, 1 << 20, -(1 << 30), 2147483647];
    for (let trial = 0; trial < 400; trial++) {
      const { enc } = valid();
      const arr = rnd() % 2 === 0 ? enc.tensors : enc.nodes;
      const i = rnd() % arr.length;
      arr[i] = specials[rnd() % specials.length]!;
      try {
        computeEncoded(enc);
      } catch (e) {
        expect(e).toBeInstanceOf(BackendError);
        // UNSUPPORTED_OP: well formed, but what no kernel does (e.g. a k cache f32 and a v cache f16)
        expect(["BAD_GRAPH", "UNSUPPORTED_OP"]).toContain((e as BackendError).code);
      }
    }
  });
});

describe.skipIf(!usable)("huge-page copies of mapped weights (hugePageCopyBytes)", () => {
  // Q4_0 rows of 4096 (2,304 bytes); 1,024 rows = 2.25 MiB a tensor, three back to back in one file
  const k = 4096,
    rows = 1024,
    rb = 2304,
    tb = rb * rows;
  const dir = mkdtempSync(join(tmpdir(), "pi-hugepage-"));
  const path = join(dir, "w.bin");
  const bytes = new Uint8Array(3 * tb);
  let seed = 99;
  for (let i = 0; i < bytes.length; i++) {
    seed = (Math.imul(seed, 1103515245) + 12345) >>> 0;
    bytes[i] = seed >>> 24;
  }
  // block scales: small positive F16 (0x2000 ≈ 0.0078) so sums stay finite
  for (let o = 0; o < bytes.length; o += 18) {
    bytes[o] = 0x00;
    bytes[o + 1] = 0x20;
  }
  writeFileSync(path, bytes);
  afterAll(() => rmSync(dir, { recursive: true, force: true }));
  const src = (i: number) => ({ path, fileOffset: i * tb, byteLength: tb });
  // (a deep toEqual of megabytes is slow)
  const same = (a: Uint8Array, b: Uint8Array) => Buffer.compare(a, b) === 0;
  const x = Float32Array.from({ length: k }, (_, i) => Math.sin(i * 0.37));
  const ids = Int32Array.from([0, 511, 1023, 7]);

  /** get_rows, a dense product (repacks the tensor: the copy goes back to the mapping) and get_rows again. */
  const outputs = (b: Backend, t: TensorHandle) => {
    const rowsOf = () => {
      const g = new Graph();
      const y = g.output(g.getRows(g.handle(t), g.input("i32", [ids.length], ids)));
      b.compute(g);
      return Array.from(y);
    };
    const before = rowsOf();
    const g = new Graph();
    const y = g.output(g.mulMat(g.handle(t), g.input("f32", [k, 1], x)));
    b.compute(g);
    return { before, product: Array.from(y), after: rowsOf(), read: new Uint8Array(b.readTensor(t).buffer) };
  };

  it("copies tensors of 2 MiB or more within the limit, with the same bytes and results as the mapping", async () => {
    const plain = await cpuBackend.load({ threads: 2, hugePageCopyBytes: 0 });
    const copying = await cpuBackend.load({ threads: 2, hugePageCopyBytes: 2 * tb });
    try {
      const ref = [0, 1, 2].map((i) => outputs(plain, plain.mapTensor("q4_0", [k, rows], src(i))));
      expect(plain.hugePageCopyBytes()).toBe(0);
      const hs = [0, 1, 2].map((i) => copying.mapTensor("q4_0", [k, rows], src(i)));
      // the third does not fit the limit and stays mapped
      expect(copying.hugePageCopyBytes()).toBe(2 * tb);
      hs.forEach((h, i) => {
        expect(
          same(new Uint8Array(copying.readTensor(h).buffer), bytes.subarray(i * tb, (i + 1) * tb)),
          `tensor ${i}`,
        ).toBe(true);
      });
      // the dense product repacks tensor 0: its copy goes back to the file mapping
      const o0 = outputs(copying, hs[0]!);
      expect(copying.hugePageCopyBytes()).toBe(tb);
      expect(o0.before).toEqual(ref[0]!.before);
      expect(o0.product).toEqual(ref[0]!.product);
      expect(o0.after).toEqual(ref[0]!.after);
      expect(same(o0.read, bytes.subarray(0, tb))).toBe(true);
      expect(o0.product.every(Number.isFinite)).toBe(true);
      copying.freeTensor(hs[1]!);
      expect(copying.hugePageCopyBytes()).toBe(0);
      // written weights: a copy is read-only like the mapping
      expectBackendError(() => copying.writeTensor(hs[2]!, new Uint8Array(tb)), "BAD_TENSOR", /read-only/);
    } finally {
      plain.dispose();
      copying.dispose();
    }
  });

  it("deferHugePageCopies: mapTensor reserves the copies, settle() makes them off the JS thread, same results", async () => {
    const plain = await cpuBackend.load({ threads: 2, hugePageCopyBytes: 0 });
    const deferring = (await cpuBackend.load({
      threads: 2,
      hugePageCopyBytes: 2 * tb,
      deferHugePageCopies: true,
    })) as CpuBackend;
    try {
      const ref = [0, 1, 2].map((i) => outputs(plain, plain.mapTensor("q4_0", [k, rows], src(i))));
      const hs = [0, 1, 2].map((i) => deferring.mapTensor("q4_0", [k, rows], src(i)));
      // reserved within the limit (the third stays mapped), none made yet: reads go through the mapping
      expect(deferring.hugePageCopyBytes()).toBe(2 * tb);
      expect(deferring.pendingHugePageCopyBytes()).toBe(2 * tb);
      expect(same(new Uint8Array(deferring.readTensor(hs[1]!).buffer), bytes.subarray(tb, 2 * tb))).toBe(true);
      await deferring.settle();
      expect(deferring.pendingHugePageCopyBytes()).toBe(0);
      expect(deferring.hugePageCopyBytes()).toBe(2 * tb);
      hs.forEach((h, i) => {
        expect(
          same(new Uint8Array(deferring.readTensor(h).buffer), bytes.subarray(i * tb, (i + 1) * tb)),
          `tensor ${i}`,
        ).toBe(true);
      });
      const o0 = outputs(deferring, hs[0]!);
      expect(o0.before).toEqual(ref[0]!.before);
      expect(o0.product).toEqual(ref[0]!.product);
      expect(o0.after).toEqual(ref[0]!.after);
      // tensor 0 was repacked by the product (its copy handed back); freeing 1 returns its copy
      expect(deferring.hugePageCopyBytes()).toBe(tb);
      deferring.freeTensor(hs[1]!);
      expect(deferring.hugePageCopyBytes()).toBe(0);
      // a tensor freed before settle() returns its reservation and is not copied
      const late = deferring.mapTensor("q4_0", [k, rows], src(2));
      expect(deferring.pendingHugePageCopyBytes()).toBe(tb);
      deferring.freeTensor(late);
      expect(deferring.pendingHugePageCopyBytes()).toBe(0);
      expect(deferring.hugePageCopyBytes()).toBe(0);
      const again = deferring.mapTensor("q4_0", [k, rows], src(1));
      expect(deferring.pendingHugePageCopyBytes()).toBe(tb);
      await deferring.settle();
      expect(deferring.pendingHugePageCopyBytes()).toBe(0);
      expect(deferring.hugePageCopyBytes()).toBe(tb);
      expect(same(new Uint8Array(deferring.readTensor(again).buffer), bytes.subarray(tb, 2 * tb))).toBe(true);
    } finally {
      plain.dispose();
      deferring.dispose();
    }
  });

  it("rejects a negative or non-numeric limit", async () => {
    for (const v of [-1, Number.NaN]) {
      await expect(cpuBackend.load({ threads: 1, hugePageCopyBytes: v })).rejects.toMatchObject({
        code: "UNAVAILABLE",
      });
    }
  });
});

describe.skipIf(!usable || !existsSync(fileURLToPath(new URL("../dist/index.js", import.meta.url))))(
  "POWERINFER_CPU_PROFILE",
  () => {
    it("prints per-op time and calls at exit, and nothing without it", () => {
      const dist = fileURLToPath(new URL("../dist/index.js", import.meta.url));
      const core = fileURLToPath(new URL("../../core/dist/index.js", import.meta.url));
      // 3 graphs of rms_norm → mul_mat (F32 weight) → relu at 2 threads
      const script = `Promise.all([import(${JSON.stringify(dist)}), import(${JSON.stringify(core)})]).then(async ([m, c]) => {
        const b = await m.cpuBackend.load({ threads: 2, hugePageCopyBytes: 0 });
        const w = b.createTensor("f32", [64, 32], new Float32Array(64 * 32).fill(0.5));
        for (let i = 0; i < 3; i++) {
          const g = new c.Graph();
          g.output(g.relu(g.mulMat(g.handle(w), g.rmsNorm(g.input("f32", [64, 1], new Float32Array(64).fill(1)), 1e-6))));
          b.compute(g);
        }
        b.dispose();
      });`;
      const run = (env: Record<string, string>) =>
        spawnSync(process.execPath, ["-e", script], { env: { ...process.env, ...env }, encoding: "utf8" });
      const on = run({ POWERINFER_CPU_PROFILE: "1" });
      expect(on.status, on.stderr).toBe(0);
      expect(on.stderr).toMatch(/^powerinfer cpu profile \(thread 0 wall time per node, [\d.]+ ms in all\):$/m);
      for (const op of ["rms_norm", "mul_mat", "relu"]) {
        expect(on.stderr).toMatch(new RegExp(`^  ${op} +f32 +[\\d.]+ ms +[\\d.]+ % +3 calls +[\\d.]+ us/call$`, "m"));
      }
      const off = run({ POWERINFER_CPU_PROFILE: "0" });
      expect(off.status, off.stderr).toBe(0);
      expect(off.stderr).not.toMatch(/profile/);
    });
  },
);
