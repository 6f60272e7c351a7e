/**
 * What a new user meets first: every option's rule is checked while the command line is parsed (one line
 * naming the option, the rule and the value, before any file is opened), and error lines give the message
 * and the fix without the error's class and code (those only with --verbose).
 */
import { spawnSync } from "node:child_process";
import { copyFileSync, existsSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model } from "@powerinfer/engine";
import { openGguf, parseModelConfig } from "@powerinfer/gguf";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";
import { InvalidArgumentError } from "commander";
import { describeError } from "../src/errors.ts";
import { seedArg } from "../src/commands/common.ts";
import { createProgram, EXAMPLES } from "../src/program.ts";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K.gguf");

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** stderr without commander's "(run with --help for usage)" hint. */
function errorLines(stderr: string): string[] {
  return stderr
    .trim()
    .split("\n")
    .filter((l) => l !== "" && !l.startsWith("(run with --help"));
}

const probe = await cpuBackend.probe();

describe("every option is checked before any file is opened", () => {
  // The files named here do not exist: an error about the option (not the file) shows it was checked first.
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-options-"));
  const m = join(dir, "missing.gguf");
  const f = join(dir, "missing.txt");
  const o = join(dir, "out.gguf");
  const cases: [string[], RegExp][] = [
    [["run", "-m", m, "-p", "x", "-n", "-5"], /--n-predict must be an integer ≥ 0 \(or -1 = until end .*\), got -5/],
    [["run", "-m", m, "-p", "x", "--vram-budget", "-1"], /--vram-budget must be a number in \[0, 1048576\], got -1/],
    [
      ["run", "-m", m, "-p", "x", "--vram-budget", "1e308"],
      /--vram-budget must be a number in \[0, 1048576\], got 1e\+308/,
    ],
    [
      ["run", "-m", m, "-p", "x", "--vram-budget", "0x10"],
      /--vram-budget must be a number in \[0, 1048576\], got "0x10"/,
    ],
    [["run", "-m", m, "-p", "x", "--top-k", "x3"], /--top-k must be an integer, got "x3"/],
    // llama.cpp's LLAMA_MAX_SEQ: at most 256 sequences
    [["serve", "-m", m, "-np", "257"], /--parallel must be an integer in \[1, 256\], got 257/],
    [["batched", "-m", m, "-p", "x", "-np", "100000"], /--parallel must be an integer in \[1, 256\], got 100000/],
    [["run", "-m", m, "-p", "x", "-ngl", "most"], /--n-gpu-layers must be an integer, auto .* or all .*, got "most"/],
    // decimal digits only (Number() would read these as 16, 10, 3 and 2)
    [
      ["run", "-m", m, "-p", "x", "-t", "0x10"],
      /--threads must be an integer in \[1, 512\] or -1 \(the default\), got "0x10"/,
    ],
    [
      ["run", "-m", m, "-p", "x", "-t", "1e1"],
      /--threads must be an integer in \[1, 512\] or -1 \(the default\), got "1e1"/,
    ],
    [["run", "-m", m, "-p", "x", "-n", "0b11"], /--n-predict must be an integer .*, got "0b11"/],
    [["run", "-m", m, "-p", "x", "-c", "2.0"], /--ctx-size must be an integer .*, got "2\.0"/],
    [["gen-model", "-o", o, "--vocab-size", "256"], /--vocab-size must be an integer ≥ 300, got 256/],
    [
      ["gen-model", "-o", o, "--preset", "smallthinker-4b-a0.6b", "--verify", "16"],
      /--verify is for the dense presets .*; for smallthinker-4b-a0\.6b run `powerinfer profile` on the written model/,
    ],
    [["run", "-m", m, "-p", "x", "--top-p", "-0.5"], /--top-p must be a number in \[0, 1\], got -0.5/],
    [["run", "-m", m, "-p", "x", "--min-p", "1.5"], /--min-p must be a number in \[0, 1\], got 1\.5/],
    [["run", "-m", m, "-p", "x", "--repeat-penalty", "0"], /--repeat-penalty must be a number > 0, got 0/],
    [
      ["run", "-m", m, "-p", "x", "--repeat-last-n", "-2"],
      /--repeat-last-n must be an integer ≥ 0 \(or -1 = the context size\), got -2/,
    ],
    [
      ["run", "-m", m, "-p", "x", "--seed", "-2"],
      /--seed must be an integer in \[0, 4294967295\] \(or -1 = random\), got -2/,
    ],
    [
      ["run", "-m", m, "-p", "x", "-t", "0"],
      /--threads must be an integer in \[1, 512\] or -1 \(the default\), got "0"/,
    ],
    [
      ["run", "-m", m, "-p", "x", "-t", "-2"],
      /--threads must be an integer in \[1, 512\] or -1 \(the default\), got "-2"/,
    ],
    [
      ["run", "-m", m, "-p", "x", "-t", "100000"],
      /--threads must be an integer in \[1, 512\] or -1 \(the default\), got "100000"/,
    ],
    [["run", "-m", m, "-p", "x", "-c", "-3"], /--ctx-size must be an integer ≥ 0, got -3/],
    [["run", "-m", m, "-p", "x", "--kv-type", "f8"], /--kv-type must be f16 or f32, got "f8"/],
    [["run", "-m", m, "-p", "x", "--sparse", "maybe"], /--sparse must be predictor, oracle or off, got "maybe"/],
    [["run", "-m", m, "-p", "x", "--solver", "simplex"], /--solver must be ilp or greedy, got "simplex"/],
    [
      ["run", "-m", m, "-p", "x", "--sparse", "off", "--sparse-threshold", "0.5"],
      /--sparse-threshold applies to --sparse predictor only, not --sparse off/,
    ],
    [
      ["serve", "-m", m, "--sparse", "oracle", "--sparse-threshold", "0.5"],
      /--sparse-threshold applies to --sparse predictor only, not --sparse oracle/,
    ],
    [
      ["run", "-m", m, "-p", "x", "--sparse-threshold", "1e40"],
      /--sparse-threshold must be a number in \[-3\.4e\+38, 3\.4e\+38\], got 1e\+40/,
    ],
    [["run", "-m", m, "-p", "x", "-f", f], /give the prompt with -p or -f, not both/],
    [["batched", "-m", m, "-p", "x", "--np", "0"], /--parallel must be an integer in \[1, 256\], got 0/],
    [["chat", "-m", m, "--top-p", "2"], /--top-p must be a number in \[0, 1\], got 2/],
    [["chat", "-m", m, "-n", "-7"], /--n-predict must be an integer ≥ 0 \(or -1 = until end of turn\), got -7/],
    [["serve", "-m", m, "--port", "70000"], /--port must be an integer in \[0, 65535\], got 70000/],
    [["serve", "-m", m, "--kv-type", "q4"], /--kv-type must be f16 or f32, got "q4"/],
    [["plan", "-m", m, "--bucket-size", "0"], /--bucket-size must be an integer ≥ 1, got 0/],
    [["profile", "-m", m, "-f", f, "--tokens", "0"], /--tokens must be an integer ≥ 2, got 0/],
    // BOS and one text token: --tokens 1 profiled 2 positions
    [["profile", "-m", m, "-f", f, "--tokens", "1"], /--tokens must be an integer ≥ 2, got 1/],
    [["perplexity", "-m", m, "-f", f, "-b", "0"], /--batch-size must be an integer ≥ 1, got 0/],
    [["train-predictor", "-m", m, "-f", f, "-o", o, "--holdout", "1"], /--holdout must be a number in \[0, 1\), got 1/],
    [["train-predictor", "-m", m, "-f", f, "-o", o, "--epochs", "-1"], /--epochs must be an integer ≥ 0, got -1/],
    [["train-predictor", "-m", m, "-f", f, "-o", o, "--init", "zeros"], /--init must be gate or random, got "zeros"/],
    [["train-predictor", "-m", m, "-f", f, "-o", o, "--lr", "0"], /--lr must be a number > 0, got 0/],
    [["gen-model", "-o", o, "--layers", "0"], /--layers must be an integer ≥ 1, got 0/],
    [["gen-model", "-o", o, "--active", "1.5"], /--active must be a number in \(0, 1\), got 1\.5/],
    [
      ["gen-model", "-o", o, "--preset", "tiny", "--layers", "999"],
      /--layers must be at most 2 \(the tiny preset's layers\), got 999/,
    ],
    [
      ["gen-model", "-o", o, "--preset", "smallthinker-4b-a0.6b", "--layers", "33"],
      /--layers must be at most 32 \(the smallthinker-4b-a0\.6b preset's layers\), got 33/,
    ],
    [
      ["gen-model", "-o", o, "--preset", "nosuch"],
      /--preset must be one of tiny, .*, smallthinker-4b-a0\.6b, smallthinker-21b-a3b, got nosuch/,
    ],
    [
      ["gen-model", "-o", join(dir, "no-such-folder", "m.gguf")],
      /output .*m\.gguf: the folder .*no-such-folder does not exist/,
    ],
    [
      ["gen-model", "-o", o, "--preset", "smallthinker-4b-a0.6b", "--drelu"],
      /--drelu: smallthinker-4b-a0\.6b is a smallthinker model; dReLU experts are written for llama-moe presets/,
    ],
    [
      ["gen-model", "-o", o, "--preset", "7b", "--layers", "1", "--drelu"],
      /--drelu: 7b is a dense preset; dReLU experts are written for llama-moe presets/,
    ],
    // the vocabulary's source is never the file written, even with --force
    [["gen-model", "-o", o, "--vocab-from", o, "--force"], /output .*out\.gguf is also an input; choose another path/],
    [["bench", "-m", m, "-r", "0"], /--repetitions must be an integer ≥ 1, got 0/],
    [["bench", "-m", m, "-p", "0", "-n", "0"], /nothing to measure: -p 0 and -n 0 leave no test/],
    [["bench", "-m", m, "--no-llama-cpp", "--no-ours"], /nothing to measure: --no-llama-cpp and --no-ours/],
    // 0 threads is not "none" (as 0 prompt tokens is): it would print an empty table
    [["bench", "-m", m, "-t", "0"], /--threads takes integers from 1 to 512, .*; got "0" \(0 is out of range\)/],
    [["bench", "-m", m, "-p", "abc"], /--n-prompt takes integers from 1 to 2\^53 \(or 0 for none\), .*; got "abc"/],
    [["bench", "-m", m, "-t", "0x2"], /--threads takes integers from 1 to 512, .*; got "0x2"/],
    [["bench", "-m", m, "-t", "100000"], /--threads .*; got "100000" \(100000 is out of range\)/],
    [["plan", "-m", m, "--disable-gpu-index"], /--disable-gpu-index leaves nothing to plan/],
    [["convert", m, o, "--to", "onnx"], /--to must be pwri or gguf, got "onnx"/],
  ];
  for (const [args, pattern] of cases) {
    it(args.filter((a) => !a.startsWith(dir)).join(" "), () => {
      const r = cli(...args);
      expect(r.code).toBe(1);
      const lines = errorLines(r.stderr);
      expect(lines, r.stderr).toHaveLength(1);
      expect(lines[0]).toMatch(pattern);
      expect(lines[0]).not.toMatch(/missing\.(gguf|txt)/); // the file was not looked at
      expect(r.stdout).toBe("");
    });
  }
});

describe("a model file that is not there, or a directory: one line before anything else is done", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-options-"));
  const m = join(dir, "missing.gguf");
  const cases: [string[], string][] = [
    [["run", "-m", m, "-p", "x"], `model file ${m} does not exist`],
    [["run", "-m", dir, "-p", "x"], `${dir} is a directory, not a model file`],
    [
      ["run", "-m", stories, "-p", "x", "--ram-budget", "1", "--stats", dir],
      `${dir} is a directory, not an activation statistics file (--stats)`,
    ],
    [["serve", "-m", m, "--port", "0"], `model file ${m} does not exist`],
    [["bench", "-m", m, "-r", "1", "--no-llama-cpp"], `model file ${m} does not exist`],
    [["inspect", m], `file ${m} does not exist`],
    [["quantize", m, join(dir, "o.gguf"), "Q8_0"], `model file ${m} does not exist`],
    [
      ["train-predictor", "-m", m, "-f", join(dir, "t.txt"), "-o", join(dir, "o.gguf")],
      `model file ${m} does not exist`,
    ],
  ];
  for (const [args, message] of cases) {
    it(`${args[0]} ${args[1] === "-m" ? "-m " : ""}${args.includes(dir) ? "DIR" : "MISSING"}`, () => {
      const r = cli(...args);
      expect(r.code).toBe(1);
      expect(r.stderr).toBe(`powerinfer: ${message}\n`); // nothing before it (no bandwidth probe, no "listening")
      expect(r.stdout).toBe("");
    });
  }

  it.skipIf(!probe.usable)(
    "train-predictor refuses a model without a ReLU FFN from its header, before reading the text",
    () => {
      const r = cli("train-predictor", "-m", stories, "-f", join(dir, "missing.txt"), "-o", join(dir, "o.gguf"));
      expect(r.code).toBe(1);
      expect(errorLines(r.stderr)).toEqual([
        `powerinfer: ${stories}: the FFN uses silu, not ReLU — its neurons are rarely exactly zero, so there is nothing to predict`,
      ]);
    },
  );
});

describe("error lines: the message and the fix, the class and code only with --verbose", () => {
  it("describeError drops the class name and code unless verbose", () => {
    const e = Object.assign(new Error("no activation statistics at x.gguf: run `powerinfer profile` first"), {
      name: "EngineError",
      code: "BAD_INPUT",
    });
    expect(describeError(e)).toBe("no activation statistics at x.gguf: run `powerinfer profile` first");
    expect(describeError(e, { verbose: true })).toBe(
      "no activation statistics at x.gguf: run `powerinfer profile` first [EngineError BAD_INPUT]",
    );
    expect(describeError(new TypeError("x is not a function"))).toBe(
      "x is not a function (an internal error: please report it, with the output of the same command with --verbose)",
    );
    expect(describeError(new TypeError("x is not a function"), { verbose: true })).toMatch(/ \[TypeError\]$/);
    expect(describeError("plain")).toBe("plain");
    // a checked input (commander's InvalidArgumentError, e.g. a missing model file) too
    const missing = new InvalidArgumentError("model file x.gguf does not exist");
    expect(describeError(missing)).toBe("model file x.gguf does not exist");
    expect(describeError(missing, { verbose: true })).toBe(
      "model file x.gguf does not exist [InvalidArgumentError commander.invalidArgument]",
    );
  });

  it.skipIf(!probe.usable)("a typed engine error from a command, with and without --verbose", () => {
    const stats = join(mkdtempSync(join(tmpdir(), "powerinfer-options-")), "none.gguf");
    // a ReLU model (a dense one has no neuron plan to make) without statistics: nothing is written
    const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
    const args = ["plan", "-m", relu, "--stats", stats, "--device-backend", "cpu"];
    const r = cli(...args);
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([
      `powerinfer: no activation statistics at ${stats}: run \`powerinfer profile -m ${relu} -f TEXT\` first`,
    ]);
    const v = cli(...args, "--verbose");
    expect(v.code).toBe(1);
    expect(errorLines(v.stderr).at(-1)).toBe(
      `powerinfer: no activation statistics at ${stats}: run \`powerinfer profile -m ${relu} -f TEXT\` first [EngineError NO_STATS]`,
    );
  });

  it("commands without model options take --verbose too", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-options-"));
    const notGguf = join(dir, "a.gguf");
    writeFileSync(notGguf, "hello, not a model");
    const args = ["quantize", notGguf, join(dir, "b.gguf"), "Q8_0"];
    const plain = errorLines(cli(...args).stderr);
    expect(plain).toEqual([
      `powerinfer: ${notGguf} at byte 0: expected magic "GGUF" or "PWRI", found bytes 68 65 6c 6c`,
    ]);
    const r = cli(...args, "--verbose");
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([`${plain[0]} [GgufError BAD_MAGIC]`]);
  });
});

