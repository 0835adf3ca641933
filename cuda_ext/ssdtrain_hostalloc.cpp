// ssdtrain's huge-page CPU allocator: torch's CPU allocations of at least a huge page go on
// transparent huge pages while an Offloader is active, so that the activations it writes to a
// drive leave in few, large I/O requests (Note [written tensors on huge pages] in
// ssdtrain/_hostalloc.py, which builds and loads this file).
//
// Linux only. Built against the installed torch's headers and libc10; the C functions at the end
// are the whole interface (ctypes). Nothing happens when the library is loaded: the allocator is
// put in place by ssdtrain_hostalloc_install() and taken out by ssdtrain_hostalloc_uninstall().

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>
#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kPage = 4096;
constexpr int kAbiVersion = 2;

std::atomic<uint64_t> g_huge_allocations{0};
std::atomic<uint64_t> g_huge_bytes{0};
std::atomic<uint64_t> g_reused{0};

// Blocks this allocator made, and those of them no tensor uses now (Note [reuse freed blocks]).
struct Blocks {
  std::mutex mutex;
  std::unordered_map<void*, size_t> length;             // every block not given back to the C library
  std::unordered_map<size_t, std::vector<void*>> idle;  // blocks to hand out again, by length
  size_t idle_bytes = 0;
  size_t limit = 0;  // at most this many idle bytes (ssdtrain_hostalloc_set_idle_limit)
};
Blocks* const g_blocks = new Blocks();  // never destroyed, like the allocator below

// Whether freed blocks are kept: from the allocator's installation until ssdtrain_hostalloc_trim()
// (the Offloader's close()), so that tensors freed after training do not fill the list again.
std::atomic<bool> g_keep{false};

// torch's default CPU allocator's deleter (it reports to the profiler and frees): memory this
// allocator did not make itself (small allocations) goes back through it.
std::atomic<c10::DeleterFnPtr> g_plain_deleter{nullptr};

// Note [reuse freed blocks]
// A block freed while the offloader runs (a tensor written, then dropped) used to go back to the
// C library, which returns large ones to the system; the next forward then faulted fresh pages in
// and the kernel zeroed every one. On the bench model that was 60-80 ms a step of clearing pages
// that baseline (whose memory glibc keeps in its heap) does not pay. Blocks are therefore kept,
// up to a limit, and handed out again for an allocation of the same length (page-rounded): the
// layers of a model allocate the same shapes over and over, so most find one. A kept block is on
// huge pages already (no madvise again). Blocks freed in backward (while torch's allocator is in
// place) are kept too: they serve the next forward. Measured on the bench model, per step of 10:
// keeping every block, all 85 allocations reused one, 18 thousand page faults, 0.08-0.17 s of
// system CPU; keeping only blocks freed in forward, 83 reused, 27-34 thousand faults, 0.17-0.18 s;
// giving back what is idle when forward ends, 75 reused, 27-38 thousand faults, 0.22-0.56 s.
// The price is memory: about 125 MiB of blocks sit idle through backward there. Bytes beyond
// the limit, and everything idle at ssdtrain_hostalloc_trim() (the Offloader's close()), go
// back to the C library.
void free_block(void* p) {
  if (p == nullptr) {
    return;
  }
  Blocks& b = *g_blocks;
  size_t len = 0;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    auto it = b.length.find(p);
    if (it != b.length.end()) {
      len = it->second;
    }
  }
  if (len == 0) {  // not ours: a small allocation torch's allocator made
    g_plain_deleter.load(std::memory_order_acquire)(p);
    return;
  }
  // Reported freed before it can be handed out again: once in the idle list, another thread may
  // take it and report it allocated, and a late Delete would drop that new record.
  c10::profiledCPUMemoryReporter().Delete(p);
  bool keep = false;
  {
    std::lock_guard<std::mutex> lock(b.mutex);
    if (g_keep.load(std::memory_order_acquire) && b.idle_bytes + len <= b.limit) {
      try {
        b.idle[len].push_back(p);
        b.idle_bytes += len;
        keep = true;
      } catch (...) {  // no memory for the list: give the block back instead
      }
    }
    if (!keep) {
      b.length.erase(p);
    }
  }
  if (!keep) {
    std::free(p);
  }
}

// What torch's own allocator does with THP_MEM_ALLOC_ENABLE=1 (posix_memalign at a huge page,
// MADV_HUGEPAGE, reported to the profiler), so tensors from either allocator are alike to torch;
// plus reuse of freed blocks (Note [reuse freed blocks]). It is only ever put in front of torch's
// default CPU allocator. One more addition: memory the C library hands out again may have been
// touched on small pages before (by allocations made before this allocator was in place, or by
// small ones); MADV_HUGEPAGE does not change pages already there, so MADV_COLLAPSE replaces them
// by huge pages (a copy, once per range; on a range already on a huge page it costs a page-table
// walk).
class HugePageAllocator final : public c10::Allocator {
 public:
  // The allocator that serves what this one does not (torch's, as a rule). Set at each install;
  // atomic because a thread that fetched this allocator just before an uninstall may still call it.
  void set_next(c10::Allocator* next) { next_.store(next, std::memory_order_release); }
  c10::Allocator* next() const { return next_.load(std::memory_order_acquire); }

