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

#include <sys/mman.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace {

constexpr size_t kHuge = size_t(2) << 20;
constexpr int kAbiVersion = 1;

std::atomic<uint64_t> g_huge_allocations{0};
std::atomic<uint64_t> g_huge_bytes{0};

// What torch's own allocator does with THP_MEM_ALLOC_ENABLE=1 (posix_memalign at a huge page,
// MADV_HUGEPAGE, reported to the profiler, freed by that allocator's deleter), so tensors from
// either allocator are alike to torch. It is only ever put in front of torch's default CPU
// allocator, whose deleter frees memory from posix_memalign. One addition: memory the C library
// hands out again may have been touched on small pages before (by allocations made before this
// allocator was in place, or by small ones); MADV_HUGEPAGE does not change pages already there,
// so MADV_COLLAPSE replaces them by huge pages (a copy, once per range; on a range already on a
// huge page it costs a page-table walk).
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
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, n) != 0 || p == nullptr) {
      return next()->allocate(n);  // let torch's allocator fail (or succeed) its own way
    }
    // MADV_COLLAPSE fails where nothing was touched yet (no page table: the first touch faults
    // a huge page in anyway) and on kernels before 6.1; either way the memory is still good.
    madvise(p, (n + 4095) / 4096 * 4096, MADV_HUGEPAGE);
    madvise(p, n / kHuge * kHuge, MADV_COLLAPSE);
    c10::profiledCPUMemoryReporter().New(p, n);
    g_huge_allocations.fetch_add(1, std::memory_order_relaxed);
    g_huge_bytes.fetch_add(n, std::memory_order_relaxed);
    return {p, p, next()->raw_deleter(), c10::Device(c10::DeviceType::CPU)};
  }

  // raw_allocate/raw_deallocate (torch uses them for scratch memory) free both kinds alike.
  c10::DeleterFnPtr raw_deleter() const override { return next()->raw_deleter(); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }


 private:
  std::atomic<c10::Allocator*> next_{nullptr};
};

std::mutex g_mutex;
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
  std::lock_guard<std::mutex> lock(g_mutex);
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == g_allocator) {
    g_installed = true;
    return 0;
  }
  c10::Allocator* plain = c10::GetDefaultCPUAllocator();
  if (current != plain || plain->raw_deleter() == nullptr) {
    return 1;
  }
  g_allocator->set_next(current);
  c10::SetCPUAllocator(g_allocator, /*priority=*/0);  // refused when someone set a higher priority
  if (c10::GetCPUAllocator() != g_allocator) {
    return 1;
  }
  g_installed = true;
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

}  // extern "C"