describe.skipIf(!probe.usable)("run: --temp below 0 and a prompt too long", () => {
  it("--temp -1 is greedy, as in llama.cpp (the same text as --temp 0)", () => {
    const a = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "16", "--temp", "-1", "-c", "128");
    const b = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "16", "--temp", "0", "-c", "128");
    expect(a.code, a.stderr).toBe(0);
    expect(a.stdout).toBe(b.stdout);
    expect(a.stdout.length).toBeGreaterThan("Once upon a time".length + 10);
  });

  it("--help says so", () => {
    expect(cli("run", "--help").stdout).toMatch(/--temp <t>\s+temperature \(0 or less = greedy/);
  });

  it("--repeat-last-n -1 is the context size, as in llama.cpp (the same text as --repeat-last-n n_ctx)", () => {
    const run = (n: string, ...more: string[]) =>
      cli(
        "run",
        "-m",
        stories,
        "-p",
        "Once upon a time",
        "-n",
        "150",
        "--temp",
        "0",
        "--repeat-penalty",
        "1.3",
        "--repeat-last-n",
        n,
        ...more,
      );
    const all = run("-1", "-c", "256");
    expect(all.code, all.stderr).toBe(0);
    expect(all.stdout).toBe(run("256", "-c", "256").stdout);
    expect(all.stdout).not.toBe(run("64", "-c", "256").stdout); // the default window gives other text here
    // batched: a prompt longer than a sequence's context is refused with the way out
    const long = cli("batched", "-m", stories, "-p", "word ".repeat(40), "-c", "16", "-n", "4");
    expect(long.code).toBe(1);
    expect(long.stderr).toMatch(
      /^powerinfer: prompt has \d+ tokens, context has room for 16 \(n_ctx 16\); use a larger -c \(each sequence's context\) or a shorter prompt\n$/,
    );
    // batched: each sequence's context (-c is per sequence)
    const batched = (n: string) =>
      cli(
        "batched",
        "-m",
        stories,
        "-p",
        "Once upon a time",
        "-n",
        "150",
        "--np",
        "2",
        "--temp",
        "0",
        "--repeat-penalty",
        "1.3",
        "--repeat-last-n",
        n,
        "-c",
        "256",
        "--json",
      );
    const texts = (r: ReturnType<typeof cli>) =>
      (JSON.parse(r.stdout) as { sequences: { text: string }[] }).sequences.map((q) => q.text);
    const b = batched("-1");
    expect(b.code, b.stderr).toBe(0);
    expect(texts(b)).toEqual(texts(batched("256")));
    expect(texts(b)).toEqual([
      all.stdout.slice("Once upon a time".length, -1),
      all.stdout.slice("Once upon a time".length, -1),
    ]);
    expect(cli("run", "--help").stdout.replace(/\s+/g, " ")).toContain(
      "--repeat-last-n <n> tokens the penalties look back over (0 = off, -1 = the context size, as llama.cpp)",
    );
  });

  it("-t -1 is the default thread count, as in llama.cpp (the same text as -t 1)", () => {
    const a = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "16", "--temp", "0", "-t", "-1", "-c", "128");
    const b = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "16", "--temp", "0", "-t", "1", "-c", "128");
    expect(a.code, a.stderr).toBe(0);
    expect(a.stdout).toBe(b.stdout);
    expect(a.stdout.length).toBeGreaterThan("Once upon a time".length + 10);
  });

  it("--seed 4294967295 is llama.cpp's LLAMA_DEFAULT_SEED: random, read as -1 (as the server reads it)", () => {
    const parse = seedArg();
    expect(parse("4294967295")).toBe(-1);
    expect(parse("-1")).toBe(-1);
    expect(parse("4294967294")).toBe(4294967294);
    expect(parse("0")).toBe(0);
    expect(() => parse("4294967296")).toThrow(/--seed must be an integer in \[0, 4294967295\]/);
  });

  it("-n -2 (llama.cpp's until the context is full) runs as -1: the same text, to a full 64-token context", () => {
    const a = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "-2", "--temp", "0", "-c", "64");
    const b = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "-1", "--temp", "0", "-c", "64");
    expect(a.code, a.stderr).toBe(0);
    expect(a.stdout).toBe(b.stdout);
    expect(a.stderr).toMatch(/context is full|context full|n_ctx/);
  });

  it("-c 0 is the model's trained context (llama.cpp's n_ctx = 0), in the CLI and the engine", async () => {
    const prompt = "Once upon a time there was a dog. ".repeat(80);
    const r = cli("run", "-m", stories, "-p", prompt, "-c", "0");
    expect(r.code).toBe(1);
    const nTrain = parseModelConfig(openGguf(stories)).n_ctx_train;
    expect(errorLines(r.stderr).at(-1)).toContain(`more than the context holds (n_ctx ${nTrain})`);
    const e = cli("eval-callback", "-m", stories, "-p", "Once upon a time", "-c", "0");
    expect(e.code, e.stderr).toBe(0);
    // a model trained on 8,192 positions: the default stops at 4,096, 0 takes all of them
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-options-"));
    const path = join(dir, "long.gguf");
    generateSyntheticMoeModel(path, { arch: "smallthinker", shape: { ...TINY_MOE_SHAPE, n_ctx: 8192 } });
    const b = await cpuBackend.load({ threads: 1 });
    const m = await Model.load(path, { backend: b });
    try {
      const d = m.createSession({ kvType: "f16" });
      const z = m.createSession({ nCtx: 0, kvType: "f16" });
      expect([d.nCtx, z.nCtx]).toEqual([4096, 8192]);
      d.dispose();
      z.dispose();
    } finally {
      m.dispose();
      b.dispose();
    }
  });

  it("a prompt longer than the context is refused before it is printed", () => {
    const prompt = "Once upon a time there was a dog. ".repeat(20);
    const r = cli("run", "-m", stories, "-p", prompt, "-c", "32");
    expect(r.code).toBe(1);
    expect(r.stdout).toBe("");
    expect(errorLines(r.stderr).at(-1)).toMatch(
      /^powerinfer: the prompt has \d+ tokens, more than the context holds \(n_ctx 32\): raise -c\/--ctx-size/,
    );
  });
});

