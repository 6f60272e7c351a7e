// GPU backend instance (executor.h): tensors, arena planning, node dispatch.
#include "executor.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "dtype.h"
#include "kernels.h"

namespace pigpu {
namespace {

constexpr uint64_t kAlign = 256;

uint64_t align_up(uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

/// First-fit placement of buffers with known lifetimes in one arena.
class ArenaPlan {
 public:
  uint64_t take(uint64_t bytes) {
    bytes = align_up(bytes == 0 ? 1 : bytes);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < bytes) continue;
      const uint64_t off = it->first;
      const uint64_t left = it->second - bytes;
      free_.erase(it);
      if (left) free_.emplace(off + bytes, left);
      return off;
    }
    // grow the top, absorbing a free range that ends there
    uint64_t off = top_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == top_) {
        off = last->first;
        free_.erase(last);
      }
    }
    top_ = off + bytes;
    return off;
  }

  void give(uint64_t off, uint64_t bytes) {
    bytes = align_up(bytes == 0 ? 1 : bytes);
    auto it = free_.emplace(off, bytes).first;
    auto next = std::next(it);
    if (next != free_.end() && off + bytes == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }

  uint64_t top() const { return top_; }

 private:
  std::map<uint64_t, uint64_t> free_;  // offset → size
  uint64_t top_ = 0;
};

Weights weights_of(const GTensor& t, const void* data) {
  return Weights{data, t.dtype, t.ne[0], t.ne[1] * t.ne[2] * t.ne[3], row_bytes(t.dtype, t.ne[0])};
}

/// Stacked experts W [K, M, E]: E matrices of M rows.
Experts experts_of(const GTensor& t, const void* data) {
  const uint64_t rb = row_bytes(t.dtype, t.ne[0]);
  return Experts{Weights{data, t.dtype, t.ne[0], t.ne[1], rb}, t.ne[2], rb * static_cast<uint64_t>(t.ne[1])};
}

uint64_t tensor_bytes(int dtype, const int64_t ne[4]) {
  const Layout l = dtype_layout(dtype);
  if (l.block == 0) throw BackendErr("BAD_TENSOR", "unknown dtype code " + std::to_string(dtype));
  if (ne[0] % l.block != 0) {
    throw BackendErr("BAD_TENSOR", std::string(dtype_name(dtype)) + ": row length " + std::to_string(ne[0]) +
                                       " is not a multiple of the block size " + std::to_string(l.block));
  }
  uint64_t rows = 1;
  for (int d = 1; d < 4; d++) rows *= static_cast<uint64_t>(ne[d]);
  return row_bytes(dtype, ne[0]) * rows;
}

}  // namespace

BackendErr as_backend_error(const GpuError& e) { return BackendErr(e.code, e.what()); }

Executor::Executor(int device, uint64_t budget) : device_(device), budget_(budget) {
  try {
    set_device(device_);
    stream_ = stream_create();
    check_warp_size(stream_);
  } catch (const GpuError& e) {
    throw as_backend_error(e);
  }
}

Executor::~Executor() {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  try {
    set_device(device_);
    if (stream_) stream_sync(stream_);
  } catch (...) {
    // a failed device cannot be drained; free what we hold anyway
  }
  tensors_.clear();
  dev_free(arena_);
  host_free_pinned(staging_);
  stream_destroy(stream_);
}

std::shared_ptr<DeviceTensor> Executor::find(int id) const {
  auto it = tensors_.find(id);
  return it == tensors_.end() ? nullptr : it->second;
}

uint64_t Executor::allocated() const {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  return allocated_;
}

uint64_t Executor::arena_bytes() const {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  return arena_size_;
}

DeviceProps Executor::props() {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  try {
    set_device(device_);
    return device_props(device_);
  } catch (const GpuError& e) {
    throw as_backend_error(e);
  }
}

