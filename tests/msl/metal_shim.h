// Metal Shading Language on the CPU, as C++20 (g++ -std=c++20 -pthread
// -Wno-attributes): enough of MSL to compile the kernels under kernels/msl/
// unchanged and run them with real concurrency.
//
// Execution model: one threadgroup at a time, one OS thread per lane (the
// lanes are created once per launch and walk the grid together), 32 lanes
// per simdgroup as on Apple GPUs (MSL_SHIM_SIMD_WIDTH changes it).
// threadgroup_barrier is a std::barrier over the threadgroup; simdgroup
// functions are collective: every lane of the simdgroup deposits its value
// in the simdgroup's scratch, waits on the simdgroup's std::barrier, and
// reads everyone's values (two scratch sets used alternately, so one
// barrier per operation suffices). A lane that
// skips a barrier or a simdgroup function its peers reach hangs the
// harness, which the harness's alarm turns into a failure.
//
// `threadgroup` becomes `static`: a function-scope threadgroup array is then
// shared by the lanes, and running threadgroups one after the other makes
// one instance enough. Hence the kernels declare threadgroup memory only in
// the kernel function (as MSL requires anyway) and never pass it to helpers.
//
// Everything the lanes need is defined before the address-space keywords
// become macros (`thread` would otherwise break <thread>).
//
// SIMD-group matrices (simdgroup_float8x8, simdgroup_half8x8; the Metal
// Shading Language specification's "SIMD-group Matrix Data Types" and
// "SIMD-group Matrix Functions" sections) are emulated with the ownership
// of the hardware: an 8x8 matrix is spread over the 32 lanes of a
// simdgroup, two elements per lane (its `thread_elements()`), and a lane
// holds only its own two. The specification fixes the count (64 elements
// over 32 threads) but not which two; the table used here is the one
// Apple's MLX relies on for its GEMMs (steel's `BaseMMAFrag<T, 8, 8>::
// get_coord`): lane l holds row (l/4 & 4) + (l/2 % 4), columns
// (l/4 & 2) * 2 + (l % 2) * 2 and the one after it. On a device with
// another table a kernel that reads `thread_elements()` computes wrong
// values, which the engine's start-up self-check catches.
// simdgroup_load / simdgroup_store move each lane's own two elements and
// synchronise the simdgroup; simdgroup_multiply_accumulate is collective:
// each lane deposits its elements of the three operands, waits on the
// simdgroup's barrier, assembles the whole operands from every lane's
// deposit through the table, and keeps its own two elements of the result.
// A kernel that hands a lane's elements to the wrong coordinates, or whose
// lanes do not all take part, computes wrong values or hangs, as on the
// device. Matrices need full 32-lane simdgroups (Apple GPUs); any other
// width aborts the run.

#pragma once

#include <algorithm>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace metal {

using uint = uint32_t;
using ulong = uint64_t;
using ushort = uint16_t;
using uchar = uint8_t;
using half = _Float16;

// MSL vectors: .x/.y/.z/.w and [i]; element-wise arithmetic, with scalars
// on either side; explicit conversion between element types.
template <class T, int N>
struct vec;

#define MSL_VEC_COMMON(N)                                                                      \
    using value_type = T;                                                                      \
    static constexpr int size = N;                                                             \
    vec() = default;                                                                           \
    constexpr vec(T s) {                                                                       \
        for (int i = 0; i < N; i++) (*this)[i] = s;                                            \
    }                                                                                          \
    template <class U>                                                                         \
    constexpr explicit vec(const vec<U, N>& o) {                                               \
        for (int i = 0; i < N; i++) (*this)[i] = static_cast<T>(o[i]);                         \
    }                                                                                          \
    constexpr T& operator[](int i) { return (&x)[i]; }                                         \
    constexpr const T& operator[](int i) const { return (&x)[i]; }

