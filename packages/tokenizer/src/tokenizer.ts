/**
 * The tokenizer: text <-> token ids for GGUF vocabularies, behaving like llama.cpp's `llama_vocab`
 * (llama-vocab.cpp): `llama_tokenize`, `llama_token_to_piece`, `llama_detokenize`, `llama_vocab_is_eog`.
 */

import { type BpeVocab, bpeTokenize } from "./bpe.js";
import { TokenizerError } from "./errors.js";
import { type PreTokenizerConfig, PreTokenizer, preTokenizerConfig, supportedPreTokenizers } from "./pretokenizer.js";
import { type SpmVocab, spmTokenize } from "./spm.js";
import { UNICODE_TO_BYTE, codePoints, toWellFormed, utf8Decode, utf8Encode, utf8Length } from "./unicode.js";
import { type GgufMetadataSource, TokenType, type TokenizerVocab, vocabFromGguf } from "./vocab.js";

/** Token attribute bits (llama.cpp `llama_token_attr`), derived from the token types. */
export const TokenAttr = {
  Undefined: 0,
  Unknown: 1 << 0,
  Unused: 1 << 1,
  Normal: 1 << 2,
  Control: 1 << 3,
  UserDefined: 1 << 4,
  Byte: 1 << 5,
  Normalized: 1 << 6,
  Lstrip: 1 << 7,
  Rstrip: 1 << 8,
  SingleWord: 1 << 9,
} as const;

/** Options of {@link Tokenizer.tokenize}. */
export interface TokenizeOptions {
  /** Add the model's BOS/EOS as its `add_bos_token` / `add_eos_token` say. Default true. */
  addSpecial?: boolean;
  /**
   * Recognise control tokens written in the text (e.g. `"<s>"`, `"<|eot_id|>"`) as single tokens.
   * Default false: they are tokenized as plain text. User-defined tokens are always recognised.
   */
  parseSpecial?: boolean;
}

/** Options of {@link Tokenizer.tokenToPiece}. */
export interface TokenToPieceOptions {
  /** Render control and unknown tokens (e.g. `"<s>"`); when false (default) they give no bytes. */
  special?: boolean;
  /** Remove up to this many leading spaces from the piece. Default 0. */
  lstrip?: number;
}

/** Options of {@link Tokenizer.detokenize}. */
export interface DetokenizeOptions {
  /** Drop a leading BOS and a trailing EOS when the model adds them. Default false. */
  removeSpecial?: boolean;
  /** Render control and unknown tokens as their text. Default false (they give nothing). */
  unparseSpecial?: boolean;
  /**
   * Remove the leading space of the first token's piece. Default as llama.cpp: true for vocabularies that
   * add a space prefix (SPM) unless a BOS was removed with `removeSpecial`. Pass false to get the plain
   * concatenation of the pieces (what a streaming generator prints).
   */
  stripLeadingSpace?: boolean;
}

const A = TokenAttr;
const EMPTY = new Uint8Array(0);

