/**
 * GGUF files as people have them: split models (`powerinfer gguf-split`, checked against llama.cpp),
 * vocabulary-only files, and malformed metadata keys — real processes, real files.
 */
import { spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model } from "@powerinfer/engine";
import {
  GgufTypes,
  GgufValueType,
  metadataEntries,
  openGguf,
  readTensorBytes,
  serializeGguf,
  writeActivationStats,
} from "@powerinfer/gguf";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { loadLlamaCpp } from "../src/bench/llama-cpp.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const stories = join(models, "stories260K.gguf");
const vocab = join(models, "vocab", "ggml-vocab-llama-spm.gguf");
const ref = JSON.parse(readFileSync(join(models, "reference", "stories260K.greedy32.json"), "utf8")).results[0] as {
  prompt: string;
  prompt_token_ids: number[];
  greedy_token_ids: number[];
  greedy_text: string;
};
const dir = mkdtempSync(join(tmpdir(), "cli-split-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function cli(args: string[], input?: string) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 120_000, input });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

const greedyArgs = ["-p", ref.prompt, "-n", "32", "--temp", "0", "-c", "256", "-t", "1"];
const probe = await cpuBackend.probe();
const peer = await loadLlamaCpp();

describe("powerinfer gguf-split", () => {
  const prefix = join(dir, "stories260K");
  const shards = [1, 2, 3].map((i) => `${prefix}-0000${i}-of-00003.gguf`);
  // every test here uses these shards (and runs alone too)
  let r: ReturnType<typeof cli>;
  beforeAll(() => {
    r = cli(["gguf-split", "--split-max-tensors", "20", stories, prefix]);
  });

  it("splits stories260K into 3 shards by --split-max-tensors 20 (20, 20, 8 tensors)", () => {
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr.trim().split("\n")).toEqual([
      `wrote ${shards[0]} (20 tensors, 0.64 MB)`,
      `wrote ${shards[1]} (20 tensors, 0.38 MB)`,
      `wrote ${shards[2]} (8 tensors, 0.17 MB)`,
    ]);
    expect(shards.map((p) => openGguf(p).tensors.length)).toEqual([20, 20, 8]);
    const dry = cli(["gguf-split", "--dry-run", "--split-max-size", "400K", stories, join(dir, "dry")]);
    expect(dry.code).toBe(0);
    // 400 KB (decimal, as llama.cpp counts): token_embd, output_norm, output and blk.0 up to ffn_down = 399,872 bytes
    expect(dry.stdout.trim().split("\n")).toEqual([
      `${join(dir, "dry")}-00001-of-00004.gguf: 10 tensors, 0.40 MB of tensor data`,
      `${join(dir, "dry")}-00002-of-00004.gguf: 18 tensors, 0.36 MB of tensor data`,
      `${join(dir, "dry")}-00003-of-00004.gguf: 18 tensors, 0.36 MB of tensor data`,
      `${join(dir, "dry")}-00004-of-00004.gguf: 2 tensors, 0.04 MB of tensor data`,
    ]);
    expect(cli(["gguf-split", "--split-max-size", "2T", stories, join(dir, "x")]).stderr).toMatch(
      /--split-max-size must be a positive integer of bytes, or one with a unit K, M or G/,
    );
  });

  it.skipIf(!probe.usable)("runs from shard 1 with the unsplit file's greedy text; shard 2 names shard 1", () => {
    const whole = cli(["run", "-m", stories, ...greedyArgs]);
    const split = cli(["run", "-m", shards[0], ...greedyArgs]);
    expect(split.code, split.stderr).toBe(0);
    expect(split.stdout).toBe(`${ref.prompt}${ref.greedy_text}\n`);
    expect(split.stdout).toBe(whole.stdout);
    const second = cli(["run", "-m", shards[1], ...greedyArgs]);
    expect(second.code).toBe(1);
    expect(second.stdout).toBe("");
    expect(second.stderr).toBe(
      `powerinfer: ${shards[1]}: this is shard 2 of 3 of a split model; give the first shard, ${shards[0]}\n`,
    );
  });

  it("inspect shows the split and which shard holds each tensor", () => {
    const r = cli(["inspect", shards[0]]);
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/^split: +3 shards, 1,185,664 bytes in all/m);
    expect(r.stdout).toContain(`  3. ${shards[2]}  8 tensors, 165,952 bytes`);
    expect(r.stdout).toMatch(/output\.weight +F32 +64 × 512 +131,072 \(shard 1\)/);
    const j = JSON.parse(cli(["inspect", "--json", shards[0]]).stdout);
    expect(j.split.shards.map((s: { tensorCount: number }) => s.tensorCount)).toEqual([20, 20, 8]);
    expect(j.tensors.at(-1).shard).toBe(3);
    expect(j.config.n_layer).toBe(5);
  });

  it("a missing input is one line naming it", () => {
    const missing = join(dir, "missing.gguf");
    const a = cli(["gguf-split", "--split-max-tensors", "20", missing, join(dir, "x")]);
    expect(a.code).toBe(1);
    expect(a.stderr).toBe(`powerinfer: model file ${missing} does not exist\n`);
    const b = cli(["gguf-split", "--merge", missing, join(dir, "y.gguf")]);
    expect(b.code).toBe(1);
    expect(b.stderr).toBe(`powerinfer: first shard ${missing} does not exist\n`);
  });

  it("replaces an existing shard or --merge output only with --force", () => {
    const keep = join(dir, "keep.txt");
    writeFileSync(keep, "precious\n");
    const m = cli(["gguf-split", "--merge", shards[0], keep]);
    expect(m.code).toBe(1);
    expect(m.stderr).toBe(`powerinfer: ${keep} exists (use --force to overwrite)\n`);
    expect(readFileSync(keep, "utf8")).toBe("precious\n");
    // splitting again over the same shards: refused before any shard is written
    const before = readFileSync(shards[0]);
    const s = cli(["gguf-split", "--split-max-tensors", "20", stories, prefix]);
    expect(s.code).toBe(1);
    expect(s.stderr).toBe(`powerinfer: ${shards[0]} exists (use --force to overwrite)\n`);
    expect(Buffer.compare(readFileSync(shards[0]), before)).toBe(0);
    const f = cli(["gguf-split", "--split-max-tensors", "20", stories, prefix, "--force"]);
    expect(f.code, f.stderr).toBe(0);
    expect(Buffer.compare(readFileSync(shards[0]), before)).toBe(0);
  });

  it("--merge writes the first shard's metadata with split.count 0 and the original tensor data byte for byte", () => {
    const out = join(dir, "merged.gguf");
    const r = cli(["gguf-split", "--merge", shards[0], out]);
    expect(r.code, r.stderr).toBe(0);
    const merged = openGguf(out);
    const first = metadataEntries(openGguf(shards[0]));
    expect(metadataEntries(merged)).toEqual(
      first.map((e) => (e.key === "split.count" ? { key: e.key, type: { type: GgufValueType.UINT16 }, value: 0 } : e)),
    );
    const orig = openGguf(stories);
    expect(merged.tensors.map((t) => t.name)).toEqual(orig.tensors.map((t) => t.name));
    const a = readFileSync(out).subarray(merged.dataOffset);
    const b = readFileSync(stories).subarray(orig.dataOffset);
    expect(Buffer.compare(a, b)).toBe(0);
    for (const t of orig.tensors)
      expect(Buffer.compare(readTensorBytes(merged, t.name), readTensorBytes(orig, t))).toBe(0);
    // shards joined with cat are named as such, with the fix
    const joined = join(dir, "joined.gguf");
    writeFileSync(joined, Buffer.concat(shards.map((p) => readFileSync(p))));
    const j = cli(["run", "-m", joined, "-p", "x"]);
    expect(j.code).toBe(1);
    expect(j.stderr).toMatch(/joined into one file \(with cat\).*powerinfer gguf-split --merge \S*joined\.gguf OUT`$/m);
    expect(j.stderr.trim().split("\n")).toHaveLength(1);
    // the fix it names works: the joined shards merge into the same file as the shards
    const fixed = join(dir, "fixed.gguf");
    expect(cli(["gguf-split", "--merge", joined, fixed]).code).toBe(0);
    expect(Buffer.compare(readFileSync(fixed), readFileSync(out))).toBe(0);
  });

  it("quantize --split-max-size writes shards that run", () => {
    const out = join(dir, "q8.gguf");
    const r = cli(["quantize", "--split-max-size", "200K", stories, out, "Q8_0"]);
    expect(r.code, r.stderr).toBe(0);
    const q = [1, 2].map((i) => join(dir, `q8-0000${i}-of-00002.gguf`));
    expect(q.map((p) => openGguf(p).tensors.length)).toEqual([24, 24]);
    if (probe.usable) {
      const unsplit = join(dir, "q8-unsplit.gguf");
      expect(cli(["quantize", stories, unsplit, "Q8_0"]).code).toBe(0);
      const a = cli(["run", "-m", q[0], ...greedyArgs]);
      expect(a.code, a.stderr).toBe(0);
      expect(a.stdout.startsWith(ref.prompt)).toBe(true);
      expect(a.stdout).toBe(cli(["run", "-m", unsplit, ...greedyArgs]).stdout);
    }
    const c = cli(["convert", "--to", "gguf", "--split-max-size", "1M", q[0], join(dir, "c.gguf")]);
    expect(c.code, c.stderr).toBe(0);
    // one shard of a split model read back whole: the split keys are its own, not the input's
    const one = openGguf(join(dir, "c-00001-of-00001.gguf"));
    expect(one.tensors).toHaveLength(48);
    expect(one.metadata.get("split.count")).toBe(1);
    // a split model rewritten as one file loses the input's split keys
    const whole = join(dir, "whole.gguf");
    expect(cli(["convert", "--to", "gguf", q[0], whole]).code).toBe(0);
    const w = openGguf(whole);
    expect(w.format).toBe("GGUF");
    expect(w.tensors).toHaveLength(48);
    expect([...w.metadata.keys()].filter((k) => k.startsWith("split."))).toEqual([]);
    // existing shards are replaced only with --force; never an input shard
    const keep = cli(["quantize", "--split-max-size", "200K", stories, join(dir, "q8.gguf"), "Q8_0"]);
    expect(keep.code).toBe(1);
    expect(keep.stderr).toMatch(/q8-00001-of-00002\.gguf exists \(use --force to overwrite\)/);
    const over = cli(["quantize", "--split-max-size", "200K", stories, join(dir, "q8.gguf"), "Q8_0", "--force"]);
    expect(over.code, over.stderr).toBe(0);
    const clash = cli(["quantize", "--split-max-size", "200K", q[0], join(dir, "q8.gguf"), "Q8_0", "--force"]);
    expect(clash.code).toBe(1);
    expect(clash.stderr).toMatch(/output .*q8-00001-of-00002\.gguf is also an input; choose another path/);
  });

  it.skipIf("unavailable" in peer || !probe.usable)(
    "llama.cpp (node-llama-cpp) loads our shards and gives the same greedy ids as the unsplit file",
    async () => {
      if ("unavailable" in peer) return;
      // shards and a merged file of their own, written by the command
      const own = join(dir, "peer", "stories260K");
      mkdirSync(dirname(own), { recursive: true });
      expect(cli(["gguf-split", "--split-max-tensors", "20", stories, own]).code).toBe(0);
      const first = `${own}-00001-of-00003.gguf`;
      const merged = join(dir, "peer", "merged.gguf");
      expect(cli(["gguf-split", "--merge", first, merged]).code).toBe(0);
      try {
        const ids: number[][] = [];
        for (const path of [stories, first, merged]) {
          const runner = await peer.open(path, { contextSize: 256, batchSize: 256, threads: 1 });
          ids.push((await runner.greedy(ref.prompt_token_ids, 32)).ids);
          await runner.dispose();
        }
        expect(ids[0]).toEqual(ref.greedy_token_ids);
        expect(ids[1]).toEqual(ids[0]);
        expect(ids[2]).toEqual(ids[0]);
        // and ours from the shards, the same ids
        const backend = await cpuBackend.load({ threads: 1 });
        const model = await Model.load(first, { backend });
        expect(model.file.splits).toHaveLength(3);
        const s = model.createSession({ nCtx: 256 });
        const got: number[] = [];
        for await (const t of s.generate(ref.prompt_token_ids, { maxTokens: 32, temperature: 0, ignoreEos: true }))
          got.push(t.id);
        s.dispose();
        model.dispose();
        backend.dispose();
        expect(got).toEqual(ref.greedy_token_ids);
      } finally {
        await peer.dispose();
      }
    },
    120_000,
  );
});

/** stories260K with one extra metadata entry whose key bytes are then rewritten by `patch`. */
function withKey(name: string, placeholder: string, patch: (buf: Uint8Array, at: number) => void): string {
  const orig = openGguf(stories);
  const buf = serializeGguf({
    metadata: [...metadataEntries(orig), { key: placeholder, type: GgufTypes.u32, value: 7 }],
    tensors: orig.tensors.map((t) => ({ name: t.name, type: t.type, shape: t.shape, data: readTensorBytes(orig, t) })),
  });
  const at = Buffer.from(buf).indexOf(Buffer.from(placeholder));
  patch(buf, at);
  const path = join(dir, name);
  writeFileSync(path, buf);
  return path;
}

describe("vocabulary-only files and malformed metadata keys", () => {
  it("run and serve refuse a vocabulary-only file in one line; inspect describes it; a GPU index and activation statistics are named", () => {
    const msg = `powerinfer: ${vocab}: this is a vocabulary-only file: it holds a tokenizer but no weights\n`;
    const run = cli(["run", "-m", vocab, "-p", "hello"]);
    expect(run.code).toBe(1);
    expect(run.stderr).toBe(msg);
    const serve = cli(["serve", "-m", vocab, "--port", "0"]);
    expect(serve.code).toBe(1);
    expect(serve.stderr).toBe(msg);
    const inspect = cli(["inspect", vocab]);
    expect(inspect.code).toBe(0);
    expect(inspect.stdout).toMatch(/^kind: +vocabulary-only \(a tokenizer, no weights\)$/m);
    expect(inspect.stdout).toMatch(/^sparse: +this is a vocabulary-only file/m);
    const idx = cli(["run", "-m", join(models, "powerinfer", "tiny.generated.gpuidx"), "-p", "x"]);
    expect(idx.stderr).toMatch(/^powerinfer: .*this is a PowerInfer GPU index/);
    const statsPath = join(dir, "m.activations.gguf");
    writeActivationStats(statsPath, {
      counts: [Int32Array.of(3, 0, 1, 2)],
      nFf: 4,
      tokenCount: 3,
      corpusName: "t.txt",
      corpusSha256: "0".repeat(64),
      modelSha256: "0".repeat(64),
    });
    const stats = cli(["run", "-m", statsPath, "-p", "x"]);
    expect(stats.code).toBe(1);
    expect(stats.stderr).toBe(
      `powerinfer: ${statsPath}: this is an activation-statistics file (written by \`powerinfer profile\`), not a model: give the model file it was measured on\n`,
    );
  });

  const bad: Array<[string, () => string, RegExp]> = [
    [
      "an empty key",
      // "zz.placehold" + u32 (28 bytes) becomes an empty key holding an 8-byte string
      () =>
        withKey("empty-key.gguf", "zz.placehold", (b, at) => {
          const dv = new DataView(b.buffer, b.byteOffset);
          dv.setBigUint64(at - 8, 0n, true);
          dv.setUint32(at, GgufValueType.STRING, true);
          dv.setBigUint64(at + 4, 8n, true);
          b.set(Buffer.from("abcdefgh"), at + 12);
        }),
      /^powerinfer: .*empty-key\.gguf at byte \d+: metadata key #\d+ is empty$/,
    ],
    [
      "a control character",
      () =>
        withKey("control-key.gguf", "zz.placeholder", (b, at) => {
          b[at + 2] = 0x07;
        }),
      /^powerinfer: .*control-key\.gguf at byte \d+: metadata key "zz\\u0007placeholder" contains the control character U\+0007$/,
    ],
    [
      "invalid UTF-8",
      () =>
        withKey("utf8-key.gguf", "zz.placeholder", (b, at) => {
          b[at + 2] = 0xff;
        }),
      /^powerinfer: .*utf8-key\.gguf at byte \d+: metadata key #\d+ is not valid UTF-8 \(bytes 7a 7a ff 70/,
    ],
    [
      "a duplicate key",
      () =>
        withKey("dup-key.gguf", "general.namf", (b, at) => {
          b[at + 11] = "e".charCodeAt(0);
        }),
      /^powerinfer: .*dup-key\.gguf at byte \d+: duplicate metadata key "general\.name"$/,
    ],
  ];
  const out = join(dir, "out");
  const text = join(dir, "text.txt");
  writeFileSync(text, "Once upon a time there was a cat.\n");
  const commands: Array<[string, (m: string) => string[], string?]> = [
    ["run", (m) => ["run", "-m", m, "-p", "x"]],
    ["chat", (m) => ["chat", "-m", m], "hello\n"],
    ["serve", (m) => ["serve", "-m", m, "--port", "0"]],
    ["batched", (m) => ["batched", "-m", m, "-p", "x", "-np", "2", "-n", "2"]],
    ["perplexity", (m) => ["perplexity", "-m", m, "-f", text]],
    ["profile", (m) => ["profile", "-m", m, "-f", text]],
    ["plan", (m) => ["plan", "-m", m]],
    ["train-predictor", (m) => ["train-predictor", "-m", m, "-f", text, "-o", `${out}.pwri.gguf`]],
    ["inspect", (m) => ["inspect", m]],
    ["convert", (m) => ["convert", m, `${out}.gguf`]],
    ["quantize", (m) => ["quantize", m, `${out}.gguf`, "Q8_0"]],
    ["gguf-split", (m) => ["gguf-split", m, out]],
  ];
  for (const [what, make, message] of bad) {
    it(`every command refuses a file with ${what}: exit 1, one line naming it`, () => {
      const path = make();
      for (const [name, args, input] of commands) {
        const r = cli(args(path), input);
        expect(r.code, `${name}: ${r.stderr}`).toBe(1);
        expect(r.stderr.trimEnd().split("\n"), `${name}: ${r.stderr}`).toHaveLength(1);
        expect(r.stderr.trimEnd(), name).toMatch(message);
      }
    }, 120_000);
  }

  it.skipIf(!probe.usable)(
    "a key that only breaks the naming convention is an inspect warning, and the model runs",
    () => {
      const path = withKey("convention-key.gguf", "zz.placeholder", (b, at) => {
        b.set(Buffer.from("Zz-Placeholder"), at);
      });
      const inspect = cli(["inspect", path]);
      expect(inspect.code).toBe(0);
      expect(inspect.stdout).toMatch(
        /^warning: +metadata key "Zz-Placeholder" does not follow the GGUF naming convention \(ASCII lower_snake_case segments separated by dots\)$/m,
      );
      expect(JSON.parse(cli(["inspect", "--json", path]).stdout).warnings).toHaveLength(1);
      const run = cli(["run", "-m", path, ...greedyArgs]);
      expect(run.code, run.stderr).toBe(0);
      expect(run.stdout).toBe(`${ref.prompt}${ref.greedy_text}\n`);
    },
  );
});
