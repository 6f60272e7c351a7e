/** Machine-readable reason of a {@link TokenizerError}. */
export type TokenizerErrorCode =
  /** `tokenizer.ggml.model` names a tokenizer this package does not implement (e.g. `bert` WordPiece). */
  | "UNSUPPORTED_MODEL"
  /** `tokenizer.ggml.pre` names a BPE pre-tokenizer this package does not implement. */
  | "UNSUPPORTED_PRE_TOKENIZER"
  /** A required GGUF key is absent (e.g. `tokenizer.ggml.tokens`, or `tokenizer.ggml.merges` for BPE). */
  | "MISSING_METADATA"
  /** A GGUF key holds a value of the wrong type or size. */
  | "INVALID_METADATA"
  /** A token id outside `[0, nVocab)` was passed. */
  | "INVALID_TOKEN_ID"
  /** A special token (BOS/EOS) is required by the options but the vocabulary does not define it. */
  | "MISSING_SPECIAL_TOKEN";

/**
 * Error thrown by the tokenizer: a bad or unsupported vocabulary, or an invalid argument.
 * `code` says which (see {@link TokenizerErrorCode}); the message names the offending key, model or id.
 */
export class TokenizerError extends Error {
  readonly code: TokenizerErrorCode;

  constructor(code: TokenizerErrorCode, message: string) {
    super(message);
    this.name = "TokenizerError";
    this.code = code;
  }
}
