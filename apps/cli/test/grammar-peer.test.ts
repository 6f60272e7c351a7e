/**
 * Grammar-constrained greedy and seeded decoding against llama.cpp's grammar sampler (node-llama-cpp, in process) on
 * stories260K: llama.cpp's example grammars that node-llama-cpp ships (json, list, arithmetic, chess, …),
 * random grammars and a JSON-schema grammar; 32 tokens each. Greedy picks the best token the grammar
 * allows, and a seeded run draws as llama.cpp's sampler does (without the grammar first, again under it
 * when refused), so the two engines agree token for token unless their logits (~1e-3 apart after a few
 * dozen tokens) move a pick: each run must agree for its first 16 tokens; later differences are printed.
 */
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Grammar, jsonSchemaToGbnf, Model } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { randomGrammar } from "../../../packages/engine/test/grammar-fuzz.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const path = join(models, "stories260K.gguf");
const N = 32;

type Nlc = typeof import("node-llama-cpp");
let lib: Nlc | undefined;
let why = "";
try {
  lib = await import("node-llama-cpp");
} catch (e) {
  why = `node-llama-cpp is not installed (${(e as Error).message.split("\n")[0]})`;
}

/** The grammars: llama.cpp's examples as node-llama-cpp ships them, random ones, a schema's. */
function grammars(): [string, string][] {
  const out: [string, string][] = [];
  if (lib) {
    // the package folder above its entry point
    let root = dirname(createRequire(import.meta.url).resolve("node-llama-cpp"));
    while (!existsSync(join(root, "llama", "grammars")) && root !== dirname(root)) root = dirname(root);
    const dir = join(root, "llama", "grammars");
    for (const f of readdirSync(dir)
      .filter((x) => x.endsWith(".gbnf"))
      .sort()) {
      out.push([f, readFileSync(join(dir, f), "utf8")]);
    }
  }
  for (let k = 0; k < 10; k++) out.push([`random ${k}`, randomGrammar(500 + k).gbnf]);
  out.push([
    "json schema",
    jsonSchemaToGbnf({
      type: "object",
      properties: { name: { type: "string", maxLength: 10 }, n: { type: "integer", minimum: 0, maximum: 99 } },
      required: ["name", "n"],
    }),
  ]);
  return out;
}

describe.skipIf(!lib)(`grammar-constrained decoding equals llama.cpp's (node-llama-cpp) ${why}`, () => {
  let llama: Awaited<ReturnType<Nlc["getLlama"]>>;
  let theirModel: Awaited<ReturnType<typeof llama.loadModel>>;
  let ctx: Awaited<ReturnType<typeof theirModel.createContext>>;
  let seq: ReturnType<typeof ctx.getSequence> | undefined;
  let ours: Model;
  let backend: Awaited<ReturnType<typeof cpuBackend.load>>;

  beforeAll(async () => {
    llama = await lib!.getLlama({ gpu: false, build: "never", logLevel: lib!.LlamaLogLevel.error });
    theirModel = await llama.loadModel({ modelPath: path });
    ctx = await theirModel.createContext({ contextSize: 128, threads: 1 });
    backend = await cpuBackend.load({ threads: 1 });
    ours = await Model.load(path, { backend });
  }, 120_000);

  afterAll(async () => {
    ours?.dispose();
    backend?.dispose();
    await ctx?.dispose();
    await theirModel?.dispose();
    await llama?.dispose();
  });

  it.each([
    ["greedy", { temperature: 0 }],
    // llama.cpp's default chain, seed 42: its sampler draws without the grammar first and draws again
    // under the grammar when the token is refused; ours does the same (grammarFirst false)
    ["seed 42, llama.cpp's default chain", { temperature: 0.8, topK: 40, topP: 0.95, minP: 0.05, seed: 42 }],
  ])(
    "%s: the same tokens for every grammar (first 16 at least)",
    async (_, settings) => {
      seq ??= ctx.getSequence();
      const prompt = "Once upon a time";
      const tokens = ours.tokenizer.tokenize(prompt);
      let compared = 0;
      for (const [name, gbnf] of grammars()) {
        const theirGrammar = await llama.createGrammar({ grammar: gbnf });
        const state = new lib!.LlamaGrammarEvaluationState({ model: theirModel, grammar: theirGrammar });
        await seq.clearHistory();
        const theirs: number[] = [];
        for await (const t of seq.evaluate(tokens, { ...settings, grammarEvaluationState: state })) {
          if (ours.tokenizer.isEog(t)) break;
          theirs.push(t);
          if (theirs.length >= N) break;
        }
        const session = ours.createSession({ nCtx: 128 });
        const mine: number[] = [];
        for await (const t of session.generate(tokens, {
          ...settings,
          maxTokens: N,
          grammar: Grammar.fromGbnf(gbnf),
        })) {
          if (t.id >= 0) mine.push(t.id);
        }
        session.dispose();
        const same = mine.findIndex((t, i) => t !== theirs[i]);
        const agree = same < 0 ? Math.min(mine.length, theirs.length) : same;
        if (agree < Math.max(mine.length, theirs.length)) {
          console.log(
            `${name}: agree for ${agree} tokens; ours ${JSON.stringify(ours.tokenizer.detokenize(mine))}, llama.cpp ${JSON.stringify(ours.tokenizer.detokenize(theirs))}`,
          );
        }
        expect({ name, agree: Math.min(agree, 16) }).toEqual({ name, agree: Math.min(16, theirs.length, mine.length) });
        expect(mine.length === theirs.length || Math.min(mine.length, theirs.length) >= 16).toBe(true);
        compared++;
        if (process.env.GRAMMAR_PEER_VERBOSE)
          console.log(name, mine.length, theirs.length, JSON.stringify(ours.tokenizer.detokenize(mine)));
      }
      expect(compared).toBeGreaterThanOrEqual(19);
    },
    120_000,
  );
});
