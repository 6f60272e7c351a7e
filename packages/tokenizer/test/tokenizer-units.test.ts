import { readFileSync } from "node:fs";
import { join } from "node:path";
import { openGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { PreTokenizer } from "../src/pretokenizer.js";
import { codePoints } from "../src/unicode.js";
import { preTokenizerConfig, Tokenizer, TokenType, type TokenizerVocab, vocabFromGguf } from "../src/index.js";

const MODELS = process.env.POWERINFER_TEST_MODELS ?? "/work/shared/models";

function words(pre: string, text: string): string[] {
  const cps = codePoints(text);
  const lengths = new PreTokenizer(preTokenizerConfig(pre)!.regexes).splitLengths(cps);
  const out: string[] = [];
  let at = 0;
  for (const n of lengths) {
    out.push(String.fromCodePoint(...cps.slice(at, at + n)));
    at += n;
  }
  expect(at).toBe(cps.length);
  return out;
}

/** Plain JS-regex version of llama.cpp's unicode_regex_split (no collapsing), as an independent oracle. */
function wordsDirect(regexes: readonly string[], text: string): string[] {
  let pieces = [text];
  for (const src of regexes) {
    const re = new RegExp(src, "gu");
    const next: string[] = [];
    for (const p of pieces) {
      let prev = 0;
      for (const m of p.matchAll(re)) {
        if (m[0].length === 0) continue;
        if (m.index > prev) next.push(p.slice(prev, m.index));
        next.push(m[0]);
        prev = m.index + m[0].length;
      }
      if (prev < p.length) next.push(p.slice(prev));
    }
    pieces = next;
  }
  return pieces;
}

describe("pre-tokenizer regexes", () => {
  const inputs = readFileSync(join(MODELS, "vocab", "ggml-vocab-gpt-2.gguf.inp"), "utf8")
    .split("\n__ggml_vocab_test__\n")
    .filter((s) => s.length > 0);

  it.each([
    "gpt-2",
    "llama-bpe",
    "falcon",
    "default",
    "qwen2",
    "starcoder",
    "tekken",
    "gpt-4o",
    "deepseek-coder",
    "poro-chat",
  ])("%s: collapsed-category splitting equals direct Unicode regex splitting on the llama.cpp test strings", (pre) => {
    const regexes = preTokenizerConfig(pre)!.regexes;
    for (const text of inputs) expect(words(pre, text)).toEqual(wordsDirect(regexes, text));
  });

  it("llama3 splits as the Llama 3 tokenizer does", () => {
    expect(words("llama-bpe", "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～")).toEqual([
      "Hello",
      ",",
      " y",
      "'all",
      "!",
      " How",
      " are",
      " you",
      " 😁",
      " ?",
      "我想在apple工作",
      "131",
      "415",
      "1",
      "天",
      "～",
    ]);
    expect(words("llama-bpe", "I'VE  done\r\n\n  it")).toEqual(["I", "'VE", " ", " done", "\r\n\n", " ", " it"]);
  });

  it("gpt2 keeps the last space of a run with the next word", () => {
    expect(words("gpt-2", "a   b\n\n c ")).toEqual(["a", "  ", " b", "\n\n", " c", " "]);
  });

  it("follows llama.cpp's tables where they differ from JavaScript's \\s", () => {
    // U+0085 is Unicode White_Space (llama.cpp) but not JS \s; U+FEFF is JS \s but not White_Space
    expect(words("gpt-2", "a\u0085\u0085b")).toEqual(["a", "\u0085", "\u0085", "b"]);
    expect(words("gpt-2", "a \uFEFFb")).toEqual(["a", " \uFEFF", "b"]);
  });
});

describe("merge order on small vocabularies", () => {
  const base = { addBos: false, addEos: false } as const;

  it("BPE merges the lowest rank first, ties to the leftmost pair", () => {
    const t = new Tokenizer({
      ...base,
      model: "gpt2",
      pre: "gpt-2",
      tokens: ["a", "b", "c", "ab", "bc", "abc", "aa", "aaa"],
      merges: ["b c", "a b", "ab c", "a a"],
      addSpacePrefix: false,
    });
    expect(t.tokenize("abc")).toEqual([0, 4]); // "b c" (rank 0) before "a b" (rank 1); "a bc" is no merge
    expect(t.tokenize("ab")).toEqual([3]);
    expect(t.tokenize("aaa")).toEqual([6, 0]); // leftmost "a a" first
  });

  it("BPE with ignore_merges (llama3) takes a whole-word token without merges", () => {
    const tokens = ["a", "b", "c", "abc"];
    const t = new Tokenizer({ ...base, model: "gpt2", pre: "llama3", tokens, merges: [], addSpacePrefix: false });
    expect(t.tokenize("abc", { addSpecial: false })).toEqual([3]);
    const g = new Tokenizer({ ...base, model: "gpt2", pre: "gpt-2", tokens, merges: [], addSpacePrefix: false });
    expect(g.tokenize("abc")).toEqual([0, 1, 2]);
  });

  it("SPM merges the highest score first, ties to the leftmost pair", () => {
    const tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "aa", "ab", "▁a"];
    const scores = Float32Array.from([0, 0, 0, -1, -1, -1, -2, -1.5, -3]);
    const tokenTypes = Int32Array.from([2, 3, 3, 1, 1, 1, 1, 1, 1]);
    const v: TokenizerVocab = { ...base, model: "llama", tokens, scores, tokenTypes, addSpacePrefix: false };
    const t = new Tokenizer({ ...v, bosId: 1, eosId: 2, unkId: 0 });
    expect(t.tokenize("aab")).toEqual([4, 7]); // "ab" (-1.5) beats "aa" (-2)
    expect(t.tokenize("aaa")).toEqual([6, 4]); // equal scores: leftmost pair first
    // no byte tokens in this vocabulary: unknown characters fall back to UNK
    expect(t.tokenize("x")).toEqual([0]);
  });

  it("user-defined tokens are split out even without parseSpecial", () => {
    const tokens = ["<unk>", "<s>", "</s>", "▁", "a", "<tool>"];
    const tokenTypes = Int32Array.from([2, 3, 3, 1, 1, TokenType.UserDefined]);
    const t = new Tokenizer({ ...base, model: "llama", tokens, tokenTypes, bosId: 1, eosId: 2, addSpacePrefix: true });
    expect(t.tokenize("a<tool>a")).toEqual([3, 4, 5, 3, 4]);
  });
});

