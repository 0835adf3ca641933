/*
 * Test-only stand-in for the CUDA driver library (libcuda.so.1). NEVER shipped in the package.
 *
 * kvikio loads libcuda.so.1 even to do I/O on host memory. On a machine without a GPU there is
 * none, so tests build this file into a temporary libcuda.so.1 (see tests/test_kvikio_backend.py).
 * Every driver call answers CUDA_ERROR_NOT_INITIALIZED, which kvikio reads as "this pointer is
 * host memory" and serves with its POSIX (compatibility mode) path. The only calls that succeed
 * are the ones a real driver answers before cuInit: the driver version and the error strings.
 */

#include <stddef.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_INITIALIZED 3

/* The driver version reported: 12.0 (below 12.8, so kvikio does not require batch copies). */
#define FAKE_DRIVER_VERSION 12000

int cuDriverGetVersion(int *version)
{
    if (version == NULL) return 1; /* CUDA_ERROR_INVALID_VALUE */
    *version = FAKE_DRIVER_VERSION;
    return CUDA_SUCCESS;
}

static const char not_init_name[] = "CUDA_ERROR_NOT_INITIALIZED";
static const char not_init_text[] = "initialization error (ssdtrain test stand-in driver: no GPU)";

int cuGetErrorName(int error, const char **str)
{
    (void)error;
    if (str == NULL) return 1;
    *str = not_init_name;
    return CUDA_SUCCESS;
}

int cuGetErrorString(int error, const char **str)
{
    (void)error;
    if (str == NULL) return 1;
    *str = not_init_text;
    return CUDA_SUCCESS;
}

/*
 * Everything else: "not initialised". Defined without parameters; on the platforms we build
 * for, the caller owns its arguments, so any argument list is fine.
 */
#define NOT_INITIALIZED(name) int name(void) { return CUDA_ERROR_NOT_INITIALIZED; }

NOT_INITIALIZED(cuInit)
NOT_INITIALIZED(cuDeviceGet)
NOT_INITIALIZED(cuDeviceGetCount)
NOT_INITIALIZED(cuDeviceGetAttribute)
NOT_INITIALIZED(cuDeviceGetName)
NOT_INITIALIZED(cuDeviceGetUuid)
NOT_INITIALIZED(cuDeviceGetUuid_v2)
NOT_INITIALIZED(cuDeviceGetPCIBusId)
NOT_INITIALIZED(cuDeviceTotalMem)
NOT_INITIALIZED(cuDeviceTotalMem_v2)
NOT_INITIALIZED(cuDevicePrimaryCtxRetain)
NOT_INITIALIZED(cuDevicePrimaryCtxRelease)
NOT_INITIALIZED(cuDevicePrimaryCtxRelease_v2)
NOT_INITIALIZED(cuCtxCreate)
NOT_INITIALIZED(cuCtxCreate_v2)
NOT_INITIALIZED(cuCtxCreate_v3)
NOT_INITIALIZED(cuCtxCreate_v4)
NOT_INITIALIZED(cuCtxDestroy)
NOT_INITIALIZED(cuCtxDestroy_v2)
NOT_INITIALIZED(cuCtxPushCurrent)
NOT_INITIALIZED(cuCtxPushCurrent_v2)
NOT_INITIALIZED(cuCtxPopCurrent)
NOT_INITIALIZED(cuCtxPopCurrent_v2)
NOT_INITIALIZED(cuCtxGetCurrent)
NOT_INITIALIZED(cuCtxSetCurrent)
NOT_INITIALIZED(cuCtxGetDevice)
NOT_INITIALIZED(cuCtxSynchronize)
NOT_INITIALIZED(cuMemAlloc)
NOT_INITIALIZED(cuMemAlloc_v2)
NOT_INITIALIZED(cuMemFree)
NOT_INITIALIZED(cuMemFree_v2)
NOT_INITIALIZED(cuMemHostAlloc)
NOT_INITIALIZED(cuMemFreeHost)
NOT_INITIALIZED(cuMemHostRegister)
NOT_INITIALIZED(cuMemHostRegister_v2)
NOT_INITIALIZED(cuMemHostUnregister)
NOT_INITIALIZED(cuMemGetAddressRange)
NOT_INITIALIZED(cuMemGetAddressRange_v2)
NOT_INITIALIZED(cuMemcpy)
NOT_INITIALIZED(cuMemcpyAsync)
NOT_INITIALIZED(cuMemcpyAsync_ptsz)
NOT_INITIALIZED(cuMemcpyHtoD)
NOT_INITIALIZED(cuMemcpyHtoD_v2)
NOT_INITIALIZED(cuMemcpyDtoH)
NOT_INITIALIZED(cuMemcpyDtoH_v2)
NOT_INITIALIZED(cuMemcpyHtoDAsync)
NOT_INITIALIZED(cuMemcpyHtoDAsync_v2)
NOT_INITIALIZED(cuMemcpyHtoDAsync_v2_ptsz)
NOT_INITIALIZED(cuMemcpyDtoHAsync)
NOT_INITIALIZED(cuMemcpyDtoHAsync_v2)
NOT_INITIALIZED(cuMemcpyDtoHAsync_v2_ptsz)
NOT_INITIALIZED(cuMemcpyBatchAsync)
NOT_INITIALIZED(cuMemcpyBatchAsync_v2)
NOT_INITIALIZED(cuPointerGetAttribute)
NOT_INITIALIZED(cuPointerGetAttributes)
NOT_INITIALIZED(cuStreamCreate)
NOT_INITIALIZED(cuStreamCreateWithPriority)
NOT_INITIALIZED(cuStreamGetFlags)
NOT_INITIALIZED(cuStreamDestroy)
NOT_INITIALIZED(cuStreamDestroy_v2)
NOT_INITIALIZED(cuStreamSynchronize)
NOT_INITIALIZED(cuStreamSynchronize_ptsz)
NOT_INITIALIZED(cuEventCreate)
NOT_INITIALIZED(cuEventDestroy)
NOT_INITIALIZED(cuEventDestroy_v2)
NOT_INITIALIZED(cuEventRecord)
NOT_INITIALIZED(cuEventRecord_ptsz)
NOT_INITIALIZED(cuEventQuery)
NOT_INITIALIZED(cuEventSynchronize)
NOT_INITIALIZED(cuLaunchHostFunc)
NOT_INITIALIZED(cuLaunchHostFunc_ptsz)
NOT_INITIALIZED(cuGetProcAddress)
NOT_INITIALIZED(cuGetProcAddress_v2)
