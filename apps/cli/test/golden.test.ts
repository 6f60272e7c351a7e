/**
 * Token-exactness against llama.cpp: for every model variant with a reference in
 * shared/models/reference, prompt ids and the 32 greedy ids equal llama.cpp's, and the first-position
 * top-10 logits are within the per-variant tolerance. A differing id is accepted only at a step whose
 * recorded margin to the runner-up is below 1e-2; the case stops being compared there (and says so).
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { Model, argmax } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type LlamaCppPeer, loadLlamaCpp } from "../src/bench/llama-cpp.js";

const models = process.env.POWERINFER_TEST_MODELS!;

interface RefCase {
  prompt: string;
  prompt_token_ids: number[];
  greedy_token_ids: number[];
  greedy_text: string;
  greedy_margin_to_runner_up: number[];
  first_position_top10: { id: number; logit: number }[];
}

/**
 * Known differences from the reference files, each one also llama.cpp's own: the references were made
 * by an AVX-512 build, and llama.cpp built for this CPU (node-llama-cpp's AVX2 binary, checked in the
 * last describe below) parts from them on the Q4_0 file at exactly these steps (recorded margins 0.023
 * and 0.011), where we follow it. Each is pinned, so that any other change fails.
 */
const KNOWN: Record<string, { logitTol?: number; divergences?: Record<string, number> }> = {
  "stories260K-Q4_0-ffn_down-F16.greedy32.json": { divergences: { "One day, a little dog": 31, "The sun was": 21 } },
};

const variants: { file: string; ref: string; tol: number }[] = [
  { file: "stories260K.gguf", ref: "stories260K.greedy32.json", tol: 1e-2 },
  { file: "stories260K-F16.gguf", ref: "stories260K-F16.greedy32.json", tol: 1e-2 },
  { file: "stories260K-BF16.gguf", ref: "stories260K-BF16.greedy32.json", tol: 5e-2 },
  { file: "stories260K-Q8_0-ffn_down-F16.gguf", ref: "stories260K-Q8_0-ffn_down-F16.greedy32.json", tol: 0.1 },
  { file: "stories260K-Q4_0-ffn_down-F16.gguf", ref: "stories260K-Q4_0-ffn_down-F16.greedy32.json", tol: 0.5 },
  { file: "stories260K.gguf", ref: "stories260K.bos-greedy200.json", tol: 1e-2 },
];

const probe = await cpuBackend.probe();

/** Greedy-decodes `n` tokens after `prompt`; returns ids and first-position logits. */
function greedy(model: Model, prompt: number[], n: number): { ids: number[]; first: Float32Array; margins: number[] } {
  const s = model.createSession({ nCtx: 256 });
  let logits = s.evaluate(prompt);
  const first = Float32Array.from(logits);
  const ids: number[] = [];
  const margins: number[] = [];
  for (let i = 0; i < n; i++) {
    const id = argmax(logits);
    const second = Math.max(...Array.from(logits).filter((_, j) => j !== id));
    margins.push(logits[id]! - second);
    ids.push(id);
    if (i < n - 1) logits = s.evaluate([id]);
  }
  s.dispose();
  return { ids, first, margins };
}

describe.skipIf(!probe.usable)(`token-exact with llama.cpp on the CPU backend (${probe.reason})`, () => {
  for (const threads of [1, 2]) {
    describe(`${threads} thread(s)`, () => {
      let backend: Backend;
      beforeAll(async () => {
        backend = await cpuBackend.load({ threads });
      });
      afterAll(() => backend?.dispose());

      for (const v of variants) {
        it(`${v.ref}`, async () => {
          const ref = JSON.parse(readFileSync(join(models, "reference", v.ref), "utf8")) as { results: RefCase[] };
          const model = await Model.load(join(models, v.file), { backend });
          try {
            for (const c of ref.results) {
              expect(model.tokenizer.tokenize(c.prompt)).toEqual(c.prompt_token_ids);
              const got = greedy(model, c.prompt_token_ids, c.greedy_token_ids.length);
              const known = KNOWN[v.ref];
              for (const t of c.first_position_top10) {
                expect(Math.abs(got.first[t.id]! - t.logit), `${c.prompt}: logit of ${t.id}`).toBeLessThanOrEqual(
                  known?.logitTol ?? v.tol,
                );
              }
              const diff = got.ids.findIndex((id, i) => id !== c.greedy_token_ids[i]);
              const knownStep = known?.divergences?.[c.prompt];
              if (knownStep !== undefined) {
                expect(diff, `known divergence of "${c.prompt}"`).toBe(knownStep);
              } else if (diff >= 0) {
                const margin = c.greedy_margin_to_runner_up[diff]!;
                // Only a near-tie may legitimately differ; stop comparing this case there.
                expect(margin, `"${c.prompt}" differs at step ${diff} (llama.cpp margin ${margin})`).toBeLessThan(1e-2);
                console.warn(
                  `"${c.prompt}" (${v.file}): near-tie at step ${diff} (margin ${margin}); compared up to it`,
                );
              } else {
                expect(model.tokenizer.detokenize(got.ids, { stripLeadingSpace: false })).toBe(c.greedy_text);
              }
            }
          } finally {
            model.dispose();
          }
        });
      }
    });
  }
});