template <class T>
struct vec<T, 2> {
    T x, y;
    MSL_VEC_COMMON(2)
    template <class A, class B>
    constexpr vec(A a, B b) : x(static_cast<T>(a)), y(static_cast<T>(b)) {}
};
template <class T>
struct vec<T, 3> {
    T x, y, z;
    MSL_VEC_COMMON(3)
    template <class A, class B, class C>
    constexpr vec(A a, B b, C c) : x(static_cast<T>(a)), y(static_cast<T>(b)), z(static_cast<T>(c)) {}
};
template <class T>
struct vec<T, 4> {
    T x, y, z, w;
    MSL_VEC_COMMON(4)
    template <class A, class B, class C, class D>
    constexpr vec(A a, B b, C c, D d)
        : x(static_cast<T>(a)), y(static_cast<T>(b)), z(static_cast<T>(c)), w(static_cast<T>(d)) {}
    constexpr vec(vec<T, 2> a, vec<T, 2> b) : x(a.x), y(a.y), z(b.x), w(b.y) {}
};
#undef MSL_VEC_COMMON

template <class T>
struct is_vec : std::false_type {};
template <class T, int N>
struct is_vec<vec<T, N>> : std::true_type {};

#define MSL_VEC_BINOP(op)                                                                      \
    template <class T, int N>                                                                  \
    constexpr vec<T, N> operator op(vec<T, N> a, vec<T, N> b) {                                \
        for (int i = 0; i < N; i++) a[i] = a[i] op b[i];                                       \
        return a;                                                                              \
    }                                                                                          \
    template <class T, int N, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>      \
    constexpr vec<T, N> operator op(vec<T, N> a, S s) {                                        \
        return a op vec<T, N>(static_cast<T>(s));                                              \
    }                                                                                          \
    template <class T, int N, class S, class = std::enable_if_t<std::is_arithmetic_v<S>>>      \
    constexpr vec<T, N> operator op(S s, vec<T, N> a) {                                        \
        return vec<T, N>(static_cast<T>(s)) op a;                                              \
    }                                                                                          \
    template <class T, int N, class B>                                                         \
    constexpr vec<T, N>& operator op##=(vec<T, N>& a, B b) {                                   \
        return a = a op b;                                                                     \
    }
MSL_VEC_BINOP(+)
MSL_VEC_BINOP(-)
MSL_VEC_BINOP(*)
MSL_VEC_BINOP(/)
#undef MSL_VEC_BINOP

template <class T, int N>
constexpr vec<T, N> operator-(vec<T, N> a) {
    for (int i = 0; i < N; i++) a[i] = -a[i];
    return a;
}

using float2 = vec<float, 2>;
using float3 = vec<float, 3>;
using float4 = vec<float, 4>;
using half2 = vec<half, 2>;
using half4 = vec<half, 4>;
using int2 = vec<int32_t, 2>;
using int4 = vec<int32_t, 4>;
using uint2 = vec<uint, 2>;
using uint3 = vec<uint, 3>;
using uint4 = vec<uint, 4>;
using ushort2 = vec<ushort, 2>;
using ulong2 = vec<ulong, 2>;
using char4 = vec<int8_t, 4>;
using uchar4 = vec<uchar, 4>;

static_assert(sizeof(half2) == 4 && sizeof(char4) == 4 && sizeof(float4) == 16 && sizeof(uint4) == 16);

// Reinterprets the bits (sizes must match, as in MSL).
template <class To, class From>
constexpr To as_type(const From& v) {
    static_assert(sizeof(To) == sizeof(From), "as_type between types of different sizes");
    return std::bit_cast<To>(v);
}

// Element-wise helpers: f applied to scalars or to each component.
template <class T, class F>
constexpr T map1(T a, F f) {
    if constexpr (is_vec<T>::value) {
        for (int i = 0; i < T::size; i++) a[i] = f(a[i]);
        return a;
    } else {
        return f(a);
    }
}
template <class T, class F>
constexpr T map2(T a, T b, F f) {
    if constexpr (is_vec<T>::value) {
        for (int i = 0; i < T::size; i++) a[i] = f(a[i], b[i]);
        return a;
    } else {
        return f(a, b);
    }
}

template <class T, int N>
constexpr T dot(vec<T, N> a, vec<T, N> b) {
    T s = a[0] * b[0];
    for (int i = 1; i < N; i++) s += a[i] * b[i];
    return s;
}

