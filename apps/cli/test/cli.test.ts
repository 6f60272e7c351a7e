/** The built CLI as a user runs it: real processes, real files. */
import { spawn, spawnSync } from "node:child_process";
import { closeSync, existsSync, mkdtempSync, openSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { metadataEntries, openGguf, readTensorBytes, writeGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K.gguf");

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

const probe = await cpuBackend.probe();

describe.skipIf(!probe.usable)(`powerinfer run (${probe.reason})`, () => {
  it("prints llama.cpp's greedy text and the timings", () => {
    const ref = JSON.parse(readFileSync(join(models, "reference", "stories260K.greedy32.json"), "utf8"));
    const r = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "32", "--temp", "0", "-c", "256");
    expect(r.code).toBe(0);
    expect(r.stdout).toBe(`Once upon a time${ref.results[0].greedy_text}\n`);
    expect(r.stderr).toMatch(/prompt eval time = .* 5 tokens/);
    // 32 tokens sampled, 31 evaluated (the last is not: llama.cpp's "31 runs")
    expect(r.stderr).toMatch(/eval time = .* 31 runs .* tokens per second/);
  });

  it("-f reads the prompt as llama.cpp does: one final newline dropped; - and pipes are standard input", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-prompt-"));
    const file = join(dir, "p.txt");
    writeFileSync(file, "Once upon a time\n");
    const args = ["-n", "8", "--temp", "0", "-t", "1"];
    const p = cli("run", "-m", stories, "-p", "Once upon a time", ...args);
    const f = cli("run", "-m", stories, "-f", file, ...args);
    expect(p.code, p.stderr).toBe(0);
    expect(f.code, f.stderr).toBe(0);
    expect(f.stdout).toBe(p.stdout);
    // only one newline goes: a prompt that ends in a blank line keeps one
    writeFileSync(file, "Once upon a time\n\n");
    expect(cli("run", "-m", stories, "-f", file, ...args).stdout).not.toBe(p.stdout);
    const piped = spawnSync(process.execPath, [bin, "run", "-m", stories, "-f", "-", ...args], {
      input: "Once upon a time\n",
      encoding: "utf8",
    });
    expect(piped.status, piped.stderr).toBe(0);
    expect(piped.stdout).toBe(p.stdout);
    const zero = cli("run", "-m", stories, "-f", "/dev/zero", ...args);
    expect(zero.code).toBe(1);
    expect(zero.stderr).toMatch(/^powerinfer: \/dev\/zero is not a text file \(it contains NUL bytes\)$/m);
    rmSync(dir, { recursive: true, force: true });
  });

  it("Ctrl-C stops generation, prints the timings and exits 130 (as llama.cpp)", async () => {
    // a long run (until the context of 4096 is full), stopped by the signal well before
    const args = ["run", "-m", stories, "-p", "Once", "-n", "-1", "--ignore-eos", "-c", "4096", "-t", "1"];
    const child = spawn(process.execPath, [bin, ...args], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    let sent = false;
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    child.stdout.on("data", (d: Buffer) => {
      stdout += d.toString();
      if (!sent && stdout.length > 40) {
        sent = true;
        child.kill("SIGINT");
      }
    });
    const code = await new Promise<number | null>((res) => child.on("close", res));
    expect(code, stderr).toBe(130);
    expect(stderr).toMatch(/eval time = .* tokens per second/);
    expect(stderr).not.toMatch(/context full/);
  });

  it("same seed, same sampled text", () => {
    const a = cli("run", "-m", stories, "-p", "The sun was", "-n", "24", "--seed", "42", "--temp", "0.9");
    const b = cli("run", "-m", stories, "-p", "The sun was", "-n", "24", "--seed", "42", "--temp", "0.9");
    expect(a.code).toBe(0);
    expect(a.stdout).toBe(b.stdout);
  });

  it("--no-repack (every weight zero-copy) samples the same Q4_0 text as the repacked default", () => {
    // Q4_0 matrices with a row count divisible by 8 (attention, output) are repacked by default; the
    // sampled text at temperature 0.9 would part at any difference in the logits' bits
    const q4 = join(models, "stories260K-Q4_0-ffn_down-F16.gguf");
    const args = ["run", "-m", q4, "-p", "Once upon a time", "-n", "48", "--seed", "7", "--temp", "0.9"];
    const packed = cli(...args);
    const plain = cli(...args, "--no-repack");
    expect(packed.code).toBe(0);
    expect(plain.code).toBe(0);
    expect(plain.stdout).toBe(packed.stdout);
    expect(packed.stdout.length).toBeGreaterThan("Once upon a time".length + 20);
  });

  it("a BOS or EOS id outside the vocabulary is a load warning naming the key, the id and the size (llama.cpp's default kept)", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-bos-"));
    const f = openGguf(stories);
    const bad = join(dir, "bad-bos.gguf");
    const ids: Record<string, number> = { "tokenizer.ggml.bos_token_id": 512, "tokenizer.ggml.eos_token_id": 70000 };
    writeGguf(bad, {
      metadata: metadataEntries(f).map((e) => (e.key in ids ? { ...e, value: ids[e.key]! } : e)),
      tensors: f.tensors.map((t) => ({
        name: t.name,
        type: t.type,
        shape: [...t.shape],
        data: () => readTensorBytes(f, t),
      })),
    });
    const args = ["-p", "Once upon a time", "-n", "8", "--temp", "0", "-t", "1"];
    const r = cli("run", "-m", bad, ...args);
    expect(r.code, r.stderr).toBe(0);
    const warnings = r.stderr.split("\n").filter((l) => l.startsWith("warning:"));
    expect(warnings).toEqual([
      "warning: tokenizer.ggml.bos_token_id is 512, outside the vocabulary of 512 tokens (ids 0 to 511): using the default 1, as llama.cpp does",
      "warning: tokenizer.ggml.eos_token_id is 70000, outside the vocabulary of 512 tokens (ids 0 to 511): using the default 2, as llama.cpp does",
    ]);
    // llama.cpp's defaults are the file's own ids here: the same text
    expect(r.stdout).toBe(cli("run", "-m", stories, ...args).stdout);
    // the untouched file (its sep/pad ids are 2^32-1, converters' "none") warns of nothing
    expect(cli("run", "-m", stories, ...args).stderr).not.toMatch(/^warning:/m);
    rmSync(dir, { recursive: true, force: true });
  });

  it("an error after text was printed starts on its own line (stdout's line is ended first)", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-nan-"));
    const f = openGguf(stories);
    const bad = join(dir, "nan-norm.gguf");
    writeGguf(bad, {
      metadata: metadataEntries(f),
      tensors: f.tensors.map((t) => ({
        name: t.name,
        type: t.type,
        shape: [...t.shape],
        data: () =>
          t.name === "output_norm.weight"
            ? new Uint8Array(new Float32Array(Number(t.shape[0])).fill(Number.NaN).buffer)
            : readTensorBytes(f, t),
      })),
    });
    const r = cli("run", "-m", bad, "-p", "Once upon a time", "-n", "4", "--temp", "0", "-t", "1");
    expect(r.code).toBe(1);
    expect(r.stdout).toBe("Once upon a time\n");
    expect(r.stderr).toMatch(/^powerinfer: logit 0 of a token is NaN/m);
    rmSync(dir, { recursive: true, force: true });
  });

  it("tells the user when the context is full instead of producing garbage", () => {
    const r = cli("run", "-m", stories, "-p", "Once upon a time", "-n", "100", "--temp", "0", "-c", "16");
    expect(r.code).toBe(0);
    expect(r.stderr).toMatch(/context full \(n_ctx 16\)/);
  });
});

