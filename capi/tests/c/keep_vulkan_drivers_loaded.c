/* Linked into every test program on Linux: keeps Mesa's lavapipe driver
 * loaded until the process exits, so LeakSanitizer still scans its globals
 * at exit. The driver keeps a small allocation reachable only from a
 * static; the Vulkan loader unloads the driver when the instance is
 * destroyed, and LeakSanitizer then reports that allocation as a leak of an
 * unknown module (Mesa 22.3), though nothing of ours is lost. Leaks in the
 * programs and the library are still reported. */
#include <dlfcn.h>

__attribute__((constructor)) static void keep_vulkan_drivers_loaded(void) {
    (void)dlopen("libvulkan_lvp.so", RTLD_NOW | RTLD_NODELETE);
}