// Float math in float (MSL has no double): f-suffixed libm calls.
template <class T>
T exp(T v) {
    return map1(v, [](auto s) { return decltype(s)(std::exp(float(s))); });
}
template <class T>
T exp2(T v) {
    return map1(v, [](auto s) { return decltype(s)(std::exp2(float(s))); });
}
template <class T>
T log(T v) {
    return map1(v, [](auto s) { return decltype(s)(std::log(float(s))); });
}
template <class T>
T sqrt(T v) {
    return map1(v, [](auto s) { return decltype(s)(std::sqrt(float(s))); });
}
template <class T>
T rsqrt(T v) {
    return map1(v, [](auto s) { return decltype(s)(1.0f / std::sqrt(float(s))); });
}
template <class T>
T floor(T v) {
    return map1(v, [](auto s) { return decltype(s)(std::floor(float(s))); });
}
template <class T>
T abs(T v) {
    return map1(v, [](auto s) { return s < 0 ? decltype(s)(-s) : s; });
}
template <class T>
constexpr T max(T a, T b) {
    return map2(a, b, [](auto p, auto q) { return p > q ? p : q; });
}
template <class T>
constexpr T min(T a, T b) {
    return map2(a, b, [](auto p, auto q) { return p < q ? p : q; });
}
template <class T>
constexpr T fmax(T a, T b) {
    return max(a, b);
}
template <class T>
constexpr T fmin(T a, T b) {
    return min(a, b);
}
template <class T>
constexpr T clamp(T v, T lo, T hi) {
    return min(max(v, lo), hi);
}
template <class T>
constexpr T fma(T a, T b, T c) {
    return a * b + c;
}
// select(a, b, c): c ? b : a (scalar condition).
template <class T>
constexpr T select(T a, T b, bool c) {
    return c ? b : a;
}

enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
    return mem_flags(uint(a) | uint(b));
}

}  // namespace metal

