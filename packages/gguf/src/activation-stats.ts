/**
 * Activation statistics files (`<model>.activations.gguf`): how often each FFN neuron fired while a
 * model ran over a corpus — the input of the placement planner and predictor training.
 *
 * Format (this project's; GGUF v3): `general.architecture = "powerinfer.activation_stats"`,
 * `powerinfer.activation_stats.block_count` (u32), `.n_ff` (u32), `.token_count` (u64: tokens the
 * counts were measured over), `.corpus_name` (string), `.corpus_sha256` (hex string), `.model_sha256`
 * (hex string; see {@link modelFingerprint}), and per layer `blk.N.activation_count` I32[n_ff]: how
 * many of the token_count tokens had neuron i active (ReLU output > 0), layers in numeric order.
 *
 * Models with routed experts (SmallThinker's ReGLU experts) add `powerinfer.activation_stats.expert_count`
 * (u32, n_expert); `.n_ff` is then an expert's neuron count (n_ff_exp), `blk.N.activation_count` is
 * I32[n_ff_exp, n_expert] (expert e's neuron i at e·n_ff_exp + i: tokens routed to e on which the neuron
 * fired) and `blk.N.expert_selection_count` I32[n_expert] counts the tokens routed to each expert (each
 * token counts once for each of its n_expert_used experts), so a neuron's firing rate inside its expert is
 * activation_count / expert_selection_count.
 */
import { createHash } from "node:crypto";
import { closeSync, openSync, readSync } from "node:fs";
import { GgufError } from "./errors.js";
import { GGMLType } from "./ggml-types.js";
import { type GgufFile, openGguf, readTensorBytes } from "./reader.js";
import { GgufValueType } from "./values.js";
import { type GgufMetadataEntry, writeGguf } from "./writer.js";

export const ACTIVATION_STATS_ARCH = "powerinfer.activation_stats";
const P = "powerinfer.activation_stats.";

export interface ActivationStats {
  /** Per layer, [n_ff] counts of tokens on which the neuron fired ([n_ff · n_expert] with experts, expert-major). */
  counts: Int32Array[];
  /** Neurons per FFN (per expert with experts). */
  nFf: number;
  /** Models with routed experts: the expert count. */
  nExpert?: number;
  /** Models with routed experts: per layer, [n_expert] tokens routed to each expert. */
  selections?: Int32Array[];
  tokenCount: number;
  corpusName: string;
  corpusSha256: string;
  modelSha256: string;
}

/**
 * A fingerprint of a model file that is cheap for multi-GB files: sha256 over the file size and the
 * GGUF header (metadata + tensor infos, up to the tensor data) plus 1 MiB sampled from the tensor data
 * (64 KiB at 16 evenly spaced offsets). Two files with the same fingerprint hold the same model for
 * every practical purpose; it is not a hash of every byte.
 */
export function modelFingerprint(file: GgufFile): string {
  const h = createHash("sha256");
  h.update(`${file.fileSize}:`);
  const fd = openSync(file.path, "r");
  try {
    const read = (off: number, len: number) => {
      const b = Buffer.alloc(Math.max(0, Math.min(len, file.fileSize - off)));
      if (b.length) readSync(fd, b, 0, b.length, off);
      h.update(b);
    };
    read(0, file.dataOffset);
    const dataLen = file.fileSize - file.dataOffset;
    for (let i = 0; i < 16; i++) read(file.dataOffset + Math.floor((dataLen * i) / 16), 65536);
  } finally {
    closeSync(fd);
  }
  return h.digest("hex");
}

