#include "tensor_store.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "neuron_cache.h"

namespace pi {

FileMapping::~FileMapping() {
  if (base && size) munmap(base, size);
}

Tensor::~Tensor() {
  if ((!mapped || copied) && data) free_weights(data, bytes);
  free_weights(packed, packed_bytes);
}

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

uint8_t* alloc_weights(size_t bytes) {
  if (bytes >= kHugePage) {
    const size_t padded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    // a mapping of our own, over-allocated by one huge page and trimmed to a 2 MiB-aligned range
    void* raw = mmap(nullptr, padded + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t a = (r + kHugePage - 1) / kHugePage * kHugePage;
    if (a > r) munmap(raw, a - r);
    if (r + padded + kHugePage > a + padded) munmap(reinterpret_cast<void*>(a + padded), r + padded + kHugePage - (a + padded));
    void* p = reinterpret_cast<void*>(a);
    madvise(p, padded, MADV_HUGEPAGE);  // advice only: without THP the pages stay 4 KiB
    // A child process (fork + exec: the bench's llama-bench, any spawn) does not get these pages: without
    // this, fork write-protects them in the parent and every page of the arena and the KV cache takes a
    // fault at its next write (pp512 on a 7B slice ran ~25 % slower after each spawn)
    madvise(p, padded, MADV_DONTFORK);
    return static_cast<uint8_t*>(p);
  }
  return static_cast<uint8_t*>(std::aligned_alloc(64, bytes == 0 ? 64 : (bytes + 63) / 64 * 64));
}

void free_weights(uint8_t* p, size_t bytes) {
  if (!p) return;
  if (bytes >= kHugePage) {
    munmap(p, (bytes + kHugePage - 1) / kHugePage * kHugePage);
  } else {
    std::free(p);
  }
}

namespace {

/// Releases this process's pages of [p, p + bytes) of a file mapping (whole pages inside the range only;
/// the file refaults them if read again).
void release_mapped(const uint8_t* p, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t b0 = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t b1 = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  if (b1 > b0) madvise(reinterpret_cast<void*>(b0), b1 - b0, MADV_DONTNEED);
}

}  // namespace

size_t tensor_bytes(int dtype, const int64_t ne[4]) {
  const Layout l = dtype_layout(dtype);
  if (l.block == 0) {
    throw BackendErr("BAD_TENSOR", "unsupported dtype code " + std::to_string(dtype));
  }
  for (int i = 0; i < 4; i++) {
    if (ne[i] < 1 || ne[i] > (int64_t{1} << 40)) {
      throw BackendErr("BAD_TENSOR", "bad dimension " + std::to_string(ne[i]));
    }
  }
  if (ne[0] % l.block != 0) {
    throw BackendErr("BAD_TENSOR", std::string(dtype_name(dtype)) + ": row length " + std::to_string(ne[0]) +
                                       " is not a multiple of the block size " + std::to_string(l.block));
  }
  const unsigned __int128 b = static_cast<unsigned __int128>(ne[0] / l.block) * static_cast<unsigned>(l.bytes) *
                              static_cast<uint64_t>(ne[1]) * static_cast<uint64_t>(ne[2]) * static_cast<uint64_t>(ne[3]);
  if (b > (static_cast<unsigned __int128>(1) << 46)) throw BackendErr("BAD_TENSOR", "tensor too large");
  return static_cast<size_t>(b);
}

TensorPtr TensorStore::create(int dtype, const int64_t ne[4]) {
  const size_t bytes = tensor_bytes(dtype, ne);
  std::lock_guard<std::mutex> lk(mu_);
  if (bytes > budget_ || allocated_ > budget_ - bytes) {
    throw BackendErr("OUT_OF_MEMORY", "cannot allocate " + std::to_string(bytes) + " bytes: " +
                                          std::to_string(allocated_) + " of the memory budget of " +
                                          std::to_string(budget_) + " bytes are in use");
  }
  uint8_t* p = alloc_weights(bytes);
  if (!p) throw BackendErr("OUT_OF_MEMORY", "allocation of " + std::to_string(bytes) + " bytes failed");
  // a fresh anonymous mapping (≥ 2 MiB) is zero already and its pages are faulted in at first use: no
  // memset, which would touch every page now (a 7B model's 2 GiB KV cache: seconds in one call)
  if (bytes < kHugePage) std::memset(p, 0, bytes);
  auto t = std::make_shared<Tensor>();
  t->id = next_id_++;
  t->dtype = dtype;
  for (int i = 0; i < 4; i++) t->ne[i] = ne[i];
  t->bytes = bytes;
  t->data = static_cast<uint8_t*>(p);
  allocated_ += bytes;
  tensors_[t->id] = t;
  return t;
}

TensorPtr TensorStore::map(int dtype, const int64_t ne[4], const std::string& path, uint64_t offset,
                           uint64_t byte_length) {
  const size_t bytes = tensor_bytes(dtype, ne);
  if (byte_length != bytes) {
    throw BackendErr("BAD_TENSOR", "mapTensor: byteLength " + std::to_string(byte_length) + " != " +
                                       std::to_string(bytes) + " bytes of a " + dtype_name(dtype) + " tensor");
  }
  const size_t align = (dtype == DT_F32 || dtype == DT_I32) ? 4 : 2;
  if (offset % align != 0) {
    throw BackendErr("BAD_TENSOR", "mapTensor: file offset " + std::to_string(offset) + " is not " +
                                       std::to_string(align) + "-byte aligned");
  }
  char resolved[PATH_MAX];
  if (!realpath(path.c_str(), resolved)) {
    throw BackendErr("IO", "mapTensor: cannot open " + path + ": " + std::strerror(errno));
  }
  const std::string key(resolved);
  std::lock_guard<std::mutex> lk(mu_);
  std::shared_ptr<FileMapping> fm = files_[key].lock();
  if (!fm) {
    const int fd = open(resolved, O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw BackendErr("IO", "mapTensor: cannot open " + path + ": " + std::strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0) {
      close(fd);
      throw BackendErr("IO", "mapTensor: cannot map empty or unreadable file " + path);
    }
    void* base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    close(fd);
    if (base == MAP_FAILED) throw BackendErr("IO", "mapTensor: mmap of " + path + " failed: " + std::strerror(err));
    fm = std::make_shared<FileMapping>();
    fm->path = key;
    fm->base = base;
    fm->size = static_cast<size_t>(st.st_size);
    files_[key] = fm;
  }
  if (offset > fm->size || byte_length > fm->size - offset) {
    throw BackendErr("BAD_TENSOR", "mapTensor: bytes " + std::to_string(offset) + ".." +
                                       std::to_string(offset + byte_length) + " exceed the file size " +
                                       std::to_string(fm->size) + " of " + path);
  }
  auto t = std::make_shared<Tensor>();
  t->id = next_id_++;
  t->dtype = dtype;
  for (int i = 0; i < 4; i++) t->ne[i] = ne[i];
  t->bytes = bytes;
  t->data = static_cast<uint8_t*>(fm->base) + offset;
  t->mapped = true;
  t->mapping = fm;
  if (bytes >= kHugePage && copied_ + bytes <= copy_limit_ && defer_copies_) {
    t->copy_pending = true;
    copied_ += bytes;
    pending_.push_back(t);
  } else if (bytes >= kHugePage && copied_ + bytes <= copy_limit_) {
    if (uint8_t* p = alloc_weights(bytes)) {
      std::memcpy(p, t->data, bytes);
      release_mapped(t->data, bytes);
      t->map_data = t->data;
      t->data = p;
      t->copied = true;
      copied_ += bytes;
    }
  }
  tensors_[t->id] = t;
  return t;
}

CacheCounters& TensorStore::counters() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!counters_) counters_ = std::make_shared<CacheCounters>();
  return *counters_;
}

TensorPtr TensorStore::map_cached(int dtype, const int64_t ne[4], const CacheSpec& spec, int group, int pool_id) {
  const size_t bytes = tensor_bytes(dtype, ne);
  // one row per neuron (2-d) or, for a stacked expert tensor, one row per expert (3-d, ne[2] experts)
  if (ne[3] != 1 || (!spec.expert_rows && ne[2] != 1)) {
    throw BackendErr("BAD_TENSOR", "mapTensorCached: only 2-d tensors (one row per neuron) or 3-d expert stacks (expertRows)");
  }
  const int64_t rows = spec.expert_rows ? ne[2] : ne[1];
  const size_t rb = bytes / static_cast<size_t>(rows);
  if (spec.row_bytes < rb || spec.n_rows != rows) {
    throw BackendErr("BAD_TENSOR", "mapTensorCached: row size/count differ from the tensor's shape");
  }
  char resolved[PATH_MAX];
  if (!realpath(spec.path.c_str(), resolved)) {
    throw BackendErr("IO", "mapTensorCached: cannot open " + spec.path + ": " + std::strerror(errno));
  }
  CacheSpec s = spec;
  s.path = resolved;
  std::shared_ptr<ReaderPool> pool;
  CacheCounters* ctr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!counters_) counters_ = std::make_shared<CacheCounters>();
    if (!readers_) {
      int n = 16;  // reads are latency-bound: more in flight than cores (POWERINFER_IO_THREADS overrides)
      if (const char* v = std::getenv("POWERINFER_IO_THREADS")) {
        const int x = std::atoi(v);
        if (x >= 1 && x <= 256) n = x;
      }
      // io_uring unless POWERINFER_IO=pread (the CLI checks the value); the pool where the kernel refuses a ring
      const char* io = std::getenv("POWERINFER_IO");
      const bool pread_only = io && std::strcmp(io, "pread") == 0;
      readers_ = std::make_shared<ReaderPool>(n, counters_.get(), pread_only ? IoEngine::PREAD : IoEngine::IO_URING);
    }
    pool = readers_;
    ctr = counters_.get();
  }
  const size_t slot_bytes = (s.row_bytes + 63) / 64 * 64;
  std::shared_ptr<SlotPool> slots;
  if (pool_id > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    const std::string key = std::to_string(pool_id) + ":" + std::to_string(slot_bytes);
    slots = pools_[key].lock();
    if (!slots) {
      slots = std::make_shared<SlotPool>(slot_bytes);
      pools_[key] = slots;
    }
  } else {
    slots = std::make_shared<SlotPool>(slot_bytes);
  }
  auto cache = std::make_shared<NeuronCache>(s, pool, slots, ctr);
  std::lock_guard<std::mutex> lk(mu_);
  if (group > 0) {
    auto& g = groups_[group];
    std::vector<NeuronCache*> live;
    for (auto& w : g) {
      if (auto c = w.lock()) live.push_back(c.get());
    }
    for (NeuronCache* c : live) {
      c->siblings.push_back(cache.get());
      cache->siblings.push_back(c);
    }
    g.push_back(cache);
  }
  auto t = std::make_shared<Tensor>();
  t->id = next_id_++;
  t->dtype = dtype;
  for (int i = 0; i < 4; i++) t->ne[i] = ne[i];
  t->bytes = bytes;
  t->data = nullptr;
  t->mapped = true;
  t->cache = cache;
  tensors_[t->id] = t;
  return t;
}

