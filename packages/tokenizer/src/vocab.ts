/**
 * The tokenizer's vocabulary as plain data, and its reading from GGUF metadata
 * (`tokenizer.ggml.*` keys) with the defaults llama.cpp's `llama_vocab::impl::load` applies.
 */

import { TokenizerError } from "./errors.js";
import { preTokenizerConfig } from "./pretokenizer.js";

/** Token types stored in `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`). */
export const TokenType = {
  Undefined: 0,
  Normal: 1,
  Unknown: 2,
  Control: 3,
  UserDefined: 4,
  Unused: 5,
  Byte: 6,
} as const;
export type TokenType = (typeof TokenType)[keyof typeof TokenType];

/**
 * Tokenizer model names (`tokenizer.ggml.model`). Only `llama` (SentencePiece with byte fallback) and
 * `gpt2` (byte-level BPE) can be tokenized; the others are recognised so errors can name them.
 */
export type TokenizerModel = "llama" | "gpt2" | "bert" | "t5" | "rwkv" | "plamo2" | "no_vocab" | (string & {});

/**
 * A vocabulary with every llama.cpp default already applied (what {@link vocabFromGguf} returns).
 * Special ids are `undefined` when the vocabulary has none.
 */
export interface TokenizerVocab {
  /** `tokenizer.ggml.model`. */
  model: TokenizerModel;
  /** `tokenizer.ggml.pre` (BPE pre-tokenizer name); absent means "default". */
  pre?: string;
  /** `tokenizer.ggml.tokens`: token texts, index = id. */
  tokens: string[];
  /** `tokenizer.ggml.scores` (SPM merge priority); all 0 when absent. */
  scores?: Float32Array;
  /** `tokenizer.ggml.token_type` ({@link TokenType}); every token is Normal when absent. */
  tokenTypes?: Int32Array;
  /** `tokenizer.ggml.merges` ("left right", rank = index); required for BPE. */
  merges?: string[];
  bosId?: number;
  eosId?: number;
  /** End-of-turn token (`tokenizer.ggml.eot_token_id`); auto-detected by text when absent. */
  eotId?: number;
  /** End-of-message token (`tokenizer.ggml.eom_token_id`); auto-detected by text when absent. */
  eomId?: number;
  unkId?: number;
  padId?: number;
  sepId?: number;
  /** Prepend BOS when tokenizing with `addSpecial` (`tokenizer.ggml.add_bos_token`). */
  addBos: boolean;
  /** Append EOS when tokenizing with `addSpecial` (`tokenizer.ggml.add_eos_token`). */
  addEos: boolean;
  /** SPM: prefix the text with a space (`tokenizer.ggml.add_space_prefix`). */
  addSpacePrefix: boolean;
  /** What reading the metadata found wrong but went on past, e.g. a special token id outside the vocabulary. */
  warnings?: string[];
}

/** The part of a GGUF file the tokenizer reads: its metadata key/value map. */
export interface GgufMetadataSource {
  readonly metadata: ReadonlyMap<string, unknown>;
}

const K = "tokenizer.ggml.";

function bad(key: string, what: string): TokenizerError {
  return new TokenizerError("INVALID_METADATA", `GGUF key ${key}: expected ${what}`);
}

function optString(md: ReadonlyMap<string, unknown>, key: string): string | undefined {
  const v = md.get(key);
  if (v === undefined) return undefined;
  if (typeof v !== "string") throw bad(key, "a string");
  return v;
}

function optInteger(md: ReadonlyMap<string, unknown>, key: string): number | undefined {
  const v = md.get(key);
  if (v === undefined) return undefined;
  if (typeof v === "bigint") return Number(v);
  if (typeof v !== "number" || !Number.isInteger(v)) throw bad(key, "an integer");
  return v;
}

function optBool(md: ReadonlyMap<string, unknown>, key: string): boolean | undefined {
  const v = md.get(key);
  if (v === undefined) return undefined;
  if (typeof v !== "boolean") throw bad(key, "a bool");
  return v;
}

function optStringArray(md: ReadonlyMap<string, unknown>, key: string): string[] | undefined {
  const v = md.get(key);
  if (v === undefined) return undefined;
  if (!Array.isArray(v) || !v.every((s) => typeof s === "string")) throw bad(key, "an array of strings");
  return v as string[];
}

function optNumberArray(md: ReadonlyMap<string, unknown>, key: string): ArrayLike<number> | undefined {
  const v = md.get(key);
  if (v === undefined) return undefined;
  if (
    ArrayBuffer.isView(v) &&
    !(v instanceof DataView) &&
    !(v instanceof BigInt64Array || v instanceof BigUint64Array)
  ) {
    return v as unknown as ArrayLike<number>;
  }
  if (Array.isArray(v) && v.every((x) => typeof x === "number")) return v as number[];
  throw bad(key, "a numeric array");
}

