/**
 * `powerinfer profile`: activation statistics of a ReLU model (dense FFN or routed ReLU experts) over real
 * text, and a sparsity report.
 */
import { createHash } from "node:crypto";
import { basename } from "node:path";
import { checkStatsForModel, defaultStatsPath, profileActivations, summarizeSparsity } from "@powerinfer/engine";
import { modelFingerprint, openGguf, readActivationStats, writeActivationStats } from "@powerinfer/gguf";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import {
  checkOutputPath,
  int,
  type ModelCliOptions,
  modelOptions,
  readTextFile,
  refuseOverwriteUnlessKind,
} from "./common.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";

/** Fewer positions than this get a warning: their firing rates are too noisy for a placement plan. */
const MIN_PROFILE_POSITIONS = 32;

export function register(program: Command): void {
  deviceOptions(
    modelOptions(
      program.command("profile").description("count how often each FFN neuron fires on a text; sparsity report"),
    ),
  )
    .requiredOption("-f, --file <file>", "text file to run the model on")
    .option(
      "--tokens <n>",
      "stop after this many positions, BOS included (may be below -c; at least 2: a chunk holds one text token after BOS)",
      int("tokens", { min: 2 }),
    )
    .option("-o, --output <file>", "statistics file (default: <model>.activations.gguf next to the model)")
    .option("--json", "print the report as JSON")
    .option("--force", "replace the output even when it is not an activation statistics file")
    .action(
      action(
        async (
          o: ModelCliOptions &
            DeviceCliOptions & { file: string; tokens?: number; output?: string; json?: boolean; force?: boolean },
        ) => {
          const out = o.output ?? defaultStatsPath(o.model);
          checkOutputPath(out, o.model, o.file);
          // an earlier profile's statistics are replaced; anything else (a model, say) only with --force
          const replacing = refuseOverwriteUnlessKind(out, o.force, "activation-stats");
          // statistics of another model are not ours to replace without --force
          if (replacing && !o.force) {
            const theirs = readActivationStats(out).modelSha256;
            const mine = modelFingerprint(openGguf(o.model));
            if (theirs && theirs !== mine) {
              throw new InvalidArgumentError(
                `${out} holds the activation statistics of another model file: choose another output or use --force to overwrite it`,
              );
            }
          }
          // profile counts every neuron's firing, so its FFN runs dense whatever --sparse says (said, not
          // refused: the same options are often given to every command)
          if (o.sparse !== undefined && o.sparse !== "off" && !o.json) {
            process.stderr.write(
              `note: profile runs the FFN densely (it counts every neuron's firing); --sparse ${o.sparse} is ignored\n`,
            );
          }
          if (openGguf(o.model).metadata.has("powerinfer.bundle.version")) {
            throw new InvalidArgumentError(
              `${o.model} is a bundled model (convert --bundle), which runs in predictor mode only, and profile needs the FFN dense: profile the PowerInfer file it was made from (\`powerinfer convert ${o.model} OUT --to pwri\` makes one) and give its statistics to the bundled model with --stats`,
            );
          }
          const text = readTextFile(o.file);
          const loaded = await loadModelWithDevice({ ...o, sparse: "off", profiling: true }, !!o.json);
          const { backend, model } = loaded;
          const cfg = model.config;
          const session = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
          const tok = model.tokenizer;
          const ids = tok.tokenize(text, { addSpecial: false });
          const fingerprint = modelFingerprint(model.file);
          const prof = profileActivations(session, ids, {
            bosId: tok.bosId,
            maxTokens: o.tokens,
            onChunk: (d, n) => {
              // a terminal: one line rewritten; a pipe or file: a line per chunk (llama.cpp's imatrix prints each)
              if (o.json) return;
              if (process.stderr.isTTY) process.stderr.write(`\rprofiling chunk ${d}/${n}`);
              else process.stderr.write(`profiling chunk ${d}/${n}\n`);
            },
          });
          if (!o.json && process.stderr.isTTY) process.stderr.write("\n");
          const stats = {
            counts: prof.counts,
            nFf: cfg.moe ? cfg.moe.n_ff_exp : cfg.n_ff,
            ...(prof.nExpert ? { nExpert: prof.nExpert, selections: prof.selections } : {}),
            tokenCount: prof.tokens,
            corpusName: basename(o.file),
            corpusSha256: createHash("sha256").update(text).digest("hex"),
            modelSha256: fingerprint,
          };
          writeActivationStats(out, stats);
          checkStatsForModel(readActivationStats(out), cfg, fingerprint); // what we wrote reads back
          const layers = summarizeSparsity(prof);

          // Bytes of weights read per decoded token: dense reads every FFN row; sparse only the firing ones.
          // With experts, a token reads n_expert_used of the n_expert experts' rows (and the router).
          const bytesOf = (name: string) => model.file.tensorMap.get(name)?.byteLength ?? 0;
          const share = cfg.moe ? cfg.moe.n_expert_used / cfg.moe.n_expert : 1;
          let dense = bytesOf("output.weight") || bytesOf("token_embd.weight");
          let sparse = dense;
          layers.forEach((L, l) => {
            const p = `blk.${l}.`;
            const attn = ["attn_q", "attn_k", "attn_v", "attn_output"].reduce(
              (s, n) => s + bytesOf(`${p}${n}.weight`),
              0,
            );
            const ffn =
              ["ffn_gate", "ffn_up", "ffn_down", "ffn_down_t"].reduce((s, n) => s + bytesOf(`${p}${n}.weight`), 0) +
              ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_down_exps_t"].reduce(
                (s, n) => s + bytesOf(`${p}${n}.weight`),
                0,
              ) *
                share;
            const pred = bytesOf(`${p}fc1.weight`) + bytesOf(`${p}fc2.weight`);
            const router = bytesOf(`${p}ffn_gate_inp.weight`);
            dense += attn + router + ffn;
            sparse += attn + router + ffn * L.mean + pred;
          });
          const report = {
            model: o.model,
            statsFile: out,
            tokens: prof.tokens,
            layers,
            meanActive: layers.reduce((s, L) => s + L.mean, 0) / layers.length,
            bytesPerTokenDense: dense,
            bytesPerTokenSparse: Math.round(sparse),
            expectedSpeedup: dense / sparse,
          };
          // a firing rate from a handful of positions is mostly noise: a hot/cold plan from it is not worth making
          if (prof.tokens < MIN_PROFILE_POSITIONS)
            process.stderr.write(
              `warning: only ${prof.tokens} positions profiled (${o.tokens !== undefined && prof.tokens >= o.tokens ? `--tokens ${o.tokens}` : `all that ${basename(o.file)} holds`}): a neuron's firing rate from so few tokens is mostly noise; profile at least ${MIN_PROFILE_POSITIONS}, preferably thousands, of text like what the model will serve before planning placement from these statistics\n`,
            );
          if (o.json) {
            process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
          } else {
            const pct = (v: number) => `${(v * 100).toFixed(1)} %`.padStart(8);
            const lines = [
              `profiled ${prof.tokens} positions of ${basename(o.file)}; statistics written to ${out}${replacing ? " (replacing the earlier statistics)" : ""}`,
              ...(cfg.moe
                ? [
                    cfg.ffn.activation === "relu"
                      ? `routed experts: ${cfg.moe.n_expert_used} of ${cfg.moe.n_expert} per token; active = share of the chosen experts' ${cfg.moe.n_ff_exp} neurons each`
                      : `routed experts: ${cfg.moe.n_expert_used} of ${cfg.moe.n_expert} per token; the experts are dense (${cfg.ffn.activation}): every neuron of a chosen expert is read (active 100 %), so these statistics rank experts by how often they are chosen (for \`plan\` and --vram-budget)`,
                    "layer | mean active | p50 | p90 | hot80 (share of (expert, neuron) with 80 % of activations) | dead | experts with 80 % of routed tokens",
                  ]
                : ["layer | mean active | p50 | p90 | hot80 (share of neurons with 80 % of activations) | dead"]),
              ...layers.map(
                (L, l) =>
                  `${String(l).padStart(5)} | ${pct(L.mean)} | ${pct(L.p50)} | ${pct(L.p90)} | ${pct(L.hot80)} | ${L.dead}` +
                  (L.hotExperts80 !== undefined ? ` | ${pct(L.hotExperts80)}` : ""),
              ),
              `weights read per decoded token: dense ${(dense / 2 ** 20).toFixed(2)} MiB, sparse ${(sparse / 2 ** 20).toFixed(2)} MiB ` +
                `(${cfg.ffn.activation !== "relu" ? "dense experts: every neuron of a chosen expert" : model.config.has_predictors ? "predictors included" : cfg.moe ? "with a perfect predictor; train per-expert ones with `powerinfer train-predictor`" : "with a perfect predictor; train one with `powerinfer train-predictor`"})`,
              `expected decode speed-up from sparsity where decoding is memory-bound: ${report.expectedSpeedup.toFixed(2)}×${cfg.ffn.activation === "relu" ? "" : " (dense experts: none)"}`,
            ];
            process.stdout.write(`${lines.join("\n")}\n`);
          }
          session.dispose();
          model.dispose();
          backend.dispose();
          loaded.device?.dispose();
        },
      ),
    );
}
