// Optional native helper for ssdtrain on GPUs: registers large CUDA buffers with cuFile.
//
// GPUDirect Storage moves data between an NVMe drive and GPU memory without a bounce buffer
// only for memory registered with cuFileBufRegister. This library offers two ways to get there:
//
//   * ssdtrain_buf_register / ssdtrain_buf_deregister: register one buffer (e.g. the reload pool);
//   * ssdtrain_alloc / ssdtrain_free: a PyTorch pluggable allocator
//     (torch.cuda.memory.CUDAPluggableAllocator) whose allocations of at least
//     ssdtrain_set_register_min_bytes() bytes are registered for as long as they live. This
//     replaces the LD_PRELOAD malloc hook other offloading code relies on.
//
// Nothing is linked at build time but libdl: libcufile.so.0 and libcuda.so.1 are opened on first
// use, so the library loads on a machine without a GPU (ssdtrain/_ext.py loads it best-effort).
// Errors are returned as codes, never thrown across the C ABI.

#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>

#include <cuda.h>
#include <cufile.h>

namespace {

// Return codes of this library (besides cuFile's own CUfileOpError values, returned as is).
constexpr int kOk = 0;
constexpr int kNoCufile = -1;  // libcufile.so.0 could not be opened
constexpr int kNoDriver = -2;  // libcuda.so.1 could not be opened
constexpr int kCudaError = -3;  // a CUDA driver call failed
constexpr int kNotRegistered = -4;

using DriverOpenFn = CUfileError_t (*)();
using BufRegisterFn = CUfileError_t (*)(const void*, size_t, int);
using BufDeregisterFn = CUfileError_t (*)(const void*);
using GetVersionFn = CUfileError_t (*)(int*);
using MemAllocFn = CUresult (*)(CUdeviceptr*, size_t);
using MemFreeFn = CUresult (*)(CUdeviceptr);
using PrimaryCtxRetainFn = CUresult (*)(CUcontext*, CUdevice);
using DeviceGetFn = CUresult (*)(CUdevice*, int);
using CtxPushFn = CUresult (*)(CUcontext);
using CtxPopFn = CUresult (*)(CUcontext*);

struct Api {
  std::mutex mu;
  bool tried_cufile = false, tried_cuda = false;
  void* cufile = nullptr;
  void* cuda = nullptr;
  DriverOpenFn driver_open = nullptr;
  BufRegisterFn buf_register = nullptr;
  BufDeregisterFn buf_deregister = nullptr;
  GetVersionFn get_version = nullptr;
  MemAllocFn mem_alloc = nullptr;
  MemFreeFn mem_free = nullptr;
  PrimaryCtxRetainFn primary_ctx_retain = nullptr;
  DeviceGetFn device_get = nullptr;
  CtxPushFn ctx_push = nullptr;
  CtxPopFn ctx_pop = nullptr;
  bool driver_opened = false;
  size_t register_min_bytes = size_t{4} << 20;
  std::unordered_map<int, CUcontext> contexts;     // device -> retained primary context
  std::unordered_map<uintptr_t, size_t> registered;  // address -> length
};

Api& api() {
  static Api a;  // never destroyed before other static destructors that may free buffers
  return a;
}

template <typename T>
void sym(void* lib, const char* name, T& out) {
  out = reinterpret_cast<T>(dlsym(lib, name));
}

// Both loaders run with api().mu held.
int load_cufile(Api& a) {
  if (!a.tried_cufile) {
    a.tried_cufile = true;
    a.cufile = dlopen("libcufile.so.0", RTLD_NOW | RTLD_GLOBAL);
    if (a.cufile != nullptr) {
      sym(a.cufile, "cuFileDriverOpen", a.driver_open);
      sym(a.cufile, "cuFileBufRegister", a.buf_register);
      sym(a.cufile, "cuFileBufDeregister", a.buf_deregister);
      sym(a.cufile, "cuFileGetVersion", a.get_version);
    }
  }
  return (a.driver_open && a.buf_register && a.buf_deregister) ? kOk : kNoCufile;
}

int load_cuda(Api& a) {
  if (!a.tried_cuda) {
    a.tried_cuda = true;
    a.cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (a.cuda != nullptr) {
      sym(a.cuda, "cuMemAlloc_v2", a.mem_alloc);
      sym(a.cuda, "cuMemFree_v2", a.mem_free);
      sym(a.cuda, "cuDevicePrimaryCtxRetain", a.primary_ctx_retain);
      sym(a.cuda, "cuDeviceGet", a.device_get);
      sym(a.cuda, "cuCtxPushCurrent_v2", a.ctx_push);
      sym(a.cuda, "cuCtxPopCurrent_v2", a.ctx_pop);
    }
  }
  return (a.mem_alloc && a.mem_free && a.primary_ctx_retain && a.device_get && a.ctx_push && a.ctx_pop)
             ? kOk
             : kNoDriver;
}

int open_driver(Api& a) {
  if (int rc = load_cufile(a); rc != kOk) return rc;
  if (!a.driver_opened) {
    CUfileError_t e = a.driver_open();
    if (e.err != CU_FILE_SUCCESS) return static_cast<int>(e.err);
    a.driver_opened = true;  // left open for the life of the process, like kvikio does
  }
  return kOk;
}

int register_locked(Api& a, const void* ptr, size_t n) {
  if (int rc = open_driver(a); rc != kOk) return rc;
  CUfileError_t e = a.buf_register(ptr, n, 0);
  if (e.err != CU_FILE_SUCCESS) return static_cast<int>(e.err);
  a.registered[reinterpret_cast<uintptr_t>(ptr)] = n;
  return kOk;
}

int deregister_locked(Api& a, const void* ptr) {
  auto it = a.registered.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == a.registered.end()) return kNotRegistered;
  a.registered.erase(it);
  CUfileError_t e = a.buf_deregister(ptr);
  return e.err == CU_FILE_SUCCESS ? kOk : static_cast<int>(e.err);
}

}  // namespace