TensorPtr TensorStore::share_cached(int dtype, const int64_t ne[4], int with, size_t part_offset) {
  const size_t bytes = tensor_bytes(dtype, ne);
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tensors_.find(with);
  if (it == tensors_.end() || !it->second->cache) {
    throw BackendErr("BAD_TENSOR", "mapTensorCached: shareWith " + std::to_string(with) + " is not a cached tensor");
  }
  const std::shared_ptr<NeuronCache>& c = it->second->cache;
  const size_t rb = bytes / static_cast<size_t>(ne[1]);
  if (ne[2] != 1 || ne[3] != 1 || ne[1] != c->n_rows() || part_offset + rb > c->row_bytes()) {
    throw BackendErr("BAD_TENSOR", "mapTensorCached: part [" + std::to_string(part_offset) + ", +" + std::to_string(rb) +
                                       ") does not fit the shared cache's rows of " + std::to_string(c->row_bytes()) + " bytes");
  }
  auto t = std::make_shared<Tensor>();
  t->id = next_id_++;
  t->dtype = dtype;
  for (int i = 0; i < 4; i++) t->ne[i] = ne[i];
  t->bytes = bytes;
  t->mapped = true;
  t->cache = c;
  t->cache_part = part_offset;
  t->cache_counts = false;
  tensors_[t->id] = t;
  return t;
}