describe("vocabFromGguf", () => {
  it("ignores out-of-range special ids (stories260K stores sep/pad = 2^32-1)", () => {
    const v = vocabFromGguf(openGguf(join(MODELS, "stories260K.gguf")));
    expect(v.model).toBe("llama");
    expect(v.tokens.length).toBe(512);
    expect([v.bosId, v.eosId, v.unkId, v.sepId, v.padId]).toEqual([1, 2, 0, undefined, undefined]);
    expect([v.addBos, v.addEos, v.addSpacePrefix]).toEqual([true, false, true]);
    // 2^32-1 is converters' "none": no warning for it
    expect(v.warnings).toBeUndefined();
  });

  it("warns of a special id outside the vocabulary, naming the key, the id and the size (llama.cpp's bad special token)", () => {
    const v = vocabFromGguf({
      metadata: new Map<string, unknown>([
        ["tokenizer.ggml.model", "llama"],
        ["tokenizer.ggml.tokens", Array.from({ length: 20 }, (_, i) => `t${i}`)],
        ["tokenizer.ggml.bos_token_id", 20],
        ["tokenizer.ggml.eos_token_id", 1000],
        ["tokenizer.ggml.eot_token_id", 25],
        ["tokenizer.ggml.padding_token_id", 2 ** 32 - 1],
      ]),
    });
    // the default stays, as in llama.cpp
    expect([v.bosId, v.eosId, v.eotId, v.padId]).toEqual([1, 2, undefined, undefined]);
    expect(v.warnings).toEqual([
      "tokenizer.ggml.bos_token_id is 20, outside the vocabulary of 20 tokens (ids 0 to 19): using the default 1, as llama.cpp does",
      "tokenizer.ggml.eos_token_id is 1000, outside the vocabulary of 20 tokens (ids 0 to 19): using the default 2, as llama.cpp does",
      "tokenizer.ggml.eot_token_id is 25, outside the vocabulary of 20 tokens (ids 0 to 19): ignored, as llama.cpp does",
    ]);
  });

  it("applies the BPE defaults and the llama3 add_bos", () => {
    const md = (extra: [string, unknown][]) => ({
      metadata: new Map<string, unknown>([
        ["tokenizer.ggml.model", "gpt2"],
        ["tokenizer.ggml.tokens", Array.from({ length: 20 }, (_, i) => `t${i}`)],
        ["tokenizer.ggml.merges", []],
        ...extra,
      ]),
    });
    const gpt2 = vocabFromGguf(md([["tokenizer.ggml.pre", "gpt-2"]]));
    expect([gpt2.bosId, gpt2.eosId, gpt2.addBos, gpt2.addSpacePrefix]).toEqual([11, 11, false, false]);
    const llama3 = vocabFromGguf(md([["tokenizer.ggml.pre", "llama-bpe"]]));
    expect(llama3.addBos).toBe(true);
    const off = vocabFromGguf(
      md([
        ["tokenizer.ggml.pre", "llama-bpe"],
        ["tokenizer.ggml.add_bos_token", false],
      ]),
    );
    expect(off.addBos).toBe(false);
    expect(() => vocabFromGguf({ metadata: new Map([["tokenizer.ggml.model", "gpt2"]]) })).toThrow(/tokens/);
    expect(() => vocabFromGguf(md([["tokenizer.ggml.bos_token_id", "x"]]))).toThrow(/integer/);
  });
});