  c10::DataPtr allocate(size_t n) override {
    if (n < kHuge) {
      return next()->allocate(n);
    }
    const size_t len = (n + kPage - 1) / kPage * kPage;
    void* p = take_idle(len);
    if (p == nullptr) {
      if (posix_memalign(&p, kHuge, len) != 0 || p == nullptr) {
        return next()->allocate(n);  // let torch's allocator fail (or succeed) its own way
      }
      // MADV_COLLAPSE fails where nothing was touched yet (no page table: the first touch
      // faults a huge page in anyway) and on kernels before 6.1; either way the memory is good.
      madvise(p, len, MADV_HUGEPAGE);
      madvise(p, len / kHuge * kHuge, MADV_COLLAPSE);
      try {
        std::lock_guard<std::mutex> lock(g_blocks->mutex);
        g_blocks->length[p] = len;
      } catch (...) {  // no memory for the table: this block is not kept track of, so not made
        std::free(p);
        return next()->allocate(n);
      }
    }
    c10::profiledCPUMemoryReporter().New(p, n);
    g_huge_allocations.fetch_add(1, std::memory_order_relaxed);
    g_huge_bytes.fetch_add(n, std::memory_order_relaxed);
    return {p, p, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate/raw_deallocate (torch uses them for scratch memory): free_block tells its own
  // blocks from torch's.
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static void* take_idle(size_t len) {
    Blocks& b = *g_blocks;
    std::lock_guard<std::mutex> lock(b.mutex);
    auto it = b.idle.find(len);
    if (it == b.idle.end() || it->second.empty()) {
      return nullptr;
    }
    void* p = it->second.back();
    it->second.pop_back();
    b.idle_bytes -= len;
    g_reused.fetch_add(1, std::memory_order_relaxed);
    return p;
  }

  std::atomic<c10::Allocator*> next_{nullptr};
};

std::mutex g_mutex;

// A fork (a DataLoader worker) copies the process with its locks as they are: had another thread
// held the block lock at that moment, the child's first free of a tensor would wait forever. So
// a fork waits for the lock, and both sides release it.
void before_fork() { g_blocks->mutex.lock(); }
void after_fork() { g_blocks->mutex.unlock(); }
std::once_flag g_fork_handlers;

// One object for the life of the process, never destroyed (not even at exit): torch may still
// allocate through it while other libraries' destructors run.
HugePageAllocator* const g_allocator = new HugePageAllocator();
bool g_installed = false;

}  // namespace

extern "C" {

int ssdtrain_hostalloc_abi_version() { return kAbiVersion; }

// 0: installed (or already); 1: torch's CPU allocator is not its default one (someone else's is in
// place; nothing done).
int ssdtrain_hostalloc_install() {
  std::call_once(g_fork_handlers, [] { pthread_atfork(before_fork, after_fork, after_fork); });
  std::lock_guard<std::mutex> lock(g_mutex);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == g_allocator) {
    g_installed = true;
    g_keep.store(true, std::memory_order_release);
    return 0;
  }
  c10::Allocator* plain = c10::GetDefaultCPUAllocator();
  if (current != plain || plain->raw_deleter() == nullptr) {
    return 1;
  }
  g_allocator->set_next(current);
  g_plain_deleter.store(plain->raw_deleter(), std::memory_order_release);
  c10::SetCPUAllocator(g_allocator, /*priority=*/0);  // refused when someone set a higher priority
  if (c10::GetCPUAllocator() != g_allocator) {
    return 1;
  }
  g_installed = true;
  g_keep.store(true, std::memory_order_release);
  return 0;
}

// 0: the allocator that was in place before is back; 1: not installed; 2: someone replaced this
// allocator after it was installed, and theirs is left in place.
int ssdtrain_hostalloc_uninstall() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_installed) {
    return 1;
  }
  g_installed = false;
  if (c10::GetCPUAllocator() != g_allocator) {
    return 2;
  }
  c10::SetCPUAllocator(g_allocator->next(), /*priority=*/0);
  return 0;
}

int ssdtrain_hostalloc_installed() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_installed && c10::GetCPUAllocator() == g_allocator;
}

uint64_t ssdtrain_hostalloc_allocations() { return g_huge_allocations.load(); }
uint64_t ssdtrain_hostalloc_bytes() { return g_huge_bytes.load(); }
uint64_t ssdtrain_hostalloc_reused() { return g_reused.load(); }

uint64_t ssdtrain_hostalloc_idle_bytes() {
  std::lock_guard<std::mutex> lock(g_blocks->mutex);
  return g_blocks->idle_bytes;
}

// At most this many bytes of freed blocks are kept for reuse (0, the default: none).
void ssdtrain_hostalloc_set_idle_limit(uint64_t limit) {
  std::lock_guard<std::mutex> lock(g_blocks->mutex);
  g_blocks->limit = limit;
}

// Gives every idle block back to the C library, and keeps no more until the allocator is
// installed again; returns how many bytes that was.
uint64_t ssdtrain_hostalloc_trim() {
  g_keep.store(false, std::memory_order_release);
  std::vector<void*> blocks;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_blocks->mutex);
    for (auto& [len, ps] : g_blocks->idle) {
      for (void* p : ps) {
        g_blocks->length.erase(p);
        blocks.push_back(p);
      }
    }
    bytes = g_blocks->idle_bytes;
    g_blocks->idle.clear();
    g_blocks->idle_bytes = 0;
  }
  for (void* p : blocks) {
    std::free(p);
  }
  return bytes;
}

}  // extern "C"
