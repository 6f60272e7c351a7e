/**
 * `GET /metrics` in Prometheus text format: llama.cpp's `llamacpp:*` series (so existing dashboards work)
 * plus `powerinfer:*` series on continuous batching (how many sequences the decode steps carried).
 */
import type { BatchScheduler } from "@powerinfer/engine";

type Kind = "counter" | "gauge";

export function prometheusText(s: BatchScheduler): string {
  const m = s.metrics;
  const lines: string[] = [];
  const put = (name: string, kind: Kind, help: string, value: number | [string, number][]) => {
    lines.push(`# HELP ${name} ${help}`, `# TYPE ${name} ${kind}`);
    if (typeof value === "number") lines.push(`${name} ${Number.isFinite(value) ? value : 0}`);
    else for (const [labels, v] of value) lines.push(`${name}{${labels}} ${v}`);
  };
  const rate = (n: number, ms: number) => (ms > 0 ? (n * 1000) / ms : 0);
  put("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", m.promptTokens);
  put(
    "llamacpp:prompt_tokens_cached_total",
    "counter",
    "Number of prompt tokens reused from a slot's cache (not processed).",
    m.promptTokensCached,
  );
  put("llamacpp:prompt_seconds_total", "counter", "Prompt process time in seconds.", m.promptMs / 1000);
  put("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", m.generatedTokens);
  put("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time in seconds.", m.generateMs / 1000);
  put(
    "llamacpp:prompt_tokens_seconds",
    "gauge",
    "Average prompt throughput in tokens/s.",
    rate(m.promptTokens, m.promptMs),
  );
  put(
    "llamacpp:predicted_tokens_seconds",
    "gauge",
    "Average generation throughput in tokens/s.",
    rate(m.generatedTokens, m.generateMs),
  );
  put("llamacpp:requests_processing", "gauge", "Number of requests processing.", s.busy);
  put("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", s.queued);
  put("llamacpp:n_tokens_max", "counter", "High watermark of the context size observed.", m.nTokensMax);
  put("llamacpp:n_decode_total", "counter", "Total number of decode steps (graphs computed).", m.decodeSteps);
  // no speculative decoding here: llama.cpp's counters, always 0, so that its dashboards find them
  put("llamacpp:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens proposed.", 0);
  put("llamacpp:spec_decode_num_accepted_tokens_total", "counter", "Number of draft tokens accepted.", 0);
  put("llamacpp:spec_decode_num_drafts_total", "counter", "Number of drafts.", 0);
  put(
    "llamacpp:n_busy_slots_per_decode",
    "gauge",
    "Average number of busy slots per decode step.",
    m.decodeSteps > 0 ? m.sequencesInSteps / m.decodeSteps : 0,
  );
  put("powerinfer:slots_total", "gauge", "Slots (sequences that can be decoded together).", s.nSlots);
  put(
    "powerinfer:max_sequences_per_decode",
    "gauge",
    "Most sequences carried by one decode step.",
    m.maxSequencesPerStep,
  );
  put(
    "powerinfer:decode_steps_by_sequences_total",
    "counter",
    "Decode steps by the number of sequences they carried.",
    m.stepsBySequences.map((n, k) => [`sequences="${k}"`, n] as [string, number]).filter(([, n], k) => k > 0 && n > 0),
  );
  put(
    "powerinfer:shared_decode_steps_total",
    "counter",
    "Decode steps in which at least two sequences were generating tokens.",
    m.sharedDecodeSteps,
  );
  put("powerinfer:tokens_evaluated_total", "counter", "Tokens (graph columns) computed.", m.tokensEvaluated);
  put(
    "powerinfer:compute_seconds_total",
    "counter",
    "Time the backend spent computing decode steps.",
    m.computeMs / 1000,
  );
  put("powerinfer:requests_total", "counter", "Requests by outcome.", [
    ['outcome="finished"', m.requestsFinished],
    ['outcome="aborted"', m.requestsAborted],
    ['outcome="rejected"', m.requestsRejected],
    ['outcome="failed"', m.requestsFailed],
  ]);
  return `${lines.join("\n")}\n`;
}
