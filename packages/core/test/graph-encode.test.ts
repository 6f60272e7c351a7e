// Graph.encode is made once and kept; setInput, setParam and output change the kept encoding in place, so a
// graph computed again (the engine's decode-graph reuse) encodes exactly as a graph built with those values.
import { describe, expect, it } from "vitest";
import { createReferenceBackend, Graph, type TensorHandle } from "../src/index.js";

/** A one-token attention step: token id → embedding, K/V written at n_past, attention over the cache. */
function step(kc: TensorHandle, vc: TensorHandle, emb: TensorHandle, token: number, nPast: number) {
  const g = new Graph();
  const ids = g.input("i32", [1], Int32Array.of(token));
  const pos = g.input("i32", [1], Int32Array.of(nPast));
  const x = g.getRows(g.handle(emb), ids);
  const q = g.rope(x, pos, { headDim: 4, nDims: 4, mode: 0, freqBase: 10000, freqScale: 1 });
  const k = g.cpy(q, g.handle(kc), nPast);
  const v = g.cpy(x, g.handle(vc), nPast);
  const att = g.attention(q, k, v, { headDim: 4, nHead: 2, nHeadKv: 2, nPast, scale: 0.5 });
  const out = g.output(att);
  return { g, ids, pos, att, out };
}

describe("Graph.encode, kept and updated in place", () => {
  const be = createReferenceBackend();
  const kc = be.createTensor("f32", [8, 16]);
  const vc = be.createTensor("f32", [8, 16]);
  const emb = be.createTensor(
    "f32",
    [8, 10],
    Float32Array.from({ length: 80 }, (_, i) => Math.sin(i)),
  );

  it("records cpy's row offset and attention's n_past as position params", () => {
    const { g } = step(kc, vc, emb, 3, 5);
    expect(g.positionParams.map(({ node, param }) => [g.nodes[node]!.op, g.nodes[node]!.params[param]])).toEqual([
      ["cpy", 5],
      ["cpy", 5],
      ["attention", 5],
    ]);
  });

  it("a moved graph encodes as one built at the new position, and computes the same values", () => {
    const a = step(kc, vc, emb, 3, 5);
    const e1 = a.g.encode();
    expect(a.g.encode()).toBe(e1); // kept
    a.g.setInput(a.ids, Int32Array.of(7));
    a.g.setInput(a.pos, Int32Array.of(6));
    for (const { node, param } of a.g.positionParams) a.g.setParam(node, param, 6);
    const out = a.g.output(a.att);
    const e2 = a.g.encode();
    expect(e2).toBe(e1);
    const b = step(kc, vc, emb, 7, 6);
    const eb = b.g.encode();
    expect(Array.from(e2.tensors)).toEqual(Array.from(eb.tensors));
    expect(Array.from(e2.nodes)).toEqual(Array.from(eb.nodes));
    expect(Array.from(e2.params)).toEqual(Array.from(eb.params));
    expect(e2.inputs.map((x) => Array.from(x as Int32Array))).toEqual(
      eb.inputs.map((x) => Array.from(x as Int32Array)),
    );
    expect(e2.outputs[0]).toBe(out);
    // computed on the reference backend: same values
    be.compute(a.g);
    be.compute(b.g);
    expect(Array.from(out)).toEqual(Array.from(b.out));
    expect(out.some((v) => v !== 0)).toBe(true);
  });

  it("a node added after encoding makes a new encoding", () => {
    const a = step(kc, vc, emb, 1, 0);
    const e1 = a.g.encode();
    a.g.output(a.g.relu(a.att));
    const e2 = a.g.encode();
    expect(e2).not.toBe(e1);
    expect(e2.nodes.length).toBe(e1.nodes.length + 10);
    expect(e2.outputs.length).toBe(2);
  });

  it("refuses what does not fit", () => {
    const a = step(kc, vc, emb, 1, 0);
    expect(() => a.g.setInput(a.att, Int32Array.of(1))).toThrow(/tensor \d+ is not an input/);
    expect(() => a.g.setInput(a.ids, Int32Array.of(1, 2))).toThrow(/needs 1 i32 values/);
    expect(() => a.g.setInput(a.ids, Float32Array.of(1))).toThrow(/needs 1 i32 values/);
    expect(() => a.g.setParam(0, 3, 1)).toThrow(/node 0 has no param 3/);
    expect(() => a.g.setParam(99, 0, 1)).toThrow(/node 99 has no param 0/);
    expect(() => a.g.setParam(2, 0, Number.NaN)).toThrow(/not finite/);
  });
});
