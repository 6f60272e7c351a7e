/**
 * Predictor-trainer throughput on one 7B-shaped layer (n_embd 4096, n_ff 11008), recorded in BENCHMARKS.md:
 *
 * 1. the CPU backend's `mul_mat` on the trainer's five product shapes (F32, C = A·Bᵀ through
 *    `backendMatMul`, one graph per product, as the trainer calls it), GFLOP/s;
 * 2. one training step (`batchLossAndGradients`: forward, loss, backward — 2·B·(2·r·e + 3·n_ff·r) FLOP)
 *    on the same backend, GFLOP/s and ms per 1,000 token positions;
 * 3. one epoch of `trainLayer` (steps + AdamW + the validation pass that early stopping needs) over
 *    `--positions` training positions, seconds per 1,000 positions, and what a 7B run would take.
 *
 * Usage: node dist/bench/trainer-bench.js [--rank 1024] [--batch 256] [-t 2] [--positions 2048] [-r 5] [--json]
 */
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import {
  type ActivationDataset,
  backendMatMul,
  batchLossAndGradients,
  initialTrainState,
  maskStride,
  randomPredictor,
  Rng,
  trainLayer,
} from "@powerinfer/predictor";
import { Command } from "commander";
import { int } from "../commands/common.js";

const E = 4096;
const F = 11008;

