/** `powerinfer serve` and `powerinfer batched` as a user runs them: the built CLI in real processes. */
import { spawn, spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K.gguf");
const probe = await cpuBackend.probe();

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 120_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("serve: the context of each slot (-c split over -np)", () => {
  it("refuses fewer than 2 tokens per slot, warns below 64, naming -c, -np and the per-slot context", async () => {
    const { checkSlotContext } = await import("../src/commands/serve.js");
    expect(() => checkSlotContext(130, 128)).toThrow(
      "-c 130 split over -np 128 slots leaves 1 token of context per slot: a slot needs at least 2 (one prompt token and one generated token); raise -c/--ctx-size or lower -np/--parallel",
    );
    expect(() => checkSlotContext(1, 1)).toThrow("-c 1 split over -np 1 slot leaves 1 token of context per slot");
    expect(() => checkSlotContext(100, 64, true)).toThrow(
      "-c 0 (the model's trained context, 100 tokens) split over -np 64 slots leaves 1 token of context per slot",
    );
    expect(checkSlotContext(256, 128)).toBe(
      "-c 256 split over -np 128 slots leaves 2 tokens of context per slot: every request's prompt and reply must fit in 2 tokens; raise -c/--ctx-size or lower -np/--parallel",
    );
    expect(checkSlotContext(63, 1)).toMatch(/leaves 63 tokens of context per slot/);
    expect(checkSlotContext(64, 1)).toBeUndefined();
    expect(checkSlotContext(8192, 128)).toBeUndefined();
  });
});

describe.skipIf(!probe.usable)(`powerinfer batched and serve (${probe.reason})`, () => {
  it("batched: every sequence equals `run` with seed S+i", () => {
    const common = ["-m", stories, "-p", "The sun was", "-n", "24", "--temp", "0.9", "-t", "1"];
    const b = cli("batched", ...common, "-np", "2", "--seed", "42", "--json");
    expect(b.code, b.stderr).toBe(0);
    const out = JSON.parse(b.stdout) as { sequences: { seed: number; text: string }[]; decode_steps: number };
    expect(out.sequences.map((s) => s.seed)).toEqual([42, 43]);
    expect(new Set(out.sequences.map((s) => s.text)).size).toBe(2);
    out.sequences.forEach((s, i) => {
      const r = cli("run", ...common, "--seed", String(42 + i));
      expect(r.code).toBe(0);
      expect(`The sun was${s.text}\n`).toBe(r.stdout);
    });
  });

  it("batched: greedy sequences are llama.cpp's reference text; plain output names each sequence", () => {
    const ref = JSON.parse(readFileSync(join(models, "reference", "stories260K.greedy32.json"), "utf8"));
    const b = cli("batched", "-m", stories, "-p", "Once upon a time", "-np", "2", "-n", "32", "--temp", "0", "-t", "1");
    expect(b.code, b.stderr).toBe(0);
    const text = `Once upon a time${ref.results[0].greedy_text}`;
    expect(b.stdout).toBe(
      `sequence 0 (seed ${/seed (\d+)/.exec(b.stdout)![1]}):\n\n${text}\n\nsequence 1 (seed ${
        Number(/seed (\d+)/.exec(b.stdout)![1]) + 1
      }):\n\n${text}\n\n`,
    );
    expect(b.stderr).toMatch(/decoded 64 tokens in .* 32 decode steps of 2\.00 sequences/);
  });

  it("batched: says so when the context (-c) stops the sequences, as run does", () => {
    const args = ["-m", stories, "-p", "Once upon a time", "-n", "-1", "--ignore-eos", "--temp", "0", "-t", "1"];
    const b = cli("batched", ...args, "-np", "2", "-c", "16");
    expect(b.code, b.stderr).toBe(0);
    expect(b.stderr.split("\n")).toContain("context full (n_ctx 16): generation stopped for all 2 sequences");
    // run's words, for one sequence
    const one = cli("batched", ...args, "-np", "1", "-c", "16");
    expect(one.stderr.split("\n")).toContain("context full (n_ctx 16): generation stopped");
    const r = cli("run", ...args, "-c", "16");
    expect(r.stderr).toContain("\ncontext full (n_ctx 16): generation stopped\n");
    // stopped by -n: no such line
    expect(cli("batched", ...args.slice(0, 4), "-n", "4", "-np", "2", "-c", "16").stderr).not.toMatch(/context full/);
  });

  it("batched --help says -c is each sequence's context, not llama.cpp's one context shared by all", () => {
    const help = cli("batched", "--help");
    expect(help.code).toBe(0);
    expect(help.stdout.replace(/\s+/g, " ")).toContain(
      "-c, --ctx-size <n> context size in tokens of each sequence, so N sequences hold N × this (llama.cpp's batched -c is one context shared by all the sequences) (default: the prompt plus -n tokens, at most the model's trained context and 4096; 0: the trained context)",
    );
    // the other commands keep the shared words
    expect(cli("run", "--help").stdout.replace(/\s+/g, " ")).toContain(
      "-c, --ctx-size <n> context size in tokens (default: the model's trained context, at most 4096; 0: the trained context)",
    );
  });

  it("serve: listens, answers, and stops cleanly on SIGTERM", async () => {
    // with llama-server's generation defaults and --no-slots
    const defaults = ["--seed", "42", "--temp", "0.5", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.1"];
    const child = spawn(
      process.execPath,
      [
        bin,
        "serve",
        "-m",
        stories,
        "--port",
        "0",
        "-np",
        "2",
        "-t",
        "1",
        "--metrics",
        ...defaults,
        "-n",
        "7",
        "--repeat-penalty",
        "1.1",
        "--no-slots",
      ],
      {
        stdio: ["ignore", "pipe", "pipe"],
      },
    );
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    const exited = new Promise<number | null>((r) => child.on("exit", (code) => r(code)));
    try {
      const end = Date.now() + 30_000;
      while (!/ready/.test(stderr) && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
      const url = /listening on (http:\/\/127\.0\.0\.1:\d+)/.exec(stderr)?.[1];
      expect(url, stderr).toBeDefined();
      expect(stderr).toMatch(/2 slots × 128 tokens/);
      const r = await fetch(`${url}/v1/completions`, {
        method: "POST",
        body: JSON.stringify({ prompt: "Once upon a time", max_tokens: 5, temperature: 0 }),
      });
      expect(((await r.json()) as { choices: { text: string }[] }).choices[0]!.text).toBe(", there was a little");
      expect(await (await fetch(`${url}/metrics`)).text()).toMatch(/llamacpp:tokens_predicted_total 5/);
      const props = (await (await fetch(`${url}/props`)).json()) as {
        default_generation_settings: { params: Record<string, unknown> };
      };
      expect(props.default_generation_settings.params).toMatchObject({
        seed: 42,
        temperature: 0.5,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.1,
        n_predict: 7,
        repeat_penalty: 1.1,
      });
      // a request that sets nothing gets them
      const d = await fetch(`${url}/completion`, { method: "POST", body: JSON.stringify({ prompt: "Once" }) });
      expect(((await d.json()) as { tokens_predicted: number }).tokens_predicted).toBe(7);
      expect((await fetch(`${url}/slots`)).status).toBe(501);
    } finally {
      child.kill("SIGTERM");
    }
    expect(await exited).toBe(0);
  });

  it("serve: bad numbers and names are one line and a non-zero exit, before it ever listens", () => {
    const cases: [string[], string][] = [
      [["-c", "-5"], "--ctx-size must be an integer ≥ 0, got -5"],
      [
        ["-c", "3", "-np", "4"],
        "-c 3 split over -np 4 slots leaves 0 tokens of context per slot: a slot needs at least 2 (one prompt token and one generated token); raise -c/--ctx-size or lower -np/--parallel",
      ],
      // one token per slot: room for the prompt, none for a reply
      [["-c", "130", "-np", "128"], "-c 130 split over -np 128 slots leaves 1 token of context per slot"],
      // -c 0: the model's trained context (128 tokens) split over the slots
      [
        ["-c", "0", "-np", "100"],
        "-c 0 (the model's trained context, 128 tokens) split over -np 100 slots leaves 1 token of context per slot",
      ],
      [["-c", "ten"], '--ctx-size must be an integer ≥ 0, got "ten"'],
      [["--queue", "-1"], "--queue must be an integer ≥ 0, got -1"],
      [["--queue", "1.5"], '--queue must be an integer ≥ 0, got "1.5"'],
      [["-np", "0"], "--parallel must be an integer in [1, 256], got 0"],
      [["--port", "70000"], "--port must be an integer in [0, 65535], got 70000"],
      [["-b", "0"], "--batch-size must be an integer ≥ 1, got 0"],
      [["-t", "0"], '--threads must be an integer in [1, 512] or -1 (the default), got "0"'],
      [["--kv-type", "q4"], '--kv-type must be f16 or f32, got "q4"'],
      [["--sparse", "nope"], '--sparse must be predictor, oracle or off, got "nope"'],
      [["--sparse-threshold", "x"], 'sparse-threshold must be a number, got "x"'],
      [["--api-key", ""], "--api-key is empty"],
      [["--alias", " "], "--alias is empty"],
      [["--seed", "-2"], "--seed must be an integer in [0, 4294967295] (or -1 = random), got -2"],
      [["--temp", "hot"], '--temp must be a number, got "hot"'],
      [["--top-k", "1.5"], '--top-k must be an integer, got "1.5"'],
      [["--top-p", "1.5"], "--top-p must be a number in [0, 1], got 1.5"],
      [["--min-p", "2"], "--min-p must be a number in [0, 1], got 2"],
      [["-n", "-3"], "--n-predict must be an integer ≥ 0 (or -1 = no limit, -2 = until the context is full), got -3"],
      [["--repeat-penalty", "0"], "--repeat-penalty must be a number > 0, got 0"],
    ];
    for (const [args, message] of cases) {
      const r = spawnSync(process.execPath, [bin, "serve", "-m", stories, "--port", "0", ...args], {
        encoding: "utf8",
        timeout: 20_000,
      });
      expect(r.status, `${args.join(" ")}: ${r.stderr}`).toBe(1);
      expect(r.stderr).not.toMatch(/listening/);
      const lines = r.stderr
        .trim()
        .split("\n")
        .filter((l) => !l.startsWith("(run with --help"));
      expect(lines, r.stderr).toHaveLength(1);
      expect(lines[0]).toContain(message);
    }
  });

  it("serve: slots of fewer than 64 tokens are warned about before it listens, and it still starts", async () => {
    const child = spawn(process.execPath, [bin, "serve", "-m", stories, "--port", "0", "-c", "640", "-np", "128"], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stderr = "";
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
    });
    try {
      const end = Date.now() + 30_000;
      while (!/ready|powerinfer: /.test(stderr) && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
      expect(stderr).toMatch(/ready — 128 slots × 5 tokens/);
      expect(stderr.split("\n")[0]).toBe(
        "warning: -c 640 split over -np 128 slots leaves 5 tokens of context per slot: every request's prompt and reply must fit in 5 tokens; raise -c/--ctx-size or lower -np/--parallel",
      );
    } finally {
      child.kill("SIGKILL");
    }
  });

  it("serve: a port in use, a host that is not this machine's or a host name that does not resolve is one line naming the option", async () => {
    const { createServer } = await import("node:net");
    const busy = createServer();
    await new Promise<void>((resolve) => busy.listen(0, "127.0.0.1", resolve));
    const port = (busy.address() as { port: number }).port;
    try {
      const r = spawnSync(process.execPath, [bin, "serve", "-m", stories, "--port", String(port)], {
        encoding: "utf8",
        timeout: 60_000,
      });
      expect(r.status, r.stderr).toBe(1);
      expect(r.stderr).toContain(`port ${port} on 127.0.0.1 is in use by another program: choose another --port`);
      expect(r.stderr).not.toMatch(/EADDRINUSE/);
    } finally {
      busy.close();
    }
    const h = spawnSync(process.execPath, [bin, "serve", "-m", stories, "--port", "0", "--host", "192.0.2.77"], {
      encoding: "utf8",
      timeout: 60_000,
    });
    expect(h.status, h.stderr).toBe(1);
    expect(h.stderr).toMatch(/cannot listen on --host 192\.0\.2\.77: not an address of this machine/);
    // a name that does not resolve is not called a foreign address
    const n = spawnSync(process.execPath, [bin, "serve", "-m", stories, "--port", "0", "--host", "not_a_host"], {
      encoding: "utf8",
      timeout: 60_000,
    });
    expect(n.status, n.stderr).toBe(1);
    expect(n.stderr).toMatch(
      /^powerinfer: cannot listen on --host not_a_host: the host name cannot be resolved \((ENOTFOUND|EAI_AGAIN: name resolution failed for now)\); give an address of this machine or a name that resolves to one$/m,
    );
    expect(n.stderr).not.toMatch(/not an address of this machine/);
  });

  it("serve: a load that fails after it listens ends with the error as the last line, no 'stopping' before it", () => {
    const r = cli("serve", "-m", join(models, "stories260K.gguf"), "--port", "0", "--ram-budget", "0.00001");
    expect(r.code).not.toBe(0);
    const lines = r.stderr.trim().split("\n");
    expect(lines[0], r.stderr).toMatch(/^powerinfer serve: listening on /);
    expect(lines.at(-1)).toMatch(/^powerinfer: RAM budget .* is too small for this model/);
    expect(r.stderr).not.toMatch(/stopping/);
  });

  it("serve: a bad model file is one line on stderr and a non-zero exit", () => {
    const r = cli("serve", "-m", join(models, "nope.gguf"), "--port", "0");
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/nope\.gguf/);
    expect(r.stderr.trim().split("\n"), r.stderr).toHaveLength(1);
  });
});
