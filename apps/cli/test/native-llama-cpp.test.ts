/**
 * The native llama.cpp benchmark peer: parsing of llama-bench's `-o json` output (a sample recorded from
 * the native build on stories260K), the build record, where the build is looked for, and a smoke run of
 * the harness with the native llama-bench on stories260K (skipped, with the reason, when the native build
 * is absent: `pnpm --filter @powerinfer/cli llama-cpp:build` makes it).
 */
import { spawnSync } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model } from "@powerinfer/engine";
import { afterAll, describe, expect, it } from "vitest";
import { CMAKE_ARGS, cmakeArgsFor, NO_AMX_FLAGS, parseBuildInfoCpp } from "../src/bench/build-llama-cpp.js";
import { formatHeader, formatMarkdown } from "../src/bench/format.js";
import { median, runBench } from "../src/bench/harness.js";
import {
  BUILD_HINT,
  defaultLlamaCppDir,
  findNativeLlamaCpp,
  LLAMA_CPP_DIR_ENV,
  llamaBenchArgs,
  NativeLlamaCppError,
  nativeLabel,
  parseBuildInfo,
  parseLlamaBenchJson,
  resolveLlamaCppDir,
  runLlamaBench,
  startLlamaBenchSpawner,
  stopLlamaBenchSpawner,
} from "../src/bench/native-llama-cpp.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const stories = join(models, "stories260K.gguf");
const fixture = (name: string) => readFileSync(join(import.meta.dirname, "fixtures", name), "utf8");
const dir = mkdtempSync(join(tmpdir(), "native-llama-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("llama-bench -o json", () => {
  it("parses a recorded run (pp64 and tg16 on stories260K, 2 repetitions)", () => {
    const rows = parseLlamaBenchJson(fixture("llama-bench-stories260K.json"));
    expect(rows).toHaveLength(2);
    const [pp, tg] = rows as [(typeof rows)[0], (typeof rows)[0]];
    expect([pp.n_prompt, pp.n_gen, tg.n_prompt, tg.n_gen]).toEqual([64, 0, 0, 16]);
    for (const r of rows) {
      expect(r.build_commit).toBe("de3ff81");
      expect(r.backends).toBe("CPU");
      expect(r.flash_attn).toBe("auto"); // printed as -1
      expect(r.n_threads).toBe(1);
      expect(r.model_n_params).toBe(292800);
      expect(r.samples_ns).toHaveLength(2);
      expect(r.samples_ts).toHaveLength(2);
      // t/s = tokens / seconds, per repetition
      const n = r.n_prompt + r.n_gen;
      for (const [i, ns] of r.samples_ns.entries()) expect(r.samples_ts[i]).toBeCloseTo((n * 1e9) / ns, 0);
      expect(r.avg_ns).toBeCloseTo((r.samples_ns[0]! + r.samples_ns[1]!) / 2, -1);
    }
  });

  it("rejects what llama-bench does not write, naming the row and field", () => {
    expect(() => parseLlamaBenchJson("llama-bench: error: x")).toThrow(NativeLlamaCppError);
    expect(() => parseLlamaBenchJson('{"a":1}')).toThrow(/not a JSON array/);
    const rows = JSON.parse(fixture("llama-bench-stories260K.json")) as Record<string, unknown>[];
    rows[1]!.avg_ts = "fast";
    expect(() => parseLlamaBenchJson(JSON.stringify(rows))).toThrow(/^llama-bench row 1: "avg_ts" must be a number$/);
    rows[1]!.avg_ts = 1;
    rows[0]!.samples_ns = [];
    expect(() => parseLlamaBenchJson(JSON.stringify(rows))).toThrow(/row 0: "samples_ns" must be non-empty/);
    delete rows[0]!.samples_ns;
    expect(() => parseLlamaBenchJson(JSON.stringify(rows))).toThrow(/row 0: "samples_ns" must be an array of numbers/);
  });

  it("asks llama-bench for one test at a time: ppN is -p N -n 0, tgN is -p 0 -n N", () => {
    const pp = llamaBenchArgs("m.gguf", { kind: "pp", n: 512, threads: 2, repetitions: 1 });
    expect(pp).toEqual(["-m", "m.gguf", "-p", "512", "-n", "0", "-t", "2", "-r", "1", "-o", "json"]);
    const tg = llamaBenchArgs("m.gguf", { kind: "tg", n: 128, threads: 1, repetitions: 3 });
    expect(tg.join(" ")).toBe("-m m.gguf -p 0 -n 128 -t 1 -r 3 -o json");
    // a depth goes to -d; depth 0 passes nothing (older llama-bench builds have no -d)
    const deep = llamaBenchArgs("m.gguf", { kind: "tg", n: 128, threads: 1, repetitions: 3, depth: 4096 });
    expect(deep.join(" ")).toBe("-m m.gguf -p 0 -n 128 -t 1 -r 3 -d 4096 -o json");
    expect(llamaBenchArgs("m.gguf", { kind: "pp", n: 8, threads: 1, repetitions: 1, depth: 0 })).not.toContain("-d");
  });

  it("median of samples", () => {
    expect(median([3, 1, 2])).toBe(2);
    expect(median([4, 1, 3, 2])).toBe(2.5);
    expect(median([])).toBeNaN();
  });
});