size_t TensorStore::cache_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t b = 0;
  for (auto& kv : tensors_) {
    if (kv.second->cache && kv.second->cache_counts) b += kv.second->cache->resident_bytes();
  }
  return b;
}

int TensorStore::io_threads() const {
  std::lock_guard<std::mutex> lk(mu_);
  return readers_ ? readers_->size() : 0;
}

int TensorStore::io_depth() const {
  std::lock_guard<std::mutex> lk(mu_);
  return readers_ ? readers_->depth() : 0;
}

bool TensorStore::all_direct() const {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : tensors_) {
    if (kv.second->cache && !kv.second->cache->direct()) return false;
  }
  return true;
}

TensorPtr TensorStore::find(int id) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tensors_.find(id);
  return it == tensors_.end() ? nullptr : it->second;
}

TensorPtr TensorStore::get(int id) const {
  TensorPtr t = find(id);
  if (!t) throw BackendErr("BAD_TENSOR", "tensor " + std::to_string(id) + " does not exist (freed or never created)");
  return t;
}

namespace {

/// 8 rows of Q4_0 (row r at src[r]) → nb BlockQ4_0x8.
void pack_group_q4_0(const BlockQ4_0* const* src, int64_t nb, BlockQ4_0x8* dst) {
  for (int64_t i = 0; i < nb; i++) {
    BlockQ4_0x8& o = dst[i];
    for (int r = 0; r < 8; r++) {
      const BlockQ4_0& b = src[r][i];
      o.d[r] = b.d;
      for (int c = 0; c < 4; c++) std::memcpy(o.qs + 32 * c + 4 * r, b.qs + 4 * c, 4);
    }
  }
}

/// 8 rows of Q4_K (row r at src[r]) → nb BlockQ4_Kx8 (scales and mins decoded to bytes).
void pack_group_q4_K(const BlockQ4_K* const* src, int64_t nb, BlockQ4_Kx8* dst) {
  for (int64_t i = 0; i < nb; i++) {
    BlockQ4_Kx8& o = dst[i];
    for (int r = 0; r < 8; r++) {
      const BlockQ4_K& b = src[r][i];
      o.d[r] = b.d;
      o.dmin[r] = b.dmin;
      for (int j = 0; j < 8; j++) k4_scale_min(j, b.scales, &o.sc[8 * j + r], &o.mn[8 * j + r]);
      for (int p = 0; p < 4; p++) {
        for (int c = 0; c < 8; c++) std::memcpy(o.qs + 256 * p + 32 * c + 4 * r, b.qs + 32 * p + 4 * c, 4);
      }
    }
  }
}

}  // namespace

