/** Synthetic models and activation data for the predictor tests. */
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { GGMLType, type GgufTensorSpec, GgufTypes, quantize, writeGguf } from "@powerinfer/gguf";
import { type ActivationDataset, maskStride, Rng } from "../src/index.ts";

export function tmp(): string {
  return mkdtempSync(join(tmpdir(), "powerinfer-predictor-"));
}

/** A tiny "layer": gate W [f×e] and ffn_norm [e]. Input dimension 0 is a constant 3 with weight −2 → sparse firing. */
export interface ToyLayer {
  gate: Float32Array;
  norm: Float32Array;
}

export function toyLayers(nLayer: number, e: number, f: number, seed: number): ToyLayer[] {
  const rng = new Rng(seed);
  return Array.from({ length: nLayer }, () => {
    const gate = new Float32Array(f * e);
    for (let i = 0; i < f; i++) {
      for (let c = 0; c < e; c++) gate[i * e + c] = c === 0 ? -2 - rng.next() : rng.normal() * 0.6;
    }
    const norm = Float32Array.from({ length: e }, () => 0.5 + rng.next());
    return { gate, norm };
  });
}

/**
 * Samples x (dim 0 = 3, others N(0,1), dim 1 with a large scale: an "outlier" dimension) and masks
 * gate·(norm ⊙ x / rms(x)) > 0 — exactly the rule of a ReLU-gated FFN.
 */
export function toyData(layers: ToyLayer[], n: number, e: number, f: number, seed: number): ActivationDataset {
  const rng = new Rng(seed);
  const s = maskStride(f);
  return {
    nEmbd: e,
    nFf: f,
    nTokens: n,
    layers: layers.map(({ gate, norm }) => {
      const inputs = new Float32Array(n * e);
      const masks = new Uint8Array(n * s);
      for (let t = 0; t < n; t++) {
        let sq = 0;
        for (let c = 0; c < e; c++) {
          const v = c === 0 ? 3 : c === 1 ? 8 * rng.normal() : rng.normal();
          inputs[t * e + c] = v;
          sq += v * v;
        }
        const rms = Math.sqrt(sq / e);
        for (let i = 0; i < f; i++) {
          let g = 0;
          for (let c = 0; c < e; c++) g += gate[i * e + c]! * ((norm[c]! * inputs[t * e + c]!) / rms);
          if (g > 0) masks[t * s + (i >> 3)]! |= 1 << (i & 7);
        }
      }
      return { inputs, masks };
    }),
  };
}

/**
 * Writes a small llama-shaped GGUF: token_embd, per layer attn_norm/ffn_norm/ffn_gate/ffn_up/ffn_down
 * (F32 unless `types` says otherwise), output_norm, plus a few metadata keys.
 */
export function writeToyModel(
  path: string,
  layers: ToyLayer[],
  e: number,
  f: number,
  opts: { downType?: GGMLType; extra?: GgufTensorSpec[] } = {},
): void {
  const rng = new Rng(99);
  const f32 = (a: Float32Array) => quantize(GGMLType.F32, a);
  const tensors: GgufTensorSpec[] = [
    {
      name: "token_embd.weight",
      type: GGMLType.F32,
      shape: [e, 8],
      data: f32(Float32Array.from({ length: e * 8 }, () => rng.normal())),
    },
  ];
  layers.forEach((L, l) => {
    const up = Float32Array.from({ length: f * e }, () => rng.normal());
    const down = Float32Array.from({ length: e * f }, () => rng.normal());
    const dt = opts.downType ?? GGMLType.F32;
    tensors.push(
      { name: `blk.${l}.attn_norm.weight`, type: GGMLType.F32, shape: [e], data: f32(new Float32Array(e).fill(1)) },
      { name: `blk.${l}.ffn_norm.weight`, type: GGMLType.F32, shape: [e], data: f32(L.norm) },
      { name: `blk.${l}.ffn_gate.weight`, type: GGMLType.F32, shape: [e, f], data: f32(L.gate) },
      { name: `blk.${l}.ffn_up.weight`, type: GGMLType.F32, shape: [e, f], data: f32(up) },
      { name: `blk.${l}.ffn_down.weight`, type: dt, shape: [f, e], data: quantize(dt, down) },
    );
  });
  tensors.push({ name: "output_norm.weight", type: GGMLType.F32, shape: [e], data: f32(new Float32Array(e).fill(1)) });
  tensors.push(...(opts.extra ?? []));
  writeGguf(path, {
    metadata: [
      { key: "general.architecture", type: GgufTypes.string, value: "llama" },
      { key: "general.name", type: GgufTypes.string, value: "toy" },
      { key: "llama.block_count", type: GgufTypes.u32, value: layers.length },
      { key: "llama.hidden_act", type: GgufTypes.string, value: "relu" },
      { key: "general.file_type", type: GgufTypes.u32, value: 0 },
    ],
    tensors,
  });
}
