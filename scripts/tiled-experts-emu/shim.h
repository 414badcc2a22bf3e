// Shim for compiling kernels.cu's dequantisers and tiled loader on the CPU (run.sh).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(x)
struct uint4 { unsigned x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// f16 → f32, exact (the GPU's cvt.f32.f16); NaN stays NaN, which bf16/f16 rounding makes canonical.
inline float h2f_sw(unsigned short h) {
    const unsigned s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float f;
    if (e == 0) f = std::ldexp((float)m, -24);
    else if (e == 31) f = m ? NAN : INFINITY;
    else f = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -f : f;
}
// f32 → f16, round to nearest even (the GPU's cvt.rn.f16.f32), for f16 activations.
inline unsigned short f2h_sw(float f) {
    unsigned u = __float_as_uint(f), s = (u >> 16) & 0x8000;
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7e00;
    float a = std::fabs(f);
    if (a >= 65520.f) return s | 0x7c00;
    if (a < std::ldexp(1.f, -14)) return s | (unsigned short)std::nearbyint(a * std::ldexp(1.f, 24));
    int ex; float mant = std::frexp(a, &ex);  // a = mant · 2^ex, mant in [0.5, 1)
    unsigned r = (unsigned)std::nearbyint(std::ldexp(mant, 11));  // 11 significant bits
    if (r == 2048) { r = 1024; ++ex; }
    return s | (unsigned short)(((ex + 14) << 10) | (r & 1023));
}
#define h2f(x) h2f_sw(x)
#define f2h(x) f2h_sw(x)