void pack_rows_x8(int dtype, int64_t k, const uint8_t* const* rows, uint8_t* dst) {
  if (dtype == DT_Q4_0) {
    const BlockQ4_0* src[8];
    for (int r = 0; r < 8; r++) src[r] = reinterpret_cast<const BlockQ4_0*>(rows[r]);
    pack_group_q4_0(src, k / QK, reinterpret_cast<BlockQ4_0x8*>(dst));
  } else {
    const BlockQ4_K* src[8];
    for (int r = 0; r < 8; r++) src[r] = reinterpret_cast<const BlockQ4_K*>(rows[r]);
    pack_group_q4_K(src, k / QK_K, reinterpret_cast<BlockQ4_Kx8*>(dst));
  }
}

const uint8_t* TensorStore::packed(const TensorPtr& t) {
  std::lock_guard<std::mutex> lk(mu_);
  if (t->packed || t->pack_refused) return t->packed;
  const int64_t k = t->ne[0], rows = t->ne[1] * t->ne[2] * t->ne[3];
  const size_t gbytes = packed_group_bytes(t->dtype, k);
  if (gbytes == 0 || rows % 8 != 0 || !t->data) return nullptr;
  const size_t bytes = gbytes * static_cast<size_t>(rows / 8);
  if (bytes > budget_ || allocated_ > budget_ - bytes) {
    t->pack_refused = true;
    return nullptr;
  }
  uint8_t* p = alloc_weights(bytes);
  if (!p) {
    t->pack_refused = true;
    return nullptr;
  }
  const size_t rb = row_bytes(t->dtype, k);
  for (int64_t g = 0; g < rows / 8; g++) {
    const uint8_t* src[8];
    for (int r = 0; r < 8; r++) src[r] = t->data + (static_cast<size_t>(g) * 8 + static_cast<size_t>(r)) * rb;
    pack_rows_x8(t->dtype, k, src, p + static_cast<size_t>(g) * gbytes);
  }
  if (t->copy_pending) {
    // a reserved copy is not made: the packed copy replaces it
    t->copy_pending = false;
    copied_ -= t->bytes;
  }
  if (t->copied) {
    // the packed copy replaces the huge-page copy: back to the file mapping for the unpacked readers
    free_weights(t->data, t->bytes);
    t->data = t->map_data;
    t->copied = false;
    copied_ -= t->bytes;
  } else if (t->mapped) {
    release_mapped(t->data, t->bytes);  // the copy replaces the mapped pages instead of doubling them
  }
  allocated_ += bytes;
  t->packed = p;
  t->packed_bytes = bytes;
  return p;
}

