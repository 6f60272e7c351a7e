export type EngineErrorCode =
  | "CONTEXT_FULL"
  | "PROMPT_TOO_LONG"
  | "UNSUPPORTED_ARCH"
  | "UNSUPPORTED_TYPE"
  | "UNSUPPORTED_OP"
  | "MISSING_TENSOR"
  | "BAD_SHAPE"
  | "BAD_INPUT"
  | "ABORTED"
  | "QUEUE_FULL"
  | "RAM_BUDGET"
  /** A placement plan had to be solved, and there are no activation statistics to solve it from. */
  | "NO_STATS"
  /** Activation statistics measured on another model (layers, n_ff, experts or the file's fingerprint differ). */
  | "STATS_MISMATCH"
  /** The backend computed a step but left logits unwritten or NaN. */
  | "BACKEND_FAULT"
  /** Reading the model file failed (rows read directly for a device copy under --ram-budget). */
  | "IO"
  | "DISPOSED";

/** Every error the engine throws on purpose; `message` is one line naming the problem. */
export class EngineError extends Error {
  constructor(
    readonly code: EngineErrorCode,
    message: string,
  ) {
    super(message);
    this.name = "EngineError";
  }
}
