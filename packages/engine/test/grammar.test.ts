/**
 * GBNF grammars: parsing (errors name the problem and place), the incremental matcher (sentences,
 * prefixes, rejections — checked against an independent backtracking matcher on random grammars), the
 * JSON-schema converter, and grammar-constrained sampling (equal to sampling from fully masked logits).
 */
import { join } from "node:path";
import { openGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { Tokenizer } from "@powerinfer/tokenizer";
import {
  Grammar,
  GrammarConstraint,
  GrammarError,
  jsonSchemaToGbnf,
  parseGbnf,
  Sampler,
  type SamplerOptions,
} from "../src/index.js";
import { checkMembership, randomGrammar, randomSentence, rng } from "./grammar-fuzz.js";

const models = process.env.POWERINFER_TEST_MODELS!;

describe("GBNF parsing", () => {
  it.each([
    ["", /empty/],
    ["root ::= foo", /undefined rule "foo"/],
    ['start ::= "a"', /no "root" rule/],
    ['root ::= "a', /unterminated string literal/],
    ["root ::= [a-z", /unterminated character class/],
    ['root ::= ("a" | "b"', /expected "\)"/],
    ['root ::= "a"{3,1}', /maximum is below the minimum/],
    ['root ::= "\\q"', /unknown escape/],
    ['root ::= "\\x4"', /expected 2 hex digits/],
    ["root ::= [z-a]", /empty range/],
    ['root ::= "a"\nroot ::= "b"', /defined twice/],
    ['root = "a"', /expected "::="/],
    ['root ::= root "a" | "b"', /left recursion \(root → root\)/],
    ['root ::= x "a"\nx ::= "b"? root', /left recursion/],
    ['root ::= <think> "a"', /token references/],
    ['root ::= "a" @', /unexpected "@"/],
  ])("%j → GrammarError %s", (src, msg) => {
    expect(() => parseGbnf(src)).toThrow(GrammarError);
    expect(() => parseGbnf(src)).toThrow(msg);
  });

  it("errors give the line and column", () => {
    expect(() => parseGbnf('root ::= a\na ::= "x" ]')).toThrow(/line 2, column 11/);
  });

  it("accepts comments, multi-line alternatives, escapes and every repetition form", () => {
    const g = Grammar.fromGbnf(
      [
        "# a comment",
        "root ::= greeting (",
        '    " " name  # inside parentheses newlines are fine',
        "  )? tail",
        'greeting ::= "hi" | "he\\x6cl\\u006F"',
        "name ::= [A-Z] [a-z]{1,3}",
        'tail ::= "!"{2} "?"{,1} [0-9]{2,} "\\t"',
      ].join("\n"),
    );
    expect(g.match("hi!!12\t")).toBe("sentence");
    expect(g.match("hello Bob!!?1234\t")).toBe("sentence");
    expect(g.match("hello Bobby!!12\t")).toBe("no"); // name: at most 4 letters
    expect(g.match("hi!!1")).toBe("prefix");
    expect(g.match("hi!!?\t")).toBe("no"); // two digits at least
    expect(g.match("hi!!??12\t")).toBe("no");
  });

  it("character classes: ranges, negation, escapes, any character", () => {
    const g = Grammar.fromGbnf('root ::= [^a-c\\n\\]] [\\-x] . "é"');
    expect(g.match("d-\u{1F600}é")).toBe("sentence");
    expect(g.match("]x.é")).toBe("no");
    expect(g.match("\n-aé")).toBe("no");
    expect(g.match("zxzé")).toBe("sentence");
    expect(g.match("zyz")).toBe("no");
  });
});

describe("the incremental matcher against an independent backtracking matcher (random grammars)", () => {
  it("agrees on random sentences, their prefixes and mutations for 200 grammars", () => {
    let checked = 0;
    for (let seed = 1; seed <= 200; seed++) {
      const gg = randomGrammar(seed);
      const g = Grammar.fromGbnf(gg.gbnf);
      const r = rng(seed * 7);
      for (let k = 0; k < 6; k++) {
        const s = randomSentence(gg, seed * 100 + k);
        if (s === undefined) continue;
        const texts = [s, s.slice(0, Math.floor(r() * (s.length + 1))), `${s}x`];
        // a mutation: one character replaced
        if (s.length > 0) {
          const i = Math.floor(r() * s.length);
          texts.push(s.slice(0, i) + ["a", "1", "\n", "é", '"'][Math.floor(r() * 5)] + s.slice(i + 1));
        }
        for (const t of texts) {
          const want = checkMembership(gg, t);
          expect({ gbnf: gg.gbnf, t, got: g.match(t) }).toEqual({ gbnf: gg.gbnf, t, got: want });
          checked++;
        }
        expect(checkMembership(gg, s)).toBe("sentence");
      }
    }
    expect(checked).toBeGreaterThan(2000);
  });
});

describe("JSON schema → GBNF", () => {
  const accepts = (schema: unknown, ok: string[], bad: string[]) => {
    const g = Grammar.fromGbnf(jsonSchemaToGbnf(schema));
    for (const t of ok) expect({ t, m: g.match(t) }).toEqual({ t, m: "sentence" });
    for (const t of bad) expect({ t, m: g.match(t) }).not.toEqual({ t, m: "sentence" });
  };

  it("objects: required first, optional in order, no other properties by default", () => {
    accepts(
      {
        type: "object",
        properties: { a: { type: "integer" }, b: { type: "string" }, c: { type: "boolean" } },
        required: ["b"],
      },
      ['{"b":"x"}', '{ "b": "x", "a": 1 }', '{"b":"","a":-12,"c":true}', '{"b":"x","c":false}', '{\n  "b" : "q"\n}'],
      ['{"a":1,"b":"x"}', '{"a":1}', '{"b":"x","d":1}', '{"b":"x","c":false,"a":1}', '{"b":x}', '{"b":"x"'],
    );
  });

  it("additionalProperties true or a schema lets other keys in", () => {
    // the extra keys are never the named ones (llama.cpp's _not_strings)
    accepts(
      {
        type: "object",
        properties: { a: { type: "null" }, ab: { type: "null" }, 'q"]': { type: "null" } },
        additionalProperties: { type: "number" },
      },
      [
        '{"a":null}',
        '{"a":null,"z":1.5e3}',
        '{"z":-0.25}',
        "{}",
        '{"abc":1}',
        '{"":1}',
        '{"b":1}',
        '{"q\\"":2}',
        '{"\\n":1}',
      ],
      ['{"z":"s"}', '{"a":null,"z":true}', '{"a":1}', '{"ab":2}', '{"q\\"]":2}'],
    );
  });

  it("any JSON value and any object (the recursive primitives)", () => {
    accepts({ type: "object" }, ['{"a": [1, {"b": null}], "c": "d"}', "{}"], ["[]", '{"a"}']);
    accepts({}, ['[1, "x", {"y": true}]', "null", "-2.5"], ["nul", "[1,]"]);
  });

  it("types, enum, const, type lists, nesting", () => {
    accepts({ type: "number" }, ["0", "-1.5", "3e10", "12.0E-2"], ["01", "1.", "+1", ".5"]);
    accepts({ type: "integer" }, ["0", "-17"], ["1.0", "00"]);
    accepts({ enum: ["red", 2, null, { x: [1] }] }, ['"red"', "2", "null", '{"x":[1]}'], ['"blue"', "3"]);
    accepts({ const: "only" }, ['"only"'], ['"other"']);
    accepts({ type: ["string", "null"] }, ['"s"', "null"], ["1"]);
    accepts(
      {
        type: "object",
        properties: {
          p: { type: "object", properties: { q: { type: "array", items: { type: "boolean" } } }, required: ["q"] },
        },
        required: ["p"],
      },
      ['{"p":{"q":[]}}', '{"p":{"q":[true, false]}}'],
      ['{"p":{}}', '{"p":{"q":[1]}}'],
    );
  });

  it("integer ranges: every integer in the range and none outside (exhaustive over −1200..1200)", () => {
    const ranges: [number | undefined, number | undefined, string?][] = [
      [0, 9],
      [1, 100],
      [-5, 5],
      [-120, -7],
      [13, 987],
      [100, undefined],
      [undefined, -3],
      [-1000, 1050],
      [7, 7],
      [3.5, 9.2, "fractional bounds round inward"],
    ];
    for (const [lo, hi] of ranges) {
      const g = Grammar.fromGbnf(jsonSchemaToGbnf({ type: "integer", minimum: lo, maximum: hi }));
      for (let x = -1200; x <= 1200; x++) {
        const want = (lo === undefined || x >= lo) && (hi === undefined || x <= hi);
        expect({ lo, hi, x, ok: g.match(String(x)) === "sentence" }).toEqual({ lo, hi, x, ok: want });
      }
      expect(g.match("007")).not.toBe("sentence");
      expect(g.match("-0")).not.toBe("sentence");
    }
    const ex = Grammar.fromGbnf(jsonSchemaToGbnf({ type: "integer", exclusiveMinimum: 0, exclusiveMaximum: 10 }));
    expect([0, 1, 9, 10].map((x) => ex.match(String(x)))).toEqual(["no", "sentence", "sentence", "no"]);
    const big = Grammar.fromGbnf(jsonSchemaToGbnf({ type: "integer", minimum: 1 }));
    expect(big.match("9999999999999999")).toBe("sentence");
  });

  it("strings: escapes, minLength/maxLength in characters", () => {
    accepts({ type: "string" }, ['"a\\"b"', '"\\u00e9\\n"', '"é"'], ['"a"b"', '"\n"', '"\\x"']);
    accepts({ type: "string", minLength: 2, maxLength: 3 }, ['"ab"', '"abc"', '"é\\n"'], ['"a"', '"abcd"']);
  });

  it("arrays: minItems/maxItems, tuples (prefixItems)", () => {
    accepts(
      { type: "array", items: { type: "integer" }, minItems: 1, maxItems: 3 },
      ["[1]", "[1, 2,3]", "[ 1 ]"],
      ["[]", "[1,2,3,4]", "[1,]"],
    );
    accepts(
      { type: "array", prefixItems: [{ type: "string" }, { type: "integer" }] },
      ['["a", 1]'],
      ['["a"]', '[1, "a"]'],
    );
  });

  it("anyOf/oneOf, $ref to $defs and definitions, allOf of objects", () => {
    accepts({ anyOf: [{ type: "integer" }, { type: "boolean" }] }, ["1", "true"], ['"1"']);
    accepts(
      {
        $defs: { pt: { type: "object", properties: { x: { type: "integer" } }, required: ["x"] } },
        type: "array",
        items: { $ref: "#/$defs/pt" },
      },
      ['[{"x":1},{"x":2}]'],
      ['[{"y":1}]'],
    );
    accepts(
      {
        definitions: {
          node: {
            type: "object",
            properties: { next: { anyOf: [{ $ref: "#/definitions/node" }, { type: "null" }] } },
            required: ["next"],
          },
        },
        $ref: "#/definitions/node",
      },
      ['{"next":{"next":null}}'],
      ['{"next":{}}'],
    );
    accepts(
      {
        allOf: [
          { type: "object", properties: { a: { type: "integer" } }, required: ["a"] },
          { type: "object", properties: { b: { type: "string" } } },
        ],
      },
      ['{"a":1}', '{"a":1,"b":"x"}'],
      ['{"b":"x"}'],
    );
  });

  it.each([
    [{ type: "string", pattern: "^a+$" }, /"pattern" is not supported/],
    [{ type: "string", format: "email" }, /format "email" is not supported/],
    [{ type: "integer", minimum: 5, maximum: 2 }, /no integer lies in \[5, 2\]/],
    [{ type: "wat" }, /unknown type "wat"/],
    [{ $ref: "https://example.com/s.json" }, /only local references/],
    [{ $ref: "#/$defs/missing" }, /points to nothing/],
    [{ type: "object", properties: { a: {} }, required: ["b"] }, /required property "b"/],
    [{ type: "array", minItems: 3, maxItems: 1 }, /maxItems 1 is below minItems 3/],
    [[1, 2], /must be a JSON object/],
    [false, /matches nothing/],
  ])("%j is refused: %s", (schema, msg) => {
    expect(() => jsonSchemaToGbnf(schema)).toThrow(GrammarError);
    expect(() => jsonSchemaToGbnf(schema)).toThrow(msg);
  });
});

describe("grammar-constrained sampling on llama.cpp's SPM vocabulary (32k tokens)", () => {
  const tok = Tokenizer.fromGguf(openGguf(join(models, "vocab", "ggml-vocab-llama-spm.gguf")));
  const nv = tok.nVocab;
  const grammar = Grammar.fromGbnf(
    jsonSchemaToGbnf({
      type: "object",
      properties: { name: { type: "string", maxLength: 12 }, n: { type: "integer" }, ok: { type: "boolean" } },
      required: ["name", "n"],
    }),
  );

  it("the mask equals checking every token on its own, and every allowed token keeps the text a prefix", () => {
    const c = new GrammarConstraint(grammar, tok);
    const m = new Uint8Array(nv);
    const texts = Array.from({ length: nv }, (_, i) => (tok.isEog(i) ? "" : tok.tokenToText(i)));
    const target = '{"name": "Abé", "n":12}';
    let text = "";
    while (text.length < target.length) {
      const n = c.mask(m);
      let count = 0;
      const differ: number[] = [];
      for (let i = 0; i < nv; i++) {
        if (m[i] !== (c.allows(i) ? 1 : 0)) differ.push(i);
        count += m[i]!;
      }
      expect(differ).toEqual([]);
      expect(n).toBe(count);
      expect(count).toBeGreaterThan(0);
      // spot-check against matching the whole text
      for (let i = 0; i < nv; i += 97) {
        const t = texts[i]!;
        if (tok.isEog(i) || t.includes("\uFFFD")) continue;
        const viable = t.length > 0 && grammar.match(text + t) !== "no";
        expect({ i, t, allowed: m[i] === 1 }).toEqual({ i, t, allowed: viable });
      }
      // the longest allowed token that continues the target
      const rest = target.slice(text.length);
      let best = -1;
      for (let i = 0; i < nv; i++) {
        if (
          m[i] &&
          texts[i]!.length > 0 &&
          rest.startsWith(texts[i]!) &&
          (best < 0 || texts[i]!.length > texts[best]!.length)
        )
          best = i;
      }
      expect(best).toBeGreaterThanOrEqual(0);
      c.accept(best);
      text += texts[best]!;
    }
    expect(c.complete).toBe(true);
    expect(c.allows(tok.eosId!)).toBe(true);
    expect(JSON.parse(text)).toEqual({ name: "Abé", n: 12 });
  });

  it("byte tokens: a character split over byte tokens is allowed only where the grammar takes it", () => {
    const g = Grammar.fromGbnf('root ::= "€" [a-z]');
    const c = new GrammarConstraint(g, tok);
    const byte = (b: number) => tok.textToToken(`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`)!;
    // € = E2 82 AC
    expect(c.allows(byte(0xe2))).toBe(true);
    expect(c.allows(byte(0xe3))).toBe(false);
    expect(c.allows(byte(0x82))).toBe(false); // a stray continuation byte
    c.accept(byte(0xe2));
    expect(c.allows(byte(0x82))).toBe(true);
    expect(c.allows(byte(0x83))).toBe(false);
    c.accept(byte(0x82));
    expect(c.allows(tok.eosId!)).toBe(false);
    c.accept(byte(0xac));
    expect(c.allows(byte(0x61))).toBe(true);
  });

  /** The sampler over the logits with every disallowed token at −∞ (the definition). */
  const fullMask = (logits: Float32Array, c: GrammarConstraint) => {
    const m = new Uint8Array(nv);
    c.mask(m);
    const l = Float32Array.from(logits);
    for (let i = 0; i < nv; i++) if (!m[i]) l[i] = Number.NEGATIVE_INFINITY;
    return l;
  };

  it.each<[string, SamplerOptions]>([
    ["greedy", { temperature: 0 }],
    ["default chain", {}],
    ["top-k 3, top-p 0.5", { topK: 3, topP: 0.5 }],
    ["top-k 0", { topK: 0 }],
    ["penalties", { repeatPenalty: 1.3, presencePenalty: 0.5, frequencyPenalty: 0.2 }],
  ])("%s, grammar first: the lazy check picks what sampling the fully masked logits picks", (_, opts) => {
    const r = rng(5);
    for (let run = 0; run < 3; run++) {
      const a = new Sampler({ ...opts, seed: 100 + run, grammarFirst: true });
      const b = new Sampler({ ...opts, seed: 100 + run, grammarFirst: true });
      const c = new GrammarConstraint(grammar, tok);
      const logits = new Float32Array(nv);
      for (let step = 0; step < 30; step++) {
        for (let i = 0; i < nv; i++) logits[i] = 3 * (r() + r() + r() - 1.5);
        const want = b.sample(fullMask(logits, c));
        const got = a.sample(logits, c);
        expect(got).toBe(want);
        if (tok.isEog(got)) break;
        c.accept(got);
        a.accept(got);
        b.accept(got);
      }
    }
  });

  it("llama.cpp's default: the chain's own draw when allowed, else a second draw from the masked logits", () => {
    const r = rng(9);
    let redrawn = 0;
    let kept = 0;
    for (let run = 0; run < 3; run++) {
      const a = new Sampler({ seed: 7 + run });
      const b = new Sampler({ seed: 7 + run }); // the same draws, by hand
      const c = new GrammarConstraint(grammar, tok);
      const logits = new Float32Array(nv);
      for (let step = 0; step < 30; step++) {
        for (let i = 0; i < nv; i++) logits[i] = 3 * (r() + r() + r() - 1.5);
        const first = b.sample(logits);
        const want = c.allows(first) ? first : b.sample(fullMask(logits, c));
        if (want === first) kept++;
        else redrawn++;
        const got = a.sample(logits, c);
        expect(got).toBe(want);
        if (tok.isEog(got)) break;
        c.accept(got);
      }
    }
    expect(kept).toBeGreaterThan(0);
    expect(redrawn).toBeGreaterThan(0);
  });

  it("no allowed token: the sampler says −1", () => {
    const g = Grammar.fromGbnf('root ::= "a"');
    const c = new GrammarConstraint(g, tok);
    c.accept(tok.textToToken("a")!);
    const logits = new Float32Array(nv);
    // only end-of-generation is allowed; banning it leaves nothing
    const s = new Sampler({ temperature: 0, logitBias: new Map([[tok.eosId!, Number.NEGATIVE_INFINITY]]) });
    expect(s.sample(logits, c)).toBe(tok.eosId); // −∞ but the only allowed token (as llama.cpp: all −∞)
    const dead = Grammar.fromGbnf('root ::= "\\x00"'); // a token starting with a NUL byte is never allowed
    expect(new Sampler({ temperature: 0 }).sample(logits, new GrammarConstraint(dead, tok))).toBe(-1);
  });
});
