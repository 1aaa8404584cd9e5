/*
 * Links against atlas.dll through its import libraries, as a Windows host that does not use
 * LoadLibrary would (scripts/test_windows.sh): once with MinGW against atlas.dll.a, once with
 * lld-link, the MSVC-compatible linker, against atlas.dll.lib. The second build has no C runtime
 * (there is no MSVC CRT here), hence the NO_CRT entry point. Exit status 0: the DLL loaded and
 * answered with the header's ABI version.
 *
 *   x86_64-w64-mingw32-gcc -I include tests/windows/link_check.c atlas.dll.a -o link_mingw.exe
 *   x86_64-w64-mingw32-gcc -DNO_CRT -ffreestanding -fno-stack-protector -I include -c tests/windows/link_check.c -o link_msvc.obj
 *   lld-link /entry:start /subsystem:console /nodefaultlib link_msvc.obj atlas.dll.lib kernel32.lib /out:link_msvc.exe
 */
#include <windows.h>

#include "atlas.h"

static int check(void) {
    const char *version = atlas_version();
    return atlas_abi_version() == ATLAS_ABI_VERSION && version && version[0] ? 0 : 1;
}

#ifdef NO_CRT
void start(void) {
    ExitProcess((UINT)check());
}
#else
#include <stdio.h>
int main(void) {
    printf("atlas %s, ABI %u\n", atlas_version(), atlas_abi_version());
    return check();
}
#endif
