/**
 * An op-by-op dump of the forward graph in the text format of llama.cpp's `llama-eval-callback`
 * (`common_debug_cb_eval`), with the graph's nodes named as llama.cpp names them (`embd`, `norm-L`,
 * `attn_norm-L`, `Qcur-L`, …, `result_output`), so that a run of ours and a run of llama.cpp on the same
 * model and prompt can be compared node by node ({@link compareTrace}) and the first node where the
 * arithmetic parts found.
 *
 * Names are derived from the graph and the weights each node reads (a matrix product by `blk.L.attn_q`
 * is `Qcur-L`, the RoPE of `Qcur-L` is `Qcur-L` again, the sum with `attn_out-L` is `ffn_inp-L`, …), so the
 * graph builder needs no change. What llama.cpp has and we do not, and the reverse:
 * - llama.cpp's RESHAPE/VIEW/PERMUTE nodes, the K/V cache writes (`cache_k_lL (view)`, F16 SET_ROWS) and
 *   the FLASH_ATTN_EXT node itself (we name our fused attention's output `kqv_out-L`, llama.cpp's reshape of it);
 * - our `silu` of the gate before the product with `ffn_up` (llama.cpp fuses both into SWIGLU): named
 *   `ffn_silu-L`, no counterpart in llama.cpp's trace (older llama.cpp builds used that name);
 * - the last layer's FFN runs on the wanted columns only in both (llama.cpp's GET_ROWS by `inp_out_ids` before
 *   `ffn_inp-L`, ours in the layer recipe); a dump taken while every column is wanted compares the last one.
 */
import type { Graph, GraphNode, TensorHandle, TensorId } from "@powerinfer/core";
import { EngineError } from "../errors.js";
import { KvCache, type KvCacheType } from "../model/kv-cache.js";
import { buildLlamaGraph, type LlamaWeights, type SparseMode } from "../model/llama.js";
import { contextSize, type Model } from "./engine.js";

/** One node of a dump: what llama-eval-callback prints for it. */
export interface TraceNode {
  /** llama.cpp's name (`Qcur-0`), or `node_N` (N = our node index) for a node without one. */
  name: string;
  /** The op in capitals (ours: MUL_MAT, RMS_NORM, ROPE, ATTENTION, …). */
  op: string;
  /** The operands: their names and shapes (ggml order, ne[0] first). */
  srcs: { name: string; ne: number[] }[];
  /** The shape as printed (4 entries, ne[0] first); RoPE outputs are shown per head [head_dim, n_head, T, 1]. */
  ne: [number, number, number, number];
  /** The values, ne[0] fastest (F32). */
  values: Float32Array;
}

/** Options of {@link evalCallback}. */
export interface EvalCallbackOptions {
  /** KV cache type (default "f16", as llama.cpp). */
  kvType?: KvCacheType;
  /** KV cache positions (default: the prompt's length). */
  nCtx?: number;
  /** FFN mode (default: the model's). */
  sparse?: SparseMode;
  /** Dump every F32 node ("all", default; unnamed ones as `node_N`) or only the named ones. */
  nodes?: "all" | "named";
}

const LAYER_WEIGHTS: readonly [keyof LlamaWeights["layers"][number], string][] = [
  ["attnNorm", "attn_norm.weight"],
  ["attnNormB", "attn_norm.bias"],
  ["attnNorm2", "attn_norm_2.weight"],
  ["attnNorm2B", "attn_norm_2.bias"],
  ["wq", "attn_q.weight"],
  ["wk", "attn_k.weight"],
  ["wv", "attn_v.weight"],
  ["wqkv", "attn_qkv.weight"],
  ["attnQNorm", "attn_q_norm.weight"],
  ["attnKNorm", "attn_k_norm.weight"],
  ["bq", "attn_q.bias"],
  ["bk", "attn_k.bias"],
  ["bv", "attn_v.bias"],
  ["wo", "attn_output.weight"],
  ["bo", "attn_output.bias"],
  ["ffnNorm", "ffn_norm.weight"],
  ["ffnNormB", "ffn_norm.bias"],
  ["ffnGate", "ffn_gate.weight"],
  ["ffnUp", "ffn_up.weight"],
  ["bUp", "ffn_up.bias"],
  ["ffnDown", "ffn_down.weight"],
  ["bDown", "ffn_down.bias"],
  ["ffnDownT", "ffn_down_t.weight"],
  ["fc1", "fc1.weight"],
  ["fc2", "fc2.weight"],
];