extern "C" {

// Bumped whenever a signature below changes; ssdtrain/_ext.py refuses other versions.
int ssdtrain_ext_abi_version() { return 1; }

// cuFile's version (e.g. 1140 for 1.14), or a negative code.
int ssdtrain_cufile_version() {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  if (int rc = load_cufile(a); rc != kOk) return rc;
  if (a.get_version == nullptr) return kNoCufile;
  int v = 0;
  CUfileError_t e = a.get_version(&v);
  return e.err == CU_FILE_SUCCESS ? v : -static_cast<int>(e.err);
}

int ssdtrain_buf_register(const void* ptr, size_t nbytes) {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  return register_locked(a, ptr, nbytes);
}

int ssdtrain_buf_deregister(const void* ptr) {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  return deregister_locked(a, ptr);
}

size_t ssdtrain_registered_bytes() {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  size_t total = 0;
  for (const auto& kv : a.registered) total += kv.second;
  return total;
}

void ssdtrain_set_register_min_bytes(size_t nbytes) {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  a.register_min_bytes = nbytes;
}

// PyTorch pluggable allocator: void* alloc(ssize_t size, int device, cudaStream_t stream).
// Memory comes from the device's primary context (the one the CUDA runtime and PyTorch use).
void* ssdtrain_alloc(ptrdiff_t size, int device, void* /*stream*/) {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  if (size <= 0 || load_cuda(a) != kOk) return nullptr;
  auto ctx_it = a.contexts.find(device);
  if (ctx_it == a.contexts.end()) {
    CUdevice dev;
    CUcontext ctx;
    if (a.device_get(&dev, device) != CUDA_SUCCESS || a.primary_ctx_retain(&ctx, dev) != CUDA_SUCCESS) {
      return nullptr;
    }
    ctx_it = a.contexts.emplace(device, ctx).first;
  }
  if (a.ctx_push(ctx_it->second) != CUDA_SUCCESS) return nullptr;
  CUdeviceptr p = 0;
  CUresult r = a.mem_alloc(&p, static_cast<size_t>(size));
  CUcontext popped;
  a.ctx_pop(&popped);
  if (r != CUDA_SUCCESS) return nullptr;
  void* ptr = reinterpret_cast<void*>(p);
  if (static_cast<size_t>(size) >= a.register_min_bytes) {
    // Best effort: unregistered memory still works with GDS, through cuFile's bounce buffers.
    register_locked(a, ptr, static_cast<size_t>(size));
  }
  return ptr;
}

// PyTorch pluggable allocator: void free(void* ptr, ssize_t size, int device, cudaStream_t stream).
// PyTorch calls it once the memory is no longer used by any stream.
void ssdtrain_free(void* ptr, ptrdiff_t /*size*/, int device, void* /*stream*/) {
  Api& a = api();
  std::lock_guard<std::mutex> lock(a.mu);
  if (ptr == nullptr || load_cuda(a) != kOk) return;
  deregister_locked(a, ptr);
  auto ctx_it = a.contexts.find(device);
  if (ctx_it != a.contexts.end() && a.ctx_push(ctx_it->second) == CUDA_SUCCESS) {
    a.mem_free(reinterpret_cast<CUdeviceptr>(ptr));
    CUcontext popped;
    a.ctx_pop(&popped);
  }
}

}  // extern "C"
