/**
 * @powerinfer/gguf — GGUF and PowerInfer-GGUF (PWRI) reader/writer, ggml tensor types, reference
 * (de)quantization, typed model configuration and PowerInfer GPU index files. Pure TypeScript, no
 * native code.
 */

export { type ActivationKind, type ModelConfig, ModelConfigSchema, parseModelConfig } from "./model-config.js";
export { GgufError, type GgufErrorCode } from "./errors.js";
export { resolveOutputFile } from "./output-path.js";
export { bf16ToF32, f16ToF32, f32ToBf16, f32ToF16 } from "./float.js";
export {
  GGML_TYPE_INFO,
  GGMLType,
  type GGMLTypeInfo,
  ggmlTypeFromName,
  ggmlTypeName,
  ggmlTypeToPwri,
  isGgmlType,
  pwriTypeToGgml,
  tensorByteLength,
} from "./ggml-types.js";
export { type GpuIndex, type GpuIndexLayer, readGpuIndex, serializeGpuIndex, writeGpuIndex } from "./gpu-index.js";
export {
  getArray,
  getNumber,
  getOptionalArray,
  getOptionalBool,
  getOptionalNumber,
  getOptionalString,
  getString,
} from "./metadata.js";
export { dequantize, quantize, quantizeQ4_0, quantizeQ8_0 } from "./quant.js";
export {
  GGML_MAX_DIMS,
  GGUF_DEFAULT_ALIGNMENT,
  type GgufFile,
  type GgufTensorInfo,
  getTensor,
  keyConventionProblem,
  keyProblem,
  openGguf,
  openGgufAt,
  parseGgufBuffer,
  readTensorBytes,
  readTensorF32,
} from "./reader.js";
export {
  type GgufValue,
  GgufValueType,
  type GgufValueTypeInfo,
  GgufTypes,
  valueTypeName,
} from "./values.js";
export {
  type GgufStreamOptions,
  type GgufStreamSpec,
  type GgufStreamTensor,
  ggufStreamSize,
  writeGgufStreaming,
} from "./stream-writer.js";
export {
  type GgufMetadataEntry,
  type GgufTensorSpec,
  type GgufWriteSpec,
  metadataEntries,
  serializeGguf,
  writeGguf,
} from "./writer.js";
export {
  ACTIVATION_STATS_ARCH,
  type ActivationStats,
  modelFingerprint,
  readActivationStats,
  writeActivationStats,
} from "./activation-stats.js";
export {
  assertModelFile,
  type GgufFileKind,
  type GgufShard,
  type GgufSplitInfo,
  ggufFileKind,
  KEY_SPLIT_COUNT,
  KEY_SPLIT_NO,
  KEY_SPLIT_TENSORS_COUNT,
  type GgufSplitOptions,
  mergeGgufSplit,
  notAModelReason,
  type OpenModelOptions,
  openGgufModel,
  parseSplitPath,
  planGgufSplit,
  splitInfo,
  splitPath,
  withoutSplitKeys,
  writeGgufSplit,
} from "./split.js";
