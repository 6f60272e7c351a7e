/**
 * Grammar-constrained sampling cost per token: the sampler's time with a grammar minus its time without,
 * on the same logits, over the 32k vocabulary of llama.cpp's `ggml-vocab-llama-spm.gguf` with a JSON
 * grammar (llama.cpp's generic JSON grammar, and a JSON-schema grammar).
 *
 * Each step's logits are Gaussian noise (σ = `--noise`) plus `--boost` on the token that continues a target
 * JSON document, so the sampled text follows realistic JSON; `--boost 0` is a model that ignores the format
 * (the best candidates are mostly refused, the full-vocabulary mask runs). Each document starts from a
 * freshly compiled grammar (its transition cache cold). Reports the median and p90 of the added time.
 *
 *   node dist/bench/grammar-bench.js [--vocab FILE] [--docs 20] [--boost 8] [--noise 2] [--json]
 */
import { join, resolve } from "node:path";
import { parseArgs } from "node:util";
import { Tokenizer } from "@powerinfer/tokenizer";
import { Grammar, GrammarConstraint, jsonSchemaToGbnf, Sampler, type SamplerOptions } from "@powerinfer/engine";
import { openGguf } from "@powerinfer/gguf";

/** Any JSON value (as llama.cpp's grammars/json.gbnf accepts), written here from the JSON spec. */
const JSON_GBNF = `
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\\"" ( [^"\\\\\\x7F\\x00-\\x1F] | "\\\\" (["\\\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\\n" [ \\t]{0,20}
`;

const SCHEMA = {
  type: "object",
  properties: {
    name: { type: "string", maxLength: 32 },
    age: { type: "integer" },
    email: { type: "string" },
    tags: { type: "array", items: { type: "string", maxLength: 16 }, maxItems: 8 },
    address: {
      type: "object",
      properties: { street: { type: "string" }, city: { type: "string" }, zip: { type: "string" } },
      required: ["city"],
    },
    role: { enum: ["admin", "user", "guest"] },
    active: { type: "boolean" },
  },
  required: ["name", "age"],
};

const DOCS = [
  {
    name: "Ada Lovelace",
    age: 36,
    email: "ada@example.org",
    tags: ["math", "engines", "poetry"],
    address: { street: "12 St James's Square", city: "London", zip: "SW1Y 4JH" },
    role: "admin",
    active: true,
  },
  { name: "Bob", age: 7, tags: [], role: "guest", active: false },
  {
    name: "Zoë Müller-Straße",
    age: 1234,
    email: "zoe@beispiel.de",
    address: { city: "Zürich" },
    role: "user",
  },
];

function gaussian(rng: () => number): number {
  const u = Math.max(rng(), 1e-12);
  return Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * rng());
}

function mulberry(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function quantile(xs: number[], q: number): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))] ?? Number.NaN;
}

interface Row {
  grammar: string;
  sampler: string;
  boost: number;
  tokens: number;
  baseMedianMs: number;
  constrainedMedianMs: number;
  addedMedianMs: number;
  addedP90Ms: number;
  /** Time inside the grammar (token checks, masks, advancing the state) per token. */
  grammarMedianMs: number;
  grammarP90Ms: number;
  fullMaskShare: number;
}

const { values: args } = parseArgs({
  options: {
    vocab: { type: "string" },
    docs: { type: "string", default: "20" },
    boost: { type: "string", default: "8,0" },
    noise: { type: "string", default: "2" },
    json: { type: "boolean", default: false },
  },
});
const models = process.env.POWERINFER_TEST_MODELS ?? resolve(process.cwd(), "../../../shared/models");
const vocabPath = args.vocab ?? join(models, "vocab", "ggml-vocab-llama-spm.gguf");
const tok = Tokenizer.fromGguf(openGguf(vocabPath));
const nv = tok.nVocab;
const nDocs = Number(args.docs);
const texts = Array.from({ length: nv }, (_, id) => tok.tokenToText(id));
/** Token ids by the first character of their text. */
const byFirst = new Map<string, number[]>();
texts.forEach((t, id) => {
  if (!t || tok.isEog(id)) return;
  const k = t[0]!;
  byFirst.set(k, [...(byFirst.get(k) ?? []), id]);
});
const noise = Number(args.noise);

