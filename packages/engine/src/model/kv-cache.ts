/** The KV cache: per layer one K and one V tensor of [head_dim·n_head_kv, n_ctx], F16 by default. */
import { type Backend, BackendError, type TensorHandle } from "@powerinfer/core";

export type KvCacheType = "f16" | "f32";

export class KvCache {
  readonly k: TensorHandle[] = [];
  readonly v: TensorHandle[] = [];

  /**
   * @param nEmbdKv head_dim · n_head_kv (elements per position per layer)
   * @param nCtx positions held
   * @throws BackendError 'OUT_OF_MEMORY' from the backend when it does not fit.
   */
  constructor(
    readonly backend: Backend,
    nLayer: number,
    readonly nEmbdKv: number,
    readonly nCtx: number,
    readonly type: KvCacheType = "f16",
  ) {
    const bytes = 2 * nLayer * nEmbdKv * nCtx * (type === "f16" ? 2 : 4);
    const free = backend.devices[0]?.freeMemory;
    if (free !== undefined && free > 0 && bytes > free) {
      throw new BackendError(
        "OUT_OF_MEMORY",
        `a KV cache for n_ctx ${nCtx} needs ${(bytes / 2 ** 30).toFixed(2)} GiB, ${backend.name} has ${(free / 2 ** 30).toFixed(2)} GiB free; use a smaller -c`,
      );
    }
    for (let l = 0; l < nLayer; l++) {
      this.k.push(backend.createTensor(type, [nEmbdKv, nCtx]));
      this.v.push(backend.createTensor(type, [nEmbdKv, nCtx]));
    }
  }

  /** Bytes held: 2 · n_layer · n_ctx · n_embd_kv · sizeof(type). */
  get byteLength(): number {
    return this.k.reduce((s, t) => s + t.byteLength, 0) * 2;
  }

  dispose(): void {
    for (const t of [...this.k, ...this.v]) this.backend.freeTensor(t);
    this.k.length = 0;
    this.v.length = 0;
  }
}
