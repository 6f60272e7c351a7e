// The conformance kit run on the reference backend (src/reference/backend.ts, which uses only the
// contract's public API), on deliberately broken variants of it (the kit must fail them), and that
// backend registered and selected by name. An out-of-tree backend is tried in apps/cli/test/third-party-backend.test.ts.
import {
  type Backend,
  type BackendDescriptor,
  type ConformanceReport,
  formatConformanceReport,
  type Graph,
  type GraphNode,
  type ReferenceOpContext,
  refAttention,
  registry,
  runConformance,
  WEIGHT_DTYPES,
} from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import {
  createReferenceBackend,
  llamaMatMul,
  REFERENCE_BACKEND_NAME as NAME,
  type ReferenceBackendOptions,
  referenceBackend,
} from "../src/index.js";

const backend = (o: ReferenceBackendOptions = {}) => createReferenceBackend(o);

function failedPairs(r: ConformanceReport): string[] {
  return [...new Set(r.failed.map((f) => `${f.op}/${f.dtype}`))].sort();
}

/** Wraps a backend so that compute() post-processes the outputs (to simulate a broken kernel). */
function tamper(inner: Backend, after: (g: Graph) => void, before?: (g: Graph) => () => void): Backend {
  const wrap = (g: Graph) => {
    const restore = before?.(g);
    const r = inner.compute(g);
    restore?.();
    after(g);
    return r;
  };
  return { ...inner, compute: wrap, computeAsync: async (g) => wrap(g) };
}

describe("conformance kit on the pure-TypeScript reference backend", () => {
  it("passes every op and dtype the backend claims", async () => {
    const b = backend();
    const r = await runConformance(b);
    expect(r.ok, formatConformanceReport(r)).toBe(true);
    expect(r.failed).toEqual([]);
    // weight ops (4 dense/sparse + 3 routed-expert), attention and attention_swa (f32/f16), cpy (3), 16 f32 ops
    expect(r.claimed.length).toBe(7 * WEIGHT_DTYPES.length + 2 + 2 + 3 + 16);
    expect(r.passed).toEqual(r.claimed);
    expect(r.cases).toBeGreaterThan(300);
    expect(b.allocatedBytes()).toBe(0); // the kit frees what it creates
    b.dispose();
  });

  it("admits llama.cpp-style activation rounding (F16/BF16/Q8_0/Q8_1/Q8_K) with float32 sums", async () => {
    const r = await runConformance(backend({ llamaRounding: true }), { ops: ["mul_mat", "mul_mat_sparse"] });
    expect(r.ok, formatConformanceReport(r)).toBe(true);
    expect(r.claimed.length).toBe(2 * WEIGHT_DTYPES.length);
  });

  it("asks only about what is claimed, and reports it", async () => {
    const b = backend({ claims: (op, d) => (op === "mul_mat" && d[0] === "q4_0") || op === "relu" });
    const log: string[] = [];
    const r = await runConformance(b, { log: (l) => log.push(l) });
    expect(r.claimed).toEqual([
      { op: "mul_mat", dtype: "q4_0" },
      { op: "relu", dtype: "f32" },
    ]);
    expect(r.ok).toBe(true);
    const text = formatConformanceReport(r);
    expect(text).toMatch(/2\/2 claimed op×dtype pairs passed/);
    expect(text).toMatch(/mul_mat\s+ok: q4_0/);
    expect(text).toMatch(/not claimed: get_rows/);
    expect(log.some((l) => l.startsWith("ok   mul_mat q4_0"))).toBe(true);
  });

  it("is deterministic for a seed", async () => {
    let calls = 0;
    const inputs: number[][] = [];
    const b = backend({
      ops: {
        relu: (n, ctx) => {
          calls++;
          inputs.push(Array.from(ctx.value(n.src[0]!)));
          return ctx.reference(n);
        },
      },
    });
    await runConformance(b, { ops: ["relu"], seed: 7 });
    const first = inputs.splice(0);
    await runConformance(b, { ops: ["relu"], seed: 7 });
    expect(inputs).toEqual(first);
    await runConformance(b, { ops: ["relu"], seed: 8 });
    expect(inputs.slice(first.length)).not.toEqual(first);
    expect(calls).toBe(3 * first.length);
  });
});

