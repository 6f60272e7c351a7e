import { readFileSync } from "node:fs";
import { join } from "node:path";
import { openGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { TokenDecoder, Tokenizer, TokenizerError, tokenizerFromGguf, vocabFromGguf } from "../src/index.js";

const MODELS = process.env.POWERINFER_TEST_MODELS ?? "/work/shared/models";
const VOCAB = join(MODELS, "vocab");

/** The llama.cpp test vectors: `.inp` strings and the expected ids of `.out` (add_special=false, parse_special=false). */
function loadCases(name: string): { text: string; ids: number[] }[] {
  const inp = readFileSync(join(VOCAB, `${name}.inp`), "utf8").split("\n__ggml_vocab_test__\n");
  expect(inp.pop()).toBe("");
  const out = readFileSync(join(VOCAB, `${name}.out`), "utf8").split("\n");
  if (out[out.length - 1] === "") out.pop();
  expect(out.length).toBe(inp.length);
  return inp.map((text, i) => ({ text, ids: out[i].trim() === "" ? [] : out[i].trim().split(/\s+/).map(Number) }));
}

const load = (() => {
  const cache = new Map<string, Tokenizer>();
  return (path: string) => {
    let t = cache.get(path);
    if (t === undefined) {
      t = tokenizerFromGguf(openGguf(path));
      cache.set(path, t);
    }
    return t;
  };
})();

describe("SPM tokenizer (ggml-vocab-llama-spm)", () => {
  const cases = loadCases("ggml-vocab-llama-spm.gguf");
  const tok = () => load(join(VOCAB, "ggml-vocab-llama-spm.gguf"));

  it("reads the vocabulary with llama.cpp's defaults", () => {
    const t = tok();
    expect(t.type).toBe("spm");
    expect(t.nVocab).toBe(32000);
    expect([t.bosId, t.eosId, t.unkId]).toEqual([1, 2, 0]);
    expect(t.addBos).toBe(true);
    expect(t.addEos).toBe(false);
    expect(t.addSpacePrefix).toBe(true);
    expect(t.nlId).toBe(13);
    expect(t.isEog(2)).toBe(true);
    expect(t.isEog(1)).toBe(false);
  });

  it.each(cases.map((c, i) => [i, JSON.stringify(c.text).slice(0, 60), c] as const))("case %i %s", (_i, _label, c) => {
    expect(tok().tokenize(c.text, { addSpecial: false, parseSpecial: false })).toEqual(c.ids);
  });

  it("round-trips every test string through detokenize", () => {
    const t = tok();
    for (const c of cases) {
      expect(t.detokenize(c.ids)).toBe(c.text);
    }
  });

  it("adds BOS by default and parses control tokens only when asked", () => {
    const t = tok();
    expect(t.tokenize("")).toEqual([1]);
    expect(t.tokenize("", { addSpecial: false })).toEqual([]);
    expect(t.tokenize("Hello")).toEqual([1, 15043]);
    const parsed = t.tokenize("<s>Hello</s>", { addSpecial: false, parseSpecial: true });
    expect(parsed).toEqual([1, 15043, 2]);
    const plain = t.tokenize("<s>", { addSpecial: false });
    expect(plain).not.toContain(1);
    expect(t.detokenize(plain)).toBe("<s>");
    expect(t.detokenize(parsed, { unparseSpecial: true })).toBe("<s> Hello</s>");
    expect(t.detokenize(parsed)).toBe(" Hello");
  });

  it("falls back to byte tokens and decodes them", () => {
    const t = tok();
    // U+1F999 (llama emoji) has no token: four byte tokens <0xF0> <0x9F> <0xA6> <0x99>
    const ids = t.tokenize("🦙", { addSpecial: false });
    expect(ids.slice(-4).map((id) => t.tokenText(id))).toEqual(["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]);
    expect(Array.from(t.tokenToPiece(ids[ids.length - 4]))).toEqual([0xf0]);
    expect(t.detokenize(ids)).toBe("🦙");
  });
});

describe("BPE tokenizer (ggml-vocab-gpt-2)", () => {
  const cases = loadCases("ggml-vocab-gpt-2.gguf");
  const tok = () => load(join(VOCAB, "ggml-vocab-gpt-2.gguf"));

  it("reads the vocabulary with llama.cpp's defaults", () => {
    const t = tok();
    expect(t.type).toBe("bpe");
    expect(t.nVocab).toBe(50257);
    expect([t.bosId, t.eosId]).toEqual([50256, 50256]);
    expect(t.addBos).toBe(false);
    expect(t.addSpacePrefix).toBe(false);
    expect(t.isEog(50256)).toBe(true);
    expect(t.nlId).toBe(198);
  });

  it.each(cases.map((c, i) => [i, JSON.stringify(c.text).slice(0, 60), c] as const))("case %i %s", (_i, _label, c) => {
    expect(tok().tokenize(c.text, { addSpecial: false, parseSpecial: false })).toEqual(c.ids);
  });

  it("round-trips the test strings that llama.cpp's clean_spaces leaves intact", () => {
    const t = tok();
    let n = 0;
    for (const c of cases) {
      if (/ [?!.,']/.test(c.text)) continue; // clean_spaces removes spaces before ?!., and in ' contractions
      expect(t.detokenize(c.ids)).toBe(c.text);
      n++;
    }
    expect(n).toBeGreaterThan(35);
    // and clean_spaces itself, as llama.cpp applies it
    expect(t.detokenize(t.tokenize(" Hello, world !", { addSpecial: false }))).toBe(" Hello, world!");
    expect(t.detokenize(t.tokenize("it 's a 're", { addSpecial: false }))).toBe("it's a're");
  });

  it("matches <|endoftext|> as one token only with parseSpecial", () => {
    const t = tok();
    expect(t.tokenize("a<|endoftext|>b", { parseSpecial: true })).toEqual([64, 50256, 65]);
    expect(t.tokenize("a<|endoftext|>b")).not.toContain(50256);
    expect(t.detokenize([64, 50256, 65])).toBe("ab");
    expect(t.detokenize([64, 50256, 65], { unparseSpecial: true })).toBe("a<|endoftext|>b");
  });
});

describe("unsupported vocabularies", () => {
  it.skip("bert-bge: WordPiece (tokenizer.ggml.model = bert) is not implemented", () => {});

  it("rejects bert-bge with a TokenizerError naming the model", () => {
    const file = openGguf(join(VOCAB, "ggml-vocab-bert-bge.gguf"));
    expect(vocabFromGguf(file).model).toBe("bert");
    let err: unknown;
    try {
      tokenizerFromGguf(file);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(TokenizerError);
    expect((err as TokenizerError).code).toBe("UNSUPPORTED_MODEL");
    expect((err as TokenizerError).message).toContain("'bert' (WordPiece)");
  });

  it("rejects an unknown BPE pre-tokenizer and a BPE vocabulary without merges", () => {
    const base = { model: "gpt2", tokens: ["a", "b"], addBos: false, addEos: false, addSpacePrefix: false };
    expect(() => new Tokenizer({ ...base, pre: "nope", merges: [] })).toThrow(/pre-tokenizer 'nope'/);
    expect(() => new Tokenizer({ ...base, pre: "gpt-2" })).toThrow(TokenizerError);
  });
});

describe("stories260K (llama.cpp reference outputs)", () => {
  const ref = JSON.parse(readFileSync(join(MODELS, "reference", "stories260K.greedy32.json"), "utf8")) as {
    results: {
      prompt: string;
      prompt_token_ids: number[];
      prompt_pieces: string[];
      greedy_token_ids: number[];
      greedy_pieces: string[];
      greedy_text: string;
    }[];
  };
  const bos200 = JSON.parse(readFileSync(join(MODELS, "reference", "stories260K.bos-greedy200.json"), "utf8")) as {
    results: { greedy_token_ids: number[]; greedy_text: string }[];
  };
  const tok = () => load(join(MODELS, "stories260K.gguf"));

  it.each(ref.results.map((r) => [r.prompt, r] as const))("%s", (_p, r) => {
    const t = tok();
    expect(t.tokenize(r.prompt)).toEqual(r.prompt_token_ids);
    expect(r.prompt_token_ids.map((id) => t.tokenToText(id, { special: true }))).toEqual(r.prompt_pieces);
    expect(r.greedy_token_ids.map((id) => t.tokenToText(id))).toEqual(r.greedy_pieces);
    expect(t.detokenize(r.greedy_token_ids, { stripLeadingSpace: false })).toBe(r.greedy_text);
    // llama_detokenize of the whole sequence: BOS renders as nothing and keeps the prompt's leading space
    expect(t.detokenize([...r.prompt_token_ids, ...r.greedy_token_ids])).toBe(` ${r.prompt}${r.greedy_text}`);
    // a streaming decoder gives the same text
    const dec = new TokenDecoder(t);
    expect(r.greedy_token_ids.map((id) => dec.push(id)).join("") + dec.flush()).toBe(r.greedy_text);
  });

  it("decodes the 200-token BOS continuation (newline byte tokens included)", () => {
    const t = tok();
    const r = bos200.results[0];
    expect(t.detokenize(r.greedy_token_ids, { stripLeadingSpace: false })).toBe(r.greedy_text);
    expect(t.detokenize([1, ...r.greedy_token_ids])).toBe(r.greedy_text);
  });
});

describe("TokenDecoder", () => {
  it("holds back a multi-byte character split over byte tokens until it is complete", () => {
    const t = load(join(MODELS, "stories260K.gguf"));
    // "é" = C3 A9 and "€" = E2 82 AC as byte tokens <0xXX> (ids 3 + byte)
    const byteId = (b: number) => t.textToToken(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`)!;
    expect(byteId(0xc3)).toBe(3 + 0xc3);
    const dec = new TokenDecoder(t);
    expect(dec.push(byteId(0xc3))).toBe("");
    expect(dec.push(byteId(0xa9))).toBe("é");
    expect(dec.push(byteId(0xe2))).toBe("");
    expect(dec.push(byteId(0x82))).toBe("");
    expect(dec.push(byteId(0xac))).toBe("€");
    expect(dec.push(t.tokenize("Hi", { addSpecial: false })[0])).toBe(" H");
    // an unfinished character at the end becomes U+FFFD
    expect(dec.push(byteId(0xe2))).toBe("");
    expect(dec.flush()).toBe("\uFFFD");
    // control tokens give nothing unless asked
    expect(dec.push(1)).toBe("");
    expect(new TokenDecoder(t, { special: true }).push(1)).toBe("<s>");
  });

  it("rejects out-of-range ids", () => {
    const t = load(join(MODELS, "stories260K.gguf"));
    expect(() => t.tokenToPiece(512)).toThrow(TokenizerError);
    expect(() => t.detokenize([-1])).toThrow(/out of range/);
  });
});
