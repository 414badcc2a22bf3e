// Shim for emulating kernels.cu on the CPU (run.sh): a warp is 32 threads that meet at every shuffle.
#pragma once
#include <cmath>
#include <cstring>
#include <algorithm>
#include <barrier>
using std::min; using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(x)
#define __shared__ static
struct dim3 { unsigned x, y, z; };
extern thread_local dim3 threadIdx, blockIdx; extern dim3 blockDim, gridDim;
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct float4 { float x, y, z, w; };
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
extern std::barrier<>* warp_bar; extern float warp_xch[32];
inline float __shfl_xor_sync(unsigned, float v, int o) {
    int l = threadIdx.x & 31; warp_xch[l] = v; warp_bar->arrive_and_wait();
    float r = warp_xch[l ^ o]; warp_bar->arrive_and_wait(); return r;
}
inline float __shfl_sync(unsigned, float v, int) { return v; }
inline int __shfl_xor_sync(unsigned, int v, int) { return v; }
inline int __shfl_sync(unsigned, int v, int) { return v; }
inline void __syncthreads() {}
inline unsigned __byte_perm(unsigned, unsigned, unsigned) { return 0; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
#define h2f h2f_shim
#define f2h f2h_shim
// f16 to f32 exactly (the quantised formats' scales); f16 activations are not emulated.
inline float h2f_shim(unsigned short h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return h >> 15 ? -v : v;
}
inline unsigned short f2h_shim(float) { return 0; }
