/**
 * The process that starts native llama-bench runs for the bench (see startLlamaBenchSpawner in
 * native-llama-cpp.ts): it receives { id, file, args, maxBuffer } messages, runs the program and answers
 * { id, error, stdout, stderr }. It exits when its parent does.
 */
import { execFile } from "node:child_process";

interface Request {
  id: number;
  file: string;
  args: string[];
  maxBuffer: number;
}

process.on("message", (m: Request) => {
  execFile(m.file, m.args, { maxBuffer: m.maxBuffer, encoding: "utf8" }, (err, stdout, stderr) => {
    process.send?.({ id: m.id, error: err ? err.message : null, stdout, stderr });
  });
});
process.on("disconnect", () => process.exit(0));