describe.skipIf(!probe.usable)(
  "the shared ReLU model (tinystories-relu-llama-7m) against its PyTorch fp32 reference",
  () => {
    it("prompt ids and 32 greedy ids equal PyTorch's (F32 KV cache)", async () => {
      const ref = JSON.parse(
        readFileSync(join(models, "relu", "tinystories-relu-llama-7m.reference.json"), "utf8"),
      ) as { greedy: { prompt: string; prompt_ids: number[]; generated_ids: number[] }[] };
      const backend = await cpuBackend.load({ threads: 2 });
      const model = await Model.load(join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), { backend });
      try {
        expect(model.config.ffn.activation).toBe("relu");
        for (const c of ref.greedy) {
          expect(model.tokenizer.tokenize(c.prompt)).toEqual(c.prompt_ids);
          const s = model.createSession({ nCtx: 256, kvType: "f32" });
          let logits = s.evaluate(c.prompt_ids);
          const ids: number[] = [];
          for (let i = 0; i < c.generated_ids.length; i++) {
            ids.push(argmax(logits));
            logits = s.evaluate([ids[i]!]);
          }
          s.dispose();
          expect(ids, c.prompt).toEqual(c.generated_ids);
        }
      } finally {
        model.dispose();
        backend.dispose();
      }
    });
  },
);

/**
 * The same checks against llama.cpp built for this machine's CPU (the `node-llama-cpp` devDependency,
 * its prebuilt CPU binary, 1 thread, n_ctx 256, its default flash attention), which shows what llama.cpp
 * itself gives here: the greedy ids must be equal up to a step where llama.cpp's own margin to the
 * runner-up is below 1e-2, and the first-position logits within the variant's tolerance. The pinned
 * divergences from the reference files above must be llama.cpp's too.
 */
const peer = await loadLlamaCpp();
const peerReason = "unavailable" in peer ? peer.unavailable : "";
/**
 * The prebuilt binary picks its CPU variant by the host's instruction set. On an AVX-512 host its arithmetic
 * is AVX-512's, not the AVX2 arithmetic the engine follows (reference/trace/README.md: llama.cpp's own Q4_0
 * text depends on the instruction set): there a first-position logit may part by up to 3× the variant's
 * tolerance (0.021 seen on F16), the pinned divergences (where we follow llama.cpp's AVX2 build) are allowed, and llama.cpp itself
 * must give the references' text (made on an AVX-512 host).
 */
const hostAvx512 = (() => {
  try {
    return /\bavx512f\b/.test(readFileSync("/proc/cpuinfo", "utf8"));
  } catch {
    return false;
  }
})();
describe.skipIf(!probe.usable || "unavailable" in peer)(
  `agrees with llama.cpp built for this CPU ${peerReason}`,
  () => {
    const llama = peer as LlamaCppPeer;
    let backend: Backend;
    beforeAll(async () => {
      backend = await cpuBackend.load({ threads: 1 });
    });
    afterAll(async () => {
      backend?.dispose();
      await llama.dispose();
    });

    for (const v of variants.filter((x) => x.ref.endsWith("greedy32.json"))) {
      it(`${v.file}`, async () => {
        const ref = JSON.parse(readFileSync(join(models, "reference", v.ref), "utf8")) as { results: RefCase[] };
        const runner = await llama.open(join(models, v.file), { contextSize: 256, batchSize: 256, threads: 1 });
        const model = await Model.load(join(models, v.file), { backend });
        try {
          for (const c of ref.results) {
            const theirs = await runner.greedy(c.prompt_token_ids, 32);
            const ours = greedy(model, c.prompt_token_ids, 32);
            for (let i = 0; i < theirs.logits[0]!.length; i++) {
              expect(Math.abs(ours.first[i]! - theirs.logits[0]![i]!), `${c.prompt}: logit ${i}`).toBeLessThanOrEqual(
                hostAvx512 ? 3 * v.tol : v.tol,
              );
            }
            const diff = ours.ids.findIndex((id, i) => id !== theirs.ids[i]);
            const known = KNOWN[v.ref]?.divergences?.[c.prompt];
            if (diff >= 0 && hostAvx512 && diff === known) {
              console.warn(
                `"${c.prompt}" (${v.file}): parts from llama.cpp's AVX-512 build at step ${diff}, as its AVX2 build does`,
              );
            } else if (diff >= 0) {
              const l = theirs.logits[diff]!;
              const top = l[theirs.ids[diff]!]!;
              const margin = top - Math.max(...Array.from(l).filter((_, j) => j !== theirs.ids[diff]));
              expect(margin, `"${c.prompt}" differs from llama.cpp at step ${diff}`).toBeLessThan(1e-2);
              console.warn(
                `"${c.prompt}" (${v.file}): near-tie with llama.cpp here at step ${diff} (margin ${margin})`,
              );
            }
            const theirDiff = theirs.ids.findIndex((id, i) => id !== c.greedy_token_ids[i]);
            if (known !== undefined && hostAvx512) {
              expect(theirDiff, `llama.cpp's AVX-512 build gives the reference text of "${c.prompt}"`).toBe(-1);
            } else if (known !== undefined) {
              expect(theirDiff, `llama.cpp here parts from the reference of "${c.prompt}" where we do`).toBe(known);
            }
          }
        } finally {
          model.dispose();
          await runner.dispose();
        }
      });
    }
  },
);
