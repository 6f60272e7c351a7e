// The wire form of core's Graph.encode() as the GPU backends read it: the wire header's types, the
// shared validator (check_graph, packages/core/native/src/wire_check.cpp) and this backend's limits.
#pragma once

#include <cstdint>

#include "powerinfer/wire.h"

namespace pigpu {

using namespace ::powerinfer::wire;

/// Most columns (tokens) a node may have: grid dimension y of the kernels.
constexpr int64_t kMaxColumns = 65535;

/// Whether the GPU kernels implement `op` for these dtypes (weight/source dtype first, as in supportsOp).
bool supports_op(int op, const int* dtypes, int n_dtypes);

/// check_graph with the GPU's limits (weight dtypes with kernels, grid size, head_dim).
/// @throws BackendErr BAD_GRAPH (malformed), UNSUPPORTED_OP (valid, but not on this backend).
CheckedGraph check_gpu_graph(const WireGraph& g, const HandleFinder& find);

}  // namespace pigpu
