/** Writing models: PWRI with ffn_down transposed, predictors, quantization, fallbacks. */
import { join } from "node:path";
import { f16ToF32, f32ToF16, GGMLType, GgufTypes, openGguf, readTensorBytes, readTensorF32 } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { randomPredictor, readPredictors, rewriteModel } from "../src/index.ts";
import { tmp, toyLayers, writeToyModel } from "./fixtures.ts";

const E = 32;
const F = 64;

describe("rewriteModel", () => {
  const dir = tmp();
  const layers = toyLayers(2, E, F, 1);
  const src = join(dir, "toy.gguf");
  writeToyModel(src, layers, E, F);
  const preds = [0, 1].map((l) => randomPredictor(8, E, F, l + 10));

  it("replacing predictors that end each layer (as PWRI files and generated models store them) writes the new ones", () => {
    // the first rewrite puts fc1/fc2 last in every layer; rewriting that file with other predictors used to drop
    // the old ones without adding the new (they followed a tensor that was skipped)
    const first = join(dir, "with-preds.pwri.gguf");
    rewriteModel(src, first, { format: "PWRI", predictors: { layers: preds, type: "f32", threshold: -1 } });
    const names = openGguf(first).tensors.map((t) => t.name);
    expect(names.filter((n) => n.startsWith("blk.0.")).at(-1)).toBe("blk.0.fc2.weight");
    const other = [0, 1].map((l) => randomPredictor(8, E, F, l + 20));
    const out = join(dir, "re-preds.pwri.gguf");
    rewriteModel(first, out, { predictors: { layers: other, type: "f32", threshold: -2 } });
    const b = openGguf(out);
    expect(b.metadata.get("powerinfer.sparse_threshold")).toBe(-2);
    for (let l = 0; l < 2; l++) {
      expect(Array.from(readTensorF32(b, `blk.${l}.fc1.weight`))).toEqual(Array.from(other[l]!.fc1));
      expect(Array.from(readTensorF32(b, `blk.${l}.fc2.weight`))).toEqual(Array.from(other[l]!.fc2));
    }
    expect(b.tensors.length).toBe(names.length);
  });

  it("PWRI: ffn_down becomes its transpose ffn_down_t, predictors and threshold are added, the rest is kept", () => {
    const out = join(dir, "toy.pwri.gguf");
    const r = rewriteModel(src, out, { format: "PWRI", predictors: { layers: preds, type: "f16", threshold: -1 } });
    expect(r.format).toBe("PWRI");
    const a = openGguf(src);
    const b = openGguf(out);
    expect(b.format).toBe("PWRI");
    for (const [k, v] of a.metadata) expect(b.metadata.get(k)).toEqual(v);
    expect(b.metadata.get("powerinfer.sparse_threshold")).toBe(-1);
    for (let l = 0; l < 2; l++) {
      expect(b.tensorMap.has(`blk.${l}.ffn_down.weight`)).toBe(false);
      const dt = b.tensorMap.get(`blk.${l}.ffn_down_t.weight`)!;
      expect(dt.shape).toEqual([E, F]);
      const down = readTensorF32(a, `blk.${l}.ffn_down.weight`); // row e: W[e, 0..F)
      const downT = readTensorF32(b, dt); // row i: W[0..E, i]
      for (let e = 0; e < E; e++) for (let i = 0; i < F; i++) expect(downT[i * E + e]).toBe(down[e * F + i]);
      const fc1 = b.tensorMap.get(`blk.${l}.fc1.weight`)!;
      const fc2 = b.tensorMap.get(`blk.${l}.fc2.weight`)!;
      expect([fc1.type, fc2.type]).toEqual([GGMLType.F16, GGMLType.F16]);
      expect(fc1.shape).toEqual([E, 8]);
      expect(fc2.shape).toEqual([8, F]);
      const back = readTensorF32(b, fc2);
      for (const v of back) expect(f16ToF32(f32ToF16(v))).toBe(v);
      expect(Math.max(...back.map((v, i) => Math.abs(v - preds[l]!.fc2[i]!)))).toBeLessThan(1e-3);
      // every other tensor byte-identical
      for (const n of [`blk.${l}.ffn_gate.weight`, `blk.${l}.ffn_up.weight`, `blk.${l}.ffn_norm.weight`]) {
        expect(Buffer.from(readTensorBytes(b, n)).equals(Buffer.from(readTensorBytes(a, n)))).toBe(true);
      }
    }
    // predictors sit with their layer
    const names = b.tensors.map((t) => t.name);
    expect(names.indexOf("blk.0.fc2.weight")).toBeLessThan(names.indexOf("blk.1.attn_norm.weight"));
    const rp = readPredictors(b, { nEmbd: E, nFf: F, nLayer: 2 });
    expect(rp.type).toBe("f16");
    expect(rp.threshold).toBe(-1);
  });

  it("back to GGUF gives the original ffn_down bytes", () => {
    const pw = join(dir, "rt.pwri.gguf");
    const gg = join(dir, "rt.gguf");
    rewriteModel(src, pw, { format: "PWRI" });
    rewriteModel(pw, gg, { format: "GGUF" });
    const a = openGguf(src);
    const c = openGguf(gg);
    expect(c.format).toBe("GGUF");
    expect(c.tensors.map((t) => t.name)).toEqual(a.tensors.map((t) => t.name));
    for (const t of a.tensors)
      expect(Buffer.from(readTensorBytes(c, t.name)).equals(Buffer.from(readTensorBytes(a, t)))).toBe(true);
  });

  it("quantizes weight matrices, keeps vectors and predictors, updates file_type", () => {
    const pw = join(dir, "q.src.gguf");
    rewriteModel(src, pw, { format: "PWRI", predictors: { layers: preds, type: "f16", threshold: -1 } });
    const out = join(dir, "q.q4.gguf");
    const r = rewriteModel(pw, out, { quantize: GGMLType.Q4_0 });
    expect(r.format).toBe("PWRI");
    const a = openGguf(pw);
    const b = openGguf(out);
    expect(b.metadata.get("general.file_type")).toBe(2);
    expect(b.metadata.get("general.quantization_version")).toBe(2);
    expect(b.metadata.get("powerinfer.sparse_threshold")).toBe(-1);
    expect(b.tensorMap.get("blk.0.ffn_gate.weight")!.type).toBe(GGMLType.Q4_0);
    expect(b.tensorMap.get("blk.0.ffn_down_t.weight")!.type).toBe(GGMLType.Q4_0);
    expect(b.tensorMap.get("blk.0.ffn_norm.weight")!.type).toBe(GGMLType.F32);
    for (const n of ["blk.0.fc1.weight", "blk.1.fc2.weight"]) {
      expect(b.tensorMap.get(n)!.type).toBe(GGMLType.F16);
      expect(Buffer.from(readTensorBytes(b, n)).equals(Buffer.from(readTensorBytes(a, n)))).toBe(true);
    }
    // Q4_0 keeps the gate within its quantization error
    const g0 = readTensorF32(a, "blk.0.ffn_gate.weight");
    const g1 = readTensorF32(b, "blk.0.ffn_gate.weight");
    const amax = Math.max(...g0.map(Math.abs));
    expect(Math.max(...g0.map((v, i) => Math.abs(v - g1[i]!)))).toBeLessThan(amax / 7);
  });

  it("rows that are not a multiple of the block fall back to F16 with a note; BF16 cannot go into PWRI", () => {
    const odd = join(dir, "odd.gguf");
    writeToyModel(odd, layers, E, F, {
      extra: [
        { name: "extra.weight", type: GGMLType.F32, shape: [48, 4], data: new Uint8Array(48 * 4 * 4) },
        { name: "extra_bf16.weight", type: GGMLType.BF16, shape: [3], data: new Uint8Array(6) },
      ],
    });
    const out = join(dir, "odd.q8.gguf");
    const r = rewriteModel(odd, out, { quantize: GGMLType.Q8_0 });
    expect(openGguf(out).tensorMap.get("extra.weight")!.type).toBe(GGMLType.F16);
    expect(r.notes.join("\n")).toMatch(
      /extra\.weight: rows of 48 are not a multiple of the Q8_0 block \(32\), stored as F16/,
    );
    const pw = join(dir, "odd.pwri.gguf");
    const r2 = rewriteModel(odd, pw, { format: "PWRI" });
    expect(openGguf(pw).tensorMap.get("extra_bf16.weight")!.type).toBe(GGMLType.F16);
    expect(r2.notes.join("\n")).toMatch(/PWRI files cannot hold BF16/);
  });

  it("refuses predictors that do not fit and types it cannot write", () => {
    const bad = [randomPredictor(8, E, F - 32, 1), preds[1]!];
    expect(() =>
      rewriteModel(src, join(dir, "x.gguf"), { predictors: { layers: bad, type: "f32", threshold: 0 } }),
    ).toThrow(/layer 0: predictor .* does not fit the model \(n_embd 32, n_ff 64\)/);
    expect(() =>
      rewriteModel(src, join(dir, "x.gguf"), { predictors: { layers: [preds[0]!], type: "f32", threshold: 0 } }),
    ).toThrow(/1 predictors for a model with 2 layers/);
    expect(() => rewriteModel(src, join(dir, "x.gguf"), { quantize: GGMLType.Q6_K })).toThrow(
      /cannot quantize to Q6_K/,
    );
    expect(() =>
      rewriteModel(src, join(dir, "x.gguf"), {
        metadata: [{ key: "powerinfer.sparse_threshold", type: GgufTypes.f32, value: "x" as never }],
      }),
    ).toThrow(/expected a number/);
  });
});