function dataset(n: number, seed: number): ActivationDataset {
  const rng = new Rng(seed);
  const inputs = new Float32Array(n * E);
  for (let i = 0; i < inputs.length; i++) inputs[i] = rng.normal();
  const s = maskStride(F);
  const masks = new Uint8Array(n * s);
  for (let t = 0; t < n; t++)
    for (let i = 0; i < F; i++) if (rng.next() < 0.1) masks[t * s + (i >> 3)]! |= 1 << (i & 7);
  return { nEmbd: E, nFf: F, nTokens: n, layers: [{ inputs, masks }] };
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

async function main(): Promise<void> {
  const o = new Command("trainer-bench")
    .option("--rank <r>", "predictor rank", int("rank", { min: 2 }), 1024)
    .option("--batch <n>", "positions per step", int("batch", { min: 1 }), 256)
    .option("-t, --threads <n>", "CPU backend threads", int("threads", { min: 1, max: 512 }), 2)
    .option("--positions <n>", "training positions of the epoch measured", int("positions", { min: 1 }), 2048)
    .option("-r, --repetitions <n>", "measured runs (median)", int("repetitions", { min: 1 }), 5)
    .option("--json", "print JSON")
    .parse()
    .opts<{ rank: number; batch: number; threads: number; positions: number; repetitions: number; json?: boolean }>();
  const r = o.rank;
  const B = o.batch;
  const backend = await cpuBackend.load({ threads: o.threads });
  const mm = backendMatMul(backend);
  const rng = new Rng(7);
  const rand = (n: number) => Float32Array.from({ length: n }, () => rng.normal());
  // the trainer's five products, as (name, M, N, K) of C[M×N] = A[M×K]·B[N×K]ᵀ
  const shapes: [string, number, number, number][] = [
    ["h = x·fc1ᵀ", B, r, E],
    ["z = h·fc2ᵀ", B, F, r],
    ["d2 = gᵀ·h", F, r, B],
    ["dh = g·fc2", B, r, F],
    ["d1 = dhᵀ·x", r, E, B],
  ];
  const gemm = shapes.map(([name, m, n, k]) => {
    const a = rand(m * k);
    const b = rand(n * k);
    const c = new Float32Array(m * n);
    mm.gemmNT(a, b, m, n, k, c); // warm-up
    const ms: number[] = [];
    for (let i = 0; i < o.repetitions; i++) {
      const t0 = performance.now();
      mm.gemmNT(a, b, m, n, k, c);
      ms.push(performance.now() - t0);
    }
    const t = median(ms);
    return { name, m, n, k, ms: t, gflops: (2 * m * n * k) / (t * 1e6) };
  });

  const data = dataset(Math.max(B, o.positions + Math.ceil(o.positions / 4)), 11);
  const p = randomPredictor(r, E, F, 3);
  const idx = Uint32Array.from({ length: B }, (_, i) => i);
  batchLossAndGradients(p, data, 0, idx, 3, mm); // warm-up
  const stepMs: number[] = [];
  for (let i = 0; i < o.repetitions; i++) {
    const t0 = performance.now();
    batchLossAndGradients(p, data, 0, idx, 3, mm);
    stepMs.push(performance.now() - t0);
  }
  const step = median(stepMs);
  const stepFlop = 2 * B * (2 * r * E + 3 * F * r);
  const productsMs = gemm.reduce((s, g) => s + g.ms, 0);

  // one epoch of trainLayer: positions [0, P) train, the next P/4 validate (as the pipeline's split)
  const P = o.positions;
  const slice = (a: number, z: number): ActivationDataset => ({
    ...data,
    nTokens: z - a,
    layers: [
      {
        inputs: data.layers[0]!.inputs.subarray(a * E, z * E),
        masks: data.layers[0]!.masks.subarray(a * maskStride(F), z * maskStride(F)),
      },
    ],
  });
  const train = slice(0, P);
  const val = slice(P, P + Math.ceil(P / 4));
  const st = initialTrainState(p);
  const t0 = performance.now();
  await trainLayer({ train, val, layer: 0, state: st, mm, options: { epochs: 1, batchSize: B } });
  const epochS = (performance.now() - t0) / 1000;
  const per1000 = (epochS / P) * 1000;
  // a 7B model: 32 layers × 100k positions × 8 epochs
  const dayEstimateH = (32 * 100 * 8 * per1000) / 3600;

  const res = {
    shape: { nEmbd: E, nFf: F, rank: r, batch: B },
    threads: o.threads,
    backend: `${backend.name} (${mm.name})`,
    gemm,
    step: {
      ms: step,
      gflops: stepFlop / (step * 1e6),
      productsShare: productsMs / step,
      msPer1000Positions: (step / B) * 1000,
    },
    epoch: { positions: P, validation: val.nTokens, seconds: epochS, secondsPer1000Positions: per1000 },
    estimate7B: { layers: 32, positions: 100_000, epochs: 8, hours: dayEstimateH },
  };
  if (o.json) {
    process.stdout.write(`${JSON.stringify(res, null, 2)}\n`);
  } else {
    const lines = [
      `predictor trainer, one 7B-shaped layer (n_embd ${E}, n_ff ${F}), rank ${r}, batch ${B}, ${o.threads} threads, ${res.backend}`,
      "",
      "| product | M × N × K | ms | GFLOP/s |",
      "| --- | --- | ---: | ---: |",
      ...gemm.map((g) => `| ${g.name} | ${g.m} × ${g.n} × ${g.k} | ${g.ms.toFixed(1)} | ${g.gflops.toFixed(1)} |`),
      "",
      `training step (forward + loss + backward, ${(stepFlop / 1e9).toFixed(1)} GFLOP): ${step.toFixed(0)} ms = ${res.step.gflops.toFixed(1)} GFLOP/s; the five products alone ${productsMs.toFixed(0)} ms (${(res.step.productsShare * 100).toFixed(0)} % of the step); ${res.step.msPer1000Positions.toFixed(0)} ms per 1,000 positions`,
      `one epoch of trainLayer over ${P} positions (+ ${val.nTokens} validation): ${epochS.toFixed(1)} s = ${per1000.toFixed(2)} s per 1,000 positions`,
      `7B estimate (32 layers × 100k positions × 8 epochs, no early stop): ${dayEstimateH.toFixed(1)} h`,
    ];
    process.stdout.write(`${lines.join("\n")}\n`);
  }
  backend.dispose();
}

main().catch((e: unknown) => {
  process.stderr.write(`trainer-bench: ${(e as Error).message}\n`);
  process.exitCode = 1;
});