void TensorStore::drop_packed(Tensor& t) {
  std::lock_guard<std::mutex> lk(mu_);
  if (t.packed) {
    free_weights(t.packed, t.packed_bytes);
    t.packed = nullptr;
    allocated_ -= t.packed_bytes;
    t.packed_bytes = 0;
  }
  t.pack_refused = false;
}

void TensorStore::release(int id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = tensors_.find(id);
  if (it == tensors_.end()) throw BackendErr("BAD_TENSOR", "tensor " + std::to_string(id) + " was already freed");
  if (!it->second->mapped) allocated_ -= it->second->bytes;
  if (it->second->copied || it->second->copy_pending) copied_ -= it->second->bytes;
  it->second->copy_pending = false;  // (copy_pending() may hold it: it skips it)
  if (it->second->packed) allocated_ -= it->second->packed_bytes;
  if (NeuronCache* c = it->second->cache_counts ? it->second->cache.get() : nullptr) {
    // siblings hold plain pointers: unlink before the cache can go
    for (NeuronCache* o : c->siblings) {
      auto& v = o->siblings;
      v.erase(std::remove(v.begin(), v.end(), c), v.end());
    }
    c->siblings.clear();
  }
  tensors_.erase(it);
}

void TensorStore::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& kv : tensors_) {
    if (kv.second->cache) kv.second->cache->siblings.clear();
  }
  tensors_.clear();
  groups_.clear();
  pools_.clear();
  files_.clear();
  allocated_ = 0;
  copied_ = 0;
  for (auto& w : pending_) {
    if (TensorPtr t = w.lock()) t->copy_pending = false;
  }
  pending_.clear();
}

void TensorStore::set_defer_copies(bool on) {
  std::lock_guard<std::mutex> lk(mu_);
  defer_copies_ = on;
}

size_t TensorStore::copy_pending() {
  std::lock_guard<std::mutex> one(copy_mu_);
  size_t done = 0;
  for (;;) {
    TensorPtr t;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (!pending_.empty() && !t) {
        t = pending_.front().lock();
        pending_.erase(pending_.begin());
        if (t && !t->copy_pending) t.reset();
      }
    }
    if (!t) return done;
    // the bytes are read from the mapping outside the lock (a mapped tensor's data changes only here or
    // when it is repacked, which keeps the mapping valid)
    const uint8_t* src = t->data;
    uint8_t* p = alloc_weights(t->bytes);
    if (p) std::memcpy(p, src, t->bytes);
    std::lock_guard<std::mutex> lk(mu_);
    if (!t->copy_pending) {  // released or repacked meanwhile: its reservation was returned then
      free_weights(p, t->bytes);
      continue;
    }
    t->copy_pending = false;
    if (!p) {
      copied_ -= t->bytes;
      continue;
    }
    release_mapped(t->data, t->bytes);
    t->map_data = t->data;
    t->data = p;
    t->copied = true;
    done += t->bytes;
  }
}

size_t TensorStore::pending_copy_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  size_t n = 0;
  for (const auto& w : pending_) {
    if (TensorPtr t = w.lock()) n += t->copy_pending ? t->bytes : 0;
  }
  return n;
}

void TensorStore::set_copy_limit(size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  copy_limit_ = bytes;
}

size_t TensorStore::copied() const {
  std::lock_guard<std::mutex> lk(mu_);
  return copied_;
}

size_t TensorStore::allocated() const {
  std::lock_guard<std::mutex> lk(mu_);
  return allocated_;
}

}  // namespace pi