namespace msl_rt {

using metal::uint;
using metal::uint3;

// 32 lanes as on Apple GPUs; the tests also build other widths (Intel and
// AMD GPUs in Macs have 8 to 64) to check nothing assumes 32.
#ifndef MSL_SHIM_SIMD_WIDTH
#define MSL_SHIM_SIMD_WIDTH 32
#endif
constexpr uint SIMD_WIDTH = MSL_SHIM_SIMD_WIDTH;
// Largest value a simdgroup function carries (a float4 / uint4).
constexpr size_t SLOT_BYTES = 16;

// What one lane deposits for a simdgroup-matrix multiply: its two elements
// of each of the three operands, as floats (exact for half too).
constexpr size_t MATRIX_SLOT_FLOATS = 6;

struct Simdgroup {
    explicit Simdgroup(uint width) : width(width), bar(width) {}
    uint width;
    std::barrier<> bar;
    alignas(64) unsigned char slot[2][SIMD_WIDTH][SLOT_BYTES];
    // The simdgroup-matrix exchange, in the same two sets as `slot`.
    alignas(64) float matrix_slot[2][SIMD_WIDTH][MATRIX_SLOT_FLOATS];
};

// One lane's view of the launch; the field names are the MSL attribute
// names, so a generated launcher passes `c.<attribute>`.
struct LaneCtx {
    uint3 thread_position_in_threadgroup;
    uint thread_index_in_threadgroup;
    uint3 threadgroup_position_in_grid;
    uint3 threadgroups_per_grid;
    uint3 threads_per_threadgroup;
    uint3 thread_position_in_grid;
    uint thread_index_in_simdgroup;
    uint simdgroup_index_in_threadgroup;
    uint simdgroups_per_threadgroup;
    uint threads_per_simdgroup;
    Simdgroup* simd;
    std::barrier<>* group;
    uint parity;  // which scratch set the next simdgroup function uses
};

inline thread_local LaneCtx* lane = nullptr;

// Converts a builtin to the parameter's declared type (uint3 -> uint takes .x).
template <class T, class V>
T builtin(V v) {
    if constexpr (metal::is_vec<V>::value && !metal::is_vec<T>::value) {
        return static_cast<T>(v.x);
    } else if constexpr (metal::is_vec<T>::value) {
        return T(v);
    } else {
        return static_cast<T>(v);
    }
}

// Every lane of the simdgroup contributes `v`; `f(vals, width, me)` computes
// this lane's result from all of them (in lane order).
template <class T, class F>
T collective(T v, F f) {
    static_assert(sizeof(T) <= SLOT_BYTES && std::is_trivially_copyable_v<T>);
    LaneCtx& c = *lane;
    Simdgroup& s = *c.simd;
    auto& slots = s.slot[c.parity];
    c.parity ^= 1;
    std::memcpy(slots[c.thread_index_in_simdgroup], &v, sizeof(T));
    // The barrier publishes the writes; with two scratch sets, nobody can
    // overwrite this set before everyone has read it (that takes passing the
    // next operation's barrier).
    s.bar.arrive_and_wait();
    T vals[SIMD_WIDTH];
    for (uint i = 0; i < s.width; i++) std::memcpy(&vals[i], slots[i], sizeof(T));
    return f(vals, s.width, c.thread_index_in_simdgroup);
}

// Pairwise (butterfly-order) reduction, the same result on every lane.
template <class T, class Op>
T tree_reduce(T* vals, uint n, Op op) {
    for (uint stride = 1; stride < n; stride *= 2) {
        for (uint i = 0; i + stride < n; i += 2 * stride) vals[i] = op(vals[i], vals[i + stride]);
    }
    return vals[0];
}

// Which element of an 8x8 simdgroup matrix lane `l` holds as its element
// `e` (0 or 1) of `thread_elements()`: {row, column}. See the header.
struct MatrixCoord {
    uint row, col;
};
constexpr MatrixCoord matrix_coord(uint l, uint e) {
    const uint q = l / 4;
    return {(q & 4) + (l / 2) % 4, (q & 2) * 2 + (l % 2) * 2 + e};
}

#ifdef MSL_SHIM_MATRIX_SWAPS_LANES
// Deliberate fault for the shim's own test: the multiply reads lanes 0
// and 1 (which hold the same row) each in the other's place.
constexpr bool matrix_swaps_lanes = true;
#else
constexpr bool matrix_swaps_lanes = false;
#endif

// The calling lane's simdgroup, which must be a full 32-lane one.
inline Simdgroup& matrix_simdgroup() {
    Simdgroup& s = *lane->simd;
    if (s.width != 32) {
        std::fprintf(stderr, "simdgroup matrices need a full 32-lane simdgroup (this one has %u lanes)\n", s.width);
        std::abort();
    }
    return s;
}

// Every lane of the simdgroup deposits `mine`; returns every lane's
// deposit, in lane order (one barrier, as `collective`).
inline void matrix_exchange(const float (&mine)[MATRIX_SLOT_FLOATS], float (&all)[32][MATRIX_SLOT_FLOATS]) {
    LaneCtx& c = *lane;
    Simdgroup& s = matrix_simdgroup();
    auto& slots = s.matrix_slot[c.parity];
    c.parity ^= 1;
    std::memcpy(slots[c.thread_index_in_simdgroup], mine, sizeof mine);
    s.bar.arrive_and_wait();
    std::memcpy(all, slots, sizeof all);
}

#ifdef MSL_SHIM_SHUFFLE_XOR_DROPS_LANE
// Deliberate fault for the harness's own test: simd_shuffle_xor reads zero
// from one lane (a tree reduction then misses that lane's values).
constexpr uint xor_dropped_lane = MSL_SHIM_SHUFFLE_XOR_DROPS_LANE;
#endif

using LaunchFn = void (*)(void* const* buffers, const LaneCtx& c);

// Runs the grid, one threadgroup after another, `tg_size` lanes each.
inline void run(uint3 grid, uint tg_size, LaunchFn launch, void* const* buffers) {
    const uint n_sg = (tg_size + SIMD_WIDTH - 1) / SIMD_WIDTH;
    std::barrier<> group(tg_size);
    std::vector<std::unique_ptr<Simdgroup>> simds;
    for (uint s = 0; s < n_sg; s++) simds.push_back(std::make_unique<Simdgroup>(std::min(SIMD_WIDTH, tg_size - s * SIMD_WIDTH)));
    std::vector<std::thread> lanes;
    for (uint i = 0; i < tg_size; i++) {
        lanes.emplace_back([&, i] {
            LaneCtx c{};
            c.thread_position_in_threadgroup = uint3(i, 0u, 0u);
            c.thread_index_in_threadgroup = i;
            c.threadgroups_per_grid = grid;
            c.threads_per_threadgroup = uint3(tg_size, 1u, 1u);
            c.thread_index_in_simdgroup = i % SIMD_WIDTH;
            c.simdgroup_index_in_threadgroup = i / SIMD_WIDTH;
            c.simdgroups_per_threadgroup = n_sg;
            c.threads_per_simdgroup = SIMD_WIDTH;
            c.simd = simds[i / SIMD_WIDTH].get();
            c.group = &group;
            lane = &c;
            for (uint z = 0; z < grid.z; z++) {
                for (uint y = 0; y < grid.y; y++) {
                    for (uint x = 0; x < grid.x; x++) {
                        c.threadgroup_position_in_grid = uint3(x, y, z);
                        c.thread_position_in_grid = uint3(x * tg_size + i, y, z);
                        launch(buffers, c);
                        // The next threadgroup reuses the static threadgroup memory.
                        group.arrive_and_wait();
                    }
                }
            }
        });
    }
    for (auto& t : lanes) t.join();
}

}  // namespace msl_rt

