/**
 * Checkpoint files of predictor training: a GGUF file (`general.architecture =
 * powerinfer.predictor_checkpoint`) holding the run's identity (`powerinfer.predictor_checkpoint.key`),
 * the state as JSON (`….state`), and the weights and Adam moments as 1-D F32 tensors. Written
 * atomically, so an interruption while saving leaves the previous checkpoint intact.
 */
import { createHash } from "node:crypto";
import {
  GGMLType,
  GgufError,
  type GgufTensorSpec,
  GgufTypes,
  openGguf,
  readTensorF32,
  writeGguf,
} from "@powerinfer/gguf";
import type { ExpertPredictorResult } from "./experts.js";
import type { LayerProgress, LayerResult, PipelineCheckpoint } from "./pipeline.js";
import type { LayerPredictor } from "./predictor.js";
import type { LayerTrainState } from "./train.js";

export const CHECKPOINT_ARCH = "powerinfer.predictor_checkpoint";
const P = `${CHECKPOINT_ARCH}.`;

/** What identifies a training run: a checkpoint is only resumed by the same run. */
export interface CheckpointKeyParts {
  /** Fingerprint of the model file (`modelFingerprint` of @powerinfer/gguf). */
  model: string;
  /** SHA-256 of the training text. */
  corpus: string;
  /** Training token positions. */
  tokens: number;
  /** Every option that changes the result. */
  options: unknown;
}

/** A short hash of the parts. */
export function checkpointKey(p: CheckpointKeyParts): string {
  return createHash("sha256").update(JSON.stringify(p)).digest("hex").slice(0, 32);
}

const replacer = (_k: string, v: unknown) => (typeof v === "number" && !Number.isFinite(v) ? { $num: String(v) } : v);
const reviver = (_k: string, v: unknown) =>
  v && typeof v === "object" && "$num" in (v as object) ? Number((v as { $num: string }).$num) : v;

function f32Bytes(a: Float32Array): Uint8Array {
  return new Uint8Array(a.buffer.slice(a.byteOffset, a.byteOffset + a.byteLength));
}

/** Writes a checkpoint (atomically). */
export function saveCheckpoint(path: string, c: PipelineCheckpoint): void {
  const tensors: GgufTensorSpec[] = [];
  const add = (name: string, a: Float32Array) =>
    tensors.push({ name, type: GGMLType.F32, shape: [a.length], data: () => f32Bytes(a) });
  const predMeta = (p: LayerPredictor) => ({ rank: p.rank, nEmbd: p.nEmbd, nFf: p.nFf });
  const addPred = (prefix: string, p: LayerPredictor) => {
    add(`${prefix}.fc1`, p.fc1);
    add(`${prefix}.fc2`, p.fc2);
  };
  const done = c.done.map((r) => {
    addPred(`done.${r.layer}`, r.predictor);
    return { ...r, predictor: predMeta(r.predictor) };
  });
  let current: unknown;
  if (c.current) {
    const st = c.current.state;
    addPred("cur.current", st.current);
    addPred("cur.best", st.best);
    add("cur.m1", st.m1);
    add("cur.v1", st.v1);
    add("cur.m2", st.m2);
    add("cur.v2", st.v2);
    const { current: cur, best, m1, v1, m2, v2, ...rest } = st;
    current = { ...c.current, state: { ...rest, current: predMeta(cur), best: predMeta(best) } };
  }
  const state = JSON.stringify({ done, current }, replacer);
  writeGguf(path, {
    metadata: [
      { key: "general.architecture", type: GgufTypes.string, value: CHECKPOINT_ARCH },
      { key: `${P}key`, type: GgufTypes.string, value: c.key },
      { key: `${P}state`, type: GgufTypes.string, value: state },
    ],
    tensors,
  });
}

/**
 * Reads a checkpoint written by {@link saveCheckpoint}.
 * @throws GgufError when the file is not a predictor checkpoint or is damaged
 */
