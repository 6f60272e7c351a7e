/**
 * Load run for the server: C concurrent clients stream completions (fixed length, distinct prompts) from
 * an in-process server on 127.0.0.1; reports requests/s, time to first token and tokens/s at each
 * concurrency, and how many sequences the decode steps carried.
 *
 * Then the event-loop check: /health latency (p50, p99, max) while 16 clients stream and another client keeps
 * sending a 1 MB prompt to /v1/completions (refused before it is tokenized; with --big-prompts tokenize, 1 MB
 * texts to /tokenize, tokenized on the worker thread). The bench clients run in the server's process, so
 * their work counts against it too.
 *
 *   node dist/bench/load-bench.js [--model FILE] [--clients 1,4,16] [--tokens 64] [--requests N]
 *                                 [--threads T (1)] [--sparse MODE] [--health-seconds S (10; 0 = skip)]
 *                                 [--big-prompts completion (default) | tokenize | completion,tokenize | none]
 *                                 [--big-pause-ms MS (250): the big-prompt client's pause between requests] [--json]
 */
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { monitorEventLoopDelay } from "node:perf_hooks";
import { parseArgs } from "node:util";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model, type SparseMode } from "@powerinfer/engine";
import { createServer } from "../server.js";

const PROMPTS = [
  "Once upon a time",
  "Tim had a red ball",
  "The sun was hot",
  "Lily wanted to",
  "One day, a little",
  "The dog ran to",
  "Mom said that",
  "Sam and Sue",
  "There was a big tree",
  "The cat saw a bird",
  "Ben liked to",
  "In the park",
  "She looked at the sky",
  "The little boat",
  "A girl named Amy",
  "They went to the",
];

interface Sample {
  ttftMs: number;
  totalMs: number;
  tokens: number;
}

/** One streamed completion; times the first text and counts the tokens of the final usage. */
async function streamOnce(url: string, prompt: string, tokens: number): Promise<Sample> {
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ prompt, max_tokens: tokens, temperature: 0, ignore_eos: true, stream: true }),
  });
  if (!res.ok || !res.body) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const decoder = new TextDecoder();
  let buf = "";
  let ttft = -1;
  let n = 0;
  for await (const part of res.body as unknown as AsyncIterable<Uint8Array>) {
    buf += decoder.decode(part, { stream: true });
    let i = buf.indexOf("\n\n");
    while (i >= 0) {
      const ev = buf.slice(0, i);
      buf = buf.slice(i + 2);
      i = buf.indexOf("\n\n");
      if (!ev.startsWith("data: ") || ev === "data: [DONE]") continue;
      const chunk = JSON.parse(ev.slice(6)) as { choices: { text: string }[]; usage?: { completion_tokens: number } };
      if (ttft < 0 && chunk.choices[0]?.text) ttft = performance.now() - t0;
      if (chunk.usage) n = chunk.usage.completion_tokens;
    }
  }
  return { ttftMs: ttft, totalMs: performance.now() - t0, tokens: n };
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

interface HealthRun {
  /** /health probes answered, and their latency in ms. */
  probes: number;
  p50_ms: number;
  p99_ms: number;
  max_ms: number;
  /** Streams completed and 1 MB requests sent during the run. */
  streams: number;
  big_prompts: number;
  big_prompt_statuses: string;
  /** How late the event loop ran timers meanwhile (perf_hooks): what the server's own work delayed. */
  loop_delay_p99_ms: number;
  loop_delay_max_ms: number;
}

/**
 * /health latency while `clients` clients stream completions back to back and one more sends a 1 MB prompt
 * over and over (pausing `pauseMs` between requests) to the `targets`: "completion" (/v1/completions: too long
 * for a slot, refused from a lower bound on its token count), "tokenize" (/tokenize: tokenized on the worker).
 */
async function healthUnderLoad(
  url: string,
  clients: number,
  tokens: number,
  seconds: number,
  targets: string[],
  pauseMs: number,
): Promise<HealthRun> {
  const end = performance.now() + seconds * 1000;
  let streams = 0;
  let big = 0;
  const statuses = new Map<string, number>();
  const text = "Once upon a time there was a little girl named Lily who loved the sea. ".repeat(
    Math.ceil(1_000_000 / 72),
  );
  const bodies = (
    [
      ["completion", "/v1/completions", JSON.stringify({ prompt: text, max_tokens: 16 })],
      ["tokenize", "/tokenize", JSON.stringify({ content: text })],
    ] as const
  ).filter(([name]) => targets.includes(name));
  const latencies: number[] = [];
  const streamers = Array.from({ length: clients }, async (_, c) => {
    for (let i = c; performance.now() < end; i += clients) {
      await streamOnce(url, PROMPTS[i % PROMPTS.length]!, tokens);
      streams++;
    }
  });
  const sender = (async () => {
    await sleep(200); // the streams are under way
    for (let i = 0; bodies.length > 0 && performance.now() < end; i++) {
      const [, path, body] = bodies[i % bodies.length]!;
      const res = await fetch(`${url}${path}`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body,
      });
      await res.arrayBuffer();
      const key = `${path} ${res.status}`;
      statuses.set(key, (statuses.get(key) ?? 0) + 1);
      big++;
      await sleep(pauseMs);
    }
  })();
  const prober = (async () => {
    await sleep(200);
    while (performance.now() < end) {
      const t0 = performance.now();
      const res = await fetch(`${url}/health`);
      await res.arrayBuffer();
      latencies.push(performance.now() - t0);
      await sleep(5);
    }
  })();
  const loop = monitorEventLoopDelay({ resolution: 5 });
  loop.enable();
  await Promise.all([...streamers, sender, prober]);
  loop.disable();
  return {
    probes: latencies.length,
    p50_ms: pct(latencies, 50),
    p99_ms: pct(latencies, 99),
    max_ms: Math.max(...latencies),
    streams,
    big_prompts: big,
    big_prompt_statuses: [...statuses].map(([k, n]) => `${k} ×${n}`).join(", "),
    loop_delay_p99_ms: loop.percentile(99) / 1e6,
    loop_delay_max_ms: loop.max / 1e6,
  };
}