describe("bad input gives one line naming the problem and a non-zero exit", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-cli-"));
  const cases: [string, () => string[], RegExp][] = [
    ["a missing file", () => ["run", "-m", join(dir, "nope.gguf"), "-p", "x"], /nope\.gguf/],
    [
      "a truncated model",
      () => {
        const p = join(dir, "truncated.gguf");
        writeFileSync(p, readFileSync(stories).subarray(0, 5000));
        return ["run", "-m", p, "-p", "x"];
      },
      /truncated\.gguf.*(TRUNCATED|past the end|truncated|expected)/i,
    ],
    [
      "an unsupported architecture",
      () => {
        // stories260K's weights under another architecture name
        const orig = openGguf(stories);
        const p = join(dir, "gpt2.gguf");
        writeGguf(p, {
          metadata: metadataEntries(orig).map((e) =>
            e.key === "general.architecture"
              ? { ...e, value: "gpt2" }
              : { ...e, key: e.key.replace(/^llama\./, "gpt2.") },
          ),
          tensors: orig.tensors.map((t) => ({ ...t, data: readTensorBytes(orig, t) })),
        });
        return ["run", "-m", p, "-p", "x"];
      },
      /unsupported architecture "gpt2"/,
    ],
    [
      "a vocabulary-only file",
      () => ["run", "-m", join(models, "vocab", "ggml-vocab-gpt-2.gguf"), "-p", "x"],
      /ggml-vocab-gpt-2\.gguf: this is a vocabulary-only file: it holds a tokenizer but no weights/,
    ],
    [
      "a prompt longer than the context",
      () => ["run", "-m", stories, "-p", "Once upon a time there was a dog. ".repeat(20), "-c", "32"],
      /prompt has \d+ tokens.*n_ctx 32/,
    ],
    ["a bad number", () => ["run", "-m", stories, "-p", "x", "-n", "ten"], /n-predict must be an integer/],
    [
      "an activation statistics file (--stats) that is not a GGUF",
      () => {
        const p = join(dir, "not-stats.txt");
        writeFileSync(p, "these are not activation statistics\n");
        return ["run", "-m", stories, "--ram-budget", "1", "--stats", p, "-p", "x"];
      },
      /^powerinfer: activation statistics file \(--stats\) .*not-stats\.txt at byte 0: expected magic "GGUF" or "PWRI"/,
    ],
    [
      "a GGUF that is not activation statistics given to batched --stats",
      () => ["batched", "-m", stories, "--ram-budget", "1", "--stats", stories, "-p", "x"],
      /^powerinfer: activation statistics file \(--stats\) .*stories260K\.gguf: not an activation statistics file/,
    ],
    [
      "a broken statistics file at the default path (<model>.activations.gguf)",
      () => {
        const m = join(dir, "m.gguf");
        writeFileSync(m, readFileSync(stories));
        writeFileSync(join(dir, "m.activations.gguf"), "GGUF");
        return ["run", "-m", m, "--ram-budget", "1", "-p", "x"];
      },
      /^powerinfer: activation statistics file .*m\.activations\.gguf \(the default of --stats\) at byte \d+: /,
    ],
    [
      "a missing text file",
      () => ["perplexity", "-m", stories, "-f", join(dir, "nope.txt")],
      /text file .*nope\.txt does not exist/,
    ],
  ];
  for (const [what, args, pattern] of cases) {
    it(what, () => {
      const r = cli(...args());
      expect(r.code).not.toBe(0);
      expect(r.stderr).toMatch(pattern);
      const lines = r.stderr
        .trim()
        .split("\n")
        .filter((l) => !l.startsWith("(run with --help"));
      expect(lines, r.stderr).toHaveLength(1);
      expect(r.stderr).not.toMatch(/\n\s+at /); // no stack dump
    });
  }
});

