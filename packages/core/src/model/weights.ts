/** Mapping GGUF tensors onto backend tensors. */
import { type GgufFile, type GgufTensorInfo, ggmlTypeName } from "@powerinfer/gguf";
import type { Backend, DType, TensorHandle } from "../backend/types.js";
import { DTYPE_CODES } from "../backend/graph.js";
import { EngineError } from "../engine/errors.js";

const DTYPE_BY_CODE = new Map<number, DType>(Object.entries(DTYPE_CODES).map(([k, v]) => [v, k as DType]));

/**
 * The backend dtype of a GGUF tensor type.
 * @throws EngineError 'UNSUPPORTED_TYPE' naming the tensor and type.
 */
export function dtypeOfTensor(t: GgufTensorInfo): DType {
  const d = DTYPE_BY_CODE.get(t.type);
  if (!d) {
    throw new EngineError(
      "UNSUPPORTED_TYPE",
      `tensor ${t.name} has type ${ggmlTypeName(t.type)}, which the engine does not support`,
    );
  }
  return d;
}

/** Maps GGUF tensors into a backend (zero-copy on a CPU backend), checking shapes. */
export class WeightMapper {
  /** Bytes of tensors mapped so far. */
  bytes = 0;
  constructor(
    readonly file: GgufFile,
    readonly backend: Backend,
  ) {}

  has(name: string): boolean {
    return this.file.tensorMap.has(name);
  }

  /**
   * @param ne expected shape (ne[0] first); checked when given.
   * @throws EngineError 'MISSING_TENSOR' or 'BAD_SHAPE'.
   */
  map(name: string, ne?: readonly number[]): TensorHandle {
    const t = this.file.tensorMap.get(name);
    if (!t) throw new EngineError("MISSING_TENSOR", `model file lacks tensor ${name}`);
    if (ne) {
      const got = [...t.shape];
      while (got.length > ne.length && got[got.length - 1] === 1) got.pop();
      if (got.length !== ne.length || got.some((v, i) => v !== ne[i])) {
        throw new EngineError("BAD_SHAPE", `tensor ${name} has shape [${t.shape}], expected [${ne}]`);
      }
    }
    this.bytes += t.byteLength;
    return this.backend.mapTensor(dtypeOfTensor(t), t.shape, {
      path: this.file.path,
      fileOffset: t.fileOffset,
      byteLength: t.byteLength,
    });
  }

  mapOptional(name: string, ne?: readonly number[]): TensorHandle | undefined {
    return this.has(name) ? this.map(name, ne) : undefined;
  }
}
