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
 * - Routed experts (`ffn_{gate,up,down}_exps`, {@link expertsPerToken}): a decoded token reads its
 *   n_expert_used chosen experts, so each stacked tensor counts n_expert_used / n_expert of its bytes
 *   (dense, and the gate in `oracle`); sparse experts' up (and gate, in `predictor`) is counted by the row
 *   counters (one row per neuron computed in a chosen expert), and so is a down projection stored
 *   neuron-major (`ffn_down_exps_t`) or made so at load (F16/F32); a quantized `ffn_down_exps` runs
 *   densely (expertDownNeuronMajor) and counts
 *   as dense. Per-expert predictors (`fc1_exps`/`fc2_exps`) count n_expert_used / n_expert of their bytes.
 * - Predictors (fc1/fc2, fc1_exps/fc2_exps) are read in `predictor` mode only.
 */
import { expertDownNeuronMajor, type SparseMode } from "@powerinfer/engine";
import { GGMLType, type GgufFile, tensorByteLength } from "@powerinfer/gguf";

const FFN = /^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down|ffn_down_t)\.weight$/;
const EXPS = /^blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps|ffn_down_exps_t|fc1_exps|fc2_exps)\.weight$/;
/** Dense layers' predictors (read only in predictor mode). */
const PRED = /^blk\.\d+\.fc[12]\.weight$/;

/** The share of a stacked expert tensor one decoded token reads: n_expert_used / n_expert (1 without experts). */
export function expertsPerToken(file: GgufFile): number {
  const arch = file.metadata.get("general.architecture");
  const used = file.metadata.get(`${String(arch)}.expert_used_count`);
  const count = file.metadata.get(`${String(arch)}.expert_count`);
  if (typeof used !== "number" || typeof count !== "number" || count <= 0) return 1;
  return used / count;
}

/** Weight bytes per decoded token that do not depend on which neurons fire. */
export function fixedBytesPerToken(file: GgufFile, mode: SparseMode): number {
  const tied = !file.tensorMap.has("output.weight");
  let bytes = 0;
  for (const t of file.tensors) {
    if (t.name === "token_embd.weight" && !tied) {
      bytes += tensorByteLength(t.type, [t.shape[0]!]);
      continue;
    }
    const x = EXPS.exec(t.name);
    if (x) {
      // predictors (per expert): read whole for the chosen experts, in predictor mode only
      const pred = x[2] === "fc1_exps" || x[2] === "fc2_exps";
      const dense = pred
        ? mode === "predictor"
        : mode === "off" ||
          (x[2] === "ffn_gate_exps" && mode === "oracle") ||
          (x[2] === "ffn_down_exps" && !expertDownNeuronMajor(t.type));
      if (dense) bytes += t.byteLength * expertsPerToken(file);
      continue;
    }
    if (PRED.test(t.name) && mode !== "predictor") continue;
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
    const up = file.tensorMap.get(`blk.${l}.ffn_up_exps.weight`);
    const gate = file.tensorMap.get(`blk.${l}.ffn_gate_exps.weight`);
    const downT = file.tensorMap.get(`blk.${l}.ffn_down_exps_t.weight`);
    const down = downT ?? file.tensorMap.get(`blk.${l}.ffn_down_exps.weight`);
    if (up && down) {
      // a chosen expert's neuron: its up row (and gate row in predictor mode), and its down row
      // neuron-major (stored so: ffn_down_exps_t; or an F16/F32 stack transposed at load) unless the down
      // projection runs densely
      const downRow = downT
        ? tensorByteLength(downT.type, [downT.shape[0]!])
        : expertDownNeuronMajor(down.type)
          ? tensorByteLength(down.type, [down.shape[1]!])
          : 0;
      const gateRow = mode === "predictor" && gate ? tensorByteLength(gate.type, [gate.shape[0]!]) : 0;
      out.push(tensorByteLength(up.type, [up.shape[0]!]) + gateRow + downRow);
      continue;
    }
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
 * @param activeRowsPerToken per layer, neurons computed per token (sparse modes; from the row counters): each
 *   counts one row of every matrix the sparse kernels read ({@link sparseRowBytes})
 * @param sparseBytesPerToken per layer, the bytes the sparse ops read per token as the engine counted them
 *   (`Session.stats.sparseBytes`: each op's rows × its row bytes); replaces the estimate from
 *   `activeRowsPerToken` where up and down read fewer rows than the gate (predictor mode)
 */
export function bytesPerToken(
  file: GgufFile,
  nLayer: number,
  mode: SparseMode,
  activeRowsPerToken?: number[],
  sparseBytesPerToken?: number[],
): number {
  let b = fixedBytesPerToken(file, mode);
  if (mode !== "off" && sparseBytesPerToken) {
    for (let l = 0; l < nLayer; l++) b += sparseBytesPerToken[l] ?? 0;
  } else if (mode !== "off") {
    const rows = sparseRowBytes(file, nLayer, mode);
    rows.forEach((rb, l) => {
      b += rb * (activeRowsPerToken?.[l] ?? 0);
    });
  }
  return b;
}
