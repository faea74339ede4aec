// Gradient buffers of the CPU kernels. A fresh [N, V] tensor is first touched by the kernel
// that writes the gradient, and every first touch of a page is a fault the OS answers by
// zeroing it: for a fresh buffer that costs about as much as writing the gradient itself.
// So the buffer is (1) advised onto transparent huge pages before its first touch (512x
// fewer faults) and (2) recycled: when the gradient is freed (after the optimizer step has
// used it), its memory is kept for the next call of the same size instead of going back to
// the OS, the way PyTorch's CUDA allocator keeps device memory. At most one buffer is kept
// (the most recently freed, of at least 4 MiB); ppo_kernels.empty_cache() returns it, and
// PPO_KERNELS_CPU_GRAD_CACHE=0 turns recycling off. Every kernel writes every entry of the
// buffers it gets (zeros included), so recycled contents are never seen.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace ppo_cpu {
inline namespace CPU_CAPABILITY {

// Advisory only: memory and contents are unchanged if refused.
inline void advise_huge_pages(void* ptr, size_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t start = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (p + nbytes) & ~(kHuge - 1);
  if (end > start + kHuge) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
#endif
}

class GradCache {
 public:
  static GradCache& get() {
    static GradCache cache;
    return cache;
  }
  // A block of at least `bytes` (2 MiB aligned), recycled when one of a close size is kept.
  void* take(size_t bytes, size_t* got) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ptr_ && bytes_ >= bytes && bytes_ <= bytes + bytes / 4 + kAlign) {
        void* p = ptr_;
        *got = bytes_;
        ptr_ = nullptr;
        bytes_ = 0;
        return p;
      }
    }
    const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, rounded);
    TORCH_CHECK(p != nullptr, "ppo_kernels: out of memory allocating a gradient of ", bytes,
                " bytes");
    advise_huge_pages(p, rounded);
    *got = rounded;
    return p;
  }
  // A freed block: kept (replacing a smaller kept one) or returned to the OS.
  void give(void* p, size_t bytes) {
    void* drop = p;
    if (enabled_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (ptr_ == nullptr || bytes_ < bytes) {
        drop = ptr_;
        ptr_ = p;
        bytes_ = bytes;
      }
    }
    std::free(drop);
  }
  void empty() {
    std::lock_guard<std::mutex> lock(mu_);
    std::free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  static constexpr size_t kAlign = size_t(2) << 20;
  static constexpr size_t kMinBytes = size_t(4) << 20;

 private:
  GradCache() {
    const char* s = std::getenv("PPO_KERNELS_CPU_GRAD_CACHE");
    enabled_ = !(s && std::strcmp(s, "0") == 0);
  }
  std::mutex mu_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  bool enabled_ = true;
};

// An uninitialised contiguous tensor for a gradient the caller writes in full.
inline at::Tensor new_grad_buffer(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = size_t(numel) * opts.dtype().itemsize();
  if (bytes < GradCache::kMinBytes) return at::empty(sizes, opts);
  size_t got = 0;
  void* p = GradCache::get().take(bytes, &got);
  return at::from_blob(p, sizes, [got](void* q) { GradCache::get().give(q, got); }, opts);
}

// A new gradient buffer of zeros, zeroed by the pool's threads a MiB a task (one memset of
// a whole share a thread: glibc writes a large memset with non-temporal stores, no read of
// the lines first, which many small ones of a row each would not).
inline at::Tensor new_zero_grad(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor out = new_grad_buffer(sizes, opts);
  char* p = static_cast<char*>(out.data_ptr());
  const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
  constexpr int64_t kGrain = int64_t(1) << 20;  // a MiB a task: the pool's wake-up pays off
  at::parallel_for(0, bytes, kGrain, [&](int64_t begin, int64_t end) {
    std::memset(p + begin, 0, static_cast<size_t>(end - begin));
  });
  return out;
}

}  // namespace CPU_CAPABILITY
}  // namespace ppo_cpu