/** Writes an activation statistics file (atomically). @throws GgufError on inconsistent layer sizes */
export function writeActivationStats(path: string, s: ActivationStats): void {
  const nx = s.nExpert ?? 1;
  for (const [l, c] of s.counts.entries()) {
    if (c.length !== s.nFf * nx) {
      throw new GgufError(
        "BAD_VALUE",
        `layer ${l} has ${c.length} counts, n_ff${s.nExpert ? ` × n_expert is ${s.nFf} × ${nx}` : ` is ${s.nFf}`}`,
      );
    }
  }
  if ((s.nExpert === undefined) !== (s.selections === undefined)) {
    throw new GgufError("BAD_VALUE", "expert statistics need both nExpert and selections");
  }
  for (const [l, c] of (s.selections ?? []).entries()) {
    if (c.length !== nx)
      throw new GgufError("BAD_VALUE", `layer ${l} has ${c.length} expert selection counts, n_expert is ${nx}`);
  }
  if (s.selections && s.selections.length !== s.counts.length) {
    throw new GgufError(
      "BAD_VALUE",
      `${s.selections.length} layers of expert selections for ${s.counts.length} layers of counts`,
    );
  }
  const i32 = (name: string, c: Int32Array, shape: number[]) => ({
    name,
    type: GGMLType.I32,
    shape,
    data: new Uint8Array(c.buffer, c.byteOffset, c.byteLength),
  });
  const str = (key: string, value: string): GgufMetadataEntry => ({
    key,
    type: { type: GgufValueType.STRING },
    value,
  });
  const u32 = (key: string, value: number): GgufMetadataEntry => ({
    key,
    type: { type: GgufValueType.UINT32 },
    value,
  });
  writeGguf(path, {
    metadata: [
      str("general.architecture", ACTIVATION_STATS_ARCH),
      u32(`${P}block_count`, s.counts.length),
      u32(`${P}n_ff`, s.nFf),
      { key: `${P}token_count`, type: { type: GgufValueType.UINT64 }, value: BigInt(s.tokenCount) },
      str(`${P}corpus_name`, s.corpusName),
      str(`${P}corpus_sha256`, s.corpusSha256),
      str(`${P}model_sha256`, s.modelSha256),
      ...(s.nExpert !== undefined ? [u32(`${P}expert_count`, s.nExpert)] : []),
    ],
    tensors: s.counts.flatMap((c, l) => [
      i32(`blk.${l}.activation_count`, c, s.nExpert ? [s.nFf, s.nExpert] : [c.length]),
      ...(s.selections ? [i32(`blk.${l}.expert_selection_count`, s.selections[l]!, [nx])] : []),
    ]),
  });
}

/**
 * Reads an activation statistics file.
 * @throws GgufError (container errors; 'BAD_VALUE' / 'MISSING_KEY' / 'MISSING_TENSOR' naming what is wrong)
 */
export function readActivationStats(path: string): ActivationStats {
  const f = openGguf(path);
  const bad = (msg: string): never => {
    throw new GgufError("BAD_VALUE", msg, { path });
  };
  if (f.metadata.get("general.architecture") !== ACTIVATION_STATS_ARCH) {
    bad(`not an activation statistics file ("general.architecture" must be "${ACTIVATION_STATS_ARCH}")`);
  }
  const need = (k: string) => {
    const v = f.metadata.get(P + k);
    if (v === undefined) throw new GgufError("MISSING_KEY", `required metadata key "${P + k}" is missing`, { path });
    return v;
  };
  const blocks = Number(need("block_count"));
  const nFf = Number(need("n_ff"));
  const ec = f.metadata.get(`${P}expert_count`);
  const nExpert = ec === undefined ? undefined : Number(ec);
  if (nExpert !== undefined && !(Number.isInteger(nExpert) && nExpert >= 1)) bad(`"${P}expert_count" must be ≥ 1`);
  const read = (name: string, n: number, shape: string): Int32Array => {
    const t = f.tensorMap.get(name);
    if (!t) throw new GgufError("MISSING_TENSOR", `no tensor "${name}"`, { path });
    if (t.type !== GGMLType.I32 || t.nElements !== n) bad(`"${name}" must be I32[${shape}]`);
    const c = new Int32Array(n);
    new Uint8Array(c.buffer).set(readTensorBytes(f, t));
    return c;
  };
  const counts: Int32Array[] = [];
  const selections: Int32Array[] = [];
  for (let l = 0; l < blocks; l++) {
    counts.push(read(`blk.${l}.activation_count`, nFf * (nExpert ?? 1), nExpert ? `${nFf}, ${nExpert}` : `${nFf}`));
    if (nExpert) selections.push(read(`blk.${l}.expert_selection_count`, nExpert, `${nExpert}`));
  }
  return {
    counts,
    nFf,
    ...(nExpert ? { nExpert, selections } : {}),
    tokenCount: Number(need("token_count")),
    corpusName: String(need("corpus_name")),
    corpusSha256: String(need("corpus_sha256")),
    modelSha256: String(need("model_sha256")),
  };
}
