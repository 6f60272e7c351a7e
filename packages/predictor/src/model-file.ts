/**
 * Writing a model file anew: as PowerInfer GGUF (`PWRI`, FFN down projection stored neuron-major as
 * `blk.N.ffn_down_t.weight` {n_embd, n_ff}) or plain GGUF (`blk.N.ffn_down.weight` {n_ff, n_embd}), with
 * predictors added or replaced (`blk.N.fc1.weight` {n_embd, r}, `blk.N.fc2.weight` {r, n_ff},
 * `powerinfer.sparse_threshold`), and/or with the weight matrices quantized. Every other tensor and
 * metadata entry is kept as it is, in its order. Tensors are produced one at a time while writing.
 */
import { resolve as resolvePath } from "node:path";
import {
  dequantize,
  GGML_TYPE_INFO,
  GGMLType,
  type GgufFile,
  type GgufMetadataEntry,
  type GgufTensorInfo,
  type GgufTensorSpec,
  GgufTypes,
  ggmlTypeName,
  metadataEntries,
  withoutSplitKeys,
  openGgufModel,
  quantize,
  readTensorBytes,
  writeGguf,
} from "@powerinfer/gguf";
import { transpose } from "./matmul.js";
import type { LayerPredictor } from "./predictor.js";

/** Types {@link rewriteModel} can quantize to. */
export const QUANTIZE_TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0] as const;
const FLOAT_TYPES = new Set<GGMLType>([GGMLType.F32, GGMLType.F16, GGMLType.BF16]);

/** llama.cpp's `general.file_type` (enum llama_ftype) for an all-`type` model. */
const FILE_TYPE: Partial<Record<GGMLType, number>> = {
  [GGMLType.F32]: 0,
  [GGMLType.F16]: 1,
  [GGMLType.Q4_0]: 2,
  [GGMLType.Q8_0]: 7,
  [GGMLType.BF16]: 32,
};

/** Options of {@link rewriteModel}. */
export interface RewriteOptions {
  /** Container of the output. Default: the input's. */
  format?: "GGUF" | "PWRI";
  /** Predictors to write (replacing any in the input), their storage type and the model-wide threshold. */
  predictors?: { layers: LayerPredictor[]; type: "f16" | "f32"; threshold: number };
  /**
   * Per-expert predictors of a model with routed experts ([layer][expert], one rank per layer), written as
   * `blk.N.fc1_exps.weight` {n_embd, r, n_expert} and `blk.N.fc2_exps.weight` {r, n_ff_exp, n_expert}
   * (replacing any in the input), with the model-wide threshold.
   */
  expertPredictors?: { layers: LayerPredictor[][]; type: "f16" | "f32"; threshold: number };
  /**
   * Convert every weight matrix (2-D `.weight` tensors except the predictors) to this type. A matrix
   * whose rows are not a multiple of the type's block becomes F16 instead (noted); one already in
   * another quantized type is kept (noted).
   */
  quantize?: GGMLType;
  /** Metadata entries to add or replace (e.g. provenance). */
  metadata?: GgufMetadataEntry[];
  /**
   * Leave the input's predictor tensors (`blk.N.fc1/fc2`) out (ignored when `predictors` is given):
   * llama.cpp refuses a GGUF with tensors its architecture does not know.
   */
  dropPredictors?: boolean;
}

/** What {@link rewriteModel} did. */
export interface RewriteResult {
  format: "GGUF" | "PWRI";
  tensors: number;
  /** Tensors written per type name ("Q4_0": 31, "F32": 16, …), most first. */
  types: [string, number][];
  /** Things worth telling the user (fallbacks, kept tensors). */
  notes: string[];
}

const DOWN = /^blk\.(\d+)\.ffn_down\.weight$/;
/** Expert routers (`blk.N.ffn_gate_inp.weight`): never quantized. */
const ROUTER = /^blk\.\d+\.ffn_gate_inp\.weight$/;
const DOWN_T = /^blk\.(\d+)\.ffn_down_t\.weight$/;
/** Routed experts' down stacks: `ffn_down_exps` {n_ff_exp, n_embd, n_expert} or neuron-major `ffn_down_exps_t`. */
const DOWN_EXPS = /^blk\.(\d+)\.ffn_down_exps(_t)?\.weight$/;
/** Predictors: `blk.N.fc1/fc2.weight`, and per-expert stacks `blk.N.fc1_exps/fc2_exps.weight`. */
const PRED = /^blk\.(\d+)\.fc[12](_exps)?\.weight$/;