/** The GGUF name of every weight handle of `w` (`blk.3.attn_q.weight`, `output.weight`, …). */
export function weightNames(w: LlamaWeights): Map<TensorHandle, string> {
  const m = new Map<TensorHandle, string>();
  w.layers.forEach((L, l) => {
    for (const [key, name] of LAYER_WEIGHTS) {
      const h = L[key];
      if (h && typeof h === "object" && "id" in h) m.set(h as TensorHandle, `blk.${l}.${name}`);
    }
  });
  m.set(w.tokEmbd, "token_embd.weight");
  if (w.posEmbd) m.set(w.posEmbd, "position_embd.weight");
  m.set(w.outputNorm, "output_norm.weight");
  if (w.outputNormB) m.set(w.outputNormB, "output_norm.bias");
  // tied embeddings: the output matrix is token_embd itself
  if (!m.has(w.output)) m.set(w.output, "output.weight");
  return m;
}

/** Names by matrix-product weight (the part after `blk.L.`). */
const MATMUL_NAMES: Readonly<Record<string, string>> = {
  "attn_q.weight": "Qcur",
  "attn_k.weight": "Kcur",
  "attn_v.weight": "Vcur",
  "attn_qkv.weight": "wqkv",
  "attn_output.weight": "attn_out",
  "ffn_gate.weight": "ffn_gate",
  "ffn_up.weight": "ffn_up",
  "ffn_down.weight": "ffn_out",
};

/** Names by norm weight: the product is the first name, the norm it multiplies the second. */
const NORM_NAMES: Readonly<Record<string, [string, string]>> = {
  "attn_norm.weight": ["attn_norm", "norm"],
  "ffn_norm.weight": ["ffn_norm", "norm"],
};

/**
 * Names the nodes of a Llama-family forward graph as llama.cpp's `llm_build_llama` names them (its
 * `cb(cur, "…", il)` calls), from the weights each node reads: see this file's header for what maps to
 * what. Adds to {@link Graph.names}; nodes it cannot place keep no name.
 * @param w the weights the graph was built from (handles are matched by identity).
 */
