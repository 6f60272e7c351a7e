/** Output of the benchmark: llama-bench's markdown table (with our columns) and JSON. */
import type { BenchResult, BenchRow } from "./harness.js";

const fmtSize = (b: number) =>
  b >= 2 ** 30
    ? `${(b / 2 ** 30).toFixed(2)} GiB`
    : b >= 2 ** 20
      ? `${(b / 2 ** 20).toFixed(2)} MiB`
      : `${(b / 1024).toFixed(2)} KiB`;
const fmtParams = (p: number) =>
  p >= 1e9 ? `${(p / 1e9).toFixed(2)} B` : p >= 1e6 ? `${(p / 1e6).toFixed(2)} M` : `${(p / 1e3).toFixed(2)} K`;
const fmtBytes = (b: number) => (b >= 1e9 ? `${(b / 1e9).toFixed(2)} GB` : `${(b / 1e6).toFixed(1)} MB`);

function backendCell(r: BenchRow): string {
  return r.engine_label;
}

/** The lines before the table: machine, versions, bandwidth, date, commit, command. */
export function formatHeader(res: BenchResult, command?: string): string {
  const lines: string[] = [];
  const m = res.machine;
  const load = m.loadAverage.map((x) => (Number.isFinite(x) ? x.toFixed(1) : "?")).join(" → ");
  lines.push(
    `- machine: ${m.cpu}, ${m.logicalCpus} logical CPUs, ${m.memoryGiB} GiB RAM; powerinfer-ts kernels: ${m.kernels}; 1-minute load average ${load} (start → end; other processes share the CPUs)`,
  );
  const bw = Object.entries(res.bandwidth).map(
    ([t, v]) => `${v.toFixed(1)} GB/s at ${t} thread${t === "1" ? "" : "s"}`,
  );
  if (bw.length)
    lines.push(
      `- memory read bandwidth (multi-threaded sum over a buffer far larger than L3, best run): ${bw.join(", ")}`,
    );
  const p = res.llamaCpp;
  if (p && "unavailable" in p) lines.push(`- llama.cpp: unavailable (${p.unavailable})`);
  else if (p?.kind === "native") {
    const b = p.build;
    const lb = res.llamaBench;
    const run = lb
      ? `; llama-bench reports build ${lb.build_number} ${lb.build_commit}, n_batch ${lb.n_batch}, n_ubatch ${lb.n_ubatch}, flash_attn ${lb.flash_attn}`
      : "";
    lines.push(
      `- llama.cpp: ${p.label} — built here from node-llama-cpp's bundled source (release tag ${b.tag}, commit ${b.commit.slice(0, 12)}), ${b.compiler}, Release, GGML_NATIVE (${b.isa.join(" ")}), CPU only; each measurement one \`llama-bench -r 1 -o json\` process${run}`,
    );
  } else if (p) {
    const features = p.systemInfo
      .replace(/^CPU\s*:\s*/, "")
      .replace(/\s*=\s*1/g, "")
      .replace(/\s*\|\s*$/, "")
      .replace(/\s*\|\s*/g, " ");
    lines.push(
      `- llama.cpp: node-llama-cpp ${p.packageVersion}, ${p.buildType} CPU binary (release tag ${p.release}; ${features}) — slower than llama.cpp built natively (build that with \`pnpm --filter @powerinfer/cli llama-cpp:build\`)`,
    );
  }
  lines.push(`- date: ${res.date}; powerinfer-ts commit: ${res.commit}`);
  if (command) lines.push(`- command: \`${command}\``);
  return lines.join("\n");
}

/** llama-bench-style markdown table plus our columns, then the sparse summary and notes. */
export function formatMarkdown(res: BenchResult): string {
  const out: string[] = [];
  out.push(
    "| model | size | params | backend | threads | sparse | active | test | t/s | median t/s | vs llama.cpp | weights/token | % of BW |",
  );
  out.push("| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
  for (const r of res.rows) {
    out.push(
      [
        "",
        r.model,
        fmtSize(r.model_size),
        fmtParams(r.model_n_params),
        backendCell(r),
        r.n_threads,
        r.sparse ?? "–",
        r.active_fraction === null ? "–" : `${(100 * r.active_fraction).toFixed(1)} %`,
        r.test,
        `${r.avg_ts.toFixed(2)} ± ${r.stddev_ts.toFixed(2)}`,
        r.median_ts.toFixed(2),
        r.vs_llama_cpp === null ? "" : `${r.vs_llama_cpp.toFixed(2)}×`,
        r.bytes_per_token === null ? "" : fmtBytes(r.bytes_per_token),
        r.bandwidth_fraction === null ? "" : `${(100 * r.bandwidth_fraction).toFixed(0)} %`,
        "",
      ]
        .join(" | ")
        .trim(),
    );
  }
  if (res.sparseSummary.length) {
    out.push("");
    out.push(
      "| model | threads | test | sparse | speed-up vs llama.cpp | bytes ratio (llama.cpp / ours) | speed-up ÷ bytes ratio |",
    );
    out.push("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    for (const s of res.sparseSummary) {
      out.push(
        `| ${s.model} | ${s.n_threads} | ${s.test} | ${s.sparse} | ${s.speedup.toFixed(2)}× | ${s.bytes_ratio.toFixed(2)}× | ${s.efficiency.toFixed(2)} |`,
      );
    }
  }
  if (res.notes.length) {
    out.push("");
    for (const n of res.notes) out.push(`- note: ${n}`);
  }
  return out.join("\n");
}

/**
 * JSON output: llama-bench's array of rows (`-o json`), each with the run's context (commit, CPU, time,
 * llama.cpp version, measured bandwidth) and our columns.
 */
export function formatJson(res: BenchResult): string {
  const context = {
    build_commit: res.commit,
    cpu_info: res.machine.cpu,
    test_time: res.date,
    llama_cpp: res.llamaCpp && !("unavailable" in res.llamaCpp) ? res.llamaCpp.label : null,
  };
  return JSON.stringify(
    res.rows.map((r) => ({ ...context, ...r, bandwidth_gbs: res.bandwidth[r.n_threads] ?? null })),
    null,
    2,
  );
}