describe("output that cannot be written", () => {
  it.skipIf(!existsSync("/dev/full"))(
    "a full device (/dev/full) ends the command with one line and exit 1, no stack trace",
    () => {
      const fd = openSync("/dev/full", "w");
      try {
        const r = spawnSync(process.execPath, [bin, "inspect", stories, "--json"], {
          stdio: ["ignore", fd, "pipe"],
          encoding: "utf8",
          timeout: 60_000,
        });
        expect(r.status).toBe(1);
        expect(r.stderr.trim()).toMatch(/^powerinfer: cannot write the output: ENOSPC/);
        expect(r.stderr.trim().split("\n")).toHaveLength(1);
      } finally {
        closeSync(fd);
      }
    },
  );
});

describe("perplexity numbers as llama.cpp prints them (%.4f)", () => {
  it("inf and nan, every digit of a huge value, four decimals", async () => {
    const { fixed4 } = await import("../src/commands/perplexity.js");
    expect(fixed4(Number.POSITIVE_INFINITY)).toBe("inf");
    expect(fixed4(Number.NaN)).toBe("nan");
    expect(fixed4(12.04912)).toBe("12.0491");
    expect(fixed4(2.5e22)).toBe("25000000000000000000000.0000");
  });
});

describe.skipIf(!probe.usable)("powerinfer perplexity", () => {
  it("reproduces the ReLU model's held-out perplexity 12.049 (all-tokens protocol of README-relu.md)", () => {
    const r = cli(
      "perplexity",
      "-m",
      join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"),
      "-f",
      join(models, "relu", "tinystories-relu-llama-7m.eval.txt"),
      "-c",
      "256",
      "--all-tokens",
      "--json",
    );
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out.tokensScored).toBe(107610);
    expect(out.chunks).toBe(422);
    // PyTorch fp32: mean NLL 2.4889889, ppl 12.049088 (we keep an F16 KV cache, as llama.cpp)
    expect(Math.abs(out.meanNll - 2.4889889333806687)).toBeLessThan(1e-4);
  }, 600_000);

  it("llama.cpp's protocol on stories260K gives a finite perplexity over whole chunks", () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-ppl-"));
    const text = join(dir, "t.txt");
    writeFileSync(
      text,
      readFileSync(join(models, "relu", "tinystories-relu-llama-7m.eval.txt"), "utf8").slice(0, 6000),
    );
    const r = cli("perplexity", "-m", stories, "-f", text, "-c", "128", "--json");
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out.tokensScored).toBe(out.chunks * 63); // positions 64..126 of each 128-token chunk predict 65..127
    expect(out.perplexity).toBeGreaterThan(1);
    expect(out.perplexity).toBeLessThan(50);
    // fewer than 2·n_ctx tokens: refused, as llama.cpp's perplexity refuses it
    const short = cli("perplexity", "-m", stories, "-f", text, "-c", "4096");
    expect(short.code).toBe(1);
    expect(short.stderr).toMatch(
      /^powerinfer: you need at least 8192 tokens to evaluate perplexity with a context of 4096: .* tokenizes to only \d+ tokens/m,
    );
    // an empty file: its BOS alone, one token
    const empty = join(dir, "empty.txt");
    writeFileSync(empty, "");
    const none = cli("perplexity", "-m", stories, "-f", empty, "-c", "128");
    expect(none.stderr).toMatch(/tokenizes to only 1 token \(a smaller/);
    // --all-tokens (no BOS added): chunks of n_ctx − 1, named with the file
    const allNone = cli("perplexity", "-m", stories, "-f", empty, "-c", "128", "--all-tokens");
    expect(allNone.code).toBe(1);
    expect(allNone.stderr).toBe(
      `powerinfer: --all-tokens scores chunks of n_ctx − 1 = 127 tokens: ${empty} tokenizes to only 0 tokens (a smaller -c scores shorter texts)\n`,
    );
  });
});
