/**
 * `powerinfer serve --chat-template` / `--chat-template-file` (llama-server's options, jinja only): the
 * template is checked before anything is loaded, replaces the model's, and its tool-call format is used.
 */
import { spawn, spawnSync } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K-ggml-org.gguf");
const probe = await cpuBackend.probe();

/** A Mistral Nemo-style template: tools in [AVAILABLE_TOOLS], calls as [TOOL_CALLS][…]. */
const MISTRAL = `{{- bos_token }}{%- for message in messages %}{%- if message.role == 'user' %}{%- if tools and loop.last %}{{- "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}{%- endif %}{{- "[INST]" + message.content + "[/INST]" }}{%- elif message.role == 'assistant' and message.tool_calls %}{{- "[TOOL_CALLS]" + (message.tool_calls | tojson) + eos_token }}{%- else %}{{- message.content + eos_token }}{%- endif %}{%- endfor %}`;

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 120_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe("serve --chat-template: checked before the model file is looked at", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-template-"));
  const m = join(dir, "missing.gguf");
  const empty = join(dir, "empty.jinja");
  writeFileSync(empty, "  \n");
  it.each([
    [["--chat-template", "{% for m in messages %}"], /--chat-template: chat template does not parse: /],
    [["--chat-template", "x", "--chat-template-file", empty], /give --chat-template or --chat-template-file, not both/],
    [["--chat-template-file", empty], /--chat-template-file: the template is empty/],
    [["--chat-template-file", join(dir, "nope.jinja")], /chat template file .*nope\.jinja does not exist/],
  ])("%j", (args, pattern) => {
    const r = cli("serve", "-m", m, "--port", "0", ...args);
    expect(r.code).toBe(1);
    const lines = r.stderr
      .trim()
      .split("\n")
      .filter((l) => l !== "" && !l.startsWith("(run with --help"));
    expect(lines, r.stderr).toHaveLength(1);
    expect(lines[0]).toMatch(pattern);
    expect(lines[0]).not.toMatch(/missing\.gguf/);
  });
});

describe.skipIf(!probe.usable)(`serve --chat-template-file with tools (${probe.reason})`, () => {
  it("renders the template's tools and answers calls in its format", async () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-template-"));
    const file = join(dir, "mistral.jinja");
    writeFileSync(file, MISTRAL);
    const child = spawn(
      process.execPath,
      [bin, "serve", "-m", stories, "--port", "0", "-t", "1", "-c", "1024", "--chat-template-file", file],
      { stdio: ["ignore", "pipe", "pipe"] },
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
      const tool = {
        type: "function",
        function: {
          name: "add",
          parameters: { type: "object", properties: { a: { type: "integer" } }, required: ["a"] },
        },
      };
      const body = { messages: [{ role: "user", content: "Add" }], tools: [tool], tool_choice: "required" };
      const props = (await (await fetch(`${url}/props`)).json()) as { chat_template: string };
      expect(props.chat_template).toBe(MISTRAL);
      const shown = (await (
        await fetch(`${url}/apply-template`, { method: "POST", body: JSON.stringify(body) })
      ).json()) as { prompt: string };
      expect(shown.prompt).toContain('[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "add", ');
      const r = await fetch(`${url}/v1/chat/completions`, {
        method: "POST",
        body: JSON.stringify({ ...body, max_tokens: 128, seed: 3 }),
      });
      // biome-ignore lint/suspicious/noExplicitAny: checked field by field
      const j = (await r.json()) as any;
      expect(r.status, JSON.stringify(j)).toBe(200);
      expect(j.choices[0].finish_reason).toBe("tool_calls");
      const call = j.choices[0].message.tool_calls[0];
      expect(call.id).toMatch(/^[a-zA-Z0-9]{9}$/);
      expect(call.function.name).toBe("add");
      expect(Number.isInteger(JSON.parse(call.function.arguments).a)).toBe(true);
    } finally {
      child.kill("SIGTERM");
    }
    expect(await exited).toBe(0);
  });
});
