/**
 * A session computes its one-token steps on the previous step's graph with the new token and position
 * written in (Session.graphFor). Here every step's logits are compared, bit for bit, with those of a
 * session that builds each step's graph afresh, on the layouts whose graphs hold positions in different
 * places: llama (stories260K), OPT (learned positions: an input of position + 2), SmallThinker (NoPE and
 * sliding-window layers: attention_swa), and a PWRI file in predictor mode (sparse nodes read the step's
 * predictor logits). A rebuilt graph between steps (a prompt batch) must not disturb the reuse.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend, Graph } from "@powerinfer/core";
import { argmax, Model, type Session, type SparseMode } from "@powerinfer/engine";
import { generateSyntheticModel, generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();
const dir = mkdtempSync(join(tmpdir(), "decode-reuse-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The session's kept decode graph (private to the engine). */
const kept = (s: Session) => (s as unknown as { decodeGraph?: { graph: Graph } }).decodeGraph?.graph;
const forget = (s: Session) => {
  (s as unknown as { decodeGraph?: unknown }).decodeGraph = undefined;
};

describe.skipIf(!probe.usable)(`decode-graph reuse (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
    await generateSyntheticModel(
      join(dir, "opt.gguf"),
      { preset: "tiny", arch: "opt", dtype: "F32", vocabSize: 512, statsTokens: 0 },
      { fsync: false },
    );
    await generateSyntheticModel(
      join(dir, "relu.pwri.gguf"),
      { preset: "tiny", arch: "relu-llama", dtype: "Q4_0", vocabSize: 512, statsTokens: 64, format: "PWRI" },
      { fsync: false },
    );
    generateSyntheticMoeModel(join(dir, "smallthinker.gguf"), {
      arch: "smallthinker",
      shape: TINY_MOE_SHAPE,
      layers: 5,
      slidingWindow: 4096,
      untiedOutput: false,
      seed: 3,
      dtype: "Q8_0",
    });
  }, 120_000);
  afterAll(() => backend?.dispose());

  const cases: [string, () => string, SparseMode][] = [
    ["llama (stories260K)", () => join(models, "stories260K.gguf"), "off"],
    ["opt (learned positions)", () => join(dir, "opt.gguf"), "off"],
    ["smallthinker (NoPE + sliding-window layers)", () => join(dir, "smallthinker.gguf"), "off"],
    ["relu-llama PWRI, predictor-sparse", () => join(dir, "relu.pwri.gguf"), "predictor"],
  ];
  for (const [label, path, sparse] of cases) {
    it(`${label}: every step's logits equal a freshly built graph's`, async () => {
      const m = await Model.load(path(), { backend, sparse });
      try {
        const reuse = m.createSession({ nCtx: 64 });
        const fresh = m.createSession({ nCtx: 64 });
        const prompt = [1, 17, 200, 45];
        let a = reuse.evaluate(prompt);
        let b = fresh.evaluate(prompt);
        expect(kept(reuse)).toBeUndefined(); // a 4-token step's graph is not kept
        let graph: Graph | undefined;
        for (let step = 0; step < 24; step++) {
          expect(Array.from(a), `${label} step ${step}`).toEqual(Array.from(b));
          const next = argmax(a);
          if (step === 12) {
            // a batch step in between: the kept graph stays and is moved past it
            a = reuse.evaluate([next, 5]);
            b = fresh.evaluate([next, 5]);
            continue;
          }
          forget(fresh);
          a = reuse.evaluate([next]);
          b = fresh.evaluate([next]);
          graph ??= kept(reuse);
          expect(kept(reuse), "the first one-token graph is computed at every later step").toBe(graph);
        }
        expect(reuse.nPast).toBe(prompt.length + 25);
        reuse.dispose();
        fresh.dispose();
      } finally {
        m.dispose();
      }
    });
  }

  it("a batch of one sequence and one token (a server's lone request) computes on the session's kept graph", async () => {
    const m = await Model.load(join(models, "stories260K.gguf"), { backend });
    try {
      const reuse = m.createSession({ nCtx: 64 });
      const fresh = m.createSession({ nCtx: 64 });
      let a = m.decodeBatch([{ session: reuse, tokens: [1, 30, 41] }]).logits[0]!;
      let b = fresh.evaluate([1, 30, 41]);
      let graph: Graph | undefined;
      for (let step = 0; step < 16; step++) {
        expect(Array.from(a), `step ${step}`).toEqual(Array.from(b));
        const next = argmax(a);
        forget(fresh);
        // batch and plain steps in turn share the kept graph
        a =
          step % 2
            ? reuse.evaluate([next])
            : (await m.decodeBatchAsync([{ session: reuse, tokens: [next] }])).logits[0]!;
        b = fresh.evaluate([next]);
        graph ??= kept(reuse);
        expect(kept(reuse)).toBe(graph);
      }
      reuse.dispose();
      fresh.dispose();
    } finally {
      m.dispose();
    }
  });
});
