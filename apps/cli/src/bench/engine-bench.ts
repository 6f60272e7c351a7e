/**
 * `pnpm bench` (apps/cli): llama-bench-style rows (model, size, params, backend, threads, test, t/s ± sd)
 * for prompt processing (ppN) and generation (tgN), ours and llama.cpp's (through the node-llama-cpp
 * package, CPU build, gpu: false) in the same run, alternating repetitions so machine drift cancels.
 *
 * Usage: node dist/bench/engine-bench.js [-m MODEL]... [-p 64] [-n 64] [-t THREADS] [-r REPS]
 */
import { statSync } from "node:fs";
import { availableParallelism, cpus } from "node:os";
import { join, resolve } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { argmax, Model } from "@powerinfer/core";
import { Command } from "commander";

interface Row {
  model: string;
  size: number;
  params: number;
  backend: string;
  threads: number;
  test: string;
  samples: number[];
}

const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
};
const sd = (xs: number[]) => {
  const m = mean(xs);
  return Math.sqrt(xs.reduce((a, b) => a + (b - m) ** 2, 0) / Math.max(1, xs.length - 1));
};

async function main(): Promise<void> {
  const repoRoot = resolve(import.meta.dirname, "../../../..");
  const models = process.env.POWERINFER_TEST_MODELS ?? join(repoRoot, "../shared/models");
  const o = new Command()
    .option("-m, --model <file...>", "models", [join(models, "stories260K.gguf")])
    .option("-p, --n-prompt <n>", "prompt tokens", (v) => Number(v), 64)
    .option("-n, --n-gen <n>", "generated tokens", (v) => Number(v), 64)
    .option("-t, --threads <n>", "threads", (v) => Number(v), Math.min(2, availableParallelism()))
    .option("-r, --repetitions <n>", "repetitions after one warm-up", (v) => Number(v), 5)
    .option("--json", "JSON output")
    .option("--no-peer", "skip llama.cpp")
    .parse()
    .opts<{
      model: string[];
      nPrompt: number;
      nGen: number;
      threads: number;
      repetitions: number;
      json?: boolean;
      peer: boolean;
    }>();

  let peer: typeof import("node-llama-cpp") | undefined;
  if (o.peer) {
    try {
      peer = await import("node-llama-cpp");
    } catch (e) {
      console.error(`llama.cpp peer unavailable (node-llama-cpp): ${(e as Error).message}`);
    }
  }
  const llama = peer
    ? await peer.getLlama({ gpu: false, build: "never", logLevel: peer.LlamaLogLevel.error })
    : undefined;
  if (llama && peer) {
    console.error(
      `peer: node-llama-cpp ${llama.buildType} build, llama.cpp release ${llama.llamaCppRelease.release}, gpu: ${llama.gpu}`,
    );
  }
  console.error(`machine: ${cpus()[0]?.model ?? "?"}, ${availableParallelism()} logical cores`);

  const backend = await cpuBackend.load({ threads: o.threads });
  const rows: Row[] = [];
  for (const path of o.model) {
    const model = await Model.load(path, { backend });
    const cfg = model.config;
    const name = `${cfg.arch} ${path.split("/").pop()}`;
    const size = statSync(path).size;
    const params = model.file.tensors.reduce((s, t) => s + t.nElements, 0);
    const nCtx = Math.max(o.nPrompt, o.nGen + 1);
    const promptIds = Array.from({ length: o.nPrompt }, (_, i) => (i === 0 ? 1 : 3 + ((i * 7919) % (cfg.n_vocab - 3))));
    // generation tokens: our greedy continuation of BOS, fed to both engines one at a time
    const genIds: number[] = [];
    {
      const s0 = model.createSession({ nCtx });
      let l = s0.evaluate([1]);
      for (let i = 0; i < o.nGen; i++) {
        genIds.push(argmax(l));
        if (i < o.nGen - 1) l = s0.evaluate([genIds[i]!]);
      }
      s0.dispose();
    }
    const ours = { pp: [] as number[], tg: [] as number[] };
    const theirs = { pp: [] as number[], tg: [] as number[] };

    const pModel = llama ? await llama.loadModel({ modelPath: path }) : undefined;
    const pCtx = pModel
      ? await pModel.createContext({ contextSize: nCtx, threads: o.threads, batchSize: o.nPrompt })
      : undefined;
    const pSeq = pCtx?.getSequence();

    const session = model.createSession({ nCtx });
    for (let rep = 0; rep <= o.repetitions; rep++) {
      // ours: pp
      session.reset();
      let t0 = performance.now();
      session.evaluate(promptIds);
      const pp = performance.now() - t0;
      // ours: tg (after BOS, one token at a time, the same token sequence as the peer)
      session.reset();
      session.evaluate([1]);
      t0 = performance.now();
      for (let i = 0; i < o.nGen; i++) argmax(session.evaluate([genIds[i]!]));
      const tg = performance.now() - t0;
      if (rep > 0) {
        ours.pp.push((o.nPrompt * 1000) / pp);
        ours.tg.push((o.nGen * 1000) / tg);
      }
      if (pSeq) {
        await pSeq.clearHistory();
        t0 = performance.now();
        await pSeq.evaluateWithoutGeneratingNewTokens(promptIds as never);
        const ppP = performance.now() - t0;
        await pSeq.clearHistory();
        await pSeq.evaluateWithoutGeneratingNewTokens([1] as never);
        t0 = performance.now();
        for (let i = 0; i < o.nGen; i++) await pSeq.evaluateWithoutGeneratingNewTokens([genIds[i]!] as never);
        const tgP = performance.now() - t0;
        if (rep > 0) {
          theirs.pp.push((o.nPrompt * 1000) / ppP);
          theirs.tg.push((o.nGen * 1000) / tgP);
        }
      }
    }
    session.dispose();
    const base = { model: name, size, params, threads: o.threads };
    rows.push({ ...base, backend: "powerinfer-ts cpu", test: `pp${o.nPrompt}`, samples: ours.pp });
    rows.push({ ...base, backend: "powerinfer-ts cpu", test: `tg${o.nGen}`, samples: ours.tg });
    if (pSeq) {
      rows.push({ ...base, backend: "llama.cpp cpu", test: `pp${o.nPrompt}`, samples: theirs.pp });
      rows.push({ ...base, backend: "llama.cpp cpu", test: `tg${o.nGen}`, samples: theirs.tg });
    }
    await pCtx?.dispose();
    await pModel?.dispose();
    model.dispose();
  }
  backend.dispose();

  if (o.json) {
    console.log(
      JSON.stringify(
        rows.map((r) => ({ ...r, avg_ts: mean(r.samples), stddev_ts: sd(r.samples) })),
        null,
        2,
      ),
    );
    return;
  }
  const fmtSize = (b: number) => (b < 2 ** 20 ? `${(b / 1024).toFixed(2)} KiB` : `${(b / 2 ** 20).toFixed(2)} MiB`);
  const fmtParams = (p: number) => (p < 1e6 ? `${(p / 1e3).toFixed(2)} K` : `${(p / 1e6).toFixed(2)} M`);
  console.log(
    "| model | size | params | backend | threads | test | t/s (mean ± sd) | median | ratio of medians vs llama.cpp |",
  );
  console.log("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |");
  for (const r of rows) {
    const peerRow = rows.find((x) => x.model === r.model && x.test === r.test && x.backend.startsWith("llama.cpp"));
    const ratio = peerRow && r !== peerRow ? (median(r.samples) / median(peerRow.samples)).toFixed(2) : "";
    console.log(
      `| ${r.model} | ${fmtSize(r.size)} | ${fmtParams(r.params)} | ${r.backend} | ${r.threads} | ${r.test} | ${mean(r.samples).toFixed(2)} ± ${sd(r.samples).toFixed(2)} | ${median(r.samples).toFixed(2)} | ${ratio} |`,
    );
  }
}

main().catch((e) => {
  console.error(`bench: ${(e as Error).message}`);
  process.exitCode = 1;
});
