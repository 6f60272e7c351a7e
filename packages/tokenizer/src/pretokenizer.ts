/**
 * BPE pre-tokenizers: the word-splitting regexes llama.cpp applies per `tokenizer.ggml.pre`
 * (llama-vocab.cpp `llm_tokenizer_bpe`, unicode.cpp `unicode_regex_split`).
 *
 * llama.cpp applies the expressions of a pre-tokenizer one after the other; each splits every piece
 * left by the previous one into matches and the text between matches (both kept). Expressions that use
 * Unicode categories run on a "collapsed" text where every non-ASCII code point is replaced by one
 * character standing for its category (non-ASCII whitespace by \v), and `\p{X}` by that character plus
 * the ASCII members of X. We do the same, so results match llama.cpp also where its ASCII tables differ
 * from Unicode (`\p{S}` lacks `~`) and `\p{Lu}`/`\p{Ll}`/... all mean "letter". Expressions without
 * categories run on the code points with non-ASCII whitespace replaced by \v, and `\s` means ASCII
 * whitespace only (C++ std::wregex in the C locale).
 */

import { Cat, cptCategory, isWhitespaceCpt } from "./unicode.js";

/** What a pre-tokenizer name selects: its regexes and the flags llama.cpp sets with it. */
export interface PreTokenizerConfig {
  /** llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*` name, lower case. */
  readonly type: string;
  readonly regexes: readonly string[];
  /** Words that are whole tokens skip the merges (`ignore_merges`). */
  readonly ignoreMerges: boolean;
  /** Detokenize removes spaces before `?!.,` and in contractions (`clean_spaces`). */
  readonly cleanSpaces: boolean;
  /** When set, overrides the model default for `add_bos` (a GGUF `add_bos_token` key still wins). */
  readonly addBos?: boolean;
  /** The pre-tokenizer disables BOS (chatglm). */
  readonly noBos?: boolean;
}