int Executor::create(int dtype, const int64_t ne[4], const void* data, uint64_t data_bytes) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  const uint64_t bytes = tensor_bytes(dtype, ne);
  if (data && data_bytes != bytes) {
    throw BackendErr("BAD_TENSOR", "data has " + std::to_string(data_bytes) + " bytes, the tensor needs " +
                                       std::to_string(bytes));
  }
  if (budget_ != UINT64_MAX && allocated_ + bytes > budget_) {
    throw BackendErr("OUT_OF_MEMORY", "tensor of " + std::to_string(bytes) + " bytes exceeds the memory budget (" +
                                          std::to_string(allocated_) + " of " + std::to_string(budget_) +
                                          " bytes in use)");
  }
  auto t = std::make_shared<DeviceTensor>();
  t->dtype = dtype;
  std::copy(ne, ne + 4, t->ne);
  t->bytes = bytes;
  try {
    set_device(device_);
    t->dev = dev_alloc(bytes);
    if (data)
      copy_h2d(t->dev, data, bytes, stream_);
    else
      zero_async(t->dev, bytes, stream_);
    stream_sync(stream_);
  } catch (const GpuError& e) {
    throw as_backend_error(e);
  }
  if (dtype == DT_I32) {
    t->host_i32.assign(static_cast<size_t>(bytes / 4), 0);
    if (data) std::memcpy(t->host_i32.data(), data, bytes);
  }
  const int id = next_id_++;
  tensors_[id] = t;
  allocated_ += bytes;
  return id;
}

int Executor::create_from_file(int dtype, const int64_t ne[4], const std::string& path, uint64_t offset,
                               uint64_t bytes) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  const uint64_t need = tensor_bytes(dtype, ne);
  if (bytes != need) {
    throw BackendErr("BAD_TENSOR", "file range of " + std::to_string(bytes) + " bytes, the tensor needs " +
                                       std::to_string(need));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw BackendErr("IO", "cannot open " + path + ": " + std::strerror(errno));
  int id = -1;
  try {
    id = create(dtype, ne, nullptr, 0);
    std::shared_ptr<DeviceTensor> t = find(id);
    std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(bytes, uint64_t{64} << 20)));
    uint64_t done = 0;
    while (done < bytes) {
      const uint64_t want = std::min<uint64_t>(buf.size(), bytes - done);
      const ssize_t r = ::pread(fd, buf.data(), want, static_cast<off_t>(offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        throw BackendErr("IO", "cannot read " + std::to_string(want) + " bytes at " + std::to_string(offset + done) +
                                   " of " + path + (r < 0 ? std::string(": ") + std::strerror(errno) : ": end of file"));
      }
      copy_h2d(static_cast<uint8_t*>(t->dev) + done, buf.data(), static_cast<uint64_t>(r), stream_);
      stream_sync(stream_);  // buf is reused
      if (dtype == DT_I32) std::memcpy(reinterpret_cast<uint8_t*>(t->host_i32.data()) + done, buf.data(), r);
      done += static_cast<uint64_t>(r);
    }
  } catch (const GpuError& e) {
    ::close(fd);
    if (id >= 0) free(id);
    throw as_backend_error(e);
  } catch (...) {
    ::close(fd);
    if (id >= 0) free(id);
    throw;
  }
  ::close(fd);
  return id;
}

std::vector<uint8_t> Executor::read(int id) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  std::shared_ptr<DeviceTensor> t = find(id);
  if (!t) throw BackendErr("BAD_TENSOR", "tensor " + std::to_string(id) + " does not exist");
  std::vector<uint8_t> out(static_cast<size_t>(t->bytes));
  try {
    set_device(device_);
    copy_d2h(out.data(), t->dev, t->bytes, stream_);
    stream_sync(stream_);
  } catch (const GpuError& e) {
    throw as_backend_error(e);
  }
  return out;
}

