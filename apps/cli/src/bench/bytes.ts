/**
 * Bytes of weights one decoded token reads, per engine and FFN mode: what bounds decode speed on a
 * machine whose memory bandwidth is the limit.
 *
 * - Dense (llama.cpp, our `--sparse off`): every weight tensor once, except the token embedding, of
 *   which one row is read (all of it when the output head is tied to it).
 * - Sparse `predictor`: the same minus ffn_gate/ffn_up/ffn_down(_t), plus, per layer, the rows the
 *   sparse kernels actually read (their row counters: neurons computed × the bytes of one row of each of
 *   the three matrices); the predictors fc1/fc2 are read whole.
 * - Sparse `oracle`: the gate is computed densely (it decides the mask), up and down sparsely.
 */
import type { SparseMode } from "@powerinfer/core";
import { GGMLType, type GgufFile, tensorByteLength } from "@powerinfer/gguf";

const FFN = /^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down|ffn_down_t)\.weight$/;

/** Weight bytes per decoded token that do not depend on which neurons fire. */
export function fixedBytesPerToken(file: GgufFile, mode: SparseMode): number {
  const tied = !file.tensorMap.has("output.weight");
  let bytes = 0;
  for (const t of file.tensors) {
    if (t.name === "token_embd.weight" && !tied) {
      bytes += tensorByteLength(t.type, [t.shape[0]!]);
      continue;
    }
    const m = FFN.exec(t.name);
    if (m && mode === "predictor") continue;
    if (m && mode === "oracle" && m[2] !== "ffn_gate") continue;
    bytes += t.byteLength;
  }
  return bytes;
}

/** Bytes of one neuron's row in each matrix the sparse kernels read row by row, per layer. */
export function sparseRowBytes(file: GgufFile, nLayer: number, mode: SparseMode): number[] {
  const out: number[] = [];
  for (let l = 0; l < nLayer; l++) {
    let b = 0;
    for (const name of ["ffn_gate", "ffn_up", "ffn_down_t", "ffn_down"]) {
      if (name === "ffn_gate" && mode === "oracle") continue;
      const t = file.tensorMap.get(`blk.${l}.${name}.weight`);
      if (!t) continue;
      if (name === "ffn_down") {
        // the engine transposes a plain GGUF's ffn_down {n_ff, n_embd} on load, to F16 when it is F16
        // and to F32 otherwise: a neuron's row then has n_embd elements of that type
        if (file.tensorMap.has(`blk.${l}.ffn_down_t.weight`)) continue;
        b += t.shape[1]! * (t.type === GGMLType.F16 ? 2 : 4);
        continue;
      }
      b += tensorByteLength(t.type, [t.shape[0]!]);
    }
    out.push(b);
  }
  return out;
}

/**
 * Weight bytes per decoded token.
 * @param activeRowsPerToken per layer, neurons computed per token (sparse modes; from the row counters)
 */
export function bytesPerToken(file: GgufFile, nLayer: number, mode: SparseMode, activeRowsPerToken?: number[]): number {
  let b = fixedBytesPerToken(file, mode);
  if (mode !== "off") {
    const rows = sparseRowBytes(file, nLayer, mode);
    rows.forEach((rb, l) => {
      b += rb * (activeRowsPerToken?.[l] ?? 0);
    });
  }
  return b;
}