const GPT2 = ["'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const LLAMA3 = [
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const QWEN2 = [
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const QWEN35 = [
  "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const STARCODER = ["\\p{N}", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"];
const FALCON = [
  "[\\p{P}\\$\\+<=>\\^~\\|`]+",
  "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
  "[0-9][0-9][0-9]",
];
const DEFAULT = [
  "[\\p{P}\\$\\+<=>\\^~\\|]+",
  "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
  "\\p{N}+",
  "[0-9][0-9][0-9]",
];
const DEEPSEEK_CODER = ["[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}"];
const DEEPSEEK3 = [
  "\\p{N}{1,3}",
  "[一-龥぀-ゟ゠-ヿ]+",
  "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];
const PORO = [" ?[^(\\s|.,!?…。，、।۔،)]+"];
const VIKING = [" ?[^(\\s|.,!?…。，、।۔،)]+", "\\p{N}"];
const TEKKEN = [
  "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const GPT4O = [
  "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const CHAMELEON = [
  "<sentinel:[0-9]+>",
  "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
  "([\\t\\n]|    |  )",
  "\\p{N}",
  "[\\p{P}!-/:-@\\[-`{-~]",
  "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
];

function cfg(
  type: string,
  regexes: readonly string[],
  extra: Partial<Omit<PreTokenizerConfig, "type" | "regexes">> = {},
): PreTokenizerConfig {
  return { type, regexes, ignoreMerges: false, cleanSpaces: true, ...extra };
}

const NO_CLEAN = { cleanSpaces: false } as const;

/** `tokenizer.ggml.pre` value -> configuration, following llama.cpp's `llama_vocab::impl::load`. */
const PRE_TOKENIZERS: ReadonlyMap<string, PreTokenizerConfig> = (() => {
  const m = new Map<string, PreTokenizerConfig>();
  const add = (names: string[], c: PreTokenizerConfig) => {
    for (const n of names) m.set(n, c);
  };
  add(["", "default"], cfg("default", DEFAULT));
  add(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
    cfg("llama3", LLAMA3, { ignoreMerges: true, addBos: true }),
  );
  add(["dbrx"], cfg("dbrx", LLAMA3));
  add(["smaug-bpe"], cfg("smaug", LLAMA3));
  add(["deepseek-coder"], cfg("deepseek-coder", DEEPSEEK_CODER, NO_CLEAN));
  add(["deepseek-v3"], cfg("deepseek3-llm", DEEPSEEK3, NO_CLEAN));
  add(["falcon"], cfg("falcon", FALCON));
  add(["mpt"], cfg("mpt", GPT2));
  add(["starcoder"], cfg("starcoder", STARCODER));
  add(["refact"], cfg("refact", STARCODER));
  add(["command-r"], cfg("command-r", STARCODER, NO_CLEAN));
  add(["smollm"], cfg("smollm", STARCODER, NO_CLEAN));
  add(["codeshell"], cfg("codeshell", STARCODER));
  add(["exaone"], cfg("exaone", STARCODER));
  add(["minerva-7b"], cfg("minerva", STARCODER));
  add(
    [
      "gpt-2",
      "phi-2",
      "jina-es",
      "jina-de",
      "gigachat",
      "jina-v2-es",
      "jina-v2-de",
      "a.x-4.0",
      "mellum",
      "modern-bert",
      "exaone4",
      "jina-v1-en",
      "jina-v2-code",
      "roberta-bpe",
    ],
    cfg("gpt2", GPT2),
  );
  add(["olmo"], cfg("olmo", GPT2));
  add(["jais"], cfg("jais", GPT2));
  add(["trillion"], cfg("trillion", GPT2, NO_CLEAN));
  add(["granite-docling"], cfg("granite-docling", GPT2, NO_CLEAN));
  add(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"], cfg("qwen2", QWEN2, NO_CLEAN));
  add(["megrez"], cfg("qwen2", QWEN2));
  add(["stablelm2"], cfg("stablelm2", QWEN2));
  add(["qwen35"], cfg("qwen35", QWEN35, NO_CLEAN));
  add(["poro-chat"], cfg("poro", PORO, NO_CLEAN));
  add(["bloom"], cfg("bloom", PORO));
  add(["gpt3-finnish"], cfg("gpt3-finnish", PORO));
  add(["glm4", "chatglm-bpe"], cfg("chatglm4", LLAMA3, { noBos: true }));
  add(["viking"], cfg("viking", VIKING, NO_CLEAN));
  add(["tekken"], cfg("tekken", TEKKEN, { cleanSpaces: false, ignoreMerges: true, addBos: true }));
  add(["chameleon"], cfg("chameleon", CHAMELEON, { cleanSpaces: false, addBos: true }));
  add(["gpt-4o", "llama4", "kanana2", "talkie"], cfg("gpt4o", GPT4O, NO_CLEAN));
  return m;
})();

/** The pre-tokenizer configuration for a `tokenizer.ggml.pre` value (absent = "default"), or undefined if unknown. */
export function preTokenizerConfig(pre: string | undefined): PreTokenizerConfig | undefined {
  return PRE_TOKENIZERS.get(pre ?? "");
}

/** Names of all `tokenizer.ggml.pre` values this package implements. */
export function supportedPreTokenizers(): string[] {
  return [...PRE_TOKENIZERS.keys()].filter((k) => k !== "");
}

// ---------------------------------------------------------------------------------------------------
// Regex splitting

const MARK = ["", "\uE0D0", "\uE0D1", "\uE0D2", "\uE0D3", "\uE0D4", "\uE0D5"]; // indexed by Cat
const CAT_REGEX: Record<string, { cat: Cat; ascii: string }> = {
  "\\p{N}": { cat: Cat.Number, ascii: "0-9" },
  "\\p{L}": { cat: Cat.Letter, ascii: "A-Za-z" },
  "\\p{P}": { cat: Cat.Punctuation, ascii: "!-#%-*,-/:;?@\\[-\\]_\\{\\}" },
  "\\p{M}": { cat: Cat.Mark, ascii: "" },
  "\\p{S}": { cat: Cat.Symbol, ascii: "\\$\\+<->\\^`\\|" },
  "\\p{Lu}": { cat: Cat.Letter, ascii: "A-Za-z" },
  "\\p{Ll}": { cat: Cat.Letter, ascii: "A-Za-z" },
  "\\p{Lt}": { cat: Cat.Letter, ascii: "A-Za-z" },
  "\\p{Lm}": { cat: Cat.Letter, ascii: "A-Za-z" },
  "\\p{Lo}": { cat: Cat.Letter, ascii: "A-Za-z" },
};

function usesCategories(src: string): boolean {
  return Object.keys(CAT_REGEX).some((k) => src.includes(k));
}

/** Rewrites `\p{X}` into the collapsed-text form (see the module comment). */
function collapseRegex(src: string): string {
  let out = "";
  let inside = false;
  for (let i = 0; i < src.length; i++) {
    const c = src[i];
    if (c === "[" && (i === 0 || src[i - 1] !== "\\")) {
      out += "[";
      inside = true;
      continue;
    }
    if (inside && c === "]" && src[i - 1] !== "\\") {
      out += "]";
      inside = false;
      continue;
    }
    if (c === "\\" && i + 3 < src.length && src[i + 1] === "p" && src[i + 2] === "{") {
      const close = src.indexOf("}", i + 3);
      if (close !== -1 && close <= i + 10) {
        const hit = CAT_REGEX[src.slice(i, close + 1)];
        if (hit !== undefined) {
          const body = MARK[hit.cat] + hit.ascii;
          out += inside ? body : `[${body}]`;
          i = close;
          continue;
        }
      }
    }
    out += c;
  }
  return out;
}

const ASCII_WS = "\\t\\n\\v\\f\\r ";

/** For the code point path: `\s` / `\S` mean ASCII whitespace only, like std::wregex in the C locale. */
function asciiWhitespaceRegex(src: string): string {
  let out = "";
  let inside = false;
  for (let i = 0; i < src.length; i++) {
    const c = src[i];
    if (c === "\\" && i + 1 < src.length) {
      const n = src[i + 1];
      i++;
      if (n === "s") out += inside ? ASCII_WS : `[${ASCII_WS}]`;
      else if (n === "S" && !inside) out += `[^${ASCII_WS}]`;
      else out += c + n;
      continue;
    }
    if (c === "[" && !inside) inside = true;
    else if (c === "]" && inside) inside = false;
    out += c;
  }
  return out;
}

interface CompiledRegex {
  readonly re: RegExp;
  /** Runs on the collapsed text (one UTF-16 unit per code point). */
  readonly collapsed: boolean;
}

/** A compiled pre-tokenizer: splits text into words the way llama.cpp's `unicode_regex_split` does. */
export class PreTokenizer {
  private readonly exprs: CompiledRegex[];
  private readonly needCollapse: boolean;

  constructor(regexes: readonly string[]) {
    this.exprs = regexes.map((src) =>
      usesCategories(src)
        ? { re: new RegExp(collapseRegex(src), "g"), collapsed: true }
        : { re: new RegExp(asciiWhitespaceRegex(src), "gu"), collapsed: false },
    );
    this.needCollapse = this.exprs.some((e) => e.collapsed);
  }

  /** Splits code points into words; returns the word lengths in code points (they sum to `cps.length`). */
  splitLengths(cps: readonly number[]): number[] {
    let collapsed = "";
    if (this.needCollapse) {
      const parts: string[] = new Array(cps.length);
      for (let i = 0; i < cps.length; i++) {
        const cp = cps[i];
        if (cp < 128) parts[i] = String.fromCharCode(cp);
        else if (isWhitespaceCpt(cp)) parts[i] = "\v";
        else parts[i] = MARK[cptCategory(cp)];
      }
      collapsed = parts.join("");
    }
    let wide: string[] | undefined;

    let offsets = [cps.length];
    for (const { re, collapsed: isCollapsed } of this.exprs) {
      const next: number[] = [];
      let start = 0;
      for (const len of offsets) {
        let sub: string;
        let unitToCp: Int32Array | undefined;
        if (isCollapsed) {
          sub = collapsed.slice(start, start + len);
        } else {
          if (wide === undefined) {
            wide = cps.map((cp) => (cp > 0x7f && isWhitespaceCpt(cp) ? "\v" : String.fromCodePoint(cp)));
          }
          sub = wide.slice(start, start + len).join("");
          if (sub.length !== len) {
            unitToCp = new Int32Array(sub.length + 1);
            let k = 0;
            for (let u = 0; u < sub.length; u++) {
              unitToCp[u] = k;
              const c = sub.charCodeAt(u);
              if (c >= 0xd800 && c <= 0xdbff && u + 1 < sub.length) {
                unitToCp[++u] = k;
              }
              k++;
            }
            unitToCp[sub.length] = k;
          }
        }
        let prev = 0;
        re.lastIndex = 0;
        for (const m of sub.matchAll(re)) {
          if (m[0].length === 0) continue;
          const a = unitToCp ? unitToCp[m.index] : m.index;
          const b = unitToCp ? unitToCp[m.index + m[0].length] : m.index + m[0].length;
          if (a > prev) next.push(a - prev);
          next.push(b - a);
          prev = b;
        }
        if (prev < len) next.push(len - prev);
        start += len;
      }
      offsets = next;
    }
    return offsets;
  }
}