namespace metal {

inline void threadgroup_barrier(mem_flags) {
    msl_rt::lane->group->arrive_and_wait();
}
inline void simdgroup_barrier(mem_flags) {
    msl_rt::lane->simd->bar.arrive_and_wait();
}

template <class T>
T simd_sum(T v) {
    return msl_rt::collective(v, [](T* vals, uint n, uint) {
        return msl_rt::tree_reduce(vals, n, [](T a, T b) { return a + b; });
    });
}
template <class T>
T simd_max(T v) {
    return msl_rt::collective(v, [](T* vals, uint n, uint) { return msl_rt::tree_reduce(vals, n, [](T a, T b) { return max(a, b); }); });
}
template <class T>
T simd_min(T v) {
    return msl_rt::collective(v, [](T* vals, uint n, uint) { return msl_rt::tree_reduce(vals, n, [](T a, T b) { return min(a, b); }); });
}
// Lane i gets lane i + delta's value; the top `delta` lanes keep their own.
template <class T>
T simd_shuffle_down(T v, ushort delta) {
    return msl_rt::collective(v, [delta](T* vals, uint n, uint me) { return me + delta < n ? vals[me + delta] : vals[me]; });
}
template <class T>
T simd_shuffle_up(T v, ushort delta) {
    return msl_rt::collective(v, [delta](T* vals, uint, uint me) { return me >= delta ? vals[me - delta] : vals[me]; });
}
template <class T>
T simd_shuffle_xor(T v, ushort mask) {
    return msl_rt::collective(v, [mask](T* vals, uint n, uint me) {
#ifdef MSL_SHIM_SHUFFLE_XOR_DROPS_LANE
        if ((me ^ mask) == msl_rt::xor_dropped_lane) return T(0);
#endif
        return (me ^ mask) < n ? vals[me ^ mask] : vals[me];
    });
}
template <class T>
T simd_shuffle(T v, ushort from) {
    return msl_rt::collective(v, [from](T* vals, uint n, uint me) { return from < n ? vals[from] : vals[me]; });
}
template <class T>
T simd_broadcast(T v, ushort from) {
    return simd_shuffle(v, from);
}
template <class T>
T simd_broadcast_first(T v) {
    return simd_shuffle(v, 0);
}

// SIMD-group matrices (see the header for the element ownership).
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
    static_assert(Cols == 8 && Rows == 8, "only 8x8 simdgroup matrices are emulated");
    simdgroup_matrix() = default;
    // MSL: `d` on the diagonal, zero elsewhere.
    explicit simdgroup_matrix(T d) {
        const uint l = msl_rt::lane->thread_index_in_simdgroup;
        for (uint e = 0; e < 2; e++) {
            const auto at = msl_rt::matrix_coord(l, e);
            elements[e] = at.row == at.col ? d : T(0);
        }
    }
    vec<T, 2>& thread_elements() { return elements; }
    const vec<T, 2>& thread_elements() const { return elements; }
    vec<T, 2> elements{T(0)};
};