/** llama.cpp's per-model default special ids and flags (before GGUF keys override them). */
function modelDefaults(model: string): Omit<TokenizerVocab, "model" | "tokens"> {
  switch (model) {
    case "llama":
      return { bosId: 1, eosId: 2, unkId: 0, addBos: true, addEos: false, addSpacePrefix: true };
    case "gpt2":
      return { bosId: 11, eosId: 11, addBos: false, addEos: false, addSpacePrefix: false };
    case "bert":
      return { bosId: 101, unkId: 100, sepId: 102, padId: 0, addBos: true, addEos: false, addSpacePrefix: false };
    case "t5":
      return { eosId: 1, unkId: 2, padId: 0, addBos: false, addEos: true, addSpacePrefix: false };
    case "plamo2":
      return { bosId: 1, eosId: 2, unkId: 0, padId: 3, addBos: false, addEos: false, addSpacePrefix: false };
    default:
      return { addBos: false, addEos: false, addSpacePrefix: false };
  }
}

/**
 * Reads the tokenizer vocabulary from GGUF metadata, applying llama.cpp's defaults where keys are absent:
 * `llama` (SPM): BOS 1, EOS 2, UNK 0, add_bos true, add_space_prefix true; `gpt2` (BPE): BOS = EOS = 11,
 * add_bos false (true for the llama3/tekken/chameleon pre-tokenizers), add_space_prefix false. Special ids
 * outside the vocabulary are ignored with a warning in `warnings` (llama.cpp keeps its default, itself dropped
 * when out of range).
 *
 * @throws TokenizerError `MISSING_METADATA` without `tokenizer.ggml.model` / `tokenizer.ggml.tokens`;
 *   `INVALID_METADATA` when a key has the wrong type or an array is shorter than the token list.
 */
export function vocabFromGguf(file: GgufMetadataSource): TokenizerVocab {
  const md = file.metadata;
  const model = optString(md, `${K}model`);
  if (model === undefined) throw new TokenizerError("MISSING_METADATA", `GGUF has no ${K}model`);
  const tokens = optStringArray(md, `${K}tokens`);
  if (tokens === undefined) throw new TokenizerError("MISSING_METADATA", `GGUF has no ${K}tokens`);
  const n = tokens.length;
  const pre = optString(md, `${K}pre`);

  let scores: Float32Array | undefined;
  const rawScores = optNumberArray(md, `${K}scores`);
  if (rawScores !== undefined) {
    if (rawScores.length < n) throw bad(`${K}scores`, `at least ${n} entries, got ${rawScores.length}`);
    scores = rawScores instanceof Float32Array ? rawScores : Float32Array.from(rawScores);
  }
  let tokenTypes: Int32Array | undefined;
  const rawTypes = optNumberArray(md, `${K}token_type`);
  if (rawTypes !== undefined) {
    if (rawTypes.length < n) throw bad(`${K}token_type`, `at least ${n} entries, got ${rawTypes.length}`);
    tokenTypes = rawTypes instanceof Int32Array ? rawTypes : Int32Array.from(rawTypes);
  }
  const merges = optStringArray(md, `${K}merges`);

  const v: TokenizerVocab = { model, tokens, ...modelDefaults(model) };
  if (pre !== undefined) v.pre = pre;
  if (scores) v.scores = scores;
  if (tokenTypes) v.tokenTypes = tokenTypes;
  if (merges) v.merges = merges;

  if (model === "gpt2") {
    const pc = preTokenizerConfig(pre);
    if (pc?.addBos !== undefined) v.addBos = pc.addBos;
    if (pc?.noBos) v.bosId = undefined;
  }
  const spacePrefix = optBool(md, `${K}add_space_prefix`);
  if (spacePrefix !== undefined) v.addSpacePrefix = spacePrefix;

  const ids: [keyof TokenizerVocab & `${string}Id`, string][] = [
    ["bosId", "bos_token_id"],
    ["eosId", "eos_token_id"],
    ["eotId", "eot_token_id"],
    ["eomId", "eom_token_id"],
    ["unkId", "unknown_token_id"],
    ["sepId", "seperator_token_id"],
    ["padId", "padding_token_id"],
  ];
  const warnings: string[] = [];
  for (const [field, key] of ids) {
    const def = v[field];
    if (def !== undefined && def >= n) v[field] = undefined;
    const id = optInteger(md, K + key);
    if (id === undefined) continue;
    if (id >= 0 && id < n) v[field] = id;
    else if (id !== -1 && id !== 2 ** 32 - 1) {
      // llama.cpp warns ("bad special token") and keeps its default; -1 as a u32 or i32 is converters' "none"
      // (e.g. a llama2.c vocabulary's separator and padding), kept quiet here
      warnings.push(
        `${K}${key} is ${id}, outside the vocabulary of ${n} tokens (ids 0 to ${n - 1}): ${v[field] === undefined ? "ignored" : `using the default ${v[field]}`}, as llama.cpp does`,
      );
    }
  }
  if (warnings.length) v.warnings = warnings;
  const addBos = optBool(md, `${K}add_bos_token`);
  if (addBos !== undefined) v.addBos = addBos;
  const addEos = optBool(md, `${K}add_eos_token`);
  if (addEos !== undefined) v.addEos = addEos;
  return v;
}