function encode(type: GGMLType, data: Float32Array): Uint8Array {
  return quantize(type, data);
}

/**
 * Whether `quantize` converts this tensor (a float one): a weight matrix, not a predictor (kept at its
 * precision) and not an expert router (llama.cpp's quantizer keeps ffn_gate_inp F32: a rounded router
 * changes which experts a token gets). Vectors and non-weights are copied as they are.
 */
export function isQuantizableMatrix(t: Pick<GgufTensorInfo, "name" | "shape">): boolean {
  return (
    t.name.endsWith(".weight") && t.shape.filter((d) => d > 1).length >= 2 && !PRED.test(t.name) && !ROUTER.test(t.name)
  );
}

/** Whether a tensor type is one `quantize` converts from (F32, F16, BF16). */
export function isFloatType(type: GGMLType): boolean {
  return FLOAT_TYPES.has(type);
}

/**
 * Rewrites the model at `inPath` to `outPath` (atomically: a temporary file renamed at the end).
 * @throws GgufError from reading or writing (e.g. `UNSUPPORTED_TYPE` for a BF16 tensor in PWRI output —
 *   quantize to F16 first), RangeError for predictors that do not fit the model
 */
export function rewriteModel(inPath: string, outPath: string, opts: RewriteOptions = {}): RewriteResult {
  const file = openGgufModel(inPath);
  return rewriteModelFile(file, outPath, opts);
}

