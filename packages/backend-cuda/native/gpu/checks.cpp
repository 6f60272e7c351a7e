// What the GPU backends support, and the shared graph validator run with their limits (see graph.h).
#include "dtype.h"
#include "graph.h"
#include "kernels.h"

namespace pigpu {

bool supports_op(int op, const int* dtypes, int n_dtypes) {
  const int d = n_dtypes > 0 ? dtypes[0] : DT_F32;
  switch (op) {
    case OP_GET_ROWS:
    case OP_MUL_MAT:
    case OP_MUL_MAT_SPARSE:
    case OP_AXPY_SPARSE:
    case OP_MUL_MAT_ID:
    case OP_MUL_MAT_ID_SPARSE:
    case OP_AXPY_ID_SPARSE: return is_gpu_weight_dtype(d);
    case OP_ATTENTION:
    case OP_ATTENTION_SWA: return d == DT_F32 || d == DT_F16;
    case OP_CPY: return d == DT_F32 || d == DT_F16 || d == DT_BF16;
    default: return op > 0 && op < OP_COUNT && d == DT_F32;
  }
}

CheckedGraph check_gpu_graph(const WireGraph& g, const HandleFinder& find) {
  CheckOptions o;
  o.weight_supported = is_gpu_weight_dtype;
  o.max_columns = kMaxColumns;
  o.max_head_dim = kMaxHeadDim;
  return check_graph(g, find, o);
}

}  // namespace pigpu
