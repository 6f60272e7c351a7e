/** attentionBytes and resolvePlan's attention inputs, on the shared 7M ReLU model (6 layers, n_embd 256, 4 KV heads of 32). */
import { copyFileSync, mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { attentionBytes, EngineError, Model, resolvePlan } from "@powerinfer/engine";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();

describe.skipIf(!probe.usable)("attention bytes of a layer", () => {
  it("sums the attention tensors and the KV cache for n_ctx; resolvePlan refuses bad attention inputs", async () => {
    const backend = await cpuBackend.load({ threads: 1 });
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-attn-"));
    const file = join(dir, "relu.gguf");
    copyFileSync(join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), file);
    const model = await Model.load(file, { backend });
    try {
      // F32 wq, wo 256 × 256, wk, wv 256 × 128, attn_norm and ffn_norm 256 (the norms move with the
      // attention): 788 480 bytes; KV 2 · n_ctx · 128 · sizeof
      const weights = 2 * 256 * 256 * 4 + 2 * 256 * 128 * 4 + 2 * 256 * 4;
      for (let l = 0; l < 6; l++) expect(attentionBytes(model, l, 256)).toBe(weights + 2 * 256 * 128 * 2);
      expect(attentionBytes(model, 0, 1000, "f32")).toBe(weights + 2 * 1000 * 128 * 4);
      expect(() => attentionBytes(model, 6, 256)).toThrow(/no layer 6 \(the model has 6\)/);
      expect(() => attentionBytes(model, 0, 0)).toThrow(EngineError);
      const base = { budgetBytes: 2 ** 22, backend: "cpu", noWrite: true, gpuIndexPath: join(dir, "none.gpuidx") };
      await expect(resolvePlan(model, { ...base, nGpuLayers: 2 })).rejects.toThrow(
        /nGpuLayers needs attention planned/,
      );
      await expect(resolvePlan(model, { ...base, nCtx: 256, nGpuLayers: 7 })).rejects.toThrow(/from 0 to 6/);
      await expect(resolvePlan(model, { ...base, attentionBytes: [1, 2] })).rejects.toThrow(
        /attentionBytes has 2 layers, the model 6/,
      );
    } finally {
      model.dispose();
      backend.dispose();
    }
  });
});