export function loadCheckpoint(path: string): PipelineCheckpoint {
  const file = openGguf(path);
  if (file.metadata.get("general.architecture") !== CHECKPOINT_ARCH) {
    throw new GgufError("BAD_VALUE", `${path} is not a predictor training checkpoint`, { path });
  }
  if (file.metadata.get(`${P}kind`) === "experts") {
    throw new GgufError("BAD_VALUE", `${path} is a checkpoint of expert predictor training`, { path });
  }
  const key = file.metadata.get(`${P}key`);
  const raw = file.metadata.get(`${P}state`);
  if (typeof key !== "string" || typeof raw !== "string") {
    throw new GgufError("MISSING_KEY", `checkpoint ${path} lacks its key or state`, { path });
  }
  const s = JSON.parse(raw, reviver) as {
    done: (Omit<LayerResult, "predictor"> & { predictor: Omit<LayerPredictor, "fc1" | "fc2"> })[];
    current?: Omit<LayerProgress, "state"> & {
      state: Omit<LayerTrainState, "current" | "best" | "m1" | "v1" | "m2" | "v2"> & {
        current: Omit<LayerPredictor, "fc1" | "fc2">;
        best: Omit<LayerPredictor, "fc1" | "fc2">;
      };
    };
  };
  const t = (name: string) => readTensorF32(file, name);
  const pred = (prefix: string, m: Omit<LayerPredictor, "fc1" | "fc2">): LayerPredictor => ({
    ...m,
    fc1: t(`${prefix}.fc1`),
    fc2: t(`${prefix}.fc2`),
  });
  const done: LayerResult[] = s.done.map((r) => ({ ...r, predictor: pred(`done.${r.layer}`, r.predictor) }));
  let current: LayerProgress | undefined;
  if (s.current) {
    const st = s.current.state;
    current = {
      ...s.current,
      state: {
        ...st,
        current: pred("cur.current", st.current),
        best: pred("cur.best", st.best),
        m1: t("cur.m1"),
        v1: t("cur.v1"),
        m2: t("cur.m2"),
        v2: t("cur.v2"),
      },
    };
  }
  return { key, done, current };
}

/** A checkpoint of per-expert predictor training: the experts finished so far (an expert is the unit of resumption). */
export interface ExpertCheckpoint {
  /** Identity of the run ({@link checkpointKey}); only the same run resumes it. */
  key: string;
  done: ExpertPredictorResult[];
}

/**
 * Writes an expert training checkpoint (atomically): the same container as {@link saveCheckpoint}, with
 * `powerinfer.predictor_checkpoint.kind = "experts"`, the finished experts' results as JSON and their weights
 * as `expert.L.E.fc1`/`.fc2`.
 */
export function saveExpertCheckpoint(path: string, c: ExpertCheckpoint): void {
  const tensors: GgufTensorSpec[] = [];
  const done = c.done.map((r) => {
    const p = r.predictor;
    for (const [part, a] of [
      ["fc1", p.fc1],
      ["fc2", p.fc2],
    ] as const) {
      tensors.push({
        name: `expert.${r.layer}.${r.expert}.${part}`,
        type: GGMLType.F32,
        shape: [a.length],
        data: () => f32Bytes(a),
      });
    }
    return { ...r, predictor: { rank: p.rank, nEmbd: p.nEmbd, nFf: p.nFf } };
  });
  writeGguf(path, {
    metadata: [
      { key: "general.architecture", type: GgufTypes.string, value: CHECKPOINT_ARCH },
      { key: `${P}key`, type: GgufTypes.string, value: c.key },
      { key: `${P}kind`, type: GgufTypes.string, value: "experts" },
      { key: `${P}state`, type: GgufTypes.string, value: JSON.stringify({ done }, replacer) },
    ],
    tensors,
  });
}

/**
 * Reads a checkpoint written by {@link saveExpertCheckpoint}.
 * @throws GgufError when the file is not an expert training checkpoint (a dense run's included) or is damaged
 */
export function loadExpertCheckpoint(path: string): ExpertCheckpoint {
  const file = openGguf(path);
  if (file.metadata.get("general.architecture") !== CHECKPOINT_ARCH || file.metadata.get(`${P}kind`) !== "experts") {
    throw new GgufError("BAD_VALUE", `${path} is not a checkpoint of expert predictor training`, { path });
  }
  const key = file.metadata.get(`${P}key`);
  const raw = file.metadata.get(`${P}state`);
  if (typeof key !== "string" || typeof raw !== "string") {
    throw new GgufError("MISSING_KEY", `checkpoint ${path} lacks its key or state`, { path });
  }
  const s = JSON.parse(raw, reviver) as {
    done: (Omit<ExpertPredictorResult, "predictor"> & { predictor: Omit<LayerPredictor, "fc1" | "fc2"> })[];
  };
  const done = s.done.map((r) => ({
    ...r,
    predictor: {
      ...r.predictor,
      fc1: readTensorF32(file, `expert.${r.layer}.${r.expert}.fc1`),
      fc2: readTensorF32(file, `expert.${r.layer}.${r.expert}.fc2`),
    },
  }));
  return { key, done };
}
