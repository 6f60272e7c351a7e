/**
 * Typed errors of the GGUF reader and writer.
 *
 * Every error raised while reading or writing a GGUF / PowerInfer GGUF file is a {@link GgufError}
 * with a machine-readable {@link GgufErrorCode}; parse errors also carry the absolute byte offset of
 * the field at fault, and the message names that offset and what was expected there.
 */

/** Machine-readable reason of a {@link GgufError}. */
export type GgufErrorCode =
  /** The first 4 bytes are neither `GGUF` nor `PWRI`. */
  | "BAD_MAGIC"
  /** The version field is not 2 or 3 (v1 and big-endian files are not supported). */
  | "UNSUPPORTED_VERSION"
  /** The file ends inside a fixed-size field of the header, or before the data section. */
  | "TRUNCATED"
  /** A string, array or count field claims more bytes than remain in the file. */
  | "LENGTH_PAST_END"
  /** A tensor's data range lies (partly) outside the file. */
  | "TENSOR_OUT_OF_BOUNDS"
  /** A tensor's data offset is not a multiple of the file's alignment. */
  | "MISALIGNED"
  /** Two tensors' data ranges overlap (a corrupted header: llama.cpp refuses such a file too). */
  | "TENSOR_OVERLAP"
  /** An unknown ggml tensor type id or GGUF metadata value type id. */
  | "UNKNOWN_TYPE"
  /** Two tensors with the same name. */
  | "DUPLICATE_TENSOR"
  /** Two metadata entries with the same key. */
  | "DUPLICATE_KEY"
  /** A metadata key that is empty, not valid UTF-8, or contains control characters. */
  | "BAD_KEY"
  /** Shards of a split model (`split.no` / `split.count`) that are missing, inconsistent or joined wrongly. */
  | "BAD_SPLIT"
  /** A well-formed GGUF that is not a model (vocabulary-only, GPU index, activation statistics) given as one. */
  | "NOT_A_MODEL"
  /** A tensor with more than 4 dimensions (ggml's GGML_MAX_DIMS). */
  | "TOO_MANY_DIMS"
  /** A tensor's element count or byte size does not fit in 2^53 - 1 (or a dimension in int64). */
  | "ELEMENT_OVERFLOW"
  /** A tensor's row length (ne0) is not a multiple of its type's block size. */
  | "BAD_SHAPE"
  /** A required metadata key is absent. */
  | "MISSING_KEY"
  /** A metadata value has the wrong type or an invalid / contradictory value. */
  | "BAD_VALUE"
  /** A tensor type that this operation does not support (dequantization, PWRI output). */
  | "UNSUPPORTED_TYPE"
  /** A tensor name that is not in the file. */
  | "MISSING_TENSOR"
  /** A file-system error (open, read, write, rename). */
  | "IO";

/** Error raised by every function of `@powerinfer/gguf` on bad input. */
export class GgufError extends Error {
  override readonly name = "GgufError";
  /** Machine-readable reason. */
  readonly code: GgufErrorCode;
  /** Absolute byte offset (in the file or buffer) of the field at fault, when there is one. */
  readonly offset?: number;
  /** Path of the file being read or written, when known. */
  readonly path?: string;

  constructor(code: GgufErrorCode, message: string, opts: { offset?: number; path?: string; cause?: unknown } = {}) {
    // "<path> at byte <offset>: <what was expected>" — the code is a property, not repeated here.
    const where = [opts.path, opts.offset !== undefined ? `at byte ${opts.offset}` : undefined]
      .filter(Boolean)
      .join(" ");
    super(where ? `${where}: ${message}` : message, opts.cause !== undefined ? { cause: opts.cause } : undefined);
    this.code = code;
    if (opts.offset !== undefined) this.offset = opts.offset;
    if (opts.path !== undefined) this.path = opts.path;
  }
}
