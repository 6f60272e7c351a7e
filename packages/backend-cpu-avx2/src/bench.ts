/**
 * Kernel benchmark of the CPU backend (`pnpm --filter @powerinfer/backend-cpu-avx2 bench`, runs
 * dist/bench.js). Prints Markdown tables:
 * - this machine's memory read bandwidth (sum of a 512 MiB F32 array, best of 5, 1 and 2 threads);
 * - matrix × vector GB/s per weight dtype for W ne = [4096, 11008] and [11008, 4096] at 1 and 2
 *   threads (median of the runs; the caches are flushed by a 64 MiB graph on the same backend before
 *   each run so weights come from DRAM, as in a model larger than the cache), and the share of the
 *   measured bandwidth;
 * - mul_mat_sparse / axpy_sparse time at 5, 10, 25, 50 % active rows vs dense, F16 and Q4_0,
 *   W [4096, 11008] (neurons = 11008), 2 threads.
 * Options: --quick (fewer dtypes and runs), --threads a,b (default 1,2).
 */
import { type Backend, type DType, DTYPE_LAYOUT, Graph, type TensorHandle } from "@powerinfer/core";
import { cpuBackend } from "./index.js";
import { loadAddon } from "./native.js";
import { cpuModelName } from "./system.js";

const args = process.argv.slice(2);
const quick = args.includes("--quick");
const threadsArg = args[args.indexOf("--threads") + 1];
const THREADS = args.includes("--threads") && threadsArg ? threadsArg.split(",").map(Number) : [1, 2];
const RUNS = quick ? 3 : 9;
const DTYPES: DType[] = quick
  ? ["f16", "q4_0"]
  : ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"];
const SHAPES: [number, number][] = [
  [4096, 11008],
  [11008, 4096],
];

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)]!;
}

/** Valid bytes for one row of `k` elements (small values, F16 scales), repeated to `rows` rows. */
function weightBytes(dtype: DType, k: number, rows: number): Uint8Array {
  const { blockSize, typeSize } = DTYPE_LAYOUT[dtype];
  const rowBytes = (k / blockSize) * typeSize;
  const row = new Uint8Array(rowBytes);
  let s = 12345;
  for (let i = 0; i < rowBytes; i++) {
    s = (Math.imul(s, 1103515245) + 12345) >>> 0;
    row[i] = s >>> 24;
  }
  const dv = new DataView(row.buffer);
  if (dtype === "f32") for (let i = 0; i < k; i++) dv.setFloat32(4 * i, ((i % 17) - 8) / 64, true);
  else if (dtype === "f16" || dtype === "bf16")
    for (let i = 0; i < k; i++) dv.setUint16(2 * i, dtype === "f16" ? 0x2c00 : 0x3c00, true);
  else {
    // scales: 0x1c00 ≈ 0.0039 as F16, at the scale fields of each block
    for (let b = 0; b < k / blockSize; b++) {
      const o = b * typeSize;
      if (dtype === "q6_K") dv.setUint16(o + 208, 0x1c00, true);
      else dv.setUint16(o, 0x1c00, true);
      if (dtype === "q4_1" || dtype === "q5_1" || dtype === "q4_K" || dtype === "q5_K")
        dv.setUint16(o + 2, 0x1c00, true);
    }
  }
  const out = new Uint8Array(rowBytes * rows);
  for (let r = 0; r < rows; r++) out.set(row, r * rowBytes);
  return out;
}

/** 64 MiB (twice a 32 MiB last-level cache), streamed through the backend's own threads. */
const FLUSH = new Float32Array((64 * 1024 * 1024) / 4);

/**
 * Evicts the weights from the caches with a graph on the same backend (scale over 64 MiB), so the
 * backend's worker threads stay awake as they do between the graphs of a decode step.
 */
function flushCaches(b: Backend): void {
  const g = new Graph();
  g.scale(g.input("f32", [FLUSH.length], FLUSH), 1);
  b.compute(g);
}

/** Median and best (min) wall time of `runs` computes of the graph, caches flushed before each. */
function timeGraph(b: Backend, make: () => Graph, runs: number): { median: number; best: number } {
  const times: number[] = [];
  b.compute(make()); // warm-up (page faults, arena)
  for (let i = 0; i < runs; i++) {
    const g = make();
    flushCaches(b);
    times.push(b.compute(g).elapsedMs);
  }
  return { median: median(times), best: Math.min(...times) };
}