describe("every command's --help shows examples, and trying them as a new user gives one clean line", () => {
  const commands = Object.keys(EXAMPLES);
  it("every command has examples", () => {
    const names = createProgram().commands.map((c) => c.name());
    expect(names.sort()).toEqual([...commands].sort());
  });
  for (const name of commands) {
    it(name, () => {
      const help = cli(name, "--help");
      expect(help.code).toBe(0);
      expect(help.stdout).toContain("Examples:");
      for (const ex of EXAMPLES[name]!) expect(help.stdout).toContain(`$ powerinfer ${ex}`);
      // run as written in an empty folder: the files they name are not there, so each ends at once
      const cwd = mkdtempSync(join(tmpdir(), "powerinfer-examples-"));
      for (const ex of EXAMPLES[name]!) {
        if (/--preset (7b|13b|40b|70b)/.test(ex) || ex.startsWith("serve") || ex.startsWith("chat")) continue;
        const args = (ex.match(/"[^"]*"|\S+/g) ?? []).map((a) => a.replace(/^"|"$/g, ""));
        const r = spawnSync(process.execPath, [bin, ...args], { cwd, encoding: "utf8", timeout: 120_000 });
        expect(r.status === 0 || r.status === 1, `${ex}: ${r.stderr}`).toBe(true);
        expect(r.stderr, ex).not.toMatch(/\n\s+at |Error\b|\b[A-Z]+_[A-Z_]+\b/);
        if (r.status === 1)
          expect(
            errorLines(r.stderr).filter((l) => l.startsWith("powerinfer:")),
            ex,
          ).toHaveLength(1);
      }
    });
  }
});

describe("outputs that already exist are not replaced unless asked", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-overwrite-"));
  const text = join(dir, "t.txt");
  writeFileSync(text, "Once upon a time there was a cat.\n");
  const model = join(models, "stories260K.gguf");

  it("convert --to pwri of a SiLU model is refused (a PWRI llama file is read as ReLU) and writes nothing", () => {
    const out = join(dir, "silu.pwri.gguf");
    const r = cli("convert", model, out);
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([
      `powerinfer: ${model}: its FFN uses silu(gate)·up, and a PowerInfer (PWRI) llama file is read as ReLU(gate)·up (by PowerInfer and by powerinfer-ts), so the converted file would compute a different model; PWRI is for ReLU models — keep this one as GGUF (--to gguf)`,
    ]);
    expect(existsSync(out)).toBe(false);
  });

  it("profile -o onto a model file is refused and leaves it as it was; --force replaces it", () => {
    const victim = join(dir, "victim.gguf");
    copyFileSync(model, victim);
    const before = readFileSync(victim);
    const r = cli("profile", "-m", model, "-f", text, "-o", victim);
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([
      `powerinfer: ${victim} exists and is a model, not activation statistics: choose another output or use --force to overwrite it`,
    ]);
    expect(readFileSync(victim).equals(before)).toBe(true);
    // --force gets past the check (this model is SiLU, so profile then refuses for that reason)
    const f = cli("profile", "-m", model, "-f", text, "-o", victim, "--force");
    expect(f.stderr).toMatch(/silu/i);
  });

  it("profile -o onto another model's statistics is refused; the same model's are replaced", () => {
    const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
    const fixture = join(models, "powerinfer", "tiny-f32.powerinfer.gguf");
    const stats = join(dir, "other.activations.gguf");
    expect(cli("profile", "-m", relu, "-f", text, "-o", stats).code).toBe(0);
    const before = readFileSync(stats);
    const r = cli("profile", "-m", fixture, "-f", text, "-o", stats);
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([
      `powerinfer: ${stats} holds the activation statistics of another model file: choose another output or use --force to overwrite it`,
    ]);
    expect(readFileSync(stats).equals(before)).toBe(true);
    const again = cli("profile", "-m", relu, "-f", text, "-o", stats);
    expect(again.code).toBe(0);
    expect(again.stdout).toMatch(/replacing the earlier statistics/);
  });

  it("--sparse-threshold on a model that does not run its predictors is refused after loading, not ignored", () => {
    const r = cli("run", "-m", model, "-p", "x", "-n", "1", "--sparse-threshold", "0.5");
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([
      "powerinfer: --sparse-threshold applies to the predictor mode; this model runs dense (no predictors or not ReLU)",
    ]);
  });

  it("train-predictor -o onto an existing file needs --force", () => {
    const out = join(dir, "existing.gguf");
    writeFileSync(out, "x");
    const r = cli("train-predictor", "-m", model, "-f", text, "-o", out);
    expect(r.code).toBe(1);
    expect(errorLines(r.stderr)).toEqual([`powerinfer: ${out} exists (use --force to overwrite)`]);
    expect(readFileSync(out, "utf8")).toBe("x");
  });
});
