/**
 * Vocabularies for synthetic models: a small SentencePiece-style (SPM, `tokenizer.ggml.model = llama`)
 * vocabulary built from a fixed alphabet and syllables, or the `tokenizer.*` metadata copied from a
 * vocabulary GGUF (e.g. llama.cpp's `ggml-vocab-llama-spm.gguf`).
 */
import { type GgufMetadataEntry, GgufTypes, GgufValueType, openGguf } from "@powerinfer/gguf";

/** Token types of llama.cpp's vocabularies. */
const NORMAL = 1;
const UNKNOWN = 2;
const CONTROL = 3;
const BYTE = 6;

/** The smallest synthetic vocabulary: 3 special tokens, 256 byte tokens and a few pieces. */
export const MIN_SYNTHETIC_VOCAB = 300;

/**
 * A synthetic SPM vocabulary of `size` tokens: `<unk>`, `<s>`, `</s>`, the 256 byte tokens `<0x00>`…,
 * then characters, "▁"-prefixed characters and syllables ("▁ba", "ban", …) in a fixed order with
 * decreasing scores, so SentencePiece merging and byte fallback both work.
 * @throws RangeError when size < {@link MIN_SYNTHETIC_VOCAB}
 */
export function syntheticVocab(size: number): GgufMetadataEntry[] {
  if (!Number.isInteger(size) || size < MIN_SYNTHETIC_VOCAB) {
    throw new RangeError(`vocabulary size must be an integer ≥ ${MIN_SYNTHETIC_VOCAB}, got ${size}`);
  }
  const tokens = ["<unk>", "<s>", "</s>"];
  const types = [UNKNOWN, CONTROL, CONTROL];
  for (let b = 0; b < 256; b++) {
    tokens.push(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`);
    types.push(BYTE);
  }
  const seen = new Set(tokens);
  const add = (piece: string) => {
    if (tokens.length >= size || seen.has(piece)) return;
    seen.add(piece);
    tokens.push(piece);
    types.push(NORMAL);
  };
  const chars = "etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,!?'\"-:;()";
  add("▁");
  for (const c of chars) add(`▁${c}`);
  for (const c of chars) add(c);
  const cons = "tnshrdlcmwfgypbvkjxqz";
  const vow = "eaoiu";
  outer: for (let len = 2; len <= 8; len++) {
    for (const c of cons) {
      for (const v of vow) {
        for (const tail of ["", ...cons]) {
          const syl = (c + v + tail).slice(0, len);
          add(`▁${syl}`);
          add(syl);
          add(`${syl}${v}`);
          if (tokens.length >= size) break outer;
        }
      }
    }
  }
  for (let i = 0; tokens.length < size; i++) add(`▁tok${i}`);
  const scores = Float32Array.from(tokens, (_, i) => (types[i] === NORMAL ? -i : 0));
  return [
    { key: "tokenizer.ggml.model", type: GgufTypes.string, value: "llama" },
    { key: "tokenizer.ggml.pre", type: GgufTypes.string, value: "default" },
    { key: "tokenizer.ggml.tokens", type: GgufTypes.array(GgufValueType.STRING), value: tokens },
    { key: "tokenizer.ggml.scores", type: GgufTypes.array(GgufValueType.FLOAT32), value: scores },
    { key: "tokenizer.ggml.token_type", type: GgufTypes.array(GgufValueType.INT32), value: Int32Array.from(types) },
    { key: "tokenizer.ggml.bos_token_id", type: GgufTypes.u32, value: 1 },
    { key: "tokenizer.ggml.eos_token_id", type: GgufTypes.u32, value: 2 },
    { key: "tokenizer.ggml.unknown_token_id", type: GgufTypes.u32, value: 0 },
    { key: "tokenizer.ggml.add_bos_token", type: GgufTypes.bool, value: true },
    { key: "tokenizer.ggml.add_eos_token", type: GgufTypes.bool, value: false },
  ];
}

/**
 * The `tokenizer.*` metadata of a GGUF file (a model or a vocabulary-only file), with its stored types.
 * @throws GgufError for an unreadable file; Error when it has no `tokenizer.ggml.tokens`
 */
export function vocabMetadataFromGguf(path: string): GgufMetadataEntry[] {
  const f = openGguf(path);
  const out: GgufMetadataEntry[] = [];
  for (const [key, value] of f.metadata) {
    if (!key.startsWith("tokenizer.")) continue;
    out.push({ key, type: f.metadataTypes.get(key)!, value });
  }
  if (!out.some((e) => e.key === "tokenizer.ggml.tokens")) {
    throw new Error(`${path} has no tokenizer.ggml.tokens: not a vocabulary`);
  }
  return out;
}

/** Number of tokens in vocabulary metadata. */
export function vocabSize(entries: GgufMetadataEntry[]): number {
  const t = entries.find((e) => e.key === "tokenizer.ggml.tokens");
  return (t?.value as unknown[] | undefined)?.length ?? 0;
}
