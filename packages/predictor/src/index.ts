/**
 * @powerinfer/predictor — per-layer activation predictors (fc1 → ReLU → fc2, after Deja Vu, Liu et al.
 * 2023, as PowerInfer, Song et al. 2023, runs them): collecting (FFN input, firing mask) pairs from a
 * model, warm-starting from the gate, training with a recall-weighted cross-entropy and AdamW,
 * calibrating thresholds, evaluating against a fixed hot-neuron list, checkpoints, and writing models
 * with predictors (PowerInfer GGUF) or quantized.
 */
export {
  type CheckpointKeyParts,
  CHECKPOINT_ARCH,
  checkpointKey,
  type ExpertCheckpoint,
  loadCheckpoint,
  loadExpertCheckpoint,
  saveCheckpoint,
  saveExpertCheckpoint,
} from "./checkpoint.js";
export {
  type ActivationDataset,
  activationCounts,
  type CollectOptions,
  collectActivations,
  fired,
  type LayerActivations,
  maskStride,
  sliceDataset,
  splitText,
} from "./dataset.js";
export {
  collectExpertActivations,
  evaluateExpertPredictors,
  type ExpertActivationDataset,
  type ExpertLayerReport,
  type ExpertPredictorResult,
  type TrainExpertPredictorsArgs,
  trainExpertPredictors,
} from "./experts.js";
export {
  evaluateSharedExpertPredictors,
  type SharedExpertPredictor,
  sharedExpertDataset,
  sharedRankForBytes,
  trainSharedExpertPredictors,
} from "./shared-experts.js";
export { type EvaluateArgs, evaluatePredictors, type LayerReport, summarizeReport } from "./evaluate.js";
export { backendMatMul, jsMatMul, type MatMul, transpose } from "./matmul.js";
export {
  type Confusion,
  confusionAt,
  hotListConfusion,
  type Quality,
  quality,
  thresholdForRecall,
} from "./metrics.js";
export {
  isFloatType,
  isQuantizableMatrix,
  QUANTIZE_TYPES,
  readPredictors,
  type RewriteOptions,
  type RewriteResult,
  rewriteModel,
  rewriteModelFile,
} from "./model-file.js";
export {
  type BakedPredictors,
  bakeThresholds,
  type LayerProgress,
  type LayerResult,
  type PipelineCheckpoint,
  type PipelineEvent,
  type PredictorTrainingOptions,
  pipelineDefaults,
  type RankCandidate,
  rankLadder,
  splitDataset,
  type TrainPredictorsArgs,
  type TrainPredictorsResult,
  trainPredictors,
} from "./pipeline.js";
export {
  fitLogitScale,
  type GateSubspace,
  gateDirectionsUsed,
  gatePredictor,
  gateSubspace,
  type LayerPredictor,
  predictLogits,
  predictorCost,
  randomPredictor,
  roundF16InPlace,
  roundPredictorF16,
} from "./predictor.js";
export { deriveSeed, Rng } from "./rng.js";
export {
  batchLossAndGradients,
  type EpochReport,
  initialTrainState,
  type LayerTrainState,
  type StepInfo,
  scorePredictor,
  type TrainLayerArgs,
  type TrainOptions,
  trainDefaults,
  trainLayer,
} from "./train.js";