async function main(): Promise<void> {
  const probe = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;
  const { addon, error } = loadAddon();
  if (!probe.usable || !addon) {
    console.log(`CPU backend unavailable: ${error ?? probe.reason}`);
    return;
  }
  console.log(`# CPU backend kernels\n`);
  console.log(
    `Machine: ${cpuModelName()}, ${(await import("node:os")).availableParallelism()} logical CPUs; kernels: ${probe.reason}\n`,
  );

  const bw = new Map<number, number>();
  console.log("## Memory read bandwidth (sum of a 512 MiB F32 array, best of 5)\n");
  console.log("| threads | GB/s |\n| ---: | ---: |");
  for (const t of THREADS) {
    const v = addon.benchReadBandwidth(512 * 1024 * 1024, t, 5) / 1e9;
    bw.set(t, v);
    console.log(`| ${t} | ${v.toFixed(1)} |`);
  }

  console.log(
    `\n## Matrix × vector (T = 1), median of ${RUNS} runs, caches flushed before each run by a 64 MiB graph\n`,
  );
  console.log(
    "GB/s = weight bytes / time: median (best) of the runs; % of BW = median GB/s / the bandwidth measured above at that thread count.\n",
  );
  console.log(`| dtype | W ne | MiB | ${THREADS.map((t) => `${t}T ms | ${t}T GB/s | ${t}T % of BW`).join(" | ")} |`);
  console.log(`| --- | --- | ---: | ${THREADS.map(() => "---: | ---: | ---:").join(" | ")} |`);
  const backends = new Map<number, Backend>();
  for (const t of THREADS) backends.set(t, await cpuBackend.load({ threads: t }));
  for (const dtype of DTYPES) {
    for (const [k, n] of SHAPES) {
      const bytes = weightBytes(dtype, k, n);
      const cells: string[] = [];
      for (const t of THREADS) {
        const b = backends.get(t)!;
        const w = b.createTensor(dtype, [k, n], bytes);
        const x = new Float32Array(k).map((_, i) => Math.sin(i));
        const tm = timeGraph(
          b,
          () => {
            const g = new Graph();
            g.output(g.mulMat(g.handle(w), g.input("f32", [k, 1], x)));
            return g;
          },
          RUNS,
        );
        b.freeTensor(w);
        const gbs = bytes.byteLength / (tm.median / 1e3) / 1e9;
        const best = bytes.byteLength / (tm.best / 1e3) / 1e9;
        cells.push(
          `${tm.median.toFixed(2)} | ${gbs.toFixed(1)} (${best.toFixed(1)}) | ${((100 * gbs) / bw.get(t)!).toFixed(0)} %`,
        );
      }
      console.log(`| ${dtype} | [${k}, ${n}] | ${(bytes.byteLength / 2 ** 20).toFixed(1)} | ${cells.join(" | ")} |`);
    }
  }

  const ts = THREADS[THREADS.length - 1]!;
  const b = backends.get(ts)!;
  console.log(`\n## Sparse ops, W [4096, 11008] (11008 neurons), ${ts} threads, median of ${RUNS} runs\n`);
  console.log(
    "Active rows chosen at random by predictor logits ≥ 0. Each cell: median time (× the dense mul_mat of the same matrix / × the same op with every row active).\n",
  );
  console.log(
    "| dtype | op | dense mul_mat ms | op at 100 % ms | 5 % | 10 % | 25 % | 50 % |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
  );
  const [E, M] = [4096, 11008];
  for (const dtype of ["f16", "q4_0"] as DType[]) {
    const w: TensorHandle = b.createTensor(dtype, [E, M], weightBytes(dtype, E, M));
    const x = new Float32Array(E).map((_, i) => Math.cos(i));
    const a = new Float32Array(M).map((_, i) => Math.sin(i));
    const dense = timeGraph(
      b,
      () => {
        const g = new Graph();
        g.output(g.mulMat(g.handle(w), g.input("f32", [E, 1], x)));
        return g;
      },
      RUNS,
    ).median;
    for (const op of ["mul_mat_sparse", "axpy_sparse"] as const) {
      const times = new Map<number, number>();
      for (const frac of [1, 0.05, 0.1, 0.25, 0.5]) {
        let s = 99;
        const logits = new Float32Array(M).map(() => {
          s = (Math.imul(s, 1103515245) + 12345) >>> 0;
          return s / 2 ** 32 < frac ? 1 : -1;
        });
        const ms = timeGraph(
          b,
          () => {
            const g = new Graph();
            const lg = g.input("f32", [M, 1], logits);
            g.output(
              op === "mul_mat_sparse"
                ? g.mulMatSparse(g.handle(w), g.input("f32", [E, 1], x), { logits: lg, threshold: 0 })
                : g.axpySparse(g.handle(w), g.input("f32", [M, 1], a), { logits: lg, threshold: 0 }),
            );
            return g;
          },
          RUNS,
        ).median;
        times.set(frac, ms);
      }
      const all = times.get(1)!;
      const cells = [0.05, 0.1, 0.25, 0.5].map((f) => {
        const ms = times.get(f)!;
        return `${ms.toFixed(2)} ms (${(ms / dense).toFixed(2)}× / ${(ms / all).toFixed(2)}×)`;
      });
      console.log(`| ${dtype} | ${op} | ${dense.toFixed(2)} | ${all.toFixed(2)} | ${cells.join(" | ")} |`);
    }
    b.freeTensor(w);
  }
  for (const bb of backends.values()) bb.dispose();
}

await main();
