// What the GPU backends support, and the shared graph validator run with their limits (see graph.h).
#include "dtype.h"
#include "graph.h"
#include "kernels.h"

namespace pigpu {

bool supports_op(int op, const int* dtypes, int n_dtypes) {
  return standard_supports_op(op, dtypes, n_dtypes, is_gpu_weight_dtype);
}

CheckedGraph check_gpu_graph(const WireGraph& g, const HandleFinder& find) {
  CheckOptions o;
  o.weight_supported = is_gpu_weight_dtype;
  o.max_columns = kMaxColumns;
  o.max_head_dim = kMaxHeadDim;
  return check_graph(g, find, o);
}

}  // namespace pigpu