export function labelLlamaGraph(g: Graph, w: LlamaWeights): void {
  const names = weightNames(w);
  const handleName = (t: TensorId | undefined): string | undefined => {
    const h = t === undefined || t < 0 ? undefined : g.tensors[t]?.handle;
    return h ? names.get(h) : undefined;
  };
  const label = (t: TensorId | undefined) => (t === undefined || t < 0 ? undefined : g.names.get(t));
  const layerOf = (weight: string) => /^blk\.(\d+)\.(.*)$/.exec(weight);
  const suffix = (s: string | undefined, prefix: string) =>
    s?.startsWith(`${prefix}-`) ? s.slice(prefix.length) : undefined;
  // the last layer's selection of the wanted columns (get_rows of an activation) keeps its source's name
  const producer = new Map<TensorId, GraphNode>();
  const through = (t: TensorId | undefined) => {
    const p = t === undefined ? undefined : producer.get(t);
    return p?.op === "get_rows" && !handleName(p.src[0]) ? label(p.src[0]) : label(t);
  };
  for (const n of g.nodes) {
    producer.set(n.dst, n);
    const w0 = handleName(n.src[0]);
    const w1 = handleName(n.src[1]);
    const s0 = through(n.src[0]);
    const s1 = through(n.src[1]);
    if (n.op === "get_rows" && w0 === "token_embd.weight" && g.tensors[n.src[1]!]?.kind === "input") {
      g.name(n.dst, "embd");
      g.name(n.src[1]!, "inp_tokens");
    } else if (n.op === "mul_mat" && w0) {
      const m = layerOf(w0);
      if (m && MATMUL_NAMES[m[2]!]) g.name(n.dst, `${MATMUL_NAMES[m[2]!]}-${m[1]}`);
      // tied embeddings: the output matrix is token_embd itself
      else if (w0 === "output.weight" || w0 === "token_embd.weight") g.name(n.dst, "result_output");
    } else if (n.op === "mul" && w1) {
      const m = layerOf(w1);
      const pair = m ? NORM_NAMES[m[2]!] : undefined;
      if (m && pair) {
        g.name(n.dst, `${pair[0]}-${m[1]}`);
        g.name(n.src[0]!, `${pair[1]}-${m[1]}`);
      } else if (w1 === "output_norm.weight") {
        g.name(n.dst, "result_norm");
        g.name(n.src[0]!, "norm");
      }
    } else if (n.op === "rope" && s0 && (s0.startsWith("Qcur-") || s0.startsWith("Kcur-"))) {
      g.name(n.dst, s0);
      if (!label(n.src[1])) g.name(n.src[1]!, "inp_pos");
    } else if ((n.op === "attention" || n.op === "attention_swa") && s0?.startsWith("Qcur-")) {
      g.name(n.dst, `kqv_out${suffix(s0, "Qcur")}`);
    } else if (n.op === "add" && s0?.startsWith("attn_out-")) {
      g.name(n.dst, `ffn_inp${suffix(s0, "attn_out")}`);
    } else if (n.op === "add" && s0?.startsWith("ffn_out-")) {
      g.name(n.dst, `l_out${suffix(s0, "ffn_out")}`);
    } else if (n.op === "silu" && s0?.startsWith("ffn_gate-")) {
      g.name(n.dst, `ffn_silu${suffix(s0, "ffn_gate")}`);
    } else if (n.op === "mul" && s0?.startsWith("ffn_silu-") && s1?.startsWith("ffn_up-")) {
      g.name(n.dst, `ffn_swiglu${suffix(s0, "ffn_silu")}`);
    }
  }
  // the K/V caches the graph writes, as llama.cpp names them (operands of attention)
  for (const n of g.nodes) {
    if (n.op !== "cpy") continue;
    const s = label(n.src[0]);
    const m = s ? /^([KV])cur-(\d+)$/.exec(s) : null;
    if (m && !label(n.dst)) g.name(n.dst, `cache_${m[1]!.toLowerCase()}_l${m[2]}`);
  }
}

/** The shape a node is printed with: RoPE outputs per head, as llama.cpp's (its Q/K are 3-D there). */
function printShape(g: Graph, n: GraphNode): [number, number, number, number] {
  const ne = g.shape(n.dst);
  if (n.op === "rope") {
    const hd = n.params[4]!;
    return [hd, ne[0] / hd, ne[1], 1];
  }
  return [...ne];
}

/**
 * Runs `tokens` (one batch, positions 0…) through the model's forward graph with every node's output kept,
 * and returns the nodes in graph order with llama.cpp's names ({@link labelLlamaGraph}). Uses a KV cache of
 * its own: the model's sessions are not touched.
 * @param tokens token ids (BOS included when the model wants one), at least one
 * @throws EngineError 'BAD_INPUT' (no tokens, an id outside the vocabulary, nCtx smaller than the prompt);
 *   BackendError from the backend (e.g. 'OUT_OF_MEMORY' for the KV cache).
 */
