import * as fs from "node:fs";
import * as nodePath from "node:path";
import { GgufError } from "./errors.js";

/** What a non-regular file is, for messages. */
function kindOf(st: fs.Stats): string {
  if (st.isDirectory()) return "a folder";
  if (st.isFIFO()) return "a FIFO (named pipe)";
  if (st.isCharacterDevice()) return "a character device";
  if (st.isBlockDevice()) return "a block device";
  if (st.isSocket()) return "a socket";
  return "not a regular file";
}

/**
 * The file a writer should replace for output `path`. The writers put their data in a temporary file and
 * rename it over the output, which would replace a symbolic link or a special file with a plain file: a
 * symlink is followed (the file it names gets the data, as `cp` or llama.cpp's writers do, and the link
 * stays), and an existing folder, FIFO, device or socket is refused before anything is written.
 * @returns `path`, or the path its symlinks lead to (which may not exist yet)
 * @throws GgufError `IO` when the output (after links) exists and is not a regular file, or when the
 *   links loop
 */
export function resolveOutputFile(path: string): string {
  let p = path;
  for (let hops = 0; hops < 40; hops++) {
    let st: fs.Stats;
    try {
      st = fs.lstatSync(p);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === "ENOENT") return p;
      throw new GgufError("IO", `cannot check the output ${path}: ${(e as Error).message}`, { path, cause: e });
    }
    if (st.isSymbolicLink()) {
      p = nodePath.resolve(nodePath.dirname(p), fs.readlinkSync(p));
      continue;
    }
    if (!st.isFile()) {
      const via = p === path ? "" : ` (the link leads to ${p})`;
      throw new GgufError("IO", `the output ${path} is ${kindOf(st)}${via}, not a regular file; nothing was written`, {
        path,
      });
    }
    return p;
  }
  throw new GgufError("IO", `the output ${path} is a loop of symbolic links; nothing was written`, { path });
}
