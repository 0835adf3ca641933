// Optional native helper for ssdtrain on GPUs: registers CUDA buffers with cuFile.
//
// GPUDirect Storage moves data between an NVMe drive and GPU memory without a bounce buffer
// only for memory registered with cuFileBufRegister. ssdtrain_buf_register /
// ssdtrain_buf_deregister register one buffer (a byte range of device memory).
//
// Host C++ only: no device code, so any C++17 compiler builds it (cuda_ext/build.py); it needs
// cufile.h and the cuda.h it includes, nothing else. Nothing is linked at build time but libdl:
// libcufile.so.0 is opened on first use, so the library loads on a machine without a GPU
// (ssdtrain/_ext.py loads it best-effort). Errors are returned as codes, never thrown across the
// C ABI.
//
// ABI 2 removed the pluggable allocator of ABI 1 (ssdtrain_alloc / ssdtrain_free): PyTorch calls
// a pluggable allocator's free as soon as a tensor dies, not when the streams that used the
// memory are done with it, and bypasses its caching allocator's statistics
// (max_memory_allocated read 0); nothing on ssdtrain's data path used it.

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
constexpr int kNotRegistered = -4;

using DriverOpenFn = CUfileError_t (*)();
using BufRegisterFn = CUfileError_t (*)(const void*, size_t, int);
using BufDeregisterFn = CUfileError_t (*)(const void*);
using GetVersionFn = CUfileError_t (*)(int*);
struct Api {
  std::mutex mu;
  bool tried_cufile = false;
  void* cufile = nullptr;
  DriverOpenFn driver_open = nullptr;
  BufRegisterFn buf_register = nullptr;
  BufDeregisterFn buf_deregister = nullptr;
  GetVersionFn get_version = nullptr;
  bool driver_opened = false;
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

// Runs with api().mu held.
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
int ssdtrain_ext_abi_version() { return 2; }

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

}  // extern "C"