const samplers: [string, SamplerOptions][] = [
  ["default (top-k 40, temp 0.8)", {}],
  ["default, grammar first", { grammarFirst: true }],
  ["greedy", { temperature: 0 }],
  ["top-k 0", { topK: 0, topP: 1, minP: 0.05 }],
  ["top-k 0, grammar first (full mask)", { topK: 0, topP: 1, minP: 0.05, grammarFirst: true }],
];
const grammars: [string, string][] = [
  ["json.gbnf", JSON_GBNF],
  ["json_schema", jsonSchemaToGbnf(SCHEMA)],
];

const rows: Row[] = [];
for (const [gname, gbnf] of grammars) {
  for (const [sname, sopts] of samplers) {
    for (const boost of args.boost!.split(",").map(Number)) {
      const added: number[] = [];
      const base: number[] = [];
      const withG: number[] = [];
      const grammarMs: number[] = [];
      let fullMasks = 0;
      let steps = 0;
      for (let d = 0; d < nDocs; d++) {
        const grammar = Grammar.fromGbnf(gbnf); // cold cache per document
        const c = new GrammarConstraint(grammar, tok);
        let maskCalls = 0;
        let inGrammar = 0;
        const counted = {
          allows: (id: number) => {
            const t = performance.now();
            const r = c.allows(id);
            inGrammar += performance.now() - t;
            return r;
          },
          mask: (out: Uint8Array) => {
            maskCalls++;
            const t = performance.now();
            const r = c.mask(out);
            inGrammar += performance.now() - t;
            return r;
          },
        };
        const rng = mulberry(1000 + d);
        const target = JSON.stringify(DOCS[d % DOCS.length], null, d % 2 ? 1 : undefined);
        const a = new Sampler({ ...sopts, seed: d });
        const b = new Sampler({ ...sopts, seed: d });
        let text = "";
        const logits = new Float32Array(nv);
        for (let step = 0; step < 200; step++) {
          for (let i = 0; i < nv; i++) logits[i] = noise * gaussian(rng);
          // boost the longest allowed token that continues the target
          if (boost > 0 && target.startsWith(text)) {
            const rest = target.slice(text.length);
            let best = -1;
            let bestLen = 0;
            for (const id of byFirst.get(rest[0] ?? "") ?? []) {
              const p = texts[id]!;
              if (p.length > bestLen && rest.startsWith(p) && c.allows(id)) {
                best = id;
                bestLen = p.length;
              }
            }
            if (rest.length === 0 && tok.eosId !== undefined) best = tok.eosId;
            if (best >= 0) logits[best] = logits[best]! + boost;
          }
          let t0 = performance.now();
          b.sample(logits);
          const t1 = performance.now() - t0;
          const before = maskCalls;
          inGrammar = 0;
          t0 = performance.now();
          const id = a.sample(logits, counted);
          const ta = performance.now();
          if (id >= 0) c.accept(id);
          inGrammar += performance.now() - ta;
          const t2 = performance.now() - t0;
          grammarMs.push(inGrammar);
          if (maskCalls > before) fullMasks++;
          steps++;
          base.push(t1);
          withG.push(t2);
          added.push(t2 - t1);
          if (id < 0 || tok.isEog(id)) break;
          text += texts[id]!;
        }
      }
      rows.push({
        grammar: gname,
        sampler: sname,
        boost,
        tokens: steps,
        baseMedianMs: quantile(base, 0.5),
        constrainedMedianMs: quantile(withG, 0.5),
        addedMedianMs: quantile(added, 0.5),
        grammarMedianMs: quantile(grammarMs, 0.5),
        grammarP90Ms: quantile(grammarMs, 0.9),
        addedP90Ms: quantile(added, 0.9),
        fullMaskShare: fullMasks / steps,
      });
    }
  }
}

if (args.json) console.log(JSON.stringify({ vocab: vocabPath, nVocab: nv, docs: nDocs, noise, rows }, null, 2));
else {
  console.log(`grammar sampling on ${vocabPath} (${nv} tokens), ${nDocs} documents per row, noise σ ${noise}`);
  console.log(
    "| grammar | sampler | boost | tokens | sampler ms (median) | with grammar | added median | added p90 | in grammar median | in grammar p90 | full masks |",
  );
  console.log("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
  for (const r of rows) {
    const f = (x: number) => x.toFixed(3);
    console.log(
      `| ${r.grammar} | ${r.sampler} | ${r.boost} | ${r.tokens} | ${f(r.baseMedianMs)} | ${f(r.constrainedMedianMs)} | ${f(r.addedMedianMs)} | ${f(r.addedP90Ms)} | ${f(r.grammarMedianMs)} | ${f(r.grammarP90Ms)} | ${(100 * r.fullMaskShare).toFixed(0)} % |`,
    );
  }
}
