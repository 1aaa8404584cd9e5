/*
 * A stand-in for AMD's HIP runtime (amdhip64_6.dll) and hipRTC (hiprtc0604.dll) on a machine with
 * no AMD GPU, for scripts/test_windows.sh: it exports every entry point Atlas resolves, reports
 * HIP 6.4, initialises, and then finds no device (hipGetDeviceCount: 0, hipErrorNoDevice), as the
 * real runtime does without a GPU. Every other call fails. Test use only; never shipped.
 *
 *   x86_64-w64-mingw32-gcc -shared -O2 -o amdhip64_6.dll tests/windows/hip_stub.c
 */
#include <stddef.h>

#define EXPORT __declspec(dllexport)

enum { HIP_SUCCESS = 0, HIP_ERROR_NO_DEVICE = 100, HIP_ERROR_NOT_SUPPORTED = 801 };
enum { HIPRTC_ERROR_INTERNAL_ERROR = 11 };

EXPORT int hipInit(unsigned flags) {
    (void)flags;
    return HIP_SUCCESS;
}

EXPORT int hipRuntimeGetVersion(int *version) {
    if (version) *version = 60443483; /* HIP 6.4.43483, as the HIP SDK 6.4 for Windows reports */
    return HIP_SUCCESS;
}

EXPORT int hipGetDeviceCount(int *count) {
    if (count) *count = 0;
    return HIP_ERROR_NO_DEVICE;
}

EXPORT const char *hipGetErrorName(int status) {
    switch (status) {
    case HIP_SUCCESS: return "hipSuccess";
    case HIP_ERROR_NO_DEVICE: return "hipErrorNoDevice";
    default: return "hipErrorNotSupported";
    }
}

EXPORT const char *hipGetErrorString(int status) {
    switch (status) {
    case HIP_SUCCESS: return "no error";
    case HIP_ERROR_NO_DEVICE: return "no ROCm-capable device is detected (Atlas test stub)";
    default: return "operation not supported (Atlas test stub)";
    }
}

EXPORT const char *hiprtcGetErrorString(int status) {
    (void)status;
    return "HIPRTC_ERROR_INTERNAL_ERROR (Atlas test stub)";
}

/* Everything else: no device, so every call fails. The x64 calling convention lets a function of
   no parameters stand for any signature (the caller owns the argument space). */
#define UNSUPPORTED(name) EXPORT int name(void) { return HIP_ERROR_NOT_SUPPORTED; }
#define RTC_FAILS(name) EXPORT int name(void) { return HIPRTC_ERROR_INTERNAL_ERROR; }

UNSUPPORTED(hipSetDevice)
UNSUPPORTED(hipGetDevice)
UNSUPPORTED(hipDeviceGet)
UNSUPPORTED(hipDeviceGetName)
UNSUPPORTED(hipDeviceGetAttribute)
UNSUPPORTED(hipGetDevicePropertiesR0600)
UNSUPPORTED(hipStreamCreateWithFlags)
UNSUPPORTED(hipStreamDestroy)
UNSUPPORTED(hipStreamSynchronize)
UNSUPPORTED(hipMalloc)
UNSUPPORTED(hipFree)
UNSUPPORTED(hipMemcpyHtoDAsync)
UNSUPPORTED(hipMemcpyDtoHAsync)
UNSUPPORTED(hipMemcpyDtoDAsync)
UNSUPPORTED(hipModuleLoadData)
UNSUPPORTED(hipModuleUnload)
UNSUPPORTED(hipModuleGetFunction)
UNSUPPORTED(hipModuleLaunchKernel)

RTC_FAILS(hiprtcCreateProgram)
RTC_FAILS(hiprtcCompileProgram)
RTC_FAILS(hiprtcGetProgramLogSize)
RTC_FAILS(hiprtcGetProgramLog)
RTC_FAILS(hiprtcGetCodeSize)
RTC_FAILS(hiprtcGetCode)
RTC_FAILS(hiprtcDestroyProgram)
