/**
 * resolveOutputFile and the writers: a symlink is followed (its target gets the file, the link stays), a
 * folder or FIFO in place of the output is refused before anything is written, a loop of links is named.
 */
import { spawnSync } from "node:child_process";
import { lstatSync, mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import { GGMLType, GgufError, openGguf, resolveOutputFile, writeGguf, writeGgufStreaming } from "../src/index.js";

const dir = mkdtempSync(join(tmpdir(), "gguf-out-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const spec = {
  metadata: [],
  tensors: [{ name: "t", type: GGMLType.F32, shape: [4], data: new Uint8Array(new Float32Array([1, 2, 3, 4]).buffer) }],
};

describe("output paths", () => {
  it("a missing or regular file is written in place; a symlink's target gets the file", async () => {
    expect(resolveOutputFile(join(dir, "new.gguf"))).toBe(join(dir, "new.gguf"));
    const target = join(dir, "target.gguf");
    writeFileSync(target, "old");
    const link = join(dir, "link.gguf");
    symlinkSync("target.gguf", link); // relative, as ln -s writes it
    expect(resolveOutputFile(link)).toBe(target);
    writeGguf(link, spec);
    expect(lstatSync(link).isSymbolicLink()).toBe(true);
    expect(openGguf(target).tensors[0]!.name).toBe("t");
    // a dangling link: the file is created where it points
    const dangling = join(dir, "dangling.gguf");
    symlinkSync(join(dir, "made.gguf"), dangling);
    await writeGgufStreaming(
      dangling,
      {
        metadata: [],
        tensors: [
          {
            name: "t",
            type: GGMLType.F32,
            shape: [4],
            data: async function* () {
              yield new Uint8Array(new Float32Array([1, 2, 3, 4]).buffer);
            },
          },
        ],
      },
      { reserveBytes: 0 },
    );
    expect(lstatSync(dangling).isSymbolicLink()).toBe(true);
    expect(openGguf(join(dir, "made.gguf")).tensors).toHaveLength(1);
  });

  it("a folder, a FIFO or a loop of links is refused, and stays what it was", () => {
    const folder = join(dir, "folder.gguf");
    mkdirSync(folder);
    expect(() => writeGguf(folder, spec)).toThrow(/folder\.gguf is a folder, not a regular file; nothing was written/);
    const fifo = join(dir, "fifo.gguf");
    expect(spawnSync("mkfifo", [fifo]).status).toBe(0);
    expect(() => writeGguf(fifo, spec)).toThrow(GgufError);
    expect(() => writeGguf(fifo, spec)).toThrow(/a FIFO \(named pipe\), not a regular file/);
    expect(lstatSync(fifo).isFIFO()).toBe(true);
    const viaLink = join(dir, "to-fifo.gguf");
    symlinkSync(fifo, viaLink);
    expect(() => writeGguf(viaLink, spec)).toThrow(/the link leads to .*fifo\.gguf/);
    const a = join(dir, "a.gguf");
    const b = join(dir, "b.gguf");
    symlinkSync(b, a);
    symlinkSync(a, b);
    expect(() => writeGguf(a, spec)).toThrow(/a loop of symbolic links/);
    // nothing was left behind by the refusals
    expect(readFileSync(join(dir, "target.gguf")).length).toBeGreaterThan(0);
  });
});