export function evalCallback(model: Model, tokens: readonly number[], opts: EvalCallbackOptions = {}): TraceNode[] {
  const cfg = model.config;
  if (tokens.length === 0) throw new EngineError("BAD_INPUT", "eval-callback: no tokens to evaluate");
  for (const t of tokens) {
    if (!Number.isInteger(t) || t < 0 || t >= cfg.n_vocab)
      throw new EngineError("BAD_INPUT", `token id ${t} outside [0, ${cfg.n_vocab})`);
  }
  // absent: the prompt's length; 0: the trained context, as a session takes it
  const nCtx = opts.nCtx === undefined ? tokens.length : contextSize(cfg, opts.nCtx);
  if (!Number.isInteger(nCtx) || nCtx < tokens.length)
    throw new EngineError("BAD_INPUT", `eval-callback: n_ctx ${nCtx} is smaller than the ${tokens.length} tokens`);
  const kv = new KvCache(model.backend, cfg.n_layer, cfg.head_dim * cfg.n_head_kv, nCtx, opts.kvType ?? "f16");
  try {
    const { graph: g } = buildLlamaGraph(cfg, model.weights, kv, Int32Array.from(tokens), 0, {
      sparse: opts.sparse ?? model.sparse,
      threshold: model.threshold,
    });
    labelLlamaGraph(g, model.weights);
    const picked: { n: GraphNode; index: number; out: Float32Array }[] = [];
    g.nodes.forEach((n, index) => {
      const t = g.tensors[n.dst]!;
      if (t.kind !== "intermediate" || t.dtype !== "f32") return;
      if (opts.nodes === "named" && !g.names.has(n.dst)) return;
      picked.push({ n, index, out: t.output ?? g.output(n.dst) });
    });
    model.backend.compute(g);
    const names = weightNames(model.weights);
    const nameOf = (t: TensorId) => {
      const tt = g.tensors[t]!;
      const own = g.names.get(t);
      if (own) return own;
      if (tt.kind === "handle") return names.get(tt.handle!) ?? `handle_${tt.handle!.id}`;
      if (tt.kind === "input") return `leaf_${t}`;
      const i = g.nodes.findIndex((x) => x.dst === t);
      return `node_${i}`;
    };
    return picked.map(({ n, index, out }) => ({
      name: g.names.get(n.dst) ?? `node_${index}`,
      op: n.op.toUpperCase(),
      srcs: n.src.filter((s) => s >= 0).map((s) => ({ name: nameOf(s), ne: [...g.shape(s)] })),
      ne: printShape(g, n),
      values: out,
    }));
  } finally {
    kv.dispose();
  }
}

/**
 * `x` with `d` decimals as C's printf("%.*f") prints it: correctly rounded from the exact binary value,
 * an exact tie to the even last digit (JavaScript's toFixed takes the larger), "-" for negative values and −0.
 */
export function cFixed(x: number, d: number): string {
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "nan" : x > 0 ? "inf" : "-inf";
  const neg = x < 0 || Object.is(x, -0);
  const a = Math.abs(x);
  const p = 10 ** d;
  const scaled = a * p;
  // exact for float32 inputs (24 + 20 bits < 53); ties are only decided here for exact products
  const fl = Math.floor(scaled);
  let n: number;
  if (scaled - fl === 0.5 && Math.fround(a) === a) n = fl % 2 === 0 ? fl : fl + 1;
  else return (neg ? "-" : "") + a.toFixed(d);
  const digits = String(n).padStart(d + 1, "0");
  return `${neg ? "-" : ""}${digits.slice(0, digits.length - d)}.${digits.slice(digits.length - d)}`;
}

const EDGE = 3;

/** Indices printed along an axis of n: all when n ≤ 6, else the first and last 3 (−1 marks the "..."). */
function printedIndices(n: number): number[] {
  if (n <= 2 * EDGE) return Array.from({ length: n }, (_, i) => i);
  return [0, 1, 2, -1, n - 3, n - 2, n - 1];
}

/**
 * The sum llama-eval-callback prints: every element added in order (ne[0] fastest) into a float
 * accumulator, as its `common_debug_print_tensor` does.
 */
export function traceSum(values: Float32Array): number {
  let s = 0;
  for (let i = 0; i < values.length; i++) s = Math.fround(s + values[i]!);
  return s;
}

/** One node in llama-eval-callback's text format (header, first/last 3 values per row, sum). */
export function formatTraceNode(n: TraceNode): string {
  const fmtNe = (ne: readonly number[]) => [0, 1, 2, 3].map((i) => ne[i] ?? 1).join(", ");
  const s0 = n.srcs[0] ? `${n.srcs[0].name}{${fmtNe(n.srcs[0].ne)}}` : "";
  const s1 = n.srcs[1] ? `${n.srcs[1].name}{${fmtNe(n.srcs[1].ne)}}` : "";
  const lines = [
    `common_debug_cb_eval: ${n.name.padStart(24)} = (f32) ${n.op.padStart(10)}(${s0}, ${s1}}) = {${fmtNe(n.ne)}}`,
  ];
  const [n0, n1, n2, n3] = n.ne;
  for (let i3 = 0; i3 < n3; i3++) {
    lines.push("    [");
    for (const i2 of printedIndices(n2)) {
      if (i2 < 0) {
        lines.push("        ..., ");
        continue;
      }
      lines.push("        [");
      for (const i1 of printedIndices(n1)) {
        if (i1 < 0) {
          lines.push("            ..., ");
          continue;
        }
        const row = n.values.subarray(((i3 * n2 + i2) * n1 + i1) * n0, ((i3 * n2 + i2) * n1 + i1 + 1) * n0);
        let text = "            [";
        printedIndices(n0).forEach((i0, k, all) => {
          if (i0 < 0) text += "   ..., ";
          else text += cFixed(row[i0]!, 4).padStart(12) + (k < all.length - 1 ? ", " : "");
        });
        lines.push(`${text}  ],`);
      }
      lines.push("        ],");
    }
    lines.push("    ]");
  }
  lines.push(`    sum = ${cFixed(traceSum(n.values), 6)}`);
  return `${lines.join("\n")}\n`;
}

