/**
 * The shared expert predictor's data and size: pairs of every expert interleaved in token order with the
 * expert as a one-hot input, and the rank of equal storage.
 */
import { describe, expect, it } from "vitest";
import {
  type ActivationDataset,
  type ExpertActivationDataset,
  maskStride,
  sharedExpertDataset,
  sharedRankForBytes,
} from "../src/index.ts";

/** Expert e's pair j has input [e, j, 100·e + j] and mask bit (j mod 3) set; n pairs per expert given. */
function data(counts: number[]): ExpertActivationDataset {
  const E = 3;
  const F = 10;
  const stride = maskStride(F);
  const experts: ActivationDataset[] = counts.map((n, e) => {
    const inputs = new Float32Array(n * E);
    const masks = new Uint8Array(n * stride);
    for (let j = 0; j < n; j++) {
      inputs.set([e, j, 100 * e + j], j * E);
      masks[j * stride] = 1 << (j % 3);
    }
    return { nEmbd: E, nFf: F, nTokens: n, layers: [{ inputs, masks }] };
  });
  return { nEmbd: E, nFfExp: F, nExpert: counts.length, nTokens: 10, experts: [experts] };
}

describe("shared expert predictor", () => {
  it("interleaves the experts' pairs in token order, with the expert as a one-hot of the given scale", () => {
    const { ds, experts, scale } = sharedExpertDataset(data([4, 2, 0]), 0, 7);
    expect(scale).toBe(7);
    expect(ds.nEmbd).toBe(3 + 3);
    expect(ds.nFf).toBe(10);
    expect(ds.nTokens).toBe(6);
    // sort keys (j + 0.5)/n: e0 .125 .375 .625 .875, e1 .25 .75
    expect(Array.from(experts)).toEqual([0, 1, 0, 0, 1, 0]);
    const rows = Array.from({ length: 6 }, (_, p) => Array.from(ds.layers[0]!.inputs.subarray(p * 6, (p + 1) * 6)));
    expect(rows).toEqual([
      [0, 0, 0, 7, 0, 0],
      [1, 0, 100, 0, 7, 0],
      [0, 1, 1, 7, 0, 0],
      [0, 2, 2, 7, 0, 0],
      [1, 1, 101, 0, 7, 0],
      [0, 3, 3, 7, 0, 0],
    ]);
    // each pair keeps its own mask
    const stride = maskStride(10);
    expect(Array.from({ length: 6 }, (_, p) => ds.layers[0]!.masks[p * stride])).toEqual([1, 1, 2, 4, 2, 1]);
  });

  it("the default scale is the inputs' root mean square", () => {
    const d = data([2]);
    // inputs [0,0,0] and [0,1,1]: mean square 2/6
    expect(sharedExpertDataset(d, 0).scale).toBeCloseTo(Math.sqrt(2 / 6), 12);
    expect(() => sharedExpertDataset(d, 1)).toThrow(/no layer 1/);
  });

  it("the rank of equal storage: n_expert·r·(n_embd + n_ff_exp) ≈ r_s·(n_embd + n_expert + n_ff_exp), even", () => {
    for (const [E, F, X, r] of [
      [1536, 768, 32, 32],
      [2560, 768, 64, 64],
      [256, 256, 16, 32],
    ] as const) {
      const rs = sharedRankForBytes(E, F, X, r);
      expect(rs % 2).toBe(0);
      const perExpert = X * r * (E + F);
      expect(Math.abs(rs * (E + X + F) - perExpert)).toBeLessThanOrEqual(2 * (E + X + F));
    }
    expect(sharedRankForBytes(1536, 768, 32, 32)).toBe(1010);
  });
});