void Executor::write(int id, const void* data, uint64_t bytes, uint64_t offset) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  std::shared_ptr<DeviceTensor> t = find(id);
  if (!t) throw BackendErr("BAD_TENSOR", "tensor " + std::to_string(id) + " does not exist");
  if (offset > t->bytes || bytes > t->bytes - offset) {
    throw BackendErr("BAD_TENSOR", "write of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                                       " exceeds the tensor's " + std::to_string(t->bytes) + " bytes");
  }
  try {
    set_device(device_);
    copy_h2d(static_cast<uint8_t*>(t->dev) + offset, data, bytes, stream_);
    stream_sync(stream_);
  } catch (const GpuError& e) {
    throw as_backend_error(e);
  }
  if (t->dtype == DT_I32) std::memcpy(reinterpret_cast<uint8_t*>(t->host_i32.data()) + offset, data, bytes);
}

void Executor::free(int id) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  auto it = tensors_.find(id);
  if (it == tensors_.end()) throw BackendErr("BAD_TENSOR", "tensor " + std::to_string(id) + " does not exist");
  allocated_ -= it->second->bytes;
  tensors_.erase(it);
}

uint8_t* Executor::ensure_staging(uint64_t bytes) {
  if (bytes > staging_size_) {
    stream_sync(stream_);  // an earlier copy may still read it
    host_free_pinned(staging_);
    staging_ = nullptr;
    staging_size_ = 0;
    const uint64_t grow = (std::max<uint64_t>(bytes, 1 << 16) + (uint64_t{1} << 16) - 1) >> 16 << 16;
    staging_ = host_alloc_pinned(grow);
    staging_size_ = grow;
  }
  return static_cast<uint8_t*>(staging_);
}

void Executor::ensure_arena(uint64_t bytes) {
  if (bytes <= arena_size_) return;
  uint64_t grow = std::max<uint64_t>(bytes, arena_size_ + arena_size_ / 2);
  grow = (grow + (uint64_t{1} << 20) - 1) >> 20 << 20;  // whole MiB
  stream_sync(stream_);
  dev_free(arena_);
  arena_ = nullptr;
  arena_size_ = 0;
  try {
    arena_ = dev_alloc(grow);
  } catch (const GpuError& e) {
    if (e.code != "OUT_OF_MEMORY" || grow == bytes) throw;
    arena_ = dev_alloc(bytes);  // without headroom
    grow = bytes;
  }
  arena_size_ = grow;
}