/** {@link rewriteModel} on an opened file. */
export function rewriteModelFile(file: GgufFile, outPath: string, opts: RewriteOptions = {}): RewriteResult {
  const inputs = file.splits ? file.splits.map((s) => s.path) : [file.path];
  if (inputs.some((p) => resolvePath(outPath) === resolvePath(p))) {
    throw new RangeError(`output ${outPath} is the input model; choose another path (the input would be lost)`);
  }
  const format = opts.format ?? file.format;
  const notes: string[] = [];
  const q = opts.quantize;
  if (q !== undefined && !(QUANTIZE_TYPES as readonly GGMLType[]).includes(q)) {
    throw new RangeError(
      `cannot quantize to ${ggmlTypeName(q)} (supported: ${QUANTIZE_TYPES.map((t) => ggmlTypeName(t)).join(", ")})`,
    );
  }
  const pwri = format === "PWRI";
  const preds = opts.predictors;
  // The type a float matrix of row length ne0 is stored as in the output.
  const targetType = (t: GgufTensorInfo, ne0: number, what: string): GGMLType => {
    let type = t.type;
    if (q !== undefined) {
      if (FLOAT_TYPES.has(t.type)) type = q;
      else if (t.type !== q) notes.push(`${what}: already ${ggmlTypeName(t.type)}, kept`);
    }
    const block = GGML_TYPE_INFO[type].blockSize;
    if (ne0 % block !== 0) {
      notes.push(
        `${what}: rows of ${ne0} are not a multiple of the ${ggmlTypeName(type)} block (${block}), stored as F16`,
      );
      type = GGMLType.F16;
    }
    if (pwri && type === GGMLType.BF16) {
      notes.push(`${what}: PWRI files cannot hold BF16, stored as F16`);
      type = GGMLType.F16;
    }
    return type;
  };

  const specs: GgufTensorSpec[] = [];
  const predictorSpecs = (l: number): GgufTensorSpec[] => {
    const p = preds!.layers[l]!;
    const type = preds!.type === "f16" ? GGMLType.F16 : GGMLType.F32;
    return [
      { name: `blk.${l}.fc1.weight`, type, shape: [p.nEmbd, p.rank], data: () => encode(type, p.fc1) },
      { name: `blk.${l}.fc2.weight`, type, shape: [p.rank, p.nFf], data: () => encode(type, p.fc2) },
    ];
  };
  const xp = opts.expertPredictors;
  if (xp && preds) throw new RangeError("predictors and expertPredictors: a model has one or the other");
  const expertSpecs = (l: number): GgufTensorSpec[] => {
    const ps = xp!.layers[l]!;
    const type = xp!.type === "f16" ? GGMLType.F16 : GGMLType.F32;
    const { rank: r, nEmbd: e, nFf: f } = ps[0]!;
    const cat = (part: "fc1" | "fc2") => {
      const n = part === "fc1" ? r * e : f * r;
      const out = new Float32Array(n * ps.length);
      ps.forEach((p, x) => {
        out.set(p[part], x * n);
      });
      return out;
    };
    return [
      { name: `blk.${l}.fc1_exps.weight`, type, shape: [e, r, ps.length], data: () => encode(type, cat("fc1")) },
      { name: `blk.${l}.fc2_exps.weight`, type, shape: [r, f, ps.length], data: () => encode(type, cat("fc2")) },
    ];
  };
  // the new predictors follow each layer's last tensor that is kept (not an old predictor being replaced:
  // a file may end a layer with them, or hold them all after the output tensors)
  const dropped = (t: GgufTensorInfo) => !!(preds || xp || opts.dropPredictors) && PRED.test(t.name);
  const lastOfLayer = new Map<number, number>();
  file.tensors.forEach((t, i) => {
    const m = /^blk\.(\d+)\./.exec(t.name);
    if (m && !dropped(t)) lastOfLayer.set(Number(m[1]), i);
  });
  if (xp) {
    if (xp.layers.length !== lastOfLayer.size) {
      throw new RangeError(
        `${xp.layers.length} layers of expert predictors for a model with ${lastOfLayer.size} layers`,
      );
    }
    xp.layers.forEach((ps, l) => {
      const up = file.tensorMap.get(`blk.${l}.ffn_up_exps.weight`);
      if (!up) throw new RangeError(`layer ${l} has no routed experts (blk.${l}.ffn_up_exps.weight)`);
      const [e, f, x] = up.shape as [number, number, number];
      const r = ps[0]?.rank;
      const bad = ps.findIndex(
        (p) =>
          p.rank !== r || p.nEmbd !== e || p.nFf !== f || p.fc1.length !== p.rank * e || p.fc2.length !== f * p.rank,
      );
      if (ps.length !== x || bad >= 0) {
        throw new RangeError(
          `layer ${l}: expert predictors (${ps.length}, expert ${bad}) do not fit ${x} experts of n_embd ${e}, n_ff_exp ${f} with one rank`,
        );
      }
    });
  }
  if (preds) {
    const nLayers = lastOfLayer.size;
    if (preds.layers.length !== nLayers) {
      throw new RangeError(`${preds.layers.length} predictors for a model with ${nLayers} layers`);
    }
    preds.layers.forEach((p, l) => {
      const up = file.tensorMap.get(`blk.${l}.ffn_up.weight`);
      const [e, f] = up ? (up.shape as [number, number]) : [p.nEmbd, p.nFf];
      if (p.nEmbd !== e || p.nFf !== f || p.fc1.length !== p.rank * e || p.fc2.length !== f * p.rank) {
        throw new RangeError(
          `layer ${l}: predictor (n_embd ${p.nEmbd}, rank ${p.rank}, n_ff ${p.nFf}) does not fit the model (n_embd ${e}, n_ff ${f})`,
        );
      }
    });
  }

  file.tensors.forEach((t, i) => {
    const down = DOWN.exec(t.name);
    const downT = DOWN_T.exec(t.name);
    const downX = DOWN_EXPS.exec(t.name);
    if (dropped(t)) return; // replaced below, or dropped
    if ((down && pwri) || (downT && !pwri) || (downX && pwri !== (downX[2] === "_t"))) {
      // stored {a, b} (rows of length a) → {b, a}, expert by expert for a stack {a, b, n_expert}: a PWRI file
      // stores the down projection neuron-major (ffn_down_t, ffn_down_exps_t)
      const [a, b] = t.shape as [number, number];
      const x = t.shape[2] ?? 1;
      const name = pwri ? t.name.replace(/\.weight$/, "_t.weight") : t.name.replace(/_t\.weight$/, ".weight");
      const quantized = !FLOAT_TYPES.has(t.type);
      const type = targetType(t, b, name);
      if (quantized && q === undefined)
        notes.push(`${name}: transposed through F32 and re-quantized to ${ggmlTypeName(type)}`);
      specs.push({
        name,
        type,
        shape: downX ? [b, a, x] : [b, a],
        data: () => {
          const v = dequantize(t.type, readTensorBytes(file, t), t.nElements);
          const out = new Float32Array(v.length);
          for (let e = 0, o = 0; e < x; e++, o += a * b) {
            transpose(v.subarray(o, o + a * b), b, a, out.subarray(o, o + a * b));
          }
          return encode(type, out);
        },
      });
    } else if (!isQuantizableMatrix(t)) {
      // predictors, expert routers, vectors and non-weights: copied (isQuantizableMatrix)
      const type = pwri && t.type === GGMLType.BF16 ? GGMLType.F16 : t.type;
      if (type !== t.type) notes.push(`${t.name}: PWRI files cannot hold BF16, stored as F16`);
      specs.push({
        name: t.name,
        type,
        shape: [...t.shape],
        data: () =>
          type === t.type
            ? readTensorBytes(file, t)
            : encode(type, dequantize(t.type, readTensorBytes(file, t), t.nElements)),
      });
    } else {
      const type = targetType(t, t.shape[0]!, t.name);
      specs.push({
        name: t.name,
        type,
        shape: [...t.shape],
        data: () =>
          type === t.type
            ? readTensorBytes(file, t)
            : encode(type, dequantize(t.type, readTensorBytes(file, t), t.nElements)),
      });
    }
    const layer = [...lastOfLayer.entries()].find(([, last]) => last === i)?.[0];
    if (preds && layer !== undefined) specs.push(...predictorSpecs(layer));
    if (xp && layer !== undefined) specs.push(...expertSpecs(layer));
  });

  // Metadata: the input's (a split model's without its split keys: the output is one file), then
  // replacements/additions.
  const entries = metadataEntries(file.splits ? withoutSplitKeys(file) : file);
  const set = (e: GgufMetadataEntry) => {
    const i = entries.findIndex((x) => x.key === e.key);
    if (i >= 0) entries[i] = e;
    else entries.push(e);
  };
  if (q !== undefined && FILE_TYPE[q] !== undefined) {
    set({ key: "general.file_type", type: GgufTypes.u32, value: FILE_TYPE[q]! });
    if (q === GGMLType.Q8_0 || q === GGMLType.Q4_0)
      set({ key: "general.quantization_version", type: GgufTypes.u32, value: 2 });
  }
  if (preds || xp) set({ key: "powerinfer.sparse_threshold", type: GgufTypes.f32, value: (preds ?? xp)!.threshold });
  for (const e of opts.metadata ?? []) set(e);
  writeGguf(outPath, { format, metadata: entries, tensors: specs });
  const types = new Map<string, number>();
  for (const s of specs) types.set(ggmlTypeName(s.type), (types.get(ggmlTypeName(s.type)) ?? 0) + 1);
  return {
    format,
    tensors: specs.length,
    types: [...types.entries()].sort((a, b) => b[1] - a[1]),
    notes: [...new Set(notes)],
  };
}

