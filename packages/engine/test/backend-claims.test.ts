// Model.load checks the backend's claims against the ops and weight dtypes the model's graph needs, so a
// backend that lacks one is told so by name before anything is loaded (not mid-generation).
import { join } from "node:path";
import { createReferenceBackend } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import { Model } from "../src/index.js";

const model = join(process.env.POWERINFER_TEST_MODELS!, "stories260K.gguf");

describe("Model.load and the backend's claims", () => {
  it("names every (op, dtype) the backend does not claim", async () => {
    const backend = createReferenceBackend({
      claims: (op, dtypes) => op !== "rms_norm" && !(op === "mul_mat" && dtypes[0] === "f32"),
    });
    await expect(Model.load(model, { backend })).rejects.toMatchObject({
      code: "UNSUPPORTED_OP",
      message: expect.stringMatching(
        /^backend ts-reference does not implement rms_norm for f32, mul_mat for f32, which this llama model needs$/,
      ),
    });
    expect(backend.allocatedBytes()).toBe(0);
    backend.dispose();
  });

  it("loads when every needed pair is claimed", async () => {
    const backend = createReferenceBackend();
    const m = await Model.load(model, { backend });
    expect(m.config.arch).toBe("llama");
    m.dispose();
    backend.dispose();
  });

  it("a backend that leaves logits NaN is reported (EngineError BACKEND_FAULT), not sampled from", async () => {
    const backend = createReferenceBackend({
      ops: {
        mul_mat: (node, ctx) => ({
          value: new Float64Array(ctx.tensor(node.dst).ne.reduce((a, b) => a * b, 1)).fill(Number.NaN),
          rowsRead: 0,
        }),
      },
    });
    const m = await Model.load(model, { backend });
    const s = m.createSession({ nCtx: 32 });
    expect(() => s.evaluate([1, 2])).toThrow(
      /logit 0 of a token is NaN or was not written by backend ts-reference: the model file holds NaN or damaged weights/,
    );
    m.dispose();
    backend.dispose();
  });
});
