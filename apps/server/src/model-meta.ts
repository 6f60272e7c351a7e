/** What llama.cpp reports about the model (`/v1/models` `meta`, `/props` `model_ftype`). */
import type { Model } from "@powerinfer/engine";
import type { ServerContext } from "./context.js";

/** llama.cpp's llama_ftype_name: `general.file_type` → name. */
const FTYPE_NAMES: Record<number, string> = {
  0: "all F32",
  1: "F16",
  2: "Q4_0",
  3: "Q4_1",
  7: "Q8_0",
  8: "Q5_0",
  9: "Q5_1",
  10: "Q2_K - Medium",
  11: "Q3_K - Small",
  12: "Q3_K - Medium",
  13: "Q3_K - Large",
  14: "Q4_K - Small",
  15: "Q4_K - Medium",
  16: "Q5_K - Small",
  17: "Q5_K - Medium",
  18: "Q6_K",
  19: "IQ2_XXS - 2.0625 bpw",
  20: "IQ2_XS - 2.3125 bpw",
  21: "Q2_K - Small",
  22: "IQ3_XS - 3.3 bpw",
  23: "IQ3_XXS - 3.0625 bpw",
  24: "IQ1_S - 1.5625 bpw",
  25: "IQ4_NL - 4.5 bpw",
  26: "IQ3_S - 3.4375 bpw",
  27: "IQ3_S mix - 3.66 bpw",
  28: "IQ2_S - 2.5 bpw",
  29: "IQ2_M - 2.7 bpw",
  30: "IQ4_XS - 4.25 bpw",
  31: "IQ1_M - 1.75 bpw",
  32: "BF16",
  36: "TQ1_0 - 1.69 bpw ternary",
  37: "TQ2_0 - 2.06 bpw ternary",
  38: "MXFP4 MoE",
  39: "NVFP4",
  40: "Q1_0",
  41: "Q2_0",
};

/** A file without `general.file_type`: llama.cpp guesses from the most common tensor type (ggml type → ftype). */
const GUESS_FROM_GGML: Record<number, number> = {
  0: 0, // F32 → all F32
  1: 1, // F16
  30: 32, // BF16
  2: 2, // Q4_0
  3: 3, // Q4_1
  6: 8, // Q5_0
  7: 9, // Q5_1
  8: 7, // Q8_0
  10: 10, // Q2_K
  11: 12, // Q3_K → Q3_K_M
  12: 15, // Q4_K → Q4_K_M
  13: 17, // Q5_K → Q5_K_M
  14: 18, // Q6_K
  35: 37, // TQ2_0
  34: 36, // TQ1_0
};

export interface ModelMeta {
  /** llama.cpp's llama_vocab_type: 1 = SPM, 2 = BPE. */
  vocab_type: number;
  n_vocab: number;
  n_ctx: number;
  n_ctx_train: number;
  n_embd: number;
  /** Weights (elements of every tensor in the file). */
  n_params: number;
  /** Bytes of tensor data. */
  size: number;
  ftype: string;
}

const cache = new WeakMap<Model, Omit<ModelMeta, "n_ctx">>();

export function modelMeta(ctx: ServerContext): ModelMeta {
  const m = ctx.model;
  let meta = cache.get(m);
  if (!meta) {
    const tensors = m.file.tensors;
    let nParams = 0;
    let size = 0;
    const counts = new Map<number, number>();
    for (const t of tensors) {
      nParams += t.nElements;
      size += t.byteLength;
      counts.set(t.type, (counts.get(t.type) ?? 0) + 1);
    }
    const fileType = m.file.metadata.get("general.file_type");
    let ftype: string;
    if (typeof fileType === "number" || typeof fileType === "bigint") {
      ftype = FTYPE_NAMES[Number(fileType)] ?? "unknown, may not work";
    } else {
      let best = 0;
      let bestN = -1;
      for (const [type, n] of counts) {
        if (n > bestN) {
          best = type;
          bestN = n;
        }
      }
      const guessed = GUESS_FROM_GGML[best];
      ftype = `(guessed) ${guessed === undefined ? "unknown, may not work" : FTYPE_NAMES[guessed]}`;
    }
    meta = {
      vocab_type: m.tokenizer.type === "spm" ? 1 : 2,
      n_vocab: m.config.n_vocab,
      n_ctx_train: m.config.n_ctx_train,
      n_embd: m.config.n_embd,
      n_params: nParams,
      size,
      ftype,
    };
    cache.set(m, meta);
  }
  return { ...meta, n_ctx: ctx.scheduler.nCtx };
}