const EOT_TEXTS = new Set([
  "<|eot_id|>",
  "<|im_end|>",
  "<|end|>",
  "<end_of_turn>",
  "<|endoftext|>",
  "<|end_of_text|>",
  "<EOT>",
  "_<EOT>",
  "[EOT]",
  "<｜end▁of▁sentence｜>",
  "<end_of_utterance>",
]);
const EOM_TEXTS = new Set(["<|eom_id|>"]);
const FIM_EOG_TEXTS = [
  new Set(["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
  new Set(["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
  new Set(["<|file_sep|>"]),
];
const EOG_TEXTS = new Set([
  "<|eot_id|>",
  "<|im_end|>",
  "<|end|>",
  "<|return|>",
  "<|call|>",
  "<|flush|>",
  "<|calls|>",
  "<end_of_turn>",
  "<|endoftext|>",
  "</s>",
  "<|eom_id|>",
  "<EOT>",
  "_<EOT>",
  "[EOT]",
  "[EOS]",
  "<|end_of_text|>",
  "<end_of_utterance>",
  "<eos>",
  "<turn|>",
  "<|tool_response>",
  "<｜end▁of▁sentence｜>",
  "[e~[",
]);

const MODEL_NAMES: Record<string, string> = {
  bert: "WordPiece",
  t5: "Unigram",
  rwkv: "RWKV",
  plamo2: "PLaMo-2",
  gemma4: "Gemma-4 BPE",
  no_vocab: "no vocabulary",
  none: "no vocabulary",
};

function attrFromType(t: number): number {
  switch (t) {
    case TokenType.Unknown:
      return A.Unknown;
    case TokenType.Unused:
      return A.Unused;
    case TokenType.Normal:
      return A.Normal;
    case TokenType.Control:
      return A.Control;
    case TokenType.UserDefined:
      return A.UserDefined;
    case TokenType.Byte:
      return A.Byte;
    default:
      return A.Undefined;
  }
}

/** C `isspace` in the C locale. */
function isCSpace(c: number): boolean {
  return c === 0x20 || (c >= 0x09 && c <= 0x0d);
}

type Fragment = { start: number; end: number } | { id: number };

/**
 * Converts text to token ids and back for a GGUF vocabulary, matching llama.cpp exactly.
 *
 * Supported: `tokenizer.ggml.model = llama` (SentencePiece-style merges by score with byte fallback) and
 * `gpt2` (byte-level BPE with merge ranks and the pre-tokenizer regexes of `tokenizer.ggml.pre`).
 */
export class Tokenizer {
  /** The vocabulary this tokenizer was built from. */
  readonly vocab: TokenizerVocab;
  /** `spm` for `tokenizer.ggml.model = llama`, `bpe` for `gpt2`. */
  readonly type: "spm" | "bpe";
  /** Number of tokens in the vocabulary. */
  readonly nVocab: number;
  readonly bosId: number | undefined;
  readonly eosId: number | undefined;
  /** End-of-turn token (from GGUF, or found by text such as `<|eot_id|>`). */
  readonly eotId: number | undefined;
  readonly eomId: number | undefined;
  readonly unkId: number | undefined;
  readonly padId: number | undefined;
  readonly sepId: number | undefined;
  /** The newline token (SPM: `<0x0A>`; BPE: first token of "\n"), when there is one. */
  readonly nlId: number | undefined;
  readonly addBos: boolean;
  readonly addEos: boolean;
  readonly addSpacePrefix: boolean;
  /** Every token that ends generation (EOS, EOT, EOM and tokens such as `<|im_end|>`), ascending. */
  readonly eogIds: readonly number[];

  private readonly texts: string[];
  private readonly attrs: Uint16Array;
  private readonly scores: Float32Array | undefined;
  private readonly tokenToId = new Map<string, number>();
  private readonly ranks = new Map<string, number>();
  private readonly eog: Set<number>;
  private readonly specialIds: number[];
  private readonly pieces: (Uint8Array | undefined)[];
  private readonly pre: PreTokenizerConfig | undefined;
  private readonly preTokenizer: PreTokenizer | undefined;
  private readonly cleanSpaces: boolean;
  private readonly spm: SpmVocab;
  private readonly bpe: BpeVocab;

  /**
   * Builds a tokenizer from vocabulary data (see {@link vocabFromGguf} for the GGUF reading).
   *
   * @throws TokenizerError `UNSUPPORTED_MODEL` when `vocab.model` is neither `llama` nor `gpt2` (the message
   *   names the model, e.g. `bert` (WordPiece)); `UNSUPPORTED_PRE_TOKENIZER` for an unknown `pre` of a BPE
   *   vocabulary (llama.cpp refuses these too); `MISSING_METADATA` for a BPE vocabulary without merges.
   */
  constructor(vocab: TokenizerVocab) {
    this.vocab = vocab;
    if (vocab.model === "llama") {
      this.type = "spm";
    } else if (vocab.model === "gpt2") {
      this.type = "bpe";
    } else {
      const kind = MODEL_NAMES[vocab.model];
      throw new TokenizerError(
        "UNSUPPORTED_MODEL",
        `tokenizer model '${vocab.model}'${kind ? ` (${kind})` : ""} is not supported; ` +
          "supported: 'llama' (SentencePiece), 'gpt2' (byte-level BPE)",
      );
    }
    if (this.type === "bpe") {
      this.pre = preTokenizerConfig(vocab.pre);
      if (this.pre === undefined) {
        throw new TokenizerError(
          "UNSUPPORTED_PRE_TOKENIZER",
          `BPE pre-tokenizer '${vocab.pre}' is not supported; supported: ${supportedPreTokenizers().join(", ")}`,
        );
      }
      if (vocab.merges === undefined) {
        throw new TokenizerError("MISSING_METADATA", "BPE vocabulary has no tokenizer.ggml.merges");
      }
      this.preTokenizer = new PreTokenizer(this.pre.regexes);
      this.cleanSpaces = this.pre.cleanSpaces;
      vocab.merges.forEach((m, i) => {
        const sp = m.indexOf(" ", 1);
        const key = sp === -1 ? "\0" : `${m.slice(0, sp)}\0${m.slice(sp + 1)}`;
        if (!this.ranks.has(key)) this.ranks.set(key, i);
      });
    } else {
      this.cleanSpaces = false;
    }

    const n = vocab.tokens.length;
    this.nVocab = n;
    this.texts = new Array(n);
    this.attrs = new Uint16Array(n);
    this.scores = vocab.scores;
    for (let i = 0; i < n; i++) {
      let t = vocab.tokens[i];
      if (t.length === 0) t = `[EMPTY_${i}]`;
      this.texts[i] = t;
      this.tokenToId.set(t, i); // a duplicate text maps to its last id
      this.attrs[i] = vocab.tokenTypes ? attrFromType(vocab.tokenTypes[i]) : A.Normal;
    }

    const inRange = (id: number | undefined) => (id !== undefined && id >= 0 && id < n ? id : undefined);
    this.bosId = inRange(vocab.bosId);
    this.eosId = inRange(vocab.eosId);
    this.unkId = inRange(vocab.unkId);
    this.padId = inRange(vocab.padId);
    this.sepId = inRange(vocab.sepId);
    this.addBos = vocab.addBos;
    this.addEos = vocab.addEos;
    this.addSpacePrefix = vocab.addSpacePrefix;

    // end-of-generation tokens, found by text as llama.cpp does (marking them control tokens)
    const markControl = (id: number) => {
      this.attrs[id] |= A.Control;
    };
    const findByText = (set: Set<string>) => {
      for (let i = 0; i < n; i++) if (set.has(this.texts[i])) return i;
      return undefined;
    };
    let eot = inRange(vocab.eotId);
    if (eot === undefined) {
      eot = findByText(EOT_TEXTS);
      if (eot !== undefined) markControl(eot);
    }
    let eom = inRange(vocab.eomId);
    if (eom === undefined) {
      eom = findByText(EOM_TEXTS);
      if (eom !== undefined) markControl(eom);
    }
    this.eotId = eot;
    this.eomId = eom;
    const eog = new Set<number>();
    for (const set of FIM_EOG_TEXTS) {
      const id = findByText(set);
      if (id !== undefined) {
        markControl(id);
        eog.add(id);
      }
    }
    for (let i = 0; i < n; i++) {
      if (EOG_TEXTS.has(this.texts[i])) {
        eog.add(i);
        markControl(i);
      }
    }
    for (const id of [this.eosId, eot, eom]) if (id !== undefined) eog.add(id);
    this.eog = eog;
    this.eogIds = [...eog].sort((a, b) => a - b);

    // special tokens, longest first, for splitting them out of the text
    const special: { id: number; len: number }[] = [];
    for (let i = 0; i < n; i++) {
      if (this.attrs[i] & (A.Control | A.UserDefined | A.Unknown))
        special.push({ id: i, len: utf8Length(this.texts[i]) });
    }
    special.sort((a, b) => b.len - a.len || a.id - b.id);
    this.specialIds = special.map((s) => s.id);
    this.pieces = new Array(n);

    const textToToken = (t: string) => this.tokenToId.get(t);
    this.spm = {
      textToToken,
      score: (id) => (this.scores ? this.scores[id] : 0),
      byteToken: (b) => this.byteToToken(b),
    };
    this.bpe = {
      textToToken,
      mergeRank: (l, r) => this.ranks.get(`${l}\0${r}`),
      ignoreMerges: this.pre?.ignoreMerges ?? false,
    };

    let nl: number | undefined;
    if (this.type === "spm") {
      nl = this.tokenToId.get("<0x0A>") ?? this.tokenToId.get("\n");
    } else {
      nl = this.tokenize("\n", { addSpecial: false })[0];
    }
    this.nlId = nl ?? this.padId;
  }

  /**
   * Builds a tokenizer from an opened GGUF file (any object with a `metadata` map, e.g. `openGguf(path)`).
   * @throws TokenizerError as {@link vocabFromGguf} and the {@link Tokenizer} constructor do.
   */
  static fromGguf(file: GgufMetadataSource): Tokenizer {
    return new Tokenizer(vocabFromGguf(file));
  }

  /**
   * Tokenizes text like `llama_tokenize(vocab, text, addSpecial, parseSpecial)`.
   *
   * SPM: spaces become U+2581, a space is prefixed to the text and to every text part following a special
   * token (when `add_space_prefix`), BOS is prepended when `addSpecial` and the model adds BOS.
   * BPE: the text is split by the pre-tokenizer regexes, then merged by rank.
   *
   * @returns token ids (an empty text gives `[]`, or `[BOS]` with `addSpecial` on SPM).
   * @throws TokenizerError `MISSING_SPECIAL_TOKEN` when BOS/EOS must be added but the vocabulary lacks it.
   */
  tokenize(text: string, opts: TokenizeOptions = {}): number[] {
    const addSpecial = opts.addSpecial ?? true;
    const parseSpecial = opts.parseSpecial ?? false;
    const s = toWellFormed(text);
    const fragments = s.length > 0 ? this.partition(s, parseSpecial) : [];
    const out: number[] = [];

    if (addSpecial && this.addBos) out.push(this.required(this.bosId, "BOS"));
    if (this.type === "spm") {
      let prevSpecial = true;
      for (const f of fragments) {
        if ("id" in f) {
          out.push(f.id);
          prevSpecial = true;
          continue;
        }
        let t = s.slice(f.start, f.end);
        if (this.addSpacePrefix && prevSpecial) t = ` ${t}`;
        spmTokenize(this.spm, t.replaceAll(" ", "\u2581"), out);
        prevSpecial = false;
      }
    } else {
      for (const f of fragments) {
        if ("id" in f) out.push(f.id);
        else bpeTokenize(this.bpe, this.preTokenizer!, codePoints(s.slice(f.start, f.end)), out);
      }
    }
    if (addSpecial && this.addEos) out.push(this.required(this.eosId, "EOS"));
    return out;
  }

  /**
   * The bytes a token stands for, like `llama_token_to_piece`: SPM `▁` becomes a space, byte tokens
   * `<0xXX>` give that byte, BPE pieces are mapped back from the GPT-2 alphabet. A piece may be part of a
   * multi-byte UTF-8 character; use {@link TokenDecoder} to stream text.
   *
   * @returns a new array (empty for control/unknown tokens unless `special`).
   * @throws TokenizerError `INVALID_TOKEN_ID` for an id outside `[0, nVocab)`.
   */
  tokenToPiece(id: number, opts: TokenToPieceOptions = {}): Uint8Array {
    return this.piece(id, opts.special ?? false, opts.lstrip ?? 0).slice();
  }

  /** {@link tokenToPiece} decoded as UTF-8 (an incomplete character becomes U+FFFD). */
  tokenToText(id: number, opts: TokenToPieceOptions = {}): string {
    return utf8Decode(this.piece(id, opts.special ?? false, opts.lstrip ?? 0));
  }

  /**
   * Converts token ids back to text like `llama_detokenize`: the pieces concatenated, the leading space of
   * an SPM text removed (see {@link DetokenizeOptions.stripLeadingSpace}), and for BPE vocabularies with
   * `clean_spaces` the spaces before `?!.,` and in `'s`/`'m`/`'re`/`'ve` removed. Invalid UTF-8 becomes U+FFFD.
   *
   * @throws TokenizerError `INVALID_TOKEN_ID` for an id outside `[0, nVocab)`.
   */
  detokenize(ids: readonly number[], opts: DetokenizeOptions = {}): string {
    return utf8Decode(this.detokenizeBytes(ids, opts));
  }

  /** {@link detokenize} as raw bytes. */
  detokenizeBytes(ids: readonly number[], opts: DetokenizeOptions = {}): Uint8Array {
    const removeSpecial = opts.removeSpecial ?? false;
    const special = opts.unparseSpecial ?? false;
    let removeSpace = this.addSpacePrefix;
    let from = 0;
    let to = ids.length;
    if (removeSpecial && this.addBos && to > 0 && ids[0] === this.bosId) {
      removeSpace = false;
      from++;
    }
    if (removeSpecial && this.addEos && to > from && ids[to - 1] === this.eosId) to--;
    if (opts.stripLeadingSpace !== undefined) removeSpace = opts.stripLeadingSpace;

    const parts: Uint8Array[] = [];
    let total = 0;
    for (let i = from; i < to; i++) {
      const p = this.piece(ids[i], special, removeSpace ? 1 : 0);
      removeSpace = false;
      parts.push(p);
      total += p.length;
    }
    const text = new Uint8Array(total);
    let at = 0;
    for (const p of parts) {
      text.set(p, at);
      at += p.length;
    }
    return this.cleanSpaces ? cleanUpSpaces(text) : text;
  }

  /** True when the token ends generation (EOS, EOT, EOM, `<|im_end|>`-like tokens): `llama_vocab_is_eog`. */
  isEog(id: number): boolean {
    return this.eog.has(id);
  }

  /** True for control tokens (BOS, EOS, `<|...|>` markers). */
  isControl(id: number): boolean {
    return (this.attr(id) & A.Control) !== 0;
  }

  /** Token attribute bits ({@link TokenAttr}). @throws TokenizerError `INVALID_TOKEN_ID`. */
  attr(id: number): number {
    this.check(id);
    return this.attrs[id];
  }

  /** The raw vocabulary text of a token (e.g. `"▁Hello"`, `"<0x0A>"`, `"Ġworld"`). @throws TokenizerError `INVALID_TOKEN_ID`. */
  tokenText(id: number): string {
    this.check(id);
    return this.texts[id];
  }

  /** The id of the token whose vocabulary text is exactly `text`, if any. */
  textToToken(text: string): number | undefined {
    return this.tokenToId.get(text);
  }

  // -------------------------------------------------------------------------------------------------

  private check(id: number): void {
    if (!Number.isInteger(id) || id < 0 || id >= this.nVocab) {
      throw new TokenizerError("INVALID_TOKEN_ID", `token id ${id} is out of range [0, ${this.nVocab})`);
    }
  }

  private required(id: number | undefined, what: string): number {
    if (id === undefined) {
      throw new TokenizerError(
        "MISSING_SPECIAL_TOKEN",
        `the model adds ${what} but its vocabulary defines no ${what} token`,
      );
    }
    return id;
  }

  /** llama.cpp `byte_to_token` for SPM: `<0xXX>`, else the byte as a one-character token, else UNK. */
  private byteToToken(b: number): number {
    const hex = b.toString(16).toUpperCase().padStart(2, "0");
    const id = this.tokenToId.get(`<0x${hex}>`) ?? (b < 0x80 ? this.tokenToId.get(String.fromCharCode(b)) : undefined);
    if (id !== undefined) return id;
    if (this.unkId !== undefined) return this.unkId;
    throw new TokenizerError("MISSING_SPECIAL_TOKEN", `vocabulary has no byte token <0x${hex}> and no UNK token`);
  }

  /** Cached piece bytes (do not mutate), with llama.cpp's `special` and `lstrip` handling. */
  private piece(id: number, special: boolean, lstrip: number): Uint8Array {
    this.check(id);
    if (!special && this.attrs[id] & (A.Unknown | A.Control)) return EMPTY;
    let p = this.pieces[id];
    if (p === undefined) {
      p = this.computePiece(id);
      this.pieces[id] = p;
    }
    let k = 0;
    while (k < lstrip && k < p.length && p[k] === 0x20) k++;
    return k > 0 ? p.subarray(k) : p;
  }

  private computePiece(id: number): Uint8Array {
    const text = this.texts[id];
    const attr = this.attrs[id];
    if (attr & (A.Unknown | A.Control | A.UserDefined)) return utf8Encode(text);
    if (attr & A.Normal) {
      if (this.type === "spm") return utf8Encode(text.replaceAll("\u2581", " "));
      const bytes: number[] = [];
      for (const ch of text) {
        const cp = ch.codePointAt(0)!;
        const b = UNICODE_TO_BYTE.get(cp);
        if (b !== undefined) {
          bytes.push(b);
        } else {
          const u = utf8Encode(ch);
          const hex = Array.from(u, (x) => x.toString(16).padStart(2, "0")).join("");
          bytes.push(...utf8Encode(`[UNK_BYTE_0x${hex}${text}]`));
        }
      }
      return Uint8Array.from(bytes);
    }
    if (attr & A.Byte) {
      const v = Number.parseInt(text.substr(3, 2), 16);
      return Uint8Array.of(Number.isNaN(v) ? 0 : v & 0xff);
    }
    return EMPTY;
  }

  /** llama.cpp `tokenizer_st_partition`: splits special tokens out of the text, longest first. */
  private partition(text: string, parseSpecial: boolean): Fragment[] {
    let frags: Fragment[] = [{ start: 0, end: text.length }];
    for (const id of this.specialIds) {
      const attr = this.attrs[id];
      if (!parseSpecial && attr & (A.Control | A.Unknown)) continue;
      const tok = this.texts[id];
      if (!frags.some((f) => "start" in f && text.indexOf(tok, f.start) !== -1)) continue;
      const out: Fragment[] = [];
      for (const f of frags) {
        if ("id" in f) {
          out.push(f);
          continue;
        }
        let s = f.start;
        const e = f.end;
        for (;;) {
          const m = text.indexOf(tok, s);
          if (m === -1 || m + tok.length > e) {
            if (e > s) out.push({ start: s, end: e });
            break;
          }
          let le = m;
          if (attr & A.Lstrip) while (le > s && isCSpace(text.charCodeAt(le - 1))) le--;
          if (le > s) out.push({ start: s, end: le });
          out.push({ id });
          let rs = m + tok.length;
          if (rs >= e) break;
          if (attr & A.Rstrip) while (rs < e && isCSpace(text.charCodeAt(rs))) rs++;
          s = rs;
        }
      }
      frags = out;
    }
    return frags;
  }
}

/** llama.cpp `clean_spaces` post-processing of detokenized BPE text (three in-place passes). */
function cleanUpSpaces(text: Uint8Array): Uint8Array {
  const SP = 0x20;
  const Q = 0x27; // '
  let total = text.length;
  // pass 1: " ?", " !", " .", " ,"
  const total1 = total;
  total = total ? 1 : 0;
  for (let i = 1; i < total1; i++) {
    const x = text[i];
    if (text[i - 1] === SP && (x === 0x3f || x === 0x21 || x === 0x2e || x === 0x2c)) total--;
    text[total++] = x;
  }
  // pass 2: " ' " -> "'"
  const total2 = total;
  total = total ? 1 : 0;
  for (let i = 1; i < total2; i++) {
    const x = text[i];
    if (x === Q && i + 1 < total2 && text[i - 1] === SP && text[i + 1] === SP) {
      total--;
      text[++i] = 0;
    }
    text[total++] = x;
  }
  // pass 3: " 's", " 'm", " 're", " 've"
  const total3 = total;
  total = total ? 1 : 0;
  for (let i = 1; i < total3; i++) {
    const x = text[i];
    if (text[i - 1] === SP && x === Q && i + 1 < total3) {
      const x1 = text[i + 1];
      if (x1 === 0x73 || x1 === 0x6d) {
        total--;
      } else if (i + 2 < total3) {
        const x2 = text[i + 2];
        if ((x1 === 0x72 && x2 === 0x65) || (x1 === 0x76 && x2 === 0x65)) total--;
      }
    }
    text[total++] = x;
  }
  return text.subarray(0, total);
}

/**
 * Streams generated tokens as text: accumulates piece bytes and returns only complete UTF-8 characters,
 * so a character split over several byte tokens (e.g. `<0xE2>` `<0x96>` `<0x81>`) comes out whole.
 */
export class TokenDecoder {
  private decoder = new TextDecoder("utf-8", { ignoreBOM: true });

  /**
   * @param tokenizer gives the pieces.
   * @param opts.special render control tokens as text (default false, as llama.cpp's generation output).
   */
  constructor(
    private readonly tokenizer: Tokenizer,
    private readonly opts: { special?: boolean } = {},
  ) {}

  /** Adds a token; returns the text completed by it (possibly ""). @throws TokenizerError `INVALID_TOKEN_ID`. */
  push(id: number): string {
    return this.pushBytes(this.tokenizer.tokenToPiece(id, { special: this.opts.special ?? false }));
  }

  /** Adds raw bytes; returns the text they complete (possibly ""). */
  pushBytes(bytes: Uint8Array): string {
    return this.decoder.decode(bytes, { stream: true });
  }

  /** Ends the stream: returns what is left (an incomplete character becomes U+FFFD) and resets. */
  flush(): string {
    const rest = this.decoder.decode();
    this.decoder = new TextDecoder("utf-8", { ignoreBOM: true });
    return rest;
  }
}

/**
 * Loads the tokenizer of a GGUF file (any object with the `metadata` map of `openGguf(path)`).
 * @throws TokenizerError see {@link vocabFromGguf} and {@link Tokenizer}.
 */
export function tokenizerFromGguf(file: GgufMetadataSource): Tokenizer {
  return Tokenizer.fromGguf(file);
}
