/**
 * Seeded sampling against llama.cpp (node-llama-cpp, in process): seed 42, 5 prompts × 3 sampler settings,
 * 32 tokens each on stories260K.
 * - Sampler alone: llama.cpp's own logits at every step of its own seeded run, fed to our Sampler, give
 *   llama.cpp's token at every step (the chain and the draw are llama.cpp's, to the bit).
 * - Engine and sampler together: our run equals llama.cpp's in all 15 runs. Our decode steps are llama.cpp's
 *   to the bit (native-llama-cpp.test.ts); this prebuilt binary's prompt batches and some of its decode sums
 *   are ordered otherwise, so logits still differ by up to ~1e-2 late in a run: a case that parts is printed.
 */
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model, Sampler } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const path = join(models, "stories260K.gguf");
const PROMPTS = ["Once upon a time", "The little dog", "One day, a girl", "Tom and Sue", "The sun was"];
const SETTINGS = [
  { temperature: 0.8, topK: 40, topP: 0.95, minP: 0.05 }, // llama.cpp's defaults
  { temperature: 1.0, topK: 100, topP: 1, minP: 0 },
  { temperature: 1.5, topK: 10, topP: 0.9, minP: 0.1 },
];
const N = 32;

type Nlc = typeof import("node-llama-cpp");
let lib: Nlc | undefined;
let why = "";
try {
  lib = await import("node-llama-cpp");
} catch (e) {
  why = `node-llama-cpp is not installed (${(e as Error).message.split("\n")[0]})`;
}

describe.skipIf(!lib)(`seeded sampling equals llama.cpp's (node-llama-cpp) ${why}`, () => {
  let llama: Awaited<ReturnType<Nlc["getLlama"]>>;
  let theirModel: Awaited<ReturnType<typeof llama.loadModel>>;
  let ctx: Awaited<ReturnType<typeof theirModel.createContext>>;
  let ours: Model;
  let backend: Awaited<ReturnType<typeof cpuBackend.load>>;
  /** llama.cpp's seeded tokens and, for each, the logits it was drawn from */
  const runs = new Map<string, { ids: number[]; logits: Float32Array[] }>();

  beforeAll(async () => {
    llama = await lib!.getLlama({ gpu: false, build: "never", logLevel: lib!.LlamaLogLevel.error });
    theirModel = await llama.loadModel({ modelPath: path });
    ctx = await theirModel.createContext({ contextSize: 256, threads: 1 });
    backend = await cpuBackend.load({ threads: 1 });
    ours = await Model.load(path, { backend });
    const seq = ctx.getSequence();
    for (const [si, st] of SETTINGS.entries()) {
      for (const prompt of PROMPTS) {
        const tokens = ours.tokenizer.tokenize(prompt);
        await seq.clearHistory();
        const ids: number[] = [];
        for await (const t of seq.evaluate(tokens, { ...st, seed: 42 })) {
          ids.push(t);
          if (ids.length >= N) break;
        }
        // the logits behind each draw, evaluated as the run did: the prompt as one batch, then token by token
        await seq.clearHistory();
        const logits: Float32Array[] = [];
        let input = tokens;
        for (let step = 0; step < N; step++) {
          const out = await seq.controlledEvaluate(
            input.map((t, i) => (i === input.length - 1 ? [t, { generateNext: { logits: true } }] : t)) as never,
          );
          const map = (out as ({ next?: { logits?: Map<number, number> } } | undefined)[]).at(-1)!.next!.logits!;
          const l = new Float32Array(ours.config.n_vocab);
          for (const [t, v] of map) l[t] = v;
          logits.push(l);
          input = [ids[step]!];
        }
        runs.set(`${si}:${prompt}`, { ids, logits });
      }
    }
  }, 300_000);

  afterAll(async () => {
    ours?.dispose();
    backend?.dispose();
    await ctx?.dispose();
    await theirModel?.dispose();
    await llama?.dispose();
  });

  it("our sampler on llama.cpp's logits draws llama.cpp's tokens at every step (15 runs × 32)", () => {
    for (const [si, st] of SETTINGS.entries()) {
      for (const prompt of PROMPTS) {
        const run = runs.get(`${si}:${prompt}`)!;
        expect(run.ids.length).toBe(N);
        const sampler = new Sampler({ ...st, seed: 42, repeatPenalty: 1 });
        const mine = run.logits.map((l) => sampler.sample(l));
        expect(mine, `${JSON.stringify(st)} "${prompt}"`).toEqual(run.ids);
      }
    }
  });

  it("our engine with our sampler gives llama.cpp's seeded text (differences only from logit drift, late)", () => {
    let equal = 0;
    for (const [si, st] of SETTINGS.entries()) {
      for (const prompt of PROMPTS) {
        const theirs = runs.get(`${si}:${prompt}`)!.ids;
        const s = ours.createSession({ nCtx: 256 });
        const sampler = new Sampler({ ...st, seed: 42, repeatPenalty: 1 });
        let logits = s.evaluate(ours.tokenizer.tokenize(prompt));
        const mine: number[] = [];
        for (let i = 0; i < N; i++) {
          const id = sampler.sample(logits);
          mine.push(id);
          if (i < N - 1) logits = s.evaluate([id]);
        }
        s.dispose();
        const d = mine.findIndex((x, i) => x !== theirs[i]);
        if (d < 0) equal++;
        else console.warn(`${JSON.stringify(st)} "${prompt}": parts from llama.cpp at token ${d} (logit drift)`);
        expect(d < 0 || d >= 16, `${JSON.stringify(st)} "${prompt}" parts at token ${d}`).toBe(true);
      }
    }
    console.log(`seeded runs equal to llama.cpp's: ${equal}/15`);
    expect(equal).toBe(15);
  });
});
