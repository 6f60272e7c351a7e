export { TokenizerError, type TokenizerErrorCode } from "./errors.js";
export { type PreTokenizerConfig, preTokenizerConfig, supportedPreTokenizers } from "./pretokenizer.js";
export {
  type DetokenizeOptions,
  TokenAttr,
  TokenDecoder,
  type TokenizeOptions,
  Tokenizer,
  type TokenToPieceOptions,
  tokenizerFromGguf,
} from "./tokenizer.js";
export {
  type GgufMetadataSource,
  TokenType,
  type TokenizerModel,
  type TokenizerVocab,
  vocabFromGguf,
} from "./vocab.js";