const pct = (xs: number[], p: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!;
};
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: {
      model: { type: "string" },
      clients: { type: "string", default: "1,4,16" },
      tokens: { type: "string", default: "64" },
      requests: { type: "string" },
      threads: { type: "string" },
      sparse: { type: "string" },
      "health-seconds": { type: "string", default: "10" },
      "big-prompts": { type: "string", default: "completion" },
      "big-pause-ms": { type: "string", default: "250" },
      json: { type: "boolean", default: false },
    },
  });
  // the shared models folder next to the repository (this file is apps/server/dist/bench/load-bench.js)
  const models =
    process.env.POWERINFER_TEST_MODELS ?? fileURLToPath(new URL("../../../../../shared/models", import.meta.url));
  const file = values.model ?? join(models, "stories260K.gguf");
  const clients = values.clients.split(",").map(Number);
  const tokens = Number(values.tokens);
  // one thread by default: on a tiny model the per-node barriers of a thread pool cost more than they save
  const threads = values.threads ? Number(values.threads) : 1;
  const slots = Math.max(...clients, Number(values["health-seconds"]) > 0 ? 16 : 1);
  const backend = await cpuBackend.load({ threads });
  const model = await Model.load(file, { backend, sparse: values.sparse as SparseMode | undefined });
  const perSlot = Math.min(model.config.n_ctx_train, 4096);
  const server = createServer({ model, slots, ctxSize: slots * perSlot, queueLimit: 1024 });
  const url = await server.listen({ host: "127.0.0.1", port: 0 });
  const sched = server.scheduler!;
  const rows: Record<string, number>[] = [];
  let health: HealthRun | undefined;
  const healthSeconds = Number(values["health-seconds"]);
  try {
    await streamOnce(url, PROMPTS[0]!, 8); // warm-up
    for (const c of clients) {
      const total = values.requests ? Number(values.requests) : Math.max(16, 4 * c);
      const m0 = { ...sched.metrics };
      let next = 0;
      const samples: Sample[] = [];
      const t0 = performance.now();
      await Promise.all(
        Array.from({ length: c }, async () => {
          for (let i = next++; i < total; i = next++) {
            samples.push(await streamOnce(url, PROMPTS[i % PROMPTS.length]!, tokens));
          }
        }),
      );
      const wall = (performance.now() - t0) / 1000;
      const m1 = sched.metrics;
      const steps = m1.decodeSteps - m0.decodeSteps;
      const generated = samples.reduce((s, x) => s + x.tokens, 0);
      rows.push({
        clients: c,
        requests: total,
        requests_per_s: total / wall,
        ttft_mean_ms: mean(samples.map((s) => s.ttftMs)),
        ttft_p50_ms: pct(
          samples.map((s) => s.ttftMs),
          50,
        ),
        ttft_p95_ms: pct(
          samples.map((s) => s.ttftMs),
          95,
        ),
        tokens_per_s: generated / wall,
        per_request_tokens_per_s: pct(
          samples.map((s) => (s.tokens * 1000) / s.totalMs),
          50,
        ),
        sequences_per_step: steps > 0 ? (m1.sequencesInSteps - m0.sequencesInSteps) / steps : 0,
      });
    }
    if (healthSeconds > 0)
      health = await healthUnderLoad(
        url,
        16,
        tokens,
        healthSeconds,
        values["big-prompts"].split(","),
        Number(values["big-pause-ms"]),
      );
  } finally {
    await server.close();
    model.dispose();
    backend.dispose();
  }
  if (values.json) {
    process.stdout.write(`${JSON.stringify({ model: file, threads, tokens, slots, rows, health }, null, 2)}\n`);
    return;
  }
  const f = (x: number, d = 1) => x.toFixed(d);
  process.stdout.write(
    `server load run: ${file.split("/").pop()}, ${backend.name} ${threads} threads, ${slots} slots, ${tokens} tokens per request (greedy, ignore_eos), streamed\n\n` +
      "| clients | requests | requests/s | TTFT mean / p50 / p95 (ms) | tokens/s (all clients) | tokens/s per request (p50) | sequences per decode step |\n" +
      "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n" +
      rows
        .map(
          (r) =>
            `| ${r.clients} | ${r.requests} | ${f(r.requests_per_s, 2)} | ${f(r.ttft_mean_ms)} / ${f(r.ttft_p50_ms)} / ${f(r.ttft_p95_ms)} | ${f(r.tokens_per_s)} | ${f(r.per_request_tokens_per_s)} | ${f(r.sequences_per_step, 2)} |`,
        )
        .join("\n") +
      "\n",
  );
  if (health) {
    process.stdout.write(
      `\n/health while 16 clients stream and one more sends 1 MB prompts (${healthSeconds} s): ${health.probes} probes, ` +
        `p50 ${f(health.p50_ms, 2)} ms, p99 ${f(health.p99_ms, 2)} ms, max ${f(health.max_ms, 2)} ms; ` +
        `event-loop delay p99 ${f(health.loop_delay_p99_ms, 2)} ms, max ${f(health.loop_delay_max_ms, 2)} ms; ` +
        `${health.streams} streams done, ${health.big_prompts} big requests (${health.big_prompt_statuses})\n`,
    );
  }
}

main().catch((e: unknown) => {
  process.stderr.write(`load-bench: ${e instanceof Error ? e.message : String(e)}\n`);
  process.exitCode = 1;
});