std::vector<double> Executor::compute(const WireGraph& g) {
  std::lock_guard<std::recursive_mutex> lk(mu_);
  // the tensors stay alive for the whole call, even if freed concurrently (they cannot be: mu_)
  std::vector<std::shared_ptr<DeviceTensor>> held;
  const CheckedGraph cg = check_gpu_graph(g, [&](int id, HandleInfo* h) {
    std::shared_ptr<DeviceTensor> t = find(id);
    if (!t) return false;
    h->dtype = t->dtype;
    std::copy(t->ne, t->ne + 4, h->ne);
    h->i32 = t->dtype == DT_I32 ? t->host_i32.data() : nullptr;
    held.push_back(t);
    return true;
  });
  const size_t nt = cg.tensors.size(), nn = cg.nodes.size();

  // ---- arena plan: inputs for the whole call, intermediates by lifetime, then scratch and counters ----
  ArenaPlan plan;
  std::vector<uint64_t> off(nt, 0);
  for (size_t i = 0; i < nt; i++) {
    if (cg.tensors[i].kind == KIND_INPUT) off[i] = plan.take(static_cast<uint64_t>(cg.tensors[i].nel) * 4);
  }
  // ---- fusion: adjacent nodes run as one kernel where the graph allows (same operations in the same
  // order, so the values are unchanged); an intermediate only the next node reads is never written ----
  std::vector<int> uses(nt, 0);
  for (size_t ni = 0; ni < nn; ni++)
    for (int sidx : cg.nodes[ni].src)
      if (sidx >= 0) uses[static_cast<size_t>(sidx)]++;
  auto private_to_next = [&](int id) {  // an intermediate read by exactly one node and not an output
    const GTensor& t = cg.tensors[static_cast<size_t>(id)];
    return t.kind == KIND_INTERMEDIATE && t.out < 0 && uses[static_cast<size_t>(id)] == 1;
  };
  enum FuseKind { FUSE_NONE, FUSE_SILU_MUL, FUSE_NORM, FUSE_ROPE_CPY };
  struct Fuse {
    int kind = FUSE_NONE;
    int len = 1;           // nodes in the group, starting here
    bool add = false;      // FUSE_NORM: ADD → RMS_NORM (the sum is still written: later nodes read it)
    bool mul = false;      // FUSE_NORM: RMS_NORM → MUL by a weight vector
  };
  std::vector<Fuse> fuse(nn);
  std::vector<size_t> group_end(nn);
  for (size_t ni = 0; ni < nn; ni++) group_end[ni] = ni;
  const char* no_fuse = std::getenv("POWERINFER_GPU_FUSE");
  const bool fusing = !(no_fuse && no_fuse[0] == '0');
  for (size_t ni = 0; fusing && ni + 1 < nn; ni++) {
    const GNode& a = cg.nodes[ni];
    const GNode& b = cg.nodes[ni + 1];
    const GTensor& ad = cg.tensors[static_cast<size_t>(a.dst)];
    Fuse f;
    if (a.op == OP_ROPE && b.op == OP_CPY && b.src[0] == a.dst && private_to_next(a.dst)) {
      f.kind = FUSE_ROPE_CPY;  // RoPE of K straight into the KV cache
      f.len = 2;
    } else if (a.op == OP_SILU && b.op == OP_MUL && private_to_next(a.dst) &&
        (b.src[0] == a.dst || b.src[1] == a.dst) && b.src[0] != b.src[1] &&
        cg.tensors[static_cast<size_t>(b.src[0])].nel == ad.nel && cg.tensors[static_cast<size_t>(b.src[1])].nel == ad.nel) {
      f.kind = FUSE_SILU_MUL;
      f.len = 2;
    } else if (a.op == OP_ADD || a.op == OP_RMS_NORM) {
      size_t k = ni;
      if (a.op == OP_ADD) {  // ADD (no broadcast) followed by RMS_NORM of its sum
        if (cg.tensors[static_cast<size_t>(a.src[1])].nel != ad.nel || b.op != OP_RMS_NORM || b.src[0] != a.dst) {
          continue;
        }
        f.add = true;
        k = ni + 1;
      }
      const GNode& nrm = cg.nodes[k];
      if (k + 1 < nn) {
        const GNode& m = cg.nodes[k + 1];
        const GTensor& nd = cg.tensors[static_cast<size_t>(nrm.dst)];
        if (m.op == OP_MUL && m.src[0] == nrm.dst && m.src[1] != nrm.dst && private_to_next(nrm.dst) &&
            nd.nel % cg.tensors[static_cast<size_t>(m.src[1])].nel == 0) {
          f.mul = true;
        }
      }
      if (!f.add && !f.mul) continue;
      f.kind = FUSE_NORM;
      f.len = 1 + (f.add ? 1 : 0) + (f.mul ? 1 : 0);
    } else {
      continue;
    }
    fuse[ni] = f;
    for (int j = 0; j < f.len; j++) group_end[ni + static_cast<size_t>(j)] = ni + static_cast<size_t>(f.len) - 1;
    ni += static_cast<size_t>(f.len) - 1;
  }
  // A tensor read inside a fused group lives until the group's last node: the fused kernel still reads
  // it while it writes the group's outputs, which must not take its memory.
  std::vector<std::vector<size_t>> dies(nn);
  for (size_t i = 0; i < nt; i++) {
    const GTensor& t = cg.tensors[i];
    if (t.kind != KIND_INTERMEDIATE || t.producer < 0 || t.out >= 0) continue;
    dies[group_end[static_cast<size_t>(std::max(t.last_use, t.producer))]].push_back(i);
  }
  auto sel = [&](const GNode& n) {
    Selection s{};
    s.threshold = static_cast<float>(n.p[0]);
    s.n_out = static_cast<int64_t>(n.p[1]);
    if (n.src[3] >= 0) {
      const GTensor& r = cg.tensors[static_cast<size_t>(n.src[3])];
      s.n_rows = r.nel;
      s.compact = cg.tensors[static_cast<size_t>(n.src[0])].ne[1] == r.nel;
      s.rows = reinterpret_cast<const int32_t*>(1);  // non-null: "has rows" (real pointer bound below)
    }
    return s;
  };
  // attention parameters of a node (pointers bound when it runs)
  auto attn = [&](const GNode& n) {
    AttentionArgs a{};
    a.window = n.op == OP_ATTENTION_SWA ? static_cast<int64_t>(n.p[5]) : 0;
    a.kv_dtype = cg.tensors[static_cast<size_t>(n.src[1])].dtype;
    a.head_dim = static_cast<int>(n.p[3]);
    a.n_head = static_cast<int>(n.p[4]);
    a.n_head_kv = static_cast<int>(n.p[1]);
    a.t = cg.tensors[static_cast<size_t>(n.src[0])].ne[1];
    a.n_past = static_cast<int64_t>(n.p[0]);
    a.scale = static_cast<float>(n.p[2]);
    return a;
  };
  uint64_t scratch = 0;
  for (size_t ni = 0; ni < nn; ni++) {
    const GNode& n = cg.nodes[ni];
    if (n.op != OP_CPY) off[static_cast<size_t>(n.dst)] = plan.take(static_cast<uint64_t>(cg.tensors[static_cast<size_t>(n.dst)].nel) * 4);
    if (n.op == OP_AXPY_SPARSE || n.op == OP_MUL_MAT || n.op == OP_MUL_MAT_SPARSE) {
      const GTensor& w = cg.tensors[static_cast<size_t>(n.src[0])];
      const int64_t t = cg.tensors[static_cast<size_t>(n.src[1])].ne[1];
      const Weights wt = weights_of(w, nullptr);
      scratch = std::max(scratch, n.op == OP_AXPY_SPARSE       ? axpy_sparse_scratch_bytes(wt, t, sel(n))
                                  : n.op == OP_MUL_MAT_SPARSE ? mul_mat_sparse_scratch_bytes(wt, t, sel(n))
                                                              : mul_mat_scratch_bytes(wt, t));
    }
    if (n.op == OP_ATTENTION || n.op == OP_ATTENTION_SWA) scratch = std::max(scratch, attention_scratch_bytes(attn(n)));
    for (size_t i : dies[ni]) plan.give(off[i], static_cast<uint64_t>(cg.tensors[i].nel) * 4);
  }
  const uint64_t scratch_off = align_up(plan.top());
  const uint64_t counters_off = align_up(scratch_off + scratch);
  const uint64_t total = counters_off + align_up(8 * (nn ? nn : 1));

  std::vector<double> rows_read(nn, 0.0);
  try {
    set_device(device_);
    ensure_arena(total);
    uint8_t* base = static_cast<uint8_t*>(arena_);
    auto ptr = [&](int id) -> void* {
      const GTensor& t = cg.tensors[static_cast<size_t>(id)];
      if (t.kind == KIND_HANDLE) return find(t.ref)->dev;
      return base + off[static_cast<size_t>(id)];
    };
    auto f32 = [&](int id) { return static_cast<float*>(ptr(id)); };
    auto i32 = [&](int id) { return static_cast<const int32_t*>(ptr(id)); };
    unsigned long long* counters = reinterpret_cast<unsigned long long*>(base + counters_off);
    // Inputs lie together at the start of the arena (taken first, in tensor order): gathered into
    // pinned staging and sent in one DMA copy.
    uint64_t in_end = 0;
    for (size_t i = 0; i < nt; i++) {
      const GTensor& t = cg.tensors[i];
      if (t.kind == KIND_INPUT) in_end = std::max(in_end, off[i] + g.inputs[static_cast<size_t>(t.ref)].bytes);
    }
    uint64_t out_bytes = 0;
    for (size_t i = 0; i < nt; i++) {
      const GTensor& t = cg.tensors[i];
      if (t.out >= 0) out_bytes = align_up(out_bytes + g.outputs[static_cast<size_t>(t.out)].bytes);
    }
    uint8_t* stage = ensure_staging(std::max(in_end, out_bytes + 8 * (nn ? nn : 1)));
    if (in_end) {
      for (size_t i = 0; i < nt; i++) {
        const GTensor& t = cg.tensors[i];
        if (t.kind != KIND_INPUT) continue;
        const WireGraph::In& in = g.inputs[static_cast<size_t>(t.ref)];
        if (in.bytes) std::memcpy(stage + off[i], in.data, in.bytes);
      }
      copy_h2d(base, stage, in_end, stream_);
    }
    zero_async(counters, 8 * nn, stream_);

    for (size_t ni = 0; ni < nn; ni++) {
      const GNode& n = cg.nodes[ni];
      if (fuse[ni].kind == FUSE_SILU_MUL) {
        const GNode& m = cg.nodes[ni + 1];
        const int other = m.src[0] == n.dst ? m.src[1] : m.src[0];
        const GTensor& g0 = cg.tensors[static_cast<size_t>(n.src[0])];
        launch_silu_mul(f32(n.src[0]), f32(other), m.src[0] == n.dst, f32(m.dst), g0.nel, stream_);
        ni += 1;
        continue;
      }
      if (fuse[ni].kind == FUSE_ROPE_CPY) {
        const GNode& c = cg.nodes[ni + 1];
        const GTensor& s0 = cg.tensors[static_cast<size_t>(n.src[0])];
        launch_rope_cpy(f32(n.src[0]), i32(n.src[1]), ptr(c.dst), cg.tensors[static_cast<size_t>(c.dst)].dtype,
                        static_cast<int64_t>(c.p[0]), s0.ne[0], s0.ne[1], static_cast<int>(n.p[4]),
                        static_cast<int>(n.p[0]), static_cast<int>(n.p[1]), n.p[2], n.p[3], stream_);
        ni += 1;
        continue;
      }
      if (fuse[ni].kind == FUSE_NORM) {
        const Fuse& f = fuse[ni];
        const GNode& nrm = cg.nodes[f.add ? ni + 1 : ni];
        const GTensor& x = cg.tensors[static_cast<size_t>(nrm.src[0])];
        const float* a = f.add ? f32(n.src[0]) : f32(nrm.src[0]);
        const float* b = f.add ? f32(n.src[1]) : nullptr;
        float* h = f.add ? f32(n.dst) : nullptr;
        const float* w = nullptr;
        int64_t nw = 1;
        float* out = f32(nrm.dst);
        if (f.mul) {
          const GNode& m = cg.nodes[ni + static_cast<size_t>(f.len) - 1];
          w = f32(m.src[1]);
          nw = cg.tensors[static_cast<size_t>(m.src[1])].nel;
          out = f32(m.dst);
        }
        launch_add_rms_norm_mul(a, b, h, w, nw, out, x.ne[0], x.nel / x.ne[0], static_cast<float>(nrm.p[0]), stream_);
        ni += static_cast<size_t>(f.len) - 1;
        continue;
      }
      const GTensor& d = cg.tensors[static_cast<size_t>(n.dst)];
      const GTensor& s0 = cg.tensors[static_cast<size_t>(n.src[0])];
      float* y = n.op == OP_CPY ? nullptr : f32(n.dst);
      const int64_t cols = s0.nel / s0.ne[0];
      switch (n.op) {
        case OP_GET_ROWS:
          launch_get_rows(weights_of(s0, ptr(n.src[0])), i32(n.src[1]), cg.tensors[static_cast<size_t>(n.src[1])].nel,
                          y, stream_);
          break;
        case OP_MUL_MAT:
          launch_mul_mat(weights_of(s0, ptr(n.src[0])), f32(n.src[1]), cg.tensors[static_cast<size_t>(n.src[1])].ne[1],
                         y, base + scratch_off, stream_);
          break;
        case OP_MUL_MAT_SPARSE:
        case OP_AXPY_SPARSE: {
          Selection s = sel(n);
          s.logits = n.src[2] >= 0 ? f32(n.src[2]) : nullptr;
          s.rows = n.src[3] >= 0 ? i32(n.src[3]) : nullptr;
          s.rows_read = counters + ni;
          const int64_t t = cg.tensors[static_cast<size_t>(n.src[1])].ne[1];
          if (n.op == OP_MUL_MAT_SPARSE)
            launch_mul_mat_sparse(weights_of(s0, ptr(n.src[0])), f32(n.src[1]), t, s, y, base + scratch_off, stream_);
          else
            launch_axpy_sparse(weights_of(s0, ptr(n.src[0])), f32(n.src[1]), t, s, y, base + scratch_off, stream_);
          break;
        }
        case OP_RMS_NORM: launch_rms_norm(f32(n.src[0]), y, s0.ne[0], cols, static_cast<float>(n.p[0]), stream_); break;
        case OP_NORM: launch_norm(f32(n.src[0]), y, s0.ne[0], cols, static_cast<float>(n.p[0]), stream_); break;
        case OP_SOFTMAX: launch_softmax(f32(n.src[0]), y, s0.ne[0], cols, static_cast<float>(n.p[0]), stream_); break;
        case OP_ROPE:
          launch_rope(f32(n.src[0]), i32(n.src[1]), y, s0.ne[0], s0.ne[1], static_cast<int>(n.p[4]),
                      static_cast<int>(n.p[0]), static_cast<int>(n.p[1]), n.p[2], n.p[3], stream_);
          break;
        case OP_ATTENTION:
        case OP_ATTENTION_SWA: {
          AttentionArgs a = attn(n);
          a.q = f32(n.src[0]);
          a.k = ptr(n.src[1]);
          a.v = ptr(n.src[2]);
          a.y = y;
          launch_attention(a, base + scratch_off, stream_);
          break;
        }
        case OP_ADD:
        case OP_MUL:
          launch_binary(n.op == OP_ADD ? BINARY_ADD : BINARY_MUL, f32(n.src[0]), f32(n.src[1]), y, s0.nel,
                        cg.tensors[static_cast<size_t>(n.src[1])].nel, stream_);
          break;
        case OP_SCALE: launch_unary(UNARY_SCALE, f32(n.src[0]), y, s0.nel, static_cast<float>(n.p[0]), stream_); break;
        case OP_SILU: launch_unary(UNARY_SILU, f32(n.src[0]), y, s0.nel, 0.0f, stream_); break;
        case OP_RELU: launch_unary(UNARY_RELU, f32(n.src[0]), y, s0.nel, 0.0f, stream_); break;
        case OP_GELU: launch_unary(UNARY_GELU, f32(n.src[0]), y, s0.nel, 0.0f, stream_); break;
        case OP_SIGMOID: launch_unary(UNARY_SIGMOID, f32(n.src[0]), y, s0.nel, 0.0f, stream_); break;
        case OP_RESHAPE: launch_slice(f32(n.src[0]), y, s0.nel, 1, 0, s0.nel, stream_); break;
        case OP_TOP_K:
          launch_top_k(f32(n.src[0]), s0.ne[0], s0.ne[1], static_cast<int>(n.p[0]), reinterpret_cast<int32_t*>(y),
                       stream_);
          break;
        case OP_MUL_MAT_ID:
        case OP_MUL_MAT_ID_SPARSE: {
          const GTensor& ids = cg.tensors[static_cast<size_t>(n.src[2])];
          const GTensor& x = cg.tensors[static_cast<size_t>(n.src[1])];
          const bool sparse = n.op == OP_MUL_MAT_ID_SPARSE;
          const float* logits = sparse && n.src[3] >= 0 ? f32(n.src[3]) : nullptr;
          launch_mul_mat_id(experts_of(s0, ptr(n.src[0])), f32(n.src[1]), x.nel / x.ne[0] != ids.ne[1],
                            i32(n.src[2]), ids.ne[0], ids.ne[1], logits, sparse ? static_cast<float>(n.p[0]) : 0.0f,
                            sparse ? counters + ni : nullptr, y, stream_);
          break;
        }
        case OP_AXPY_ID_SPARSE: {
          const GTensor& ids = cg.tensors[static_cast<size_t>(n.src[2])];
          launch_axpy_id_sparse(experts_of(s0, ptr(n.src[0])), f32(n.src[1]), i32(n.src[2]), ids.nel,
                                n.src[3] >= 0 ? f32(n.src[3]) : nullptr, static_cast<float>(n.p[0]), counters + ni, y,
                                stream_);
          break;
        }
        case OP_MOE_SUM: {
          const GTensor& ids = cg.tensors[static_cast<size_t>(n.src[2])];
          launch_moe_sum(f32(n.src[0]), f32(n.src[1]), i32(n.src[2]), s0.ne[0],
                         cg.tensors[static_cast<size_t>(n.src[1])].ne[0], ids.ne[0], ids.ne[1], n.p[0] != 0,
                         static_cast<float>(n.p[1]), y, stream_);
          break;
        }
        case OP_MOE_SCATTER: {
          const GTensor& ids = cg.tensors[static_cast<size_t>(n.src[1])];
          launch_moe_scatter(f32(n.src[0]), s0.ne[0], i32(n.src[1]), ids.ne[0], ids.ne[1], static_cast<int64_t>(n.p[0]),
                             static_cast<int64_t>(n.p[1]), static_cast<float>(n.p[2]), y, stream_);
          break;
        }
        case OP_CPY:
          launch_cpy(f32(n.src[0]), ptr(n.dst), d.dtype, s0.ne[0], s0.ne[1], static_cast<int64_t>(n.p[0]), stream_);
          break;
        case OP_SLICE:
          launch_slice(f32(n.src[0]), y, s0.ne[0], s0.ne[1], static_cast<int64_t>(n.p[0]), static_cast<int64_t>(n.p[1]),
                       stream_);
          break;
        default: throw BackendErr("BAD_GRAPH", std::string("no kernel for ") + op_name(n.op));
      }
    }

    std::vector<uint64_t> out_at(nt, 0);  // outputs come back through pinned staging, then the counters
    uint64_t o_off = 0;
    for (size_t i = 0; i < nt; i++) {
      const GTensor& t = cg.tensors[i];
      if (t.out < 0) continue;
      const WireGraph::Out& o = g.outputs[static_cast<size_t>(t.out)];
      out_at[i] = o_off;
      copy_d2h(stage + o_off, ptr(static_cast<int>(i)), o.bytes, stream_);
      o_off = align_up(o_off + o.bytes);
    }
    std::vector<unsigned long long> counts(nn ? nn : 1, 0);
    copy_d2h(stage + o_off, counters, 8 * nn, stream_);
    stream_sync(stream_);
    for (size_t i = 0; i < nt; i++) {
      const GTensor& t = cg.tensors[i];
      if (t.out < 0) continue;
      const WireGraph::Out& o = g.outputs[static_cast<size_t>(t.out)];
      if (o.bytes) std::memcpy(o.data, stage + out_at[i], o.bytes);
    }
    if (nn) std::memcpy(counts.data(), stage + o_off, 8 * nn);
    for (size_t ni = 0; ni < nn; ni++) rows_read[ni] = static_cast<double>(counts[ni]);
  } catch (const GpuError& e) {
    try {
      stream_sync(stream_);
    } catch (...) {
      // the error is reported below
    }
    throw as_backend_error(e);
  }
  return rows_read;
}

}  // namespace pigpu