/** A whole dump in llama-eval-callback's text format. */
export function formatEvalCallback(nodes: readonly TraceNode[]): string {
  return nodes.map(formatTraceNode).join("");
}

/** One node parsed from llama-eval-callback's output ({@link parseEvalCallback}). */
export interface TraceEntry {
  name: string;
  /** Result type as printed (f32, f16). */
  type: string;
  op: string;
  ne: [number, number, number, number];
  /**
   * The printed rows in order (every printed (i2, i1), i3 outermost), each the printed values as integers
   * in units of the last digit (1e-4), with null where "..." stood.
   */
  rows: (number | null)[][];
  /** The printed sum, in units of 1e-6. */
  sum: number;
  /** Line of the header in the text (1-based). */
  line: number;
}

/** "-0.1271" → −1271 (units of the last of `d` decimals), exactly. */
function fixedToInt(s: string, d: number): number {
  const m = /^(-?)(\d+)\.(\d+)$/.exec(s);
  if (!m || m[3]!.length !== d) throw new EngineError("BAD_INPUT", `not a number with ${d} decimals: "${s}"`);
  const v = Number(m[2]!) * 10 ** d + Number(m[3]!);
  return m[1] ? -v : v;
}

const HEADER = /^common_debug_cb_eval:\s+(.+?) = \((\w+)\)\s+(\w+)\(.*\) = \{(\d+), (\d+), (\d+), (\d+)\}$/;

/**
 * Parses the text llama-eval-callback prints (stdout, or a file of it) into its nodes, in order. Lines that
 * are not part of a node (logs, the generated text) are skipped.
 * @throws EngineError 'BAD_INPUT' naming the line when a node's block is malformed.
 */
export function parseEvalCallback(text: string): TraceEntry[] {
  const lines = text.split("\n");
  const out: TraceEntry[] = [];
  let cur: TraceEntry | undefined;
  lines.forEach((raw, i) => {
    const line = raw.replace(/\r$/, "");
    const h = HEADER.exec(line);
    if (h) {
      if (cur) throw new EngineError("BAD_INPUT", `line ${cur.line}: node ${cur.name} has no sum line`);
      cur = {
        name: h[1]!.trim(),
        type: h[2]!,
        op: h[3]!,
        ne: [Number(h[4]), Number(h[5]), Number(h[6]), Number(h[7])],
        rows: [],
        sum: 0,
        line: i + 1,
      };
      return;
    }
    if (!cur) return;
    const row = /^\s+\[(.*)\],$/.exec(line);
    if (row && row[1]!.trim() !== "") {
      cur.rows.push(
        row[1]!
          .split(",")
          .map((v) => v.trim())
          .filter((v) => v !== "")
          .map((v) => (v === "..." ? null : fixedToInt(v, 4))),
      );
      return;
    }
    const sum = /^\s+sum = (\S+)$/.exec(line);
    if (sum) {
      cur.sum = fixedToInt(sum[1]!, 6);
      out.push(cur);
      cur = undefined;
    }
  });
  if (cur)
    throw new EngineError(
      "BAD_INPUT",
      `line ${(cur as TraceEntry).line}: node ${(cur as TraceEntry).name} has no sum line`,
    );
  return out;
}

