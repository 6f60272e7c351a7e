#!/usr/bin/env node
// Per-expert predictors against one shared predictor with the expert as input, at equal storage (the MoE
// issue's question: which recalls better for the same bytes). On a model with routed ReLU experts and a text:
// the text is split (the last --holdout of it held out), the (FFN input, firing mask) pairs routed to each
// expert collected on both parts, then
//   per-expert (gate start): what `powerinfer train-predictor` writes (rank --rank, thresholds folded),
//   per-expert (random start): the same from random weights (the shared predictor has no gate to start from),
//   shared: fc2 · ReLU(fc1 · [x; s·onehot(e)]) at the rank of equal storage (packages/predictor shared-experts.ts),
// each calibrated for --target-recall on its validation pairs, reported on the held-out pairs: recall,
// precision, predicted and true active shares, weights stored and weights a token reads; and, for a comparison
// at equal recall, the share each predicts when its threshold is set on the held-out pairs themselves for
// exactly --target-recall (an oracle threshold: what the predictor can separate, not what it would ship with).
//
// usage: node apps/cli/scripts/compare-expert-predictors.mjs -m MODEL.gguf -f TEXT [--tokens 4000]
//          [--holdout 0.2] [--rank 32] [--target-recall 0.95] [--epochs N] [-t THREADS] [--json]
// Build first (pnpm build). F32 predictors (no F16 rounding), CPU backend.
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model } from "@powerinfer/engine";
import {
  backendMatMul,
  bakeThresholds,
  collectExpertActivations,
  evaluateExpertPredictors,
  evaluateSharedExpertPredictors,
  maskStride,
  predictLogits,
  sharedExpertDataset,
  sharedRankForBytes,
  splitText,
  trainExpertPredictors,
  trainSharedExpertPredictors,
} from "@powerinfer/predictor";

const { values: o } = parseArgs({
  options: {
    model: { type: "string", short: "m" },
    file: { type: "string", short: "f" },
    tokens: { type: "string", default: "4000" },
    holdout: { type: "string", default: "0.2" },
    rank: { type: "string", default: "32" },
    "target-recall": { type: "string", default: "0.95" },
    epochs: { type: "string" },
    threads: { type: "string", short: "t", default: "2" },
    json: { type: "boolean", default: false },
  },
});
const die = (m) => {
  process.stderr.write(`compare-expert-predictors: ${m}\n`);
  process.exit(1);
};
if (!o.model || !o.file) die("give -m MODEL.gguf (routed ReLU experts) and -f TEXT");
const num = (k, min, int) => {
  const v = Number(o[k]);
  if (!(v >= min) || (int && !Number.isInteger(v)))
    die(`--${k} must be ${int ? "an integer " : ""}≥ ${min}, got ${o[k]}`);
  return v;
};
const tokens = num("tokens", 64, true);
const holdout = num("holdout", 0.01);
const rank = num("rank", 2, true);
if (rank % 2) die("--rank must be even");
const targetRecall = num("target-recall", 0.5);
const threads = num("threads", 1, true);
const epochs = o.epochs === undefined ? undefined : num("epochs", 1, true);
const log = (s) => {
  if (!o.json) process.stderr.write(`${s}\n`);
};