describe("conformance kit fails broken backends", () => {
  it("a mul_mat whose inner loop stops one element short", async () => {
    const offByOne = (n: GraphNode, ctx: ReferenceOpContext) => {
      const [k, rows] = ctx.tensor(n.src[0]!).ne;
      const w = ctx.value(n.src[0]!);
      const x = ctx.value(n.src[1]!);
      const t = x.length / k;
      const y = new Float64Array(rows * t);
      for (let c = 0; c < t; c++) {
        for (let r = 0; r < rows; r++)
          for (let j = 0; j < k - 1; j++) y[c * rows + r]! += w[r * k + j]! * x[c * k + j]!;
      }
      return { value: y };
    };
    const r = await runConformance(backend({ ops: { mul_mat: offByOne } }), { ops: ["mul_mat", "relu"] });
    expect(r.ok).toBe(false);
    expect(failedPairs(r)).toEqual(WEIGHT_DTYPES.map((d) => `mul_mat/${d}`).sort());
    expect(r.passed).toEqual([{ op: "relu", dtype: "f32" }]);
    const f = r.failed.find((x) => x.dtype === "f32")!;
    expect(f.maxErr).toBeGreaterThan(f.tol);
    expect(f.message).toMatch(/> tolerance/);
    expect(formatConformanceReport(r)).toMatch(/FAIL mul_mat f32 W\[/);
  });

  it("an op that leaves one output element unwritten", async () => {
    // the broken kernel skips the last element of the first output: whatever was there stays
    const b = backend();
    const broken = tamper(
      b,
      () => {},
      (g) => {
        const out = g.tensors.find((t) => t.output)?.output;
        if (!out) return () => {};
        const last = out.length - 1;
        const kept = out[last]!;
        return () => {
          out[last] = kept;
        };
      },
    );
    const r = await runConformance(broken, { ops: ["silu", "get_rows"], dtypes: ["f32", "q6_K"] });
    expect(failedPairs(r)).toEqual(["get_rows/f32", "get_rows/q6_K", "silu/f32"]);
    expect(r.failed[0]!.message).toMatch(/NaN: never written/);
    expect(r.failed[0]!.maxErr).toBe(Number.POSITIVE_INFINITY);
  });

  it("a sparse op that writes inactive neurons, and one that miscounts rows read", async () => {
    const leaky = (n: GraphNode, ctx: ReferenceOpContext) => {
      const r = ctx.reference(n);
      return { ...r, value: r.value!.map((v) => (v === 0 ? 1e-30 : v)) };
    };
    const readsAll = (n: GraphNode, ctx: ReferenceOpContext) => {
      const r = ctx.reference(n);
      const [, m] = ctx.tensor(n.src[0]!).ne;
      const t = ctx.tensor(n.src[1]!).ne[1];
      return { ...r, rowsRead: m * t };
    };
    const r = await runConformance(backend({ ops: { mul_mat_sparse: leaky, axpy_sparse: readsAll } }), {
      ops: ["mul_mat_sparse", "axpy_sparse"],
      dtypes: ["q4_0", "f16"],
    });
    expect(failedPairs(r)).toEqual([
      "axpy_sparse/f16",
      "axpy_sparse/q4_0",
      "mul_mat_sparse/f16",
      "mul_mat_sparse/q4_0",
    ]);
    expect(r.failed.find((f) => f.op === "mul_mat_sparse")!.message).toMatch(/inactive: the output must be exactly 0/);
    expect(r.failed.find((f) => f.op === "axpy_sparse")!.message).toMatch(/rowsRead\[\d+\] = \d+, expected \d+/);
  });

  it("routed experts: every slot reading expert 0, unnormalised weights, a top_k in ascending order, a sparse expert op reading every neuron", async () => {
    const expert0 = (n: GraphNode, ctx: ReferenceOpContext) => {
      const [k, m, e] = ctx.tensor(n.src[0]!).ne;
      const w = ctx.value(n.src[0]!);
      const x = ctx.value(n.src[1]!);
      const [u, t] = ctx.tensor(n.src[2]!).ne;
      const xCols = x.length / k;
      const y = new Float64Array(m * u * t);
      for (let c = 0; c < t; c++)
        for (let s = 0; s < u; s++)
          for (let r = 0; r < m; r++) {
            let acc = 0;
            const col = xCols === t ? c : c * u + s;
            for (let i = 0; i < k; i++) acc += w[r * k + i]! * x[col * k + i]!;
            y[(c * u + s) * m + r] = e > 0 ? acc : 0;
          }
      return { value: y };
    };
    const raw = (n: GraphNode, ctx: ReferenceOpContext) => ctx.reference({ ...n, params: [0, n.params[1]!] });
    const ascending = (n: GraphNode, ctx: ReferenceOpContext) => {
      const x = ctx.value(n.src[0]!);
      const [len] = ctx.tensor(n.src[0]!).ne;
      const k = n.params[0]!;
      const out = new Float64Array((x.length / len) * k);
      for (let c = 0; c < x.length / len; c++) {
        const idx = Array.from({ length: len }, (_, i) => i).sort((a, b) => x[c * len + a]! - x[c * len + b]!);
        for (let j = 0; j < k; j++) out[c * k + j] = idx[j]!;
      }
      return { value: out };
    };
    const readsAll = (n: GraphNode, ctx: ReferenceOpContext) => {
      const r = ctx.reference(n);
      return { ...r, rowsRead: (r.value!.length / ctx.tensor(n.dst).ne[0]) * ctx.tensor(n.src[0]!).ne[1] };
    };
    const r = await runConformance(backend({ ops: { mul_mat_id: expert0, moe_sum: raw, axpy_id_sparse: readsAll } }), {
      ops: ["mul_mat_id", "moe_sum", "axpy_id_sparse"],
      dtypes: ["f32", "q8_0"],
    });
    expect(failedPairs(r)).toEqual([
      "axpy_id_sparse/f32",
      "axpy_id_sparse/q8_0",
      "moe_sum/f32",
      "mul_mat_id/f32",
      "mul_mat_id/q8_0",
    ]);
    // top_k is read through a correct mul_mat_id
    const r2 = await runConformance(backend({ ops: { top_k: ascending } }), {
      ops: ["top_k", "mul_mat_id"],
      dtypes: ["f32"],
    });
    expect(failedPairs(r2)).toEqual(["top_k/f32"]);
  });

  it("a sparse op that treats logits == threshold as inactive", async () => {
    const strict = (n: GraphNode, ctx: ReferenceOpContext) => {
      const thr = n.params[0]!;
      const logits = n.src[2]! >= 0 ? ctx.value(n.src[2]!) : null;
      const r = ctx.reference(n);
      if (!logits) return r;
      const y = r.value!.slice();
      let read = r.rowsRead!;
      for (let i = 0; i < logits.length; i++) {
        if (logits[i] === thr && y[i] !== 0) {
          y[i] = 0;
          read--;
        }
      }
      return { value: y, rowsRead: read };
    };
    const r = await runConformance(backend({ ops: { mul_mat_sparse: strict } }), {
      ops: ["mul_mat_sparse"],
      dtypes: ["f32"],
    });
    expect(r.ok).toBe(false);
  });

  it("cpy that also writes the row after its range", async () => {
    const b = backend();
    const broken = tamper(b, (g) => {
      for (const n of g.nodes) {
        if (n.op !== "cpy") continue;
        const dst = g.tensors[n.dst]!;
        const row = n.params[0]! + g.tensors[n.src[0]!]!.ne[1];
        if (row < dst.ne[1])
          b.writeTensor(dst.handle!, new Uint8Array(2), row * dst.ne[0] * (dst.dtype === "f32" ? 4 : 2));
      }
    });
    const r = await runConformance(broken, { ops: ["cpy"] });
    expect(failedPairs(r)).toEqual(["cpy/bf16", "cpy/f16", "cpy/f32"]);
    expect(r.failed[0]!.message).toMatch(/changed, but cpy writes only rows/);
  });

  it("attention without the causal mask, and attention with the wrong GQA head mapping", async () => {
    const noMask = (n: GraphNode, ctx: ReferenceOpContext) => {
      const [nPast, nHeadKv, scale, headDim, nHead] = n.params as [number, number, number, number, number];
      const q = ctx.value(n.src[0]!);
      const t = ctx.tensor(n.src[0]!).ne[1];
      const qd = headDim * nHead;
      const y = new Float64Array(qd * t);
      for (let c = 0; c < t; c++) {
        // every query sees the whole batch: query c attends as if it were the last one
        const col = refAttention(q.subarray(c * qd, c * qd + qd), ctx.value(n.src[1]!), ctx.value(n.src[2]!), 1, {
          headDim,
          nHead,
          nHeadKv,
          nPast: nPast + t - 1,
          scale,
        });
        y.set(col, c * qd);
      }
      return { value: y };
    };
    const r1 = await runConformance(backend({ ops: { attention: noMask } }), { ops: ["attention"] });
    expect(failedPairs(r1)).toEqual(["attention/f16", "attention/f32"]);

    const wrongGqa = (n: GraphNode, ctx: ReferenceOpContext) => {
      const [nPast, nHeadKv, scale, headDim, nHead] = n.params as [number, number, number, number, number];
      if (nHeadKv === nHead) return ctx.reference(n);
      // head h reads KV head h % n_head_kv instead of h / (n_head / n_head_kv)
      const q = ctx.value(n.src[0]!);
      const t = ctx.tensor(n.src[0]!).ne[1];
      const y = new Float64Array(q.length);
      for (let h = 0; h < nHead; h++) {
        const g = h % nHeadKv;
        const qh = new Float64Array(headDim * t);
        for (let c = 0; c < t; c++)
          qh.set(q.subarray(c * headDim * nHead + h * headDim, c * headDim * nHead + (h + 1) * headDim), c * headDim);
        const pick = (cache: Float64Array) => {
          const ctxLen = cache.length / (headDim * nHeadKv);
          const out = new Float64Array(headDim * ctxLen);
          for (let p = 0; p < ctxLen; p++) {
            out.set(
              cache.subarray(p * headDim * nHeadKv + g * headDim, p * headDim * nHeadKv + (g + 1) * headDim),
              p * headDim,
            );
          }
          return out;
        };
        const o = refAttention(qh, pick(ctx.value(n.src[1]!)), pick(ctx.value(n.src[2]!)), t, {
          headDim,
          nHead: 1,
          nHeadKv: 1,
          nPast,
          scale,
        });
        for (let c = 0; c < t; c++)
          y.set(o.subarray(c * headDim, (c + 1) * headDim), c * headDim * nHead + h * headDim);
      }
      return { value: y };
    };
    const r2 = await runConformance(backend({ ops: { attention: wrongGqa } }), { ops: ["attention"] });
    expect(failedPairs(r2)).toEqual(["attention/f16", "attention/f32"]);
  });

  it("rope with the pairs of the other mode", async () => {
    const swapped = (n: GraphNode, ctx: ReferenceOpContext) =>
      ctx.reference({ ...n, params: [n.params[0]!, 2 - n.params[1]!, ...n.params.slice(2)] });
    const r = await runConformance(backend({ ops: { rope: swapped } }), { ops: ["rope"] });
    expect(failedPairs(r)).toEqual(["rope/f32"]);
  });

  it("Q4_0 dequantization with interleaved nibbles (elements 2j, 2j+1 instead of j, j+16)", async () => {
    const interleaved = (n: GraphNode, ctx: ReferenceOpContext) => {
      const [k, rows] = ctx.tensor(n.src[0]!).ne;
      const w = ctx.value(n.src[0]!);
      const wrong = new Float64Array(w.length);
      for (let b = 0; b < (k * rows) / 32; b++) {
        for (let j = 0; j < 16; j++) {
          wrong[b * 32 + 2 * j] = w[b * 32 + j]!;
          wrong[b * 32 + 2 * j + 1] = w[b * 32 + j + 16]!;
        }
      }
      const x = ctx.value(n.src[1]!);
      const t = x.length / k;
      const y = new Float64Array(rows * t);
      for (let c = 0; c < t; c++) {
        for (let r = 0; r < rows; r++)
          for (let j = 0; j < k; j++) y[c * rows + r]! += wrong[r * k + j]! * x[c * k + j]!;
      }
      return { value: y };
    };
    const r = await runConformance(backend({ ops: { mul_mat: interleaved } }), { ops: ["mul_mat"], dtypes: ["q4_0"] });
    expect(failedPairs(r)).toEqual(["mul_mat/q4_0"]);
  });

  it("tolerances are not loose: Q8_0-rounded activations fail with F32 weights, BF16-rounded ones with F16 weights", async () => {
    // F32 weights with activations rounded as for Q8_0 weights; F16 weights with activations rounded to BF16
    const lying = backend({
      ops: {
        mul_mat: (n, ctx) => {
          const tensor = ctx.tensor(n.src[0]!);
          if (tensor.dtype !== "f32" && tensor.dtype !== "f16") return ctx.reference(n);
          const fake = {
            ...ctx,
            tensor: (id: number) =>
              id === n.src[0]
                ? { ...tensor, dtype: tensor.dtype === "f32" ? ("q8_0" as const) : ("bf16" as const) }
                : ctx.tensor(id),
          };
          return llamaMatMul(n, fake);
        },
      },
    });
    const r = await runConformance(lying, { ops: ["mul_mat"], dtypes: ["f32", "f16", "q8_0"] });
    expect(failedPairs(r)).toEqual(["mul_mat/f16", "mul_mat/f32"]);
  });

  it("a compute that throws is a failure with the error's message, not a crash", async () => {
    const r = await runConformance(
      backend({
        ops: {
          norm: () => {
            throw new Error("kernel exploded");
          },
        },
      }),
      { ops: ["norm", "rms_norm"] },
    );
    expect(failedPairs(r)).toEqual(["norm/f32"]);
    expect(r.failed[0]!.message).toBe("threw: kernel exploded");
  });
});

describe("a backend registered from outside core", () => {
  it("is selected by name from the default registry and passes the kit", async () => {
    const descriptor: BackendDescriptor = referenceBackend;
    registry.register(descriptor, 0);
    try {
      expect(registry.names()).toContain(NAME);
      const log: string[] = [];
      const {
        backend: b,
        descriptor: d,
        probe,
      } = await registry.load({ prefer: [NAME], env: {}, log: (l) => log.push(l) });
      expect(d).toBe(descriptor);
      expect(b.name).toBe(NAME);
      expect(probe.usable).toBe(true);
      expect(log).toEqual([]);
      const r = await runConformance(b, { ops: ["mul_mat", "rms_norm"], dtypes: ["q4_K", "f32"] });
      expect(r.ok, formatConformanceReport(r)).toBe(true);
      b.dispose();
      // and the environment override picks it too
      const s = await registry.select({ prefer: ["nope"], env: { POWERINFER_BACKEND: NAME } });
      expect(s.descriptor.name).toBe(NAME);
    } finally {
      registry.unregister(NAME);
    }
  });

  it("a backend that claims no op is not ok (nothing was shown), unless filters asked for unclaimed pairs", async () => {
    const b = backend({ claims: () => false });
    const r = await runConformance(b);
    expect(r.claimed).toEqual([]);
    expect(r.ok).toBe(false);
    expect(formatConformanceReport(r)).toMatch(/NOT OK: the backend claims no op/);
    expect((await runConformance(b, { ops: ["add"] })).ok).toBe(true);
  });
});