// the compiled spawner (the CLI's build output; vitest runs the TypeScript sources)
const spawnerScript = join(import.meta.dirname, "..", "dist", "bench", "llama-bench-spawner.js");

describe.skipIf(!existsSync(spawnerScript))(
  `llama-bench runs through the spawner process${existsSync(spawnerScript) ? "" : " (skipped: the CLI is not built)"}`,
  () => {
    it("a fake llama-bench started by the spawner (not by this process) gives its row; a failing one its last stderr line", async () => {
      const fake = join(dir, "fake-llama-bench");
      const ppidFile = join(dir, "fake-ppid");
      const json = join(dir, "one-row.json");
      const rows = JSON.parse(fixture("llama-bench-stories260K.json")) as unknown[];
      writeFileSync(json, JSON.stringify([rows[1]]));
      writeFileSync(
        fake,
        `#!/bin/sh\necho $PPID > ${ppidFile}\nif [ "$2" = fail ]; then echo "error: no such model" >&2; exit 1; fi\ncat ${json}\n`,
      );
      chmodSync(fake, 0o755);
      const peer = { kind: "native" as const, dir, llamaBench: fake, build: {} as never, label: "fake" };
      const pid = startLlamaBenchSpawner(spawnerScript);
      try {
        expect(pid).toBeGreaterThan(0);
        expect(pid).not.toBe(process.pid);
        const row = await runLlamaBench(peer, "m.gguf", { kind: "tg", n: 16, threads: 1, repetitions: 2, depth: 0 });
        expect([row.n_prompt, row.n_gen, row.n_threads]).toEqual([0, 16, 1]);
        expect(Number(readFileSync(ppidFile, "utf8"))).toBe(pid);
        await expect(
          runLlamaBench(peer, "fail", { kind: "tg", n: 16, threads: 1, repetitions: 2, depth: 0 }),
        ).rejects.toThrow(/llama-bench tg16 on fail failed: error: no such model/);
      } finally {
        stopLlamaBenchSpawner();
      }
      // without the spawner this process starts it
      await runLlamaBench(peer, "m.gguf", { kind: "tg", n: 16, threads: 1, repetitions: 2, depth: 0 });
      expect(Number(readFileSync(ppidFile, "utf8"))).toBe(process.pid);
    });
  },
);

