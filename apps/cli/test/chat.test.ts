/**
 * `powerinfer chat`: piped input answered line by line (the built CLI in real processes, replies checked
 * against `powerinfer run` on the same ChatML prompt), and what happens when the context fills (the
 * conversation logic over a scripted session, where every token position is known).
 */
import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import {
  ChatTemplate,
  type GeneratedToken,
  type GenerateOptions,
  type StopReason,
  type Timings,
} from "@powerinfer/engine";
import { describe, expect, it } from "vitest";
import { Chat, type ChatSession } from "@powerinfer/engine";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K.gguf");
const probe = await cpuBackend.probe();

function cli(input: string | undefined, ...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { input, encoding: "utf8", timeout: 120_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

type Msg = { role: string; content: string };
/** llama.cpp's ChatML fallback (stories260K has no chat template). */
const chatml = (messages: Msg[]) =>
  `${messages.map((m) => `<|im_start|>${m.role}\n${m.content}<|im_end|>\n`).join("")}<|im_start|>assistant\n`;

/** The greedy reply to a conversation, from `powerinfer run` on its ChatML text. */
function runReply(messages: Msg[], ...args: string[]): string {
  const prompt = chatml(messages);
  const r = cli(undefined, "run", "-m", stories, "-p", prompt, "--temp", "0", "-t", "1", ...args);
  expect(r.code, r.stderr).toBe(0);
  expect(r.stdout.startsWith(prompt)).toBe(true);
  return r.stdout.slice(prompt.length, -1); // run ends with a newline of its own
}

describe.skipIf(!probe.usable)(`powerinfer chat with piped input (${probe.reason})`, () => {
  const common = ["-m", stories, "-n", "16", "--temp", "0", "-t", "1"];

  it("answers every line in order, then exits 0 at end of input", () => {
    const lines = ["Hi", "Tell me a story", "What happened next?"];
    const r = cli(`${lines.join("\n")}\n`, "chat", ...common, "-c", "512");
    expect(r.code, r.stderr).toBe(0);
    const messages: Msg[] = [];
    let expected = "";
    for (const line of lines) {
      messages.push({ role: "user", content: line });
      const reply = runReply(messages, "-n", "16", "-c", "512");
      expect(reply.length).toBeGreaterThan(0);
      messages.push({ role: "assistant", content: reply });
      expected += `${reply}\n`;
    }
    expect(r.stdout).toBe(expected);
    expect(r.stderr).not.toMatch(/context full|powerinfer:/);
  });

  it("skips empty lines and stops at /exit", () => {
    const one = cli("Hi\n", "chat", ...common);
    expect(one.code, one.stderr).toBe(0);
    expect(one.stdout).toBe(`${runReply([{ role: "user", content: "Hi" }], "-n", "16")}\n`);
    const r = cli("\n  \nHi\n/exit\nTell me a story\n", "chat", ...common);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toBe(one.stdout);
  });

  it("a full context drops the oldest turns, keeps the system prompt, and the chat goes on", () => {
    // n_ctx 128 (the model's trained context): one ChatML turn with its reply and the next message do not fit
    // with room for 16 more tokens, so every turn after the first is answered with the system prompt alone
    const system = "You tell stories.";
    const lines = ["Hi", "Tell me a story", "What happened next?"];
    const r = cli(`${lines.join("\n")}\n`, "chat", ...common, "--system", system);
    expect(r.code, r.stderr).toBe(0);
    const notices = r.stderr.split("\n").filter((l) => l.startsWith("context full"));
    expect(notices).toEqual([
      "context full (n_ctx 128): dropped the 2 oldest messages (the system prompt is kept)",
      "context full (n_ctx 128): dropped the 2 oldest messages (the system prompt is kept)",
    ]);
    const expected = lines
      .map(
        (content) =>
          `${runReply(
            [
              { role: "system", content: system },
              { role: "user", content },
            ],
            "-n",
            "16",
          )}\n`,
      )
      .join("");
    expect(r.stdout).toBe(expected);
  });

  it("bad values are one line and a non-zero exit", () => {
    for (const [args, pattern] of [
      [["-n", "-2"], /--n-predict must be an integer ≥ 0 \(or -1 = until end of turn\), got -2/],
      [["-c", "-1"], /--ctx-size must be an integer ≥ 0, got -1/],
      [["--system", "a long system prompt ".repeat(20), "-c", "64"], /system prompt takes \d+ tokens of the 64-token/],
    ] as const) {
      const r = cli("Hi\n", "chat", "-m", stories, ...args);
      expect(r.code, r.stderr).not.toBe(0);
      expect(r.stderr).toMatch(pattern);
      expect(r.stdout).toBe("");
      expect(
        r.stderr
          .trim()
          .split("\n")
          .filter((l) => l.startsWith("powerinfer:")),
      ).toHaveLength(1);
    }
  });
});

/**
 * A session that evaluates whatever it is given (one token per position) and then writes "x" until the
 * reply has `replyLength` tokens (then end of turn), the budget is spent or the context is full, as the
 * engine does. It records where each prompt was evaluated.
 */
class ScriptedSession implements ChatSession {
  nPast = 0;
  timings: Timings = { promptTokens: 0, promptMs: 0, generatedTokens: 0, generateMs: 0 };
  readonly evaluated: { at: number; text: string }[] = [];
  /** Tokens of the reply being written, across calls. */
  written = 0;
  replyLength = 0;

  constructor(readonly nCtx: number) {}

  async *generate(prompt: readonly number[], opts: GenerateOptions): AsyncGenerator<GeneratedToken> {
    if (this.nPast + prompt.length > this.nCtx) throw new Error(`prompt too long at ${this.nPast}`);
    this.evaluated.push({ at: this.nPast, text: String.fromCharCode(...prompt) });
    this.nPast += prompt.length;
    const max = opts.maxTokens ?? -1;
    this.timings = { promptTokens: prompt.length, promptMs: 0, generatedTokens: 0, generateMs: 0 };
    let reason: StopReason;
    for (let n = 0; ; n++) {
      if (opts.signal?.aborted) {
        reason = "aborted";
        break;
      }
      if (max >= 0 && n >= max) {
        reason = "length";
        break;
      }
      if (this.written >= this.replyLength) {
        reason = "eos";
        break;
      }
      this.written++;
      yield { id: "x".charCodeAt(0), text: "x" };
      if (this.nPast >= this.nCtx) {
        reason = "context";
        break;
      }
      this.nPast++;
    }
    this.timings.stopReason = reason;
  }

  reply(length: number): this {
    this.written = 0;
    this.replyLength = length;
    return this;
  }
}

/** One token per character; a terse template so every position can be counted. */
function scripted(nCtx: number, settings: { system?: string; nPredict: number }) {
  const session = new ScriptedSession(nCtx);
  const template = new ChatTemplate(
    "{% for m in messages %}{{ m.role[0] + ':' + m.content + ';' }}{% endfor %}{% if add_generation_prompt %}a:{% endif %}",
    false,
    "",
    "",
  );
  const out = { text: "", notices: [] as string[] };
  const chat = new Chat(
    session,
    (text) => [...text].map((c) => c.charCodeAt(0)),
    template,
    { ...settings, sampling: {} },
    {
      text: (s) => {
        out.text += s;
      },
      notice: (l) => {
        out.notices.push(l);
      },
    },
  );
  return { session, chat, out };
}

describe("chat when the context fills", () => {
  it("a reply that fills the context goes on after the oldest turn is dropped; the cache keeps the common prefix", async () => {
    const { session, chat, out } = scripted(40, { system: "S", nPredict: -1 });
    session.reply(5);
    await chat.turn("hi"); // "s:S;u:hi;a:" 11 tokens + 5
    expect(out.text).toBe("xxxxx\n");
    session.reply(25);
    // "s:S;u:hi;a:xxxxx;u:yo;a:" is 24 tokens (16 cached): 16 tokens of the reply fill the context and a 17th
    // is sampled; then "u:hi;a:xxxxx;" is dropped and "s:S;u:yo;a:" + the 17 tokens (28) are evaluated
    // again from the shared "s:S;u:" (6), and the last 8 tokens follow
    await chat.turn("yo");
    expect(out.text).toBe(`xxxxx\n${"x".repeat(25)}\n`);
    expect(out.notices).toEqual([
      "context full (n_ctx 40): dropped the 2 oldest messages (the system prompt is kept); the reply goes on",
    ]);
    expect(session.evaluated).toEqual([
      { at: 0, text: "s:S;u:hi;a:" },
      { at: 16, text: ";u:yo;a:" },
      { at: 6, text: `yo;a:${"x".repeat(17)}` },
    ]);
    expect(session.nPast).toBe(28 + 8);
    expect(chat.messages).toEqual([
      { role: "system", content: "S" },
      { role: "user", content: "yo" },
      { role: "assistant", content: "x".repeat(25) },
    ]);
  });

  it("a turn starts by dropping old turns until the reply has room (-n), then reuses the system prompt's cache", async () => {
    const { session, chat, out } = scripted(40, { nPredict: 10 });
    session.reply(1000);
    await chat.turn("one"); // "u:one;a:" 8 + 10
    await chat.turn("two"); // 8 + 11 + 8 = 27 + 10 ≤ 40
    expect(out.notices).toEqual([]);
    await chat.turn("three"); // 27 + 11 + 10 = 48 > 40: drop "one" → 19 + 10 + 10 = 39 ≤ 40
    expect(out.notices).toEqual(["context full (n_ctx 40): dropped the 2 oldest messages"]);
    expect(chat.messages.map((m) => m.content)).toEqual(["two", "x".repeat(10), "three", "x".repeat(10)]);
    expect(session.evaluated.at(-1)).toEqual({ at: 2, text: "two;a:xxxxxxxxxx;u:three;a:" });
    expect(out.text).toBe(`${"x".repeat(10)}\n`.repeat(3));
  });

  it("a reply that alone fills the context is cut with a notice; the next message still gets an answer", async () => {
    const { session, chat, out } = scripted(20, { nPredict: -1 });
    session.reply(100);
    await chat.turn("hi"); // 7 + 13 evaluated, and a 14th token sampled
    expect(out.text).toBe(`${"x".repeat(14)}\n`);
    expect(out.notices).toEqual(["context full (n_ctx 20): the reply is cut; this turn alone fills the context"]);
    session.reply(3);
    await chat.turn("yo");
    expect(out.notices.at(-1)).toBe("context full (n_ctx 20): dropped the 2 oldest messages");
    expect(out.text).toBe(`${"x".repeat(14)}\nxxx\n`);
  });

  it("a message longer than the context is not sent; the chat goes on", async () => {
    const { session, chat, out } = scripted(20, { nPredict: 4 });
    await chat.turn("y".repeat(30));
    expect(out.notices).toEqual([
      "message not sent: it takes 35 tokens, the context holds 20 (n_ctx); use a larger -c",
    ]);
    expect(chat.messages).toEqual([]);
    session.reply(4);
    await chat.turn("hi");
    expect(out.text).toBe("xxxx\n");
  });

  it("a message that cannot fit even alone is refused before any older turn is dropped", async () => {
    const { session, chat, out } = scripted(40, { nPredict: 4 });
    session.reply(4);
    await chat.turn("hi");
    await chat.turn("y".repeat(60));
    expect(out.notices).toEqual([
      "message not sent: it takes 65 tokens, the context holds 40 (n_ctx); use a larger -c",
    ]);
    expect(chat.messages.map((m) => m.content)).toEqual(["hi", "xxxx"]);
  });

  it("Ctrl+C stops the reply being written and keeps what was written", async () => {
    const { session, chat, out } = scripted(100, { nPredict: -1 });
    session.reply(50);
    const s = session.generate.bind(session);
    session.generate = async function* (p, o) {
      for await (const t of s(p, o)) {
        yield t;
        if (session.written === 3) expect(chat.interrupt()).toBe(true);
      }
    };
    await chat.turn("hi");
    expect(out.text).toBe("xxx\n");
    expect(chat.interrupt()).toBe(false);
    expect(chat.messages.at(-1)).toEqual({ role: "assistant", content: "xxx" });
  });

  it("a system prompt that fills the context is refused", () => {
    expect(() => scripted(10, { system: "a long system prompt", nPredict: -1 })).toThrow(
      /the system prompt takes 28 tokens of the 10-token context/,
    );
  });
});