/** How one of our nodes compares with llama.cpp's node of the same name ({@link compareTrace}). */
export interface NodeComparison {
  name: string;
  /** Largest difference over the printed values, in units of the 4th decimal. */
  maxDiff: number;
  /** Where it is: index of the printed row and of the value in it. */
  at: { row: number; col: number };
  /** Our and llama.cpp's printed value there (units of 1e-4). */
  ours: number;
  ref: number;
  /** Difference of the sums, in units of the 6th decimal. */
  sumDiff: number;
  /** True when we kept every token and llama.cpp only the last (its last layer): our last column was compared. */
  lastColumn: boolean;
}

/** The printed rows of a node (as {@link TraceEntry.rows}) from its values. */
function printedRows(n: TraceNode): (number | null)[][] {
  const parsed = parseEvalCallback(formatTraceNode(n));
  return parsed[0]!.rows;
}

/**
 * Compares our dump with llama.cpp's, node by node, for every node of ours with a llama.cpp name. Nodes of a
 * name are paired in order (llama.cpp's `norm-L` twice per layer, ours too): each of ours takes the next
 * llama.cpp node of that name with the same op and element count (our MUL_MAT `Qcur-L` its MUL_MAT), or
 * else the next with the same element count (our attention output `kqv_out-L` its reshape). Where
 * llama.cpp computed only the last token (its last layer's FFN), our last column is compared. Nodes
 * without a counterpart are left out.
 * @returns one entry per compared node, in our graph order.
 */
export function compareTrace(ours: readonly TraceNode[], ref: readonly TraceEntry[]): NodeComparison[] {
  const res: NodeComparison[] = [];
  const cursor = new Map<string, number>();
  const count = (ne: readonly number[]) => ne[0]! * ne[1]! * ne[2]! * ne[3]!;
  for (const n of ours) {
    if (/^node_\d+$/.test(n.name)) continue;
    const total = count(n.ne);
    const from = cursor.get(n.name) ?? 0;
    const cands = ref
      .map((r, i) => ({ r, i }))
      .filter(({ r, i }) => i >= from && r.name === n.name && r.type === "f32");
    const whole = (r: TraceEntry) => count(r.ne) === total;
    // llama.cpp's last layer: one column [n, 1] where ours is [n, T]
    const last = (r: TraceEntry) => r.ne[0] === n.ne[0] && count(r.ne) === r.ne[0] && n.ne[2] * n.ne[3] === 1;
    const pick =
      cands.find(({ r }) => r.op === n.op && whole(r)) ??
      cands.find(({ r }) => whole(r)) ??
      cands.find(({ r }) => last(r));
    if (!pick) continue;
    cursor.set(n.name, pick.i + 1);
    const r = pick.r;
    let node = n;
    const lastColumn = !whole(r);
    if (lastColumn) {
      const k = n.ne[0];
      node = { ...n, ne: [k, 1, 1, 1], values: n.values.subarray(total - k) };
    }
    if (!(r.ne[0] === node.ne[0] && r.ne[1] === node.ne[1] && r.ne[2] === node.ne[2])) {
      // same values in another layout (e.g. [64, 5] against [8, 8, 5]): compare in llama.cpp's
      node = { ...node, ne: r.ne };
    }
    const rows = printedRows(node);
    let maxDiff = 0;
    let at = { row: 0, col: 0 };
    let o = 0;
    let f = 0;
    for (let i = 0; i < Math.max(rows.length, r.rows.length); i++) {
      const row = rows[i] ?? [];
      const theirs = r.rows[i] ?? [];
      for (let j = 0; j < Math.max(row.length, theirs.length); j++) {
        const v = row[j];
        const w = theirs[j];
        // a value printed on one side only (another layout): an infinite difference, never a silent pass
        const d = v === null && w === null ? 0 : v == null || w == null ? Number.POSITIVE_INFINITY : Math.abs(v - w);
        if (d > maxDiff || (i === 0 && j === 0)) {
          maxDiff = d;
          at = { row: i, col: j };
          o = v ?? Number.NaN;
          f = w ?? Number.NaN;
        }
      }
    }
    const sum = fixedToInt(cFixed(traceSum(node.values), 6), 6);
    res.push({ name: n.name, maxDiff, at, ours: o, ref: f, sumDiff: Math.abs(sum - r.sum), lastColumn });
  }
  return res;
}
