/**
 * The worker thread behind {@link TokenizerService}: a copy of the model's tokenizer (built from the
 * vocabulary it is sent) that tokenizes long texts while the server's event loop goes on.
 */
import { setPriority } from "node:os";
import { parentPort, workerData } from "node:worker_threads";
import { Tokenizer, type TokenizerVocab } from "@powerinfer/tokenizer";

// a long tokenization is background work: lower this thread (nice 10) so that the event loop and the decode
// steps keep the CPU when the cores are busy. Only on Linux, where a nice value is per thread (elsewhere it
// would lower the whole server).
if (process.platform === "linux") {
  try {
    setPriority(0, 10);
  } catch {
    // not permitted here: run at the normal priority
  }
}

interface Job {
  id: number;
  text: string;
  addSpecial: boolean;
  parseSpecial: boolean;
}

const tokenizer = new Tokenizer((workerData as { vocab: TokenizerVocab }).vocab);
const port = parentPort!;
port.on("message", (job: Job) => {
  try {
    const ids = Int32Array.from(
      tokenizer.tokenize(job.text, { addSpecial: job.addSpecial, parseSpecial: job.parseSpecial }),
    );
    port.postMessage({ id: job.id, ids }, [ids.buffer]);
  } catch (e) {
    port.postMessage({ id: job.id, error: e instanceof Error ? e.message : String(e) });
  }
});
