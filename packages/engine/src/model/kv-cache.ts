/** The KV cache: per layer one K and one V tensor of [head_dim·n_head_kv, n_ctx], F16 by default. */
import { type Backend, BackendError, type TensorHandle } from "@powerinfer/core";
import { formatBytes } from "./ram-budget.js";

export type KvCacheType = "f16" | "f32";

export class KvCache {
  readonly k: TensorHandle[] = [];
  readonly v: TensorHandle[] = [];

  /**
   * @param nEmbdKv head_dim · n_head_kv (elements per position per layer)
   * @param nCtx positions held
   * @param layerBackend per layer, the backend holding its K and V (default `backend`): a layer whose
   *   attention runs on a device keeps its cache there
   * @throws BackendError 'OUT_OF_MEMORY' from the backend when it does not fit (nothing stays allocated).
   */
  constructor(
    readonly backend: Backend,
    nLayer: number,
    readonly nEmbdKv: number,
    readonly nCtx: number,
    readonly type: KvCacheType = "f16",
    layerBackend?: (l: number) => Backend,
  ) {
    const bytes = 2 * nLayer * nEmbdKv * nCtx * (type === "f16" ? 2 : 4);
    const free = backend.devices[0]?.freeMemory;
    if (free !== undefined && free > 0 && bytes > free) {
      throw new BackendError(
        "OUT_OF_MEMORY",
        `a KV cache for n_ctx ${nCtx} needs ${formatBytes(bytes, 2)}, ${backend.name} has ${formatBytes(free, 2)} free; use a smaller -c`,
      );
    }
    try {
      for (let l = 0; l < nLayer; l++) {
        const b = layerBackend?.(l) ?? backend;
        this.owners.push(b);
        this.k.push(b.createTensor(type, [nEmbdKv, nCtx]));
        this.v.push(b.createTensor(type, [nEmbdKv, nCtx]));
      }
    } catch (e) {
      this.dispose();
      throw e;
    }
  }

  /** Per layer, the backend holding its K and V. */
  readonly owners: Backend[] = [];

  /** Bytes held: 2 · n_layer · n_ctx · n_embd_kv · sizeof(type). */
  get byteLength(): number {
    return this.k.reduce((s, t) => s + t.byteLength, 0) * 2;
  }

  dispose(): void {
    for (let l = 0; l < this.k.length; l++) {
      this.owners[l]!.freeTensor(this.k[l]!);
      if (this.v[l]) this.owners[l]!.freeTensor(this.v[l]!);
    }
    this.k.length = 0;
    this.v.length = 0;
  }
}