describe("the native build's record and location", () => {
  const info = {
    schema: 1,
    tag: "v0.5.0",
    commit: "de3ff815ea7d559ee917f063901b8986f038abc6",
    buildNumber: 1,
    compiler: "GNU 12.2.0",
    isa: ["avx", "avx2", "f16c", "fma"],
    cpu: "AMD EPYC",
    cmakeArgs: ["-DGGML_NATIVE=ON"],
    targets: ["llama-bench"],
    bundle: "/x/gitRelease.bundle",
    builtAt: "2026-11-30T21:00:00.000Z",
    buildSeconds: 600,
  };

  it("labels rows with tag, commit and the widest SIMD extension", () => {
    expect(nativeLabel(parseBuildInfo(JSON.stringify(info)))).toBe("llama.cpp v0.5.0 de3ff81 native (avx2)");
    expect(nativeLabel({ ...info, isa: ["avx512f", "avx2"] })).toBe("llama.cpp v0.5.0 de3ff81 native (avx512f)");
    expect(nativeLabel({ ...info, isa: [] })).toBe("llama.cpp v0.5.0 de3ff81 native");
    expect(() => parseBuildInfo(JSON.stringify({ ...info, isa: "avx2" }), "b.json")).toThrow(
      /^b\.json: "isa" must be an array of strings$/,
    );
    expect(() => parseBuildInfo(JSON.stringify({ ...info, schema: 2 }))).toThrow(/unknown schema 2/);
  });

  it("looks in --llama-cpp-dir, else $POWERINFER_LLAMA_CPP_DIR, else the cache folder named by the tag", () => {
    expect(resolveLlamaCppDir("/a/b", { [LLAMA_CPP_DIR_ENV]: "/c" })).toBe("/a/b");
    expect(resolveLlamaCppDir(undefined, { [LLAMA_CPP_DIR_ENV]: "/c" })).toBe("/c");
    expect(defaultLlamaCppDir("v0.5.0", { XDG_CACHE_HOME: "/cache" })).toBe("/cache/powerinfer-ts/llama.cpp/v0.5.0");
    expect(resolveLlamaCppDir(undefined, { XDG_CACHE_HOME: "/cache" })).toMatch(
      /^\/cache\/powerinfer-ts\/llama\.cpp\//,
    );
  });

  it("the build script: Release, native, CPU only; build number and commit from the generated build info", () => {
    for (const f of ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DLLAMA_OPENSSL=OFF"])
      expect(CMAKE_ARGS).toContain(f);
    const text =
      'int LLAMA_BUILD_NUMBER = 7;\nchar const * LLAMA_COMMIT = "abc1234";\nchar const * LLAMA_COMPILER = "GNU 12";\n';
    expect(parseBuildInfoCpp(text)).toEqual({ buildNumber: 7, commit: "abc1234", compiler: "GNU 12" });
    expect(() => parseBuildInfoCpp("int x;")).toThrow(NativeLlamaCppError);
  });

  it("a CPU with AMX gets a peer built without ggml's AMX kernels unless --amx; other CPUs get the plain arguments", () => {
    expect(cmakeArgsFor(["avx2", "fma"], false)).toEqual(CMAKE_ARGS);
    const noAmx = cmakeArgsFor(["amx_int8", "amx_tile", "avx512f"], false);
    expect(noAmx.slice(0, CMAKE_ARGS.length)).toEqual(CMAKE_ARGS);
    expect(noAmx.slice(CMAKE_ARGS.length)).toEqual([
      `-DCMAKE_C_FLAGS=${NO_AMX_FLAGS}`,
      `-DCMAKE_CXX_FLAGS=${NO_AMX_FLAGS}`,
    ]);
    expect(NO_AMX_FLAGS.split(" ")).toEqual(["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]);
    expect(cmakeArgsFor(["amx_tile", "avx512f"], true)).toEqual(CMAKE_ARGS);
  });

  it("an empty folder has no build, and the reason says how to build one", () => {
    const r = findNativeLlamaCpp(dir);
    expect(r).toEqual({ unavailable: `no native llama.cpp build in ${dir} (build it with \`${BUILD_HINT}\`)` });
  });
});

const probe = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;
const native = findNativeLlamaCpp(resolveLlamaCppDir());
const skip = "unavailable" in native ? native.unavailable : !probe.usable ? `CPU backend ${probe.reason}` : "";

describe.skipIf(skip !== "")(`the native llama-bench as the bench peer ${skip ? `(skipped: ${skip})` : ""}`, () => {
  it("stories260K, 1 repetition: llama-bench rows labelled with the native build, ratios against them, at depths 0 and 16", async () => {
    if ("unavailable" in native) throw new Error(native.unavailable);
    const lines: string[] = [];
    const r = await runBench({
      models: [{ path: stories }],
      nPrompt: [32],
      nGen: [8],
      nDepth: [0, 16],
      threads: [1],
      repetitions: 1,
      sparse: ["off"],
      bandwidthMiB: 0,
      llamaCppPeer: "native",
      log: (l) => lines.push(l),
    });
    expect(r.notes).toEqual([]);
    expect(r.llamaCpp).toMatchObject({ kind: "native", label: native.label });
    const peer = r.rows.filter((x) => x.engine === "llama.cpp");
    const names = ["pp32", "tg8", "pp32 @ d16", "tg8 @ d16"];
    expect(peer.map((x) => `${x.engine_label} ${x.test}`)).toEqual(names.map((t) => `${native.label} ${t}`));
    for (const row of peer) {
      expect(row.samples_ns).toHaveLength(1);
      expect(row.avg_ts).toBeGreaterThan(0);
    }
    const ours = r.rows.filter((x) => x.engine === "powerinfer-ts");
    expect(ours.map((x) => x.test)).toEqual(names);
    expect(ours.map((x) => x.n_depth)).toEqual([0, 0, 16, 16]);
    for (const row of ours)
      expect(row.vs_llama_cpp).toBeCloseTo(row.median_ts / peer.find((p) => p.test === row.test)!.median_ts, 9);
    // llama-bench sits out the warm-up round (it warms up inside its own process)
    expect(lines.filter((l) => l.startsWith("warm-up: llama.cpp"))).toEqual([]);
    expect(lines.filter((l) => l.startsWith("rep 1: llama.cpp (native)"))).toHaveLength(4);
    expect(r.llamaBench).toMatchObject({ n_threads: 1, build_commit: native.build.commit.slice(0, 7) });
    expect(formatHeader(r)).toContain(`- llama.cpp: ${native.label} — built here`);
    expect(formatMarkdown(r)).toContain(`| ${native.label} | 1 | – | – | tg8 |`);
  }, 120_000);
});

describe("without the native build", () => {
  it.skipIf(!probe.usable)(
    `--llama-cpp-peer native reports the missing build and runs ours alone ${probe.usable ? "" : probe.reason}`,
    async () => {
      const r = await runBench({
        models: [{ path: stories }],
        nPrompt: [8],
        nGen: [4],
        threads: [1],
        repetitions: 1,
        sparse: ["off"],
        bandwidthMiB: 0,
        llamaCppPeer: "native",
        llamaCppDir: dir,
      });
      expect(r.llamaCpp).toEqual({ unavailable: expect.stringContaining(`no native llama.cpp build in ${dir}`) });
      expect(r.notes.join("\n")).toContain(BUILD_HINT);
      expect(r.rows.every((x) => x.engine === "powerinfer-ts")).toBe(true);
    },
  );

  it.skipIf(!probe.usable)(
    `auto falls back to node-llama-cpp, labelled as the slower prebuilt peer ${probe.usable ? "" : probe.reason}`,
    async () => {
      const r = await runBench({
        models: [{ path: stories }],
        nPrompt: [8],
        nGen: [4],
        threads: [1],
        repetitions: 1,
        sparse: ["off"],
        bandwidthMiB: 0,
        llamaCppDir: dir,
      });
      expect(r.notes[0]).toMatch(/no native llama\.cpp build .*fell back to node-llama-cpp's prebuilt binary/);
      if (r.llamaCpp && "kind" in r.llamaCpp) {
        expect(r.llamaCpp.kind).toBe("prebuilt");
        const peer = r.rows.filter((x) => x.engine === "llama.cpp");
        expect(peer).toHaveLength(2);
        expect(peer[0]!.engine_label).toMatch(
          /^llama\.cpp \S+ prebuilt \(node-llama-cpp [\d.]+, slower than native\)$/,
        );
      } else {
        expect(r.llamaCpp).toEqual({ unavailable: expect.stringMatching(/node-llama-cpp/) });
      }
    },
  );
});

/** `llama-eval-callback` blocks: node name → per ubatch, the printed first/last values of the row and the sum. */
function parseEvalCallback(out: string): Map<string, { values: string[]; sum: string }[]> {
  const nodes = new Map<string, { values: string[]; sum: string }[]>();
  const re =
    /common_debug_cb_eval:\s+(\S+) = \(f32\)[^\n]*\n\s*\[\n\s*\[\n\s*\[([^\]]*)\],\n\s*\],\n\s*\]\n\s*sum = (\S+)\n/g;
  for (const m of out.matchAll(re)) {
    const values = m[2]!
      .split(",")
      .map((v) => v.trim())
      .filter((v) => v !== "" && v !== "...");
    const list = nodes.get(m[1]!) ?? [];
    list.push({ values, sum: m[3]! });
    nodes.set(m[1]!, list);
  }
  return nodes;
}

/** A row as llama-eval-callback prints it: the first and last three values (%.4f) and the float sum (%f). */
function printed(row: Float32Array): { values: string[]; sum: string } {
  let sum = 0;
  for (const v of row) sum = Math.fround(sum + v);
  const pick = row.length > 6 ? [...row.subarray(0, 3), ...row.subarray(row.length - 3)] : [...row];
  return { values: pick.map((v) => v.toFixed(4)), sum: sum.toFixed(6) };
}

describe.skipIf(skip !== "")(
  `decode arithmetic equals the native llama.cpp's ${skip ? `(skipped: ${skip})` : ""}`,
  () => {
    // Our CPU kernels follow llama.cpp's AVX2 arithmetic; an AVX-512 build sums in 16 lanes (its values part
    // from ours by ~1e-4 after a few tokens here). eval-callback.test.ts checks every node against the
    // recorded AVX2 traces instead.
    const avx512 = !("unavailable" in native) && native.build.isa.includes("avx512f");
    it.skipIf(avx512)(
      `stories260K token by token (ubatch 1): every layer's ffn_inp and the logits print as llama-eval-callback's${avx512 ? " (skipped: the native build is AVX-512, our kernels follow its AVX2 arithmetic)" : ""}`,
      async () => {
        if ("unavailable" in native) throw new Error(native.unavailable);
        const prompt = "One day, a girl named";
        const r = spawnSync(
          join(dirname(native.llamaBench), "llama-eval-callback"),
          ["-m", stories, "-p", prompt, "-n", "1", "-t", "1", "-b", "512", "-ub", "1", "-c", "256"],
          { encoding: "utf8", timeout: 120_000, maxBuffer: 64 * 2 ** 20 },
        );
        expect(r.status, r.stderr).toBe(0);
        const theirs = parseEvalCallback(r.stdout);
        const backend = await cpuBackend.load({ threads: 1 });
        const model = await Model.load(stories, { backend });
        try {
          const ids = model.tokenizer.tokenize(prompt);
          const s = model.createSession({ nCtx: 256 });
          let compared = 0;
          let logits = new Float32Array(0);
          for (const [t, id] of ids.entries()) {
            logits = s.evaluate([id], {
              onCapture: (layers) => {
                for (const [l, c] of layers.entries()) {
                  // the log is written by a thread and its end can be cut when the process exits
                  const last = l === layers.length - 1; // computed by llama.cpp for the final position only
                  if (last && t !== ids.length - 1) continue;
                  const want = theirs.get(`ffn_inp-${l}`)?.[last ? 0 : t];
                  if (!want) continue;
                  expect(printed(c.ffnInput), `token ${t} ffn_inp-${l}`).toEqual(want);
                  compared++;
                }
              },
            });
          }
          const out = theirs.get("result_output")?.[0];
          if (out) expect(printed(logits), "result_output").toEqual(out);
          s.dispose();
          // llama.cpp computes the last layer only for the positions whose logits it returns
          expect(compared).toBeGreaterThanOrEqual((model.config.n_layer - 1) * (ids.length - 1));
        } finally {
          model.dispose();
          backend.dispose();
        }
      },
      180_000,
    );
  },
);