const backend = await cpuBackend.load({ threads });
const model = await Model.load(o.model, { backend, sparse: "off" });
try {
  const cfg = model.config;
  const moe = cfg.moe;
  if (!moe || cfg.ffn.activation !== "relu") die(`${o.model} has no routed ReLU experts`);
  const text = readFileSync(o.file, "utf8");
  const split = splitText(text, holdout);
  const ids = (s) => model.tokenizer.tokenize(s.slice(0, tokens * 64), { addSpecial: false });
  const t0 = performance.now();
  const train = await collectExpertActivations(model, ids(split.train), { maxTokens: tokens });
  const held = await collectExpertActivations(model, ids(split.heldOut), {
    maxTokens: Math.max(64, Math.round(tokens * holdout)),
  });
  log(
    `collected ${train.nTokens} training and ${held.nTokens} held-out positions in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
  );
  const mm = backendMatMul(backend);
  const E = cfg.n_embd;
  const F = moe.n_ff_exp;
  const X = moe.n_expert;
  const U = moe.n_expert_used;
  const base = { targetRecall, predictorType: "f32", ...(epochs ? { train: { epochs } } : {}) };
  const rows = [];
  // predicted share at exactly `targetRecall` on the held-out pairs: logits of every (pair, neuron) with its label
  const atRecall = (parts) => {
    const firing = [];
    let total = 0;
    for (const { z, masks, n } of parts) {
      const stride = maskStride(F);
      for (let t = 0; t < n; t++)
        for (let i = 0; i < F; i++) if ((masks[t * stride + (i >> 3)] >> (i & 7)) & 1) firing.push(z[t * F + i]);
      total += n * F;
    }
    firing.sort((a, b) => a - b);
    const thr = firing[Math.min(firing.length - 1, Math.floor((1 - targetRecall) * firing.length))];
    let sel = 0;
    for (const { z } of parts) for (let j = 0; j < z.length; j++) if (z[j] >= thr) sel++;
    return sel / total;
  };
  const mean = (rs, k) => rs.reduce((s, r) => s + r[k] * r.pairs, 0) / rs.reduce((s, r) => s + r.pairs, 0);
  const add = (variant, r, stored, read, report, seconds, predictedAtRecall) =>
    rows.push({
      predictedAtRecall,
      variant,
      rank: r,
      storedWeights: stored,
      readPerToken: read,
      recall: mean(report, "recall"),
      precision: mean(report, "precision"),
      predicted: mean(report, "predictedFraction"),
      trueActive: mean(report, "trueFraction"),
      seconds,
      layers: report,
    });
  for (const init of ["gate", "random"]) {
    const t = performance.now();
    const res = await trainExpertPredictors({ file: model.file, data: train, mm, options: { ...base, rank, init } });
    const flat = res.experts.flat();
    const baked = bakeThresholds(flat, false);
    const byLayer = res.experts.map((layer, l) => layer.map((_, e) => baked.predictors[l * X + e]));
    const report = evaluateExpertPredictors(byLayer, baked.threshold, held, mm, false);
    const parts = byLayer.flatMap((ps, l) =>
      ps.flatMap((p, e) => {
        const ds = held.experts[l][e];
        if (ds.nTokens === 0) return [];
        const L = ds.layers[0];
        return [{ z: predictLogits(p, L.inputs, ds.nTokens, mm), masks: L.masks, n: ds.nTokens }];
      }),
    );
    add(
      `per-expert (${init} start)`,
      rank,
      X * rank * (E + F),
      U * rank * (E + F),
      report,
      (performance.now() - t) / 1000,
      atRecall(parts),
    );
    log(`trained per-expert predictors (${init} start) in ${((performance.now() - t) / 1000).toFixed(1)} s`);
  }
  const rs = sharedRankForBytes(E, F, X, rank);
  const t = performance.now();
  const shared = await trainSharedExpertPredictors({ data: train, mm, options: { ...base, rank: rs } });
  const report = evaluateSharedExpertPredictors(shared.layers, held, mm, false);
  const sharedParts = shared.layers.map((p) => {
    const { ds } = sharedExpertDataset(held, p.layer, p.scale);
    const L = ds.layers[0];
    return { z: predictLogits(p.predictor, L.inputs, ds.nTokens, mm), masks: L.masks, n: ds.nTokens };
  });
  add(
    "shared (expert as input)",
    rs,
    rs * (E + X + F),
    rs * (E + X) + U * rs * F,
    report,
    (performance.now() - t) / 1000,
    atRecall(sharedParts),
  );
  log(`trained the shared predictors (rank ${rs}) in ${((performance.now() - t) / 1000).toFixed(1)} s`);
  if (o.json) {
    process.stdout.write(
      `${JSON.stringify({ model: o.model, trainingTokens: train.nTokens, heldOutTokens: held.nTokens, targetRecall, rows })}\n`,
    );
  } else {
    const pct = (x) => `${(x * 100).toFixed(1)} %`;
    process.stdout.write(
      `${o.model}: ${cfg.n_layer} layers, ${X} experts of ${F} neurons (${U} per token), n_embd ${E}; ${train.nTokens} training / ${held.nTokens} held-out positions; calibrated for recall ${targetRecall}\n` +
        `variant | rank | weights stored per layer | weights read per token per layer | held-out recall | precision | predicted | true active | predicted at held-out recall ${targetRecall}\n` +
        rows
          .map(
            (r) =>
              `${r.variant} | ${r.rank} | ${r.storedWeights.toLocaleString("en-US")} | ${r.readPerToken.toLocaleString("en-US")} | ${r.recall.toFixed(4)} | ${r.precision.toFixed(3)} | ${pct(r.predicted)} | ${pct(r.trueActive)} | ${pct(r.predictedAtRecall)}`,
          )
          .join("\n") +
        "\n",
    );
  }
} finally {
  model.dispose();
  backend.dispose();
}
