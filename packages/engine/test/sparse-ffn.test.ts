// sparseFfn in predictor mode computes the gate over the predicted neurons first and then up and down only
// over those whose gate is > 0. ReLU(gate)·up is 0 for the others, so the output must equal — bit for bit —
// the older formulation that ran all three projections over every predicted neuron, while the row counters
// show the fewer up and down rows.
import { createReferenceBackend, Graph } from "@powerinfer/core";
import type { ModelConfig } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { sparseFfn } from "../src/model/blocks.js";

const E = 64; // n_embd
const F = 96; // n_ff
const T = 3; // tokens

function rng(seed: number) {
  let s = seed >>> 0;
  return () => {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    return s / 2 ** 32;
  };
}

describe("sparseFfn with a predictor (ReLU gate)", () => {
  for (const upActivation of [undefined, "relu"] as const) {
    it(`${upActivation ? "ReLU(gate)·ReLU(up) (Bamboo)" : "ReLU(gate)·up"}: equals up and down over every predicted neuron, reading only the firing ones`, () => {
      const r = rng(upActivation ? 7 : 3);
      const rand = (n: number) => Float32Array.from({ length: n }, () => r() * 2 - 1);
      const b = createReferenceBackend();
      const gateW = b.createTensor("f32", [E, F], rand(E * F));
      const upW = b.createTensor("f32", [E, F], rand(E * F));
      const downT = b.createTensor("f32", [E, F], rand(E * F));
      const hData = rand(E * T);
      const logitData = rand(F * T); // threshold 0: about half the neurons predicted
      const cfg = { n_ff: F, ffn: { activation: "relu", up_activation: upActivation } } as unknown as ModelConfig;

      const g1 = new Graph();
      const sel1 = { logits: g1.input("f32", [F, T], logitData), threshold: 0 };
      const y1 = g1.output(sparseFfn(g1, cfg, { gate: gateW, up: upW, downT }, g1.input("f32", [E, T], hData), sel1));
      const rows1 = b.compute(g1).rowsRead;
      const ops1 = g1.nodes.map((n, i) => [n.op, rows1[i]!] as const).filter(([op]) => op.endsWith("_sparse"));

      // the former graph: gate, up and down all over the predicted neurons
      const g0 = new Graph();
      const h0 = g0.input("f32", [E, T], hData);
      const o = { logits: g0.input("f32", [F, T], logitData), threshold: 0, nOut: F };
      let up = g0.mulMatSparse(g0.handle(upW), h0, o);
      if (upActivation) up = g0.relu(up);
      const a = g0.mul(g0.relu(g0.mulMatSparse(g0.handle(gateW), h0, o)), up);
      const y0 = g0.output(g0.axpySparse(g0.handle(downT), a, o));
      b.compute(g0);

      expect(y1).toEqual(y0);
      // row counters: the gate reads the predicted neurons, up and down those of them whose gate is > 0
      let predicted = 0;
      let firing = 0;
      const gw = b.readTensor(gateW);
      const gv = new Float32Array(gw.buffer, gw.byteOffset, E * F);
      for (let t = 0; t < T; t++) {
        for (let i = 0; i < F; i++) {
          if (!(logitData[t * F + i]! >= 0)) continue;
          predicted++;
          let s = 0;
          for (let k = 0; k < E; k++) s += gv[i * E + k]! * hData[t * E + k]!;
          if (s > 1e-4) firing++;
          else if (s > -1e-4) firing += 0.5; // too close to 0 to call in float64: either way
        }
      }
      expect(ops1.map(([op]) => op)).toEqual(["mul_mat_sparse", "mul_mat_sparse", "axpy_sparse"]);
      expect(ops1[0]![1]).toBe(predicted);
      expect(Math.abs(ops1[1]![1] - firing)).toBeLessThanOrEqual(1);
      expect(ops1[2]![1]).toBe(ops1[1]![1]);
      expect(firing).toBeGreaterThan(0.3 * predicted);
      expect(firing).toBeLessThan(0.7 * predicted);
      b.dispose();
    });
  }
});
