/**
 * The backend scheduler: one forward graph whose nodes are assigned to backends (main = 0, device = 1, …)
 * is cut into pieces where ownership changes, in the way ggml's backend scheduler splits a graph
 * (`ggml_backend_sched`): each piece is a contiguous run of one backend's nodes and is computed in one call
 * of that backend; a tensor made in one piece and read in another crosses as an activation (an output of the
 * producing piece, an input of the reader), never as a weight. Pieces of different backends with no data
 * between them run at the same time (`computeAsync`): the device's and the CPU's halves of a split FFN.
 *
 * Cutting rule, node by node in graph order: a node joins its backend's open piece unless it reads a tensor
 * made by a piece of another backend that the open piece does not already wait for; then that open piece is
 * closed and a new one started (except when the node also reads a non-F32 tensor of the open piece, which
 * only crosses within a piece: the open piece then waits too). A piece whose tensor another backend reads is closed at that point (its
 * later nodes would delay the reader). So the pieces of one sparse FFN layer split between device and CPU
 * are: main [residual, attention, norms, predictor] → device [hot rows] ∥ main [cold rows] → main [sum, …].
 */
import { type ComputeResult, Graph, type GraphTensor } from "@powerinfer/core";
import type { Backend } from "@powerinfer/core";
import { EngineError } from "../errors.js";

/** One contiguous run of one backend's nodes, computed in one call. */
export interface GraphPiece {
  /** Index into the backends array. */
  backend: number;
  graph: Graph;
  /** Per node of `graph`: the index of the node in the whole graph. */
  nodeMap: number[];
  /** Pieces (indices) whose outputs this piece reads, or which precede it on the same backend. */
  deps: number[];
}

/** The result of running a split graph: {@link ComputeResult} over the whole graph's nodes, plus the calls made. */
export interface ScheduledResult extends ComputeResult {
  /** Backend compute calls made (pieces). */
  calls: number;
  /** Per piece: backend index, start and end (ms, performance.now clock). */
  timeline: { backend: number; start: number; end: number }[];
}

/**
 * Cuts `g` into pieces by the backend of each node (`nodeBackend[i]`, 0 when absent).
 * @throws EngineError 'BAD_INPUT' when a non-F32 intermediate (e.g. top-k expert ids) would cross backends.
 */
export function splitGraph(g: Graph, nodeBackend: ArrayLike<number>): GraphPiece[] {
  const nT = g.tensors.length;
  const prod = new Int32Array(nT).fill(-1); // piece that computes each intermediate
  const pieceOfNode = new Int32Array(g.nodes.length);
  const pieces: { backend: number; nodes: number[]; deps: Set<number> }[] = [];
  const open = new Map<number, number>(); // backend → open piece
  const lastOf = new Map<number, number>(); // backend → its latest piece
  g.nodes.forEach((n, i) => {
    const b = nodeBackend[i] ?? 0;
    const foreign = new Set<number>();
    for (const s of n.src) {
      if (s < 0) continue;
      const q = prod[s]!;
      if (q >= 0 && pieces[q]!.backend !== b) foreign.add(q);
    }
    // a piece read by another backend takes no more nodes
    for (const q of foreign) if (open.get(pieces[q]!.backend) === q) open.delete(pieces[q]!.backend);
    let p = open.get(b);
    // a node that reads another backend's tensor starts a piece of its own (so what came before it on this
    // backend runs meanwhile) — unless it reads a non-F32 tensor of the open piece (top-k expert ids), which
    // cannot cross pieces: then that piece waits for the other backend instead
    const readsLocalInt =
      p !== undefined && n.src.some((t) => t >= 0 && prod[t] === p && g.tensors[t]!.dtype !== "f32");
    if (p !== undefined && !readsLocalInt && [...foreign].some((q) => !pieces[p!]!.deps.has(q))) p = undefined;
    if (p === undefined) {
      p = pieces.length;
      const deps = new Set<number>();
      const prev = lastOf.get(b);
      if (prev !== undefined) deps.add(prev);
      pieces.push({ backend: b, nodes: [], deps });
      open.set(b, p);
      lastOf.set(b, p);
    }
    const piece = pieces[p]!;
    for (const q of foreign) piece.deps.add(q);
    piece.nodes.push(i);
    pieceOfNode[i] = p;
    if (g.tensors[n.dst]!.kind === "intermediate") prod[n.dst] = p;
  });
  // tensors read outside the piece that made them cross as activations
  const transfer = new Map<number, Float32Array>();
  pieces.forEach((piece, p) => {
    for (const i of piece.nodes) {
      for (const s of g.nodes[i]!.src) {
        if (s < 0 || prod[s]! < 0 || prod[s] === p || transfer.has(s)) continue;
        const t = g.tensors[s]!;
        if (t.dtype !== "f32") {
          throw new EngineError(
            "BAD_INPUT",
            `a ${t.dtype} tensor (from ${g.nodes[i]!.op}'s source) would cross backends; keep its producer and readers on one backend`,
          );
        }
        transfer.set(s, t.output ?? new Float32Array(t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]));
      }
    }
  });
  return pieces.map((piece) => {
    const sub = new Graph();
    const map = new Map<number, number>();
    const add = (t: GraphTensor) => {
      sub.tensors.push(t);
      return sub.tensors.length - 1;
    };
    const ref = (s: number): number => {
      if (s < 0) return -1;
      const have = map.get(s);
      if (have !== undefined) return have;
      const t = g.tensors[s]!;
      let id: number;
      if (t.kind === "intermediate") {
        // made in an earlier piece (made here ones are mapped when their node is added)
        id = add({ dtype: "f32", ne: t.ne, kind: "input", data: transfer.get(s)! });
      } else {
        id = add({ dtype: t.dtype, ne: t.ne, kind: t.kind, handle: t.handle, data: t.data });
      }
      map.set(s, id);
      return id;
    };
    for (const i of piece.nodes) {
      const n = g.nodes[i]!;
      const src = n.src.map(ref);
      const d = g.tensors[n.dst]!;
      let dst: number;
      if (d.kind === "intermediate") {
        dst = add({ dtype: d.dtype, ne: d.ne, kind: "intermediate", output: transfer.get(n.dst) ?? d.output });
        map.set(n.dst, dst);
      } else {
        dst = ref(n.dst);
      }
      sub.nodes.push({ op: n.op, dst, src, params: n.params });
    }
    return { backend: piece.backend, graph: sub, nodeMap: piece.nodes, deps: [...piece.deps].sort((a, b) => a - b) };
  });
}

