export { encode, encodedBytes, SYNTHETIC_DTYPES, type SyntheticDType } from "./encode.js";
export {
  type GenerateOptions as SyntheticGenerateOptions,
  generateSyntheticModel,
  planSyntheticModel,
  type SyntheticLayerStats,
  type SyntheticModelOptions,
  type SyntheticModelPlan,
  type SyntheticModelReport,
} from "./generator.js";
export {
  SHAPE_PRESET_NAMES,
  SHAPE_PRESETS,
  type ShapePreset,
  SYNTHETIC_ARCHS,
  type SyntheticArch,
  type SyntheticShape,
} from "./presets.js";
export { fillGauss, gauss, hashU32, mix32, streamKey, uniform } from "./random.js";
export {
  hotNeuronShare,
  normalCdf,
  normalQuantile,
  type PowerLawOptions,
  powerLawFrequencies,
} from "./stats-math.js";
export { MIN_SYNTHETIC_VOCAB, syntheticVocab, vocabMetadataFromGguf } from "./vocab.js";
export {
  activeParametersPerToken,
  calibrateExpertThreshold,
  generateSyntheticMoeModel,
  MOE_SHAPE_PRESETS,
  type MoeActivityDesign,
  type MoeDesignPlan,
  type MoePredictorOptions,
  moeRoutingProbabilities,
  planMoeDesign,
  type MoeShapePreset,
  SYNTHETIC_MOE_ARCHS,
  type SyntheticMoeArch,
  type SyntheticMoeOptions,
  type SyntheticMoeReport,
  type SyntheticMoeShape,
} from "./moe.js";