using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;

template <class T, int Cols, int Rows = Cols>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
    simdgroup_matrix<T, Cols, Rows> m;
    m.elements = vec<T, 2>(value);
    return m;
}

// Where element (row, col) of the matrix lies in a row-major layout of
// `elements_per_row` elements (transposed: where element (col, row) lies).
// The kernels pass their offset in the pointer: a non-zero matrix origin
// is not emulated, and aborts.
inline ulong matrix_offset(uint row, uint col, ulong elements_per_row, ulong2 origin, bool transpose) {
    if (origin.x != 0 || origin.y != 0) {
        std::fprintf(stderr, "simdgroup_load/store: a non-zero matrix origin is not emulated\n");
        std::abort();
    }
    if (transpose) std::swap(row, col);
    return ulong(row) * elements_per_row + col;
}

// Each lane loads its own two elements; the simdgroup then synchronises
// (all lanes take part, as on the device). One overload serves device and
// threadgroup memory: both are plain pointers here.
template <class T, class S>
void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const S* src, ulong elements_per_row = 8,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
    msl_rt::Simdgroup& s = msl_rt::matrix_simdgroup();
    const uint l = msl_rt::lane->thread_index_in_simdgroup;
    for (uint e = 0; e < 2; e++) {
        const auto at = msl_rt::matrix_coord(l, e);
        d.elements[e] = T(src[matrix_offset(at.row, at.col, elements_per_row, matrix_origin, transpose_matrix)]);
    }
    s.bar.arrive_and_wait();
}

template <class T, class S>
void simdgroup_store(const simdgroup_matrix<T, 8, 8>& a, S* dst, ulong elements_per_row = 8,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
    msl_rt::Simdgroup& s = msl_rt::matrix_simdgroup();
    const uint l = msl_rt::lane->thread_index_in_simdgroup;
    for (uint e = 0; e < 2; e++) {
        const auto at = msl_rt::matrix_coord(l, e);
        dst[matrix_offset(at.row, at.col, elements_per_row, matrix_origin, transpose_matrix)] = S(a.elements[e]);
    }
    s.bar.arrive_and_wait();
}

// d = a * b + c, collectively: the operands are assembled from every
// lane's elements, and each lane keeps its own two elements of d (each a
// float sum over k = 0..7 in order, from c).
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
    const float mine[msl_rt::MATRIX_SLOT_FLOATS] = {float(a.elements[0]), float(a.elements[1]), float(b.elements[0]),
                                                    float(b.elements[1]), float(c.elements[0]), float(c.elements[1])};
    float all[32][msl_rt::MATRIX_SLOT_FLOATS];
    msl_rt::matrix_exchange(mine, all);
    float m[3][8][8];
    for (uint l = 0; l < 32; l++) {
        const uint from = msl_rt::matrix_swaps_lanes && l < 2 ? 1 - l : l;
        for (uint e = 0; e < 2; e++) {
            const auto at = msl_rt::matrix_coord(l, e);
            for (uint op = 0; op < 3; op++) m[op][at.row][at.col] = all[from][2 * op + e];
        }
    }
    const uint me = msl_rt::lane->thread_index_in_simdgroup;
    for (uint e = 0; e < 2; e++) {
        const auto at = msl_rt::matrix_coord(me, e);
        float sum = m[2][at.row][at.col];
        for (uint k = 0; k < 8; k++) sum += m[0][at.row][k] * m[1][k][at.col];
        d.elements[e] = TD(sum);
    }
}

template <class TD, class TA, class TB>
void simdgroup_multiply(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                        const simdgroup_matrix<TB, 8, 8>& b) {
    simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, 8, 8>(TD(0)));
}

}  // namespace metal

// MSL keywords and address spaces. `constant` data is read-only; device,
// thread and threadgroup pointers are plain pointers.
#define kernel
#define device
#define constant const
#define thread
#define threadgroup static