function merge(
  pieces: GraphPiece[],
  nNodes: number,
  results: ComputeResult[],
  t0: number,
  timeline: ScheduledResult["timeline"],
): ScheduledResult {
  const rowsRead = new Float64Array(nNodes);
  pieces.forEach((piece, p) => {
    const r = results[p]!;
    piece.nodeMap.forEach((orig, j) => {
      rowsRead[orig] = r.rowsRead[j] ?? 0;
    });
  });
  return { rowsRead, elapsedMs: performance.now() - t0, calls: pieces.length, timeline };
}

/**
 * Computes a graph over several backends, one piece after another on the JavaScript thread.
 * A graph on one backend is computed as it is, in one call.
 */
export function computeScheduled(
  g: Graph,
  nodeBackend: ArrayLike<number> | undefined,
  backends: readonly Backend[],
): ScheduledResult {
  const t0 = performance.now();
  if (!nodeBackend || backends.length === 1) {
    const r = backends[0]!.compute(g);
    return { ...r, calls: 1, timeline: [{ backend: 0, start: t0, end: performance.now() }] };
  }
  const pieces = splitGraph(g, nodeBackend);
  const timeline: ScheduledResult["timeline"] = [];
  const results = pieces.map((piece) => {
    const start = performance.now();
    const r = backends[piece.backend]!.compute(piece.graph);
    timeline.push({ backend: piece.backend, start, end: performance.now() });
    return r;
  });
  return merge(pieces, g.nodes.length, results, t0, timeline);
}

/**
 * Computes a graph over several backends off the JavaScript thread: each piece starts as soon as the pieces
 * it reads from (and its backend's previous piece) are done, so pieces of different backends overlap.
 */
export async function computeScheduledAsync(
  g: Graph,
  nodeBackend: ArrayLike<number> | undefined,
  backends: readonly Backend[],
): Promise<ScheduledResult> {
  const t0 = performance.now();
  if (!nodeBackend || backends.length === 1) {
    const r = await backends[0]!.computeAsync(g);
    return { ...r, calls: 1, timeline: [{ backend: 0, start: t0, end: performance.now() }] };
  }
  const pieces = splitGraph(g, nodeBackend);
  const timeline: ScheduledResult["timeline"] = [];
  const done: Promise<ComputeResult>[] = [];
  pieces.forEach((piece, p) => {
    done[p] = Promise.all(piece.deps.map((d) => done[d]!)).then(async () => {
      const start = performance.now();
      const r = await backends[piece.backend]!.computeAsync(piece.graph);
      timeline.push({ backend: piece.backend, start, end: performance.now() });
      return r;
    });
  });
  // every piece settles before this returns or throws (no compute left running on a failed step)
  const settled = await Promise.allSettled(done);
  const failed = settled.find((s) => s.status === "rejected");
  if (failed) throw (failed as PromiseRejectedResult).reason;
  return merge(
    pieces,
    g.nodes.length,
    settled.map((s) => (s as PromiseFulfilledResult<ComputeResult>).value),
    t0,
    timeline,
  );
}
