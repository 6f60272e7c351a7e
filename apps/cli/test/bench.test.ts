/**
 * Smoke test of the benchmark harness (benchmarks are not tests: this only checks that the harness runs
 * and reports what it should, with 1 repetition and tiny sizes).
 */
import { mkdtempSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { generateSyntheticModel, generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { openGguf } from "@powerinfer/gguf";
import { InvalidArgumentError } from "commander";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { bytesPerToken, fixedBytesPerToken } from "../src/bench/bytes.js";
import { formatHeader, formatJson, formatMarkdown } from "../src/bench/format.js";
import {
  type BenchResult,
  checkTwin,
  kvCacheBytes,
  llamaBenchRepetitions,
  randomTokens,
  runBench,
} from "../src/bench/harness.js";
import { TINY_MOE_SHAPE } from "./moe-shape.js";
import { intList, sparseList } from "../src/commands/bench.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const stories = join(models, "stories260K.gguf");
const probe = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;
const dir = mkdtempSync(join(tmpdir(), "bench-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("bytes of weights per decoded token", () => {
  it("dense: every weight once, one row of the token embedding", () => {
    const f = openGguf(stories);
    const all = f.tensors.reduce((s, t) => s + t.byteLength, 0);
    const embd = f.tensorMap.get("token_embd.weight")!;
    expect(fixedBytesPerToken(f, "off")).toBe(all - embd.byteLength + embd.shape[0]! * 4);
    expect(bytesPerToken(f, 5, "off")).toBe(fixedBytesPerToken(f, "off"));
  });

  it("sparse: FFN matrices by rows read (predictor), the gate stays dense (oracle)", async () => {
    const path = join(dir, "b.pwri.gguf");
    await generateSyntheticModel(path, { preset: "tiny", format: "PWRI", statsTokens: 0 }, { fsync: false });
    const f = openGguf(path);
    const dense = bytesPerToken(f, 2, "off");
    const ffn = f.tensors.filter((t) => /ffn_(gate|up|down_t)/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    const row = 256 * 2; // one F16 row of n_embd
    // the predictors are read in predictor mode only
    const preds = f.tensors.filter((t) => /\.fc[12]\./.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    expect(preds).toBeGreaterThan(0);
    expect(bytesPerToken(f, 2, "predictor", [0, 0])).toBe(dense - ffn + preds);
    expect(bytesPerToken(f, 2, "predictor", [100, 50])).toBe(dense - ffn + preds + 150 * 3 * row);
    // the engine's own count (Session.stats.sparseBytes: up and down read fewer rows than the gate) replaces it
    expect(bytesPerToken(f, 2, "predictor", [100, 50], [7000, 3000])).toBe(dense - ffn + preds + 10000);
    const gate = 2 * 1024 * row;
    expect(bytesPerToken(f, 2, "oracle", [100, 50])).toBe(dense - ffn + gate + 150 * 2 * row);
  });

  it("routed experts: the chosen experts' share of each stacked tensor; sparse experts by rows read", () => {
    const path = join(dir, "st.gguf");
    const shape = { n_embd: 64, n_ff: 32, n_ff_exp: 32, n_expert: 8, n_expert_used: 2, n_head: 2, n_head_kv: 1 };
    generateSyntheticMoeModel(path, {
      arch: "smallthinker",
      shape: { ...shape, n_layer: 2, n_ctx: 64 },
      dtype: "Q8_0",
      untiedOutput: false,
    });
    const f = openGguf(path);
    const all = f.tensors.reduce((s, t) => s + t.byteLength, 0);
    const exps = f.tensors.filter((t) => /_exps\./.test(t.name));
    const expBytes = exps.reduce((s, t) => s + t.byteLength, 0);
    const gateExps = exps.filter((t) => /gate_exps/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    const downExps = exps.filter((t) => /down_exps/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    // tied output: all of token_embd is read; a token reads 2 of the 8 experts
    expect(bytesPerToken(f, 2, "off")).toBe(all - expBytes + expBytes / 4);
    // oracle: the chosen experts' gates and (Q8_0: no neuron-major copy) down projections, then per neuron
    // computed an up row (64 Q8_0 values: 2 blocks of 34 bytes)
    const row = 2 * 34;
    expect(bytesPerToken(f, 2, "oracle", [20, 30])).toBe(all - expBytes + gateExps / 4 + downExps / 4 + 50 * row);
    // F16: the down projection is read neuron-major too, a row of 64 F16 values per neuron computed
    const p16 = join(dir, "st16.gguf");
    generateSyntheticMoeModel(p16, {
      arch: "smallthinker",
      shape: { ...shape, n_layer: 2, n_ctx: 64 },
      dtype: "F16",
      untiedOutput: false,
    });
    const g = openGguf(p16);
    const all16 = g.tensors.reduce((s, t) => s + t.byteLength, 0);
    const exps16 = g.tensors.filter((t) => /_exps\./.test(t.name));
    const gate16 = exps16.filter((t) => /gate_exps/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    const exp16 = exps16.reduce((s, t) => s + t.byteLength, 0);
    expect(bytesPerToken(g, 2, "oracle", [20, 30])).toBe(all16 - exp16 + gate16 / 4 + 50 * (64 * 2 + 64 * 2));
    // per-expert predictors: the chosen experts' share, in predictor mode only; gate, up and down by rows
    const pp = join(dir, "st16p.gguf");
    generateSyntheticMoeModel(pp, {
      arch: "smallthinker",
      shape: { ...shape, n_layer: 2, n_ctx: 64 },
      dtype: "F16",
      untiedOutput: false,
      design: {},
      predictors: {},
    });
    const h = openGguf(pp);
    const allP = h.tensors.reduce((s, t) => s + t.byteLength, 0);
    const predP = h.tensors.filter((t) => /fc[12]_exps/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    const expP = h.tensors.filter((t) => /ffn_.*_exps/.test(t.name)).reduce((s, t) => s + t.byteLength, 0);
    expect(predP).toBeGreaterThan(0);
    expect(bytesPerToken(h, 2, "off")).toBe(allP - predP - expP + expP / 4);
    expect(bytesPerToken(h, 2, "predictor", [20, 30])).toBe(allP - predP - expP + predP / 4 + 50 * 3 * 64 * 2);
  });
});

describe("--twin", () => {
  it("must be the same model (a PWRI twin or one without predictors is; another model is refused by name)", async () => {
    const pw = join(dir, "twin.pwri.gguf");
    const gg = join(dir, "twin.gguf");
    await generateSyntheticModel(pw, { preset: "tiny", format: "PWRI", statsTokens: 0 }, { fsync: false });
    await generateSyntheticModel(gg, { preset: "tiny", format: "GGUF", statsTokens: 0 }, { fsync: false });
    expect(() => checkTwin(openGguf(pw), pw, openGguf(gg), gg)).not.toThrow();
    expect(() => checkTwin(openGguf(pw), pw, openGguf(stories), stories)).toThrow(
      /--twin .*stories260K\.gguf is not the same model as .*twin\.pwri\.gguf: n_embd 64 vs 256/,
    );
  });
});

describe("the native peer's repetitions", () => {
  it("a model with routed experts gets a warm repetition first (its one-token warm-up maps only a few experts)", () => {
    expect(llamaBenchRepetitions(openGguf(stories))).toBe(1);
    const path = join(dir, "reps-moe.gguf");
    generateSyntheticMoeModel(path, { arch: "smallthinker", shape: TINY_MOE_SHAPE, untiedOutput: false });
    expect(llamaBenchRepetitions(openGguf(path))).toBe(2);
  });
});

describe("options", () => {
  it("parses llama-bench-style lists", () => {
    expect(intList("-p")("512,1024")).toEqual([512, 1024]);
    // llama-bench's ranges: first-last, first-last+step, first-last*mult
    expect(intList("-d", 0, false)("0-64+32")).toEqual([0, 32, 64]);
    expect(intList("-p")("64-512*2,1000")).toEqual([64, 128, 256, 512, 1000]);
    expect(intList("-t", 1, false, 512)("1-3")).toEqual([1, 2, 3]);
    // -t -1: the CPU count (clamped to the range), as the other commands' -t -1
    expect(intList("-t", 1, false, 512, () => 6)("-1,2")).toEqual([6, 2]);
    expect(intList("-t", 1, false, 512, () => 900)("-1")).toEqual([512]);
    expect(() => intList("-t", 1, false, 512)("-1")).toThrow(/-t takes integers from 1 to 512/);
    for (const [arg, re] of [
      ["8-4", /runs backwards/],
      ["0-64*2", /does not advance/],
      ["1-5+0", /does not advance/],
      ["600", /600 is out of range/],
      ["2-3x", /takes integers from 1 to 512/],
    ] as const) {
      expect(() => intList("-t", 1, false, 512)(arg), arg).toThrow(re);
    }
    expect(() => intList("-p")("1-100000")).toThrow(/more than 1000 values/);
    expect(intList("-p")("0")).toEqual([]);
    expect(intList("-d", 0, false)("0,4096")).toEqual([0, 4096]);
    expect(() => intList("-d", 0, false)("-1")).toThrow(InvalidArgumentError);
    // repeated options add up (llama-bench's rule); a previous value that is not a default is kept
    expect(intList("-d", 0, false)("32", [0])).toEqual([0, 32]);
    expect(intList("-p")("0", [16])).toEqual([16]);
    expect(() => intList("-p")("12,x")).toThrow(InvalidArgumentError);
    expect(sparseList("auto")).toBe("auto");
    expect(sparseList("off,oracle")).toEqual(["off", "oracle"]);
    expect(() => sparseList("dense")).toThrow(/--sparse must be/);
    expect(randomTokens(5, 512, 1)).toEqual(randomTokens(5, 512, 1));
    expect(randomTokens(100, 512, 1).every((t) => t >= 3 && t < 512)).toBe(true);
  });
});

describe.skipIf(!probe.usable)("runBench smoke (1 repetition, tiny sizes)", () => {
  let stories260K: BenchResult;
  let sparse: BenchResult;
  let deep: BenchResult;
  beforeAll(async () => {
    stories260K = await runBench({
      models: [{ path: stories }],
      nPrompt: [16],
      nGen: [8],
      threads: [1],
      repetitions: 1,
      sparse: "auto",
      bandwidthMiB: 16,
      llamaCppPeer: "prebuilt", // the native peer has its own test (native-llama-cpp.test.ts)
    });
    const pwri = join(dir, "s.pwri.gguf");
    const gguf = join(dir, "s.gguf");
    const opts = { preset: "tiny", layers: 1, statsTokens: 16 } as const;
    await generateSyntheticModel(pwri, { ...opts, format: "PWRI" }, { fsync: false });
    await generateSyntheticModel(gguf, opts, { fsync: false });
    sparse = await runBench({
      models: [{ path: pwri, twin: gguf }],
      nPrompt: [8],
      nGen: [8],
      threads: [1],
      repetitions: 1,
      sparse: ["off", "predictor", "oracle"],
      bandwidth: stories260K.bandwidth,
      llamaCppPeer: "prebuilt",
    });
    deep = await runBench({
      models: [{ path: stories }],
      nPrompt: [8],
      nGen: [4],
      nDepth: [0, 24],
      threads: [1],
      repetitions: 1,
      sparse: ["off"],
      bandwidth: stories260K.bandwidth,
      llamaCppPeer: "prebuilt",
    });
  }, 120_000);

  it("a depth whose KV cache cannot fit skips the model with a note before any token list is made", async () => {
    const r = await runBench({
      models: [{ path: stories }],
      nPrompt: [8],
      nGen: [],
      nDepth: [2 ** 40],
      threads: [1],
      repetitions: 1,
      sparse: ["off"],
      bandwidth: stories260K.bandwidth,
      llamaCpp: false,
    });
    expect(r.rows).toEqual([]);
    expect(r.notes.join("\n")).toMatch(
      /skipped: its tests need a KV cache for n_ctx \d+ .* GiB is free; use smaller -d\/-p\/-n/,
    );
    expect(kvCacheBytes(openGguf(stories), 100)).toBe(2 * 5 * 4 * 8 * 100 * 2);
  });

  it("-d: every test once per depth, named as llama-bench names them; the prebuilt peer runs depth 0 only and says so", () => {
    const ours = deep.rows.filter((x) => x.engine === "powerinfer-ts");
    expect(ours.map((x) => `${x.test} ${x.n_prompt} ${x.n_gen} ${x.n_depth}`)).toEqual([
      "pp8 8 0 0",
      "tg4 0 4 0",
      "pp8 @ d24 8 0 24",
      "tg4 @ d24 0 4 24",
    ]);
    expect(formatMarkdown(deep)).toMatch(/\| tg4 @ d24 \| [\d.]+ ± 0\.00 \|/);
    if (deep.rows.some((x) => x.engine === "llama.cpp")) {
      expect(deep.rows.filter((x) => x.engine === "llama.cpp").map((x) => x.test)).toEqual(["pp8", "tg4"]);
      expect(deep.notes.join("\n")).toMatch(/llama\.cpp \(prebuilt\) cannot run depth \(-d\) tests/);
      expect(ours.find((x) => x.test === "tg4 @ d24")!.vs_llama_cpp).toBeNull();
    }
  });

  it("stories260K: llama-bench rows for ours (and llama.cpp when its binary is there), bytes per token, bandwidth share", () => {
    const r = stories260K;
    expect(r.bandwidth[1]).toBeGreaterThan(0.1);
    expect(r.machine.logicalCpus).toBeGreaterThan(0);
    const ours = r.rows.filter((x) => x.engine === "powerinfer-ts");
    expect(ours.map((x) => x.test)).toEqual(["pp16", "tg8"]);
    for (const row of r.rows) {
      expect(row.samples_ts).toHaveLength(1);
      expect(row.avg_ts).toBeGreaterThan(0);
      expect(row.model).toBe("llama stories260K");
      expect(row.model_n_params).toBe(292800);
    }
    const tg = ours.find((x) => x.test === "tg8")!;
    expect(tg.sparse).toBe("off");
    expect(tg.bytes_per_token).toBe(fixedBytesPerToken(openGguf(stories), "off"));
    expect(tg.bandwidth_fraction).toBeGreaterThan(0);
    if (r.llamaCpp && !("unavailable" in r.llamaCpp)) {
      expect(r.rows.filter((x) => x.engine === "llama.cpp")).toHaveLength(2);
      expect(tg.vs_llama_cpp).toBeGreaterThan(0);
      expect(r.llamaCpp.kind).toBe("prebuilt");
      if (r.llamaCpp.kind === "prebuilt") expect(r.llamaCpp.packageVersion).toMatch(/^\d+\.\d+/);
      expect(r.rows.find((x) => x.engine === "llama.cpp")!.engine_label).toMatch(/prebuilt/);
    } else {
      expect(r.notes.join("\n")).toMatch(/llama\.cpp: /);
    }
    const md = formatMarkdown(r).split("\n");
    expect(md[0]).toBe(
      "| model | size | params | backend | threads | sparse | active | test | t/s | median t/s | vs llama.cpp | weights/token | % of BW |",
    );
    expect(
      md.some((l) =>
        /^\| llama stories260K \| 1\.13 MiB \| 292\.80 K \| powerinfer-ts CPU \| 1 \| off \| – \| tg8 \| [\d.]+ ± 0\.00 \| [\d.]+ \|/.test(
          l,
        ),
      ),
    ).toBe(true);
    expect(formatHeader(r, "powerinfer bench -m x")).toMatch(
      /- machine: .*\n- memory read bandwidth.*GB\/s at 1 thread/,
    );
    const json = JSON.parse(formatJson(r));
    expect(json[0]).toMatchObject({ model_filename: stories, n_threads: 1, build_commit: r.commit });
    expect(json[0].samples_ns).toHaveLength(1);
  });

  it("a PWRI file with its GGUF twin: sparse rows with active fraction from the row counters, fewer bytes, a summary", () => {
    const rows = sparse.rows.filter((x) => x.engine === "powerinfer-ts");
    expect(rows.map((x) => `${x.sparse} ${x.test}`)).toEqual([
      "off pp8",
      "off tg8",
      "predictor pp8",
      "predictor tg8",
      "oracle pp8",
      "oracle tg8",
    ]);
    const tg = (mode: string) => rows.find((x) => x.sparse === mode && x.test === "tg8")!;
    expect(tg("off").model_filename).toMatch(/s\.gguf$/); // dense runs the twin
    expect(tg("predictor").model_filename).toMatch(/s\.pwri\.gguf$/);
    // each row gives the size of the file it ran (the twin has no predictors: smaller, fewer parameters)
    expect(tg("off").model_size).toBe(statSync(tg("off").model_filename).size);
    expect(tg("predictor").model_size).toBe(statSync(tg("predictor").model_filename).size);
    expect(tg("off").model_n_params).toBeLessThan(tg("predictor").model_n_params);
    expect(tg("off").active_fraction).toBeNull();
    expect(tg("oracle").active_fraction).toBeGreaterThan(0.03);
    expect(tg("oracle").active_fraction).toBeLessThan(0.2);
    expect(tg("predictor").active_fraction).toBeGreaterThan(tg("oracle").active_fraction!);
    expect(tg("predictor").bytes_per_token).toBeLessThan(tg("off").bytes_per_token!);
    if (sparse.rows.some((x) => x.engine === "llama.cpp")) {
      expect(sparse.sparseSummary.map((s) => s.sparse)).toEqual(["predictor", "oracle"]);
      expect(sparse.sparseSummary[0]!.bytes_ratio).toBeGreaterThan(1.2);
      expect(formatMarkdown(sparse)).toContain("| speed-up vs llama.cpp | bytes ratio (llama.cpp / ours) |");
    }
  });
});
