/**
 * llama.cpp as a benchmark peer, through the `node-llama-cpp` npm package (a devDependency of the CLI:
 * benchmarks only), CPU build with `gpu: false`, never building from source.
 */
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { argmax } from "@powerinfer/engine";

type NodeLlamaCpp = typeof import("node-llama-cpp");
type Llama = Awaited<ReturnType<NodeLlamaCpp["getLlama"]>>;

/** What was loaded, for the report. */
export interface LlamaCppInfo {
  /** node-llama-cpp package version. */
  packageVersion: string;
  /** llama.cpp release the binary was built from (e.g. "b6xxx"). */
  release: string;
  /** "prebuilt" or "localBuild". */
  buildType: string;
  /** llama.cpp's system info line (CPU features). */
  systemInfo: string;
}

export interface LlamaCppPeer {
  info: LlamaCppInfo;
  /** Loads a model with a context for benchmarking; throws when llama.cpp cannot load the file. */
  open(path: string, opts: { contextSize: number; batchSize: number; threads: number }): Promise<LlamaCppRunner>;
  dispose(): Promise<void>;
}

export interface LlamaCppRunner {
  /** Evaluates tokens from an empty context as one batch; milliseconds. */
  pp(tokens: number[]): Promise<number>;
  /** Evaluates tokens one at a time from an empty context; milliseconds. */
  tg(tokens: number[]): Promise<number>;
  /**
   * Greedy decoding from an empty context: the prompt as one batch, then `n` − 1 tokens one at a time
   * (argmax of the raw logits, ties to the lowest id). Returns the `n` ids and the raw logits
   * (F32, n_vocab each) before each of them — `logits[0]` is the first position's.
   */
  greedy(prompt: number[], n: number): Promise<{ ids: number[]; logits: Float32Array[] }>;
  dispose(): Promise<void>;
}

function packageVersion(): string {
  try {
    const require = createRequire(import.meta.url);
    let dir = dirname(require.resolve("node-llama-cpp"));
    for (let i = 0; i < 5; i++) {
      try {
        const pkg = JSON.parse(readFileSync(join(dir, "package.json"), "utf8"));
        if (pkg.name === "node-llama-cpp") return String(pkg.version);
      } catch {
        // go up
      }
      dir = dirname(dir);
    }
  } catch {
    // not resolvable
  }
  return "unknown";
}

/** Loads the llama.cpp peer, or returns why it is unavailable (never throws). */
export async function loadLlamaCpp(): Promise<LlamaCppPeer | { unavailable: string }> {
  let lib: NodeLlamaCpp;
  try {
    lib = await import("node-llama-cpp");
  } catch (e) {
    return { unavailable: `node-llama-cpp is not installed (${(e as Error).message.split("\n")[0]})` };
  }
  let llama: Llama;
  try {
    // maxThreads 0: a context's `threads` is then the exact thread count, not a hint
    llama = await lib.getLlama({ gpu: false, build: "never", maxThreads: 0, logLevel: lib.LlamaLogLevel.error });
  } catch (e) {
    return { unavailable: `node-llama-cpp has no usable CPU binary here (${(e as Error).message.split("\n")[0]})` };
  }
  const info: LlamaCppInfo = {
    packageVersion: packageVersion(),
    release: llama.llamaCppRelease.release,
    buildType: llama.buildType,
    systemInfo: llama.systemInfo,
  };
  return {
    info,
    async open(path, { contextSize, batchSize, threads }) {
      const model = await llama.loadModel({ modelPath: path });
      try {
        const ctx = await model.createContext({ contextSize, batchSize, threads: { ideal: threads, min: threads } });
        const seq = ctx.getSequence();
        // the output row is computed (llama.cpp's batch logits flag); only one value crosses into JS
        const wantLogits = { generateNext: { logits: { filter: { tokens: [0] } } } };
        return {
          // Both tests ask for the last token's logits, as llama-bench's llama_batch_get_one does: with no
          // output requested llama.cpp skips the last layer's work after attention and the output
          // matrix (its graph drops rows nobody reads), which inflated t/s by up to 3× on 1–2-layer slices.
          async pp(tokens) {
            await seq.clearHistory();
            const t0 = performance.now();
            await seq.controlledEvaluate(
              tokens.map((t, i) => (i === tokens.length - 1 ? ([t, wantLogits] as const) : t)) as never,
            );
            return performance.now() - t0;
          },
          async tg(tokens) {
            await seq.clearHistory();
            const t0 = performance.now();
            for (const t of tokens) await seq.controlledEvaluate([[t, wantLogits]] as never);
            return performance.now() - t0;
          },
          async greedy(prompt, n) {
            await seq.clearHistory();
            const ids: number[] = [];
            const all: Float32Array[] = [];
            let input = prompt;
            for (let step = 0; step < n; step++) {
              const items = input.map((t, i) =>
                i === input.length - 1 ? ([t, { generateNext: { logits: true } }] as const) : t,
              );
              const out = await seq.controlledEvaluate(items as never);
              const map = (out[out.length - 1] as { next?: { logits?: Map<number, number> } } | undefined)?.next
                ?.logits;
              if (!map) throw new Error("node-llama-cpp returned no logits");
              let size = 0;
              for (const t of map.keys()) size = Math.max(size, t + 1);
              const logits = new Float32Array(size);
              for (const [t, v] of map) logits[t] = v;
              const best = argmax(logits);
              all.push(logits);
              ids.push(best);
              input = [best];
            }
            return { ids, logits: all };
          },
          async dispose() {
            await ctx.dispose();
            await model.dispose();
          },
        };
      } catch (e) {
        await model.dispose();
        throw e;
      }
    },
    async dispose() {
      await llama.dispose();
    },
  };
}
