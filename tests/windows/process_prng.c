/*
 * bcryptprimitives.dll for Wine 8 (Debian bookworm), for the test run only; never shipped.
 *
 * Rust 1.80+ programs import ProcessPrng from bcryptprimitives.dll (Windows 10+), which Wine
 * gained only in 9.x, so Wine 8 cannot start them. This DLL exports ProcessPrng backed by
 * RtlGenRandom (advapi32's SystemFunction036), which Wine 8 has. scripts/test_windows.sh puts it
 * into the throwaway Wine prefix's system32.
 *
 *   x86_64-w64-mingw32-gcc -shared -O2 -o bcryptprimitives.dll tests/windows/process_prng.c -ladvapi32
 */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length) {
    while (length > 0) {
        ULONG chunk = length > 0x10000000 ? 0x10000000 : (ULONG)length;
        if (!SystemFunction036(data, chunk)) return FALSE;
        data += chunk;
        length -= chunk;
    }
    return TRUE;
}
