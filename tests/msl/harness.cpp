// Runs one MSL kernel (compiled as C++ with metal_shim.h) over a grid.
//
//   harness GX GY GZ TG OUT...   < buffers
//
// stdin: u32 buffer count, then per buffer (in [[buffer(n)]] order) a u64
// byte length and the bytes. stdout: for each index OUT, the u64 length and
// the bytes of that buffer after the run. Every buffer ends exactly at a
// page that cannot be read or written, so a read or write past its end
// (which Metal leaves undefined) crashes the run instead of passing quietly.
// MSL_HARNESS_TIMEOUT (seconds, default 120) bounds a run, so a kernel whose
// lanes disagree on barriers fails instead of hanging.

#include "metal_shim.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

void msl_launch(void* const* buffers, const msl_rt::LaneCtx& c);

namespace {

void fail(const char* what) {
    std::fprintf(stderr, "harness: %s\n", what);
    std::exit(2);
}

void read_all(void* dst, size_t n) {
    auto* p = static_cast<unsigned char*>(dst);
    while (n > 0) {
        ssize_t r = ::read(0, p, n);
        if (r <= 0) fail("short read on stdin");
        p += r;
        n -= size_t(r);
    }
}

void write_all(const void* src, size_t n) {
    auto* p = static_cast<const unsigned char*>(src);
    while (n > 0) {
        ssize_t r = ::write(1, p, n);
        if (r <= 0) fail("short write on stdout");
        p += r;
        n -= size_t(r);
    }
}

// `len` bytes ending 16-byte aligned right before an inaccessible page.
unsigned char* guarded(size_t len) {
    const size_t page = size_t(sysconf(_SC_PAGESIZE));
    const size_t body = (len + 15) / 16 * 16;
    const size_t pages = (body + page - 1) / page;
    auto* base = static_cast<unsigned char*>(
        mmap(nullptr, (pages + 1) * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    if (base == MAP_FAILED) fail("mmap");
    unsigned char* guard = base + pages * page;
    if (mprotect(guard, page, PROT_NONE) != 0) fail("mprotect");
    return guard - body;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 5) fail("usage: harness GX GY GZ TG OUT...");
    const char* timeout = std::getenv("MSL_HARNESS_TIMEOUT");
    alarm(timeout ? unsigned(std::atoi(timeout)) : 120u);
    const metal::uint3 grid(std::stoul(argv[1]), std::stoul(argv[2]), std::stoul(argv[3]));
    const unsigned tg = unsigned(std::stoul(argv[4]));
    if (tg == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0) fail("empty grid or threadgroup");

    uint32_t n = 0;
    read_all(&n, sizeof n);
    std::vector<void*> buffers(n);
    std::vector<uint64_t> lens(n);
    for (uint32_t i = 0; i < n; i++) {
        read_all(&lens[i], sizeof lens[i]);
        buffers[i] = guarded(lens[i]);
        read_all(buffers[i], lens[i]);
    }

    msl_rt::run(grid, tg, msl_launch, buffers.data());

    for (int a = 5; a < argc; a++) {
        const unsigned long i = std::stoul(argv[a]);
        if (i >= n) fail("output index out of range");
        write_all(&lens[i], sizeof lens[i]);
        write_all(buffers[i], lens[i]);
    }
    return 0;
}