/**
 * The predictors stored in a model file (`blk.N.fc1.weight`, `blk.N.fc2.weight` for every layer N) as
 * float32, with their storage type and the file's `powerinfer.sparse_threshold` (0 when absent).
 * @param expect when given, the n_embd, n_ff and layer count they must fit
 * @throws RangeError naming the layer and shapes when a predictor is missing or does not fit
 */
export function readPredictors(
  file: GgufFile,
  expect?: { nEmbd: number; nFf: number; nLayer: number },
): { layers: LayerPredictor[]; type: "f16" | "f32"; threshold: number } {
  const layers: LayerPredictor[] = [];
  let type: "f16" | "f32" = "f16";
  for (let l = 0; ; l++) {
    const fc1 = file.tensorMap.get(`blk.${l}.fc1.weight`);
    const fc2 = file.tensorMap.get(`blk.${l}.fc2.weight`);
    if (!fc1 && !fc2) break;
    if (!fc1 || !fc2) throw new RangeError(`${file.path}: layer ${l} has only half of its predictor`);
    const [e, r] = fc1.shape as [number, number];
    const [r2, f] = fc2.shape as [number, number];
    if (r2 !== r || (expect && (e !== expect.nEmbd || f !== expect.nFf))) {
      throw new RangeError(
        `${file.path}: layer ${l} predictor fc1 [${fc1.shape}], fc2 [${fc2.shape}] does not fit n_embd ${expect?.nEmbd ?? e}, n_ff ${expect?.nFf ?? f}`,
      );
    }
    if (fc1.type !== GGMLType.F16 || fc2.type !== GGMLType.F16) type = "f32";
    layers.push({
      rank: r,
      nEmbd: e,
      nFf: f,
      fc1: dequantize(fc1.type, readTensorBytes(file, fc1), fc1.nElements),
      fc2: dequantize(fc2.type, readTensorBytes(file, fc2), fc2.nElements),
    });
  }
  if (expect && layers.length !== expect.nLayer) {
    throw new RangeError(`${file.path} has predictors for ${layers.length} layers, the model has ${expect.nLayer}`);
  }
  const th = file.metadata.get("powerinfer.sparse_threshold");
  return { layers, type, threshold: typeof th === "number" ? th : 0 };
}
