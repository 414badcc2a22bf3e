// pipeshard-exec GPU kernels, compiled at run time with NVRTC. No headers: f16 converts with PTX `cvt`, bf16
// with bit shifts (round to nearest even), so the module builds wherever NVRTC runs.
// Compile-time defines: ACT_BF16 (1: matrices/activations fed to GEMMs are bf16, 0: f16),
// KV_KIND (0: f32, 1: f16, 2: bf16), HEAD_DIM (multiple of 32, at most 256).
// Layouts: activations [tokens, features] row-major f32; KV cache [ctx, kv_heads, head_dim] for K and for V.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define FULL 0xffffffffu
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(u16 x) { return __uint_as_float(((u32)x) << 16); }
__device__ __forceinline__ u16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ float h2f(u16 h) { float f; asm("{cvt.f32.f16 %0, %1;}" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ u16 f2h(float f) { u16 h; asm("{cvt.rn.f16.f32 %0, %1;}" : "=h"(h) : "f"(f)); return h; }

#if ACT_BF16
#define ACT_LOAD(x) bf2f(x)
#define ACT_STORE(x) f2bf(x)
#else
#define ACT_LOAD(x) h2f(x)
#define ACT_STORE(x) f2h(x)
#endif
typedef u16 act_t;

#if KV_KIND == 0
typedef float kv_t;
#define KV_LOAD(x) (x)
#define KV_STORE(x) (x)
#elif KV_KIND == 1
typedef u16 kv_t;
#define KV_LOAD(x) h2f(x)
#define KV_STORE(x) f2h(x)
#else
typedef u16 kv_t;
#define KV_LOAD(x) bf2f(x)
#define KV_STORE(x) f2bf(x)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[w] = v;
    __syncthreads();
    if (w == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

// Programmatic dependent launch (sm_90): a kernel launched with it may start while the one before it in the
// stream runs; it waits here before touching that kernel's outputs. Launched without, or before sm_90, no-ops.
__device__ __forceinline__ void griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel, if launched with programmatic dependence, start (it still waits for this one's end
// before reading its outputs).
__device__ __forceinline__ void griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// h[t, :] = table[ids[t], :] (one block per token).
extern "C" __global__ void embed(const act_t* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u64 row = (u64)ids[blockIdx.x] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = ACT_LOAD(table[row + i]);
}

// out[r, :] = norm(x[r, :]) * w (+ b), rounded to the activation type. layer_norm: 0 RMSNorm, 1 LayerNorm.
// One block per row; each thread keeps its NORM_PER elements of x and of w (strided by blockDim.x, so loads
// coalesce) in registers and issues all their loads before the reduction: a loop over the row, one dependent
// load per pass, then a second pass for w, had taken 7 us a 4096-row on the H200. The launcher checks
// dim <= NORM_PER * blockDim.x.
#define NORM_PER 16
extern "C" __global__ void norm_act(const float* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                                    act_t* __restrict__ out, int dim, float eps, int layer_norm) {
    const float* xr = x + (u64)blockIdx.x * dim;
    act_t* o = out + (u64)blockIdx.x * dim;
    float v[NORM_PER], wv[NORM_PER];
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        v[j] = i < dim ? xr[i] : 0.f;
        wv[j] = i < dim ? w[i] : 0.f;
    }
    float mean = 0.f;
    if (layer_norm) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < NORM_PER; ++j) s += v[j];
        mean = block_sum(s) / dim;
    }
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const float d = threadIdx.x + j * blockDim.x < dim ? v[j] - mean : 0.f;
        ss += d * d;
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / dim + eps);
#pragma unroll
    for (int j = 0; j < NORM_PER; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < dim) o[i] = ACT_STORE((v[j] - mean) * inv * wv[j] + (b ? b[i] : 0.f));
    }
}

// In-place RMSNorm of every dim-row of x (per-head q/k norm), kept in f32. One warp per row.
extern "C" __global__ void rmsnorm_rows_f32(float* __restrict__ x, const float* __restrict__ w, int dim, float eps, int rows) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float* xr = x + (u64)row * dim;
    float s = 0.f;
    for (int i = lane; i < dim; i += 32) s += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(warp_sum(s) / dim + eps);
    for (int i = lane; i < dim; i += 32) xr[i] = xr[i] * inv * w[i];
}

// Holds the stream for `ns` nanoseconds of the GPU's global timer (one thread): work queued behind it then
// runs back to back at the device's pace, however slowly the host enqueued it (the profiler's timing).
extern "C" __global__ void spin(u64 ns) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// Copies n bytes from host memory mapped into the device's address space (a buffer registered with
// CU_MEMHOSTREGISTER_DEVICEMAP) to device memory, with the SMs' loads over PCIe, in the stream's order and
// outside the copy engines: an upload on the compute stream waits there until the H2D stream's queue of weight
// copies drains or stalls. Four 16-byte loads in flight a thread, as reads over PCIe are latency-bound.
extern "C" __global__ void copy_mapped(unsigned char* __restrict__ dst, const unsigned char* __restrict__ src,
                                       u64 n) {
    const u64 n16 = n / 16;
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 i = t;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = s[i], b = s[i + stride], c = s[i + 2 * stride], e = s[i + 3 * stride];
        d[i] = a;
        d[i + stride] = b;
        d[i + 2 * stride] = c;
        d[i + 3 * stride] = e;
    }
    for (; i < n16; i += stride) d[i] = s[i];
    if (t < n % 16) dst[n16 * 16 + t] = src[n16 * 16 + t];
}

// Up to five copies of 4-byte words from mapped host memory (as copy_mapped reads it) in one launch, blockIdx.y
// picking the part: a small step's expert inputs (token ids, routing weights, the normed input, the grouped
// experts' unit addresses and first entries) go up in the compute stream's order without a copy engine, which
// a streamed unit's copy may hold for hundreds of µs. Parts of zero words are skipped.
struct MappedParts {
    u64 dst[5];
    u64 src[5];
    u64 words[5];
};

extern "C" __global__ void copy_mapped_parts(const MappedParts p) {
    const int k = blockIdx.y;
    u32* d = (u32*)p.dst[k];
    const u32* s = (const u32*)p.src[k];
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < p.words[k]; i += (u64)gridDim.x * blockDim.x)
        d[i] = s[i];
}

// Up to five parts whose words travel in the launch's parameters, one block a part (blockIdx.y): a decode
// step's routing (token ids, weights, the grouped experts' unit addresses and first entries, ~170 bytes) goes up
// with the launch itself, neither by a copy engine that a streamed unit's copy holds nor by loads of mapped
// memory. The parts' words lie back to back in `data`, sized for a one-token step: the launch fetches its whole
// parameter block over the link the copy fills (session 22, beside a 256 MiB copy: 4 KiB of parameters 60 us;
// 64 words 9.4 us, as an empty launch; the mapped loads 19.2).
#define INLINE_PARTS_WORDS 64
struct InlineParts {
    u64 dst[5];
    u32 words[5];
    u32 data[INLINE_PARTS_WORDS];
};

extern "C" __global__ void copy_inline_parts(const InlineParts p) {
    const int k = blockIdx.y;
    u32 first = 0;
    for (int j = 0; j < k; ++j) first += p.words[j];
    u32* d = (u32*)p.dst[k];
    for (u32 i = threadIdx.x; i < p.words[k]; i += blockDim.x) d[i] = p.data[first + i];
}

// x[i] += src[i] for n f32, src in host memory mapped into the device (as copy_mapped reads it): a MoE layer's
// CPU experts' sum goes into the residual stream in one kernel, with no copy queued behind the H2D stream's.
extern "C" __global__ void add_mapped(float* __restrict__ x, const float* __restrict__ src, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += src[i];
}

// x[i] += b[i % dim] for n elements.
extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ b, int dim, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += b[i % dim];
}

// Rotates the first 2*half dims of each head of x [m, heads, head_dim], token t at position pos0 + t*pos_step
// (rotate_half form).
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ inv_freq, int m, int heads, int head_dim,
                                int half, int pos0, int pos_step) {
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 total = (u64)m * heads * half;
    if (idx >= total) return;
    const int i = idx % half;
    const u64 th = idx / half;
    const int t = th / heads;
    float s, c;
    sincosf((float)(pos0 + t * pos_step) * inv_freq[i], &s, &c);
    float* p = x + th * head_dim;
    const float a = p[i], bb = p[i + half];
    p[i] = a * c - bb * s;
    p[i + half] = bb * c + a * s;
}

// `rope` of q's and k's heads and `store_kv` of the rotated K and of V in one launch (a one-token decode step,
// whose q|k|v the decode GEMV wrote back to back). Per token: (heads + kv_heads)·half threads rotate a pair
// each (a K pair goes to the cache too), kv_heads·(head_dim - 2·half) store K's unrotated dimensions, kv_heads·
// head_dim store V.
extern "C" __global__ void rope_store_kv(float* __restrict__ q, float* __restrict__ k, const float* __restrict__ v,
                                         const float* __restrict__ inv_freq, kv_t* __restrict__ kc,
                                         kv_t* __restrict__ vc, int m, int heads, int kv_heads, int head_dim,
                                         int half, int pos0, int pos_step, long long row0, long long row_step) {
    const int kv_dim = kv_heads * head_dim, rot = (heads + kv_heads) * half, plain = kv_heads * (head_dim - 2 * half);
    const u64 per = (u64)rot + plain + kv_dim;
    griddep_wait();
    griddep_launch_dependents();
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)m * per) return;
    const int t = (int)(idx / per);
    int i = (int)(idx - (u64)t * per);
    const u64 dst = (u64)(row0 + (long long)t * row_step) * kv_dim;
    if (i < rot) {
        const int hh = i / half, d = i % half;
        float s, c;
        sincosf((float)(pos0 + t * pos_step) * inv_freq[d], &s, &c);
        const bool is_k = hh >= heads;
        float* p = is_k ? k + (u64)t * kv_dim + (u64)(hh - heads) * head_dim : q + ((u64)t * heads + hh) * head_dim;
        const float a = p[d], bb = p[d + half];
        const float ra = a * c - bb * s, rb = bb * c + a * s;
        p[d] = ra;
        p[d + half] = rb;
        if (is_k) {
            kv_t* o = kc + dst + (u64)(hh - heads) * head_dim;
            o[d] = KV_STORE(ra);
            o[d + half] = KV_STORE(rb);
        }
        return;
    }
    i -= rot;
    if (i < plain) {
        const int width = head_dim - 2 * half;
        const int e = (i / width) * head_dim + 2 * half + i % width;
        kc[dst + e] = KV_STORE(k[(u64)t * kv_dim + e]);
        return;
    }
    i -= plain;
    vc[dst + i] = KV_STORE(v[(u64)t * kv_dim + i]);
}

// Writes K and V rows of m tokens into the cache, token t at row row0 + t*row_step, rounded to the cache type.
extern "C" __global__ void store_kv(const float* __restrict__ k, const float* __restrict__ v, kv_t* __restrict__ kc,
                                    kv_t* __restrict__ vc, int kv_dim, long long row0, long long row_step, int m) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (u64)m * kv_dim) return;
    const u64 t = i / kv_dim;
    const u64 dst = (u64)(row0 + (long long)t * row_step) * kv_dim + i % kv_dim;
    kc[dst] = KV_STORE(k[i]);
    vc[dst] = KV_STORE(v[i]);
}

#define D HEAD_DIM
#define PER (HEAD_DIM / 32)
#define ATTN_WARPS 4
// Cache rows a lane loads before using any of them (registers: KG × PER floats).
#define KG (PER >= 8 ? 8 : 16)

// The PER cache elements a lane owns (contiguous, aligned to their size: the launcher checks the cache pointers)
// as f32, read with one vector load instead of PER scalar ones: scalar 2-byte loads had held decode attention
// at ~0.8 TB/s of KV on the H200.
__device__ __forceinline__ void load_kv_lane(const kv_t* p, float* out) {
    const int bytes = PER * (int)sizeof(kv_t);
    if (bytes < 4) {
#pragma unroll
        for (int r = 0; r < PER; ++r) out[r] = KV_LOAD(p[r]);
        return;
    }
    u32 wd[bytes >= 4 ? bytes / 4 : 1];
    if (bytes >= 16) {
#pragma unroll
        for (int c = 0; c < bytes / 16; ++c) {
            const uint4 q4 = reinterpret_cast<const uint4*>(p)[c];
            wd[4 * c] = q4.x; wd[4 * c + 1] = q4.y; wd[4 * c + 2] = q4.z; wd[4 * c + 3] = q4.w;
        }
    } else if (bytes == 8) {
        const uint2 q2 = *reinterpret_cast<const uint2*>(p);
        wd[0] = q2.x; wd[1] = q2.y;
    } else {
        wd[0] = *reinterpret_cast<const u32*>(p);
    }
#pragma unroll
    for (int r = 0; r < PER; ++r) {
#if KV_KIND == 0
        out[r] = __uint_as_float(wd[r]);
#else
        out[r] = KV_LOAD((u16)(wd[r / 2] >> (16 * (r & 1))));
#endif
    }
}

// Folds the partial dot products of 2·OFF keys across lanes that differ in bit OFF: each lane keeps the half of
// the keys its bit selects and adds its partner's partials of them. After OFF = 16, 8, 4, 2, 1, part[0] of lane
// l holds the whole dot product of key l (31 shuffles for 32 keys, instead of a 5-shuffle sum per key).
template <int OFF>
__device__ __forceinline__ void fold_keys(float* part, int lane) {
    const bool upper = (lane & OFF) != 0;
#pragma unroll
    for (int i = 0; i < OFF; ++i) {
        const float send = upper ? part[i] : part[i + OFF];
        const float keep = upper ? part[i + OFF] : part[i];
        part[i] = keep + __shfl_xor_sync(FULL, send, OFF);
    }
}

// Causal attention, one warp per (token, head, key split), online softmax over tiles of 32 keys.
// Lane l owns dimensions [l·PER, l·PER + PER) of q, K, V and the output, so each key row is read by the whole
// warp in one coalesced sweep; fold_keys turns a tile's partial dot products into one score per lane.
// Consecutive warps are consecutive heads of one (token, split), so a block's warps share their KV head's rows
// through L1 under grouped-query attention. With n_splits == 1 it writes out [m, heads*D] in the activation
// type; otherwise partial sums part_o [(token·heads + head)·n_splits + split, D] and part_ml [same, 2].
// Token t reads rows t*seq_rows + j for j < pos0 + t*pos_step + 1 (one sequence's chunk: seq_rows 0,
// pos_step 1; one token of each sequence: pos_step 0). With mask_seqs > 0 (a unified cache of mask_seqs
// sequences with mask_prompt-token prompts) it scores every row and keeps those of sequence t only.
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) attention(
    const float* __restrict__ q, const kv_t* __restrict__ kc, const kv_t* __restrict__ vc, act_t* __restrict__ out,
    float* __restrict__ part_o, float* __restrict__ part_ml, int m, int pos0, int n_heads, int n_kv_heads,
    float scale, int n_splits, int keys_per_split, long long seq_rows, int pos_step, int mask_prompt,
    int mask_seqs) {
    // Launched under the kernel before it (programmatic launch): its inputs are that kernel's outputs. A
    // one-token step's output projection (the decode GEMV) may start fetching its weights meanwhile.
    griddep_wait();
    griddep_launch_dependents();
    const int lane = threadIdx.x & 31;
    const long long warp = (long long)blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    if (warp >= (long long)m * n_heads * n_splits) return;
    const int h = (int)(warp % n_heads);
    const long long ts = warp / n_heads;
    const int s = (int)(ts % n_splits);
    const int t = (int)(ts / n_splits);
    const long long th = (long long)t * n_heads + h;
    const int kvh = h / (n_heads / n_kv_heads);
    const int kv_dim = n_kv_heads * D;
    const int n_keys = pos0 + t * pos_step + 1;
    const u64 col = (u64)kvh * D + lane * PER;
    kc += (u64)t * seq_rows * kv_dim + col;
    vc += (u64)t * seq_rows * kv_dim + col;
    const long long prompts = (long long)mask_seqs * mask_prompt;
    const int k_begin = s * keys_per_split;
    const int k_end = min(n_keys, k_begin + keys_per_split);
    float qr[PER], acc[PER];
#pragma unroll
    for (int r = 0; r < PER; ++r) { qr[r] = q[th * D + lane * PER + r]; acc[r] = 0.f; }
    float mx = NEG_INF, l = 0.f;
    for (int base = k_begin; base < k_end; base += 32) {
        const int cnt = min(32, k_end - base);
        const int last = k_end - 1;
        float part[32];
        // KG rows' loads are issued before any of their products, past the tile's end clamped to its last row
        // (scored, then masked below): a load guarded per key had serialised a tile's 32 reads, and a 1K-key
        // decode took 31 µs for 2 MB of KV on the H200 (ncu, session 13).
#pragma unroll
        for (int g = 0; g < 32; g += KG) {
            float kr[KG][PER];
#pragma unroll
            for (int i = 0; i < KG; ++i) load_kv_lane(kc + (u64)min(base + g + i, last) * kv_dim, kr[i]);
#pragma unroll
            for (int i = 0; i < KG; ++i) {
                float d = 0.f;
#pragma unroll
                for (int r = 0; r < PER; ++r) d += qr[r] * kr[i][r];
                part[g + i] = d;
            }
        }
        fold_keys<16>(part, lane);
        fold_keys<8>(part, lane);
        fold_keys<4>(part, lane);
        fold_keys<2>(part, lane);
        fold_keys<1>(part, lane);
        const int j = base + lane;
        bool keep = lane < cnt;
        if (keep && mask_seqs > 0) {
            const long long owner = j < prompts ? j / mask_prompt : (j - prompts) % mask_seqs;
            keep = owner == t;
        }
        const float sc = keep ? part[0] * scale : NEG_INF;
        const float new_m = fmaxf(mx, warp_max(sc));
        // A tile with no kept key yet leaves new_m at -inf: nothing to add, nothing to rescale.
        const float p = keep ? expf(sc - new_m) : 0.f;
        const float corr = new_m == NEG_INF ? 1.f : expf(mx - new_m);
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int r = 0; r < PER; ++r) acc[r] *= corr;
        // The same grouping for V; a key past the tile's end has p = 0 (its clamped row adds nothing).
#pragma unroll
        for (int g = 0; g < 32; g += KG) {
            if (g >= cnt) break;
            float vr[KG][PER];
#pragma unroll
            for (int i = 0; i < KG; ++i) load_kv_lane(vc + (u64)min(base + g + i, last) * kv_dim, vr[i]);
#pragma unroll
            for (int i = 0; i < KG; ++i) {
                const float pj = __shfl_sync(FULL, p, g + i);
#pragma unroll
                for (int r = 0; r < PER; ++r) acc[r] += pj * vr[i][r];
            }
        }
        mx = new_m;
    }
    if (n_splits == 1) {
        const float inv = 1.f / l;
#pragma unroll
        for (int r = 0; r < PER; ++r) out[th * D + lane * PER + r] = ACT_STORE(acc[r] * inv);
    } else {
        const long long w = th * n_splits + s;
#pragma unroll
        for (int r = 0; r < PER; ++r) part_o[w * D + lane * PER + r] = acc[r];
        if (lane == 0) { part_ml[w * 2] = mx; part_ml[w * 2 + 1] = l; }
    }
}

// Merges the key splits of attention (at most 256): one block of COMBINE_WARPS warps per (token, head). Every
// warp finds the splits' largest max and the softmax denominator itself (lanes stride over the splits), then
// warp w adds splits w, w + COMBINE_WARPS, … into its lanes' dimensions, and the warps' sums meet in shared
// memory. One warp walking 16 splits one after another, each waiting for its loads, had taken 10 µs (H200).
#define COMBINE_WARPS 16
extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) attn_combine(
    const float* __restrict__ part_o, const float* __restrict__ part_ml, act_t* __restrict__ out, int n_splits,
    long long rows) {
    __shared__ float sums[COMBINE_WARPS][D];
    griddep_wait();
    griddep_launch_dependents();
    const long long th = blockIdx.x;
    if (th >= rows) return;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const float* ml = part_ml + th * n_splits * 2;
    float big = NEG_INF;
    for (int s = lane; s < n_splits; s += 32) big = fmaxf(big, ml[2 * s]);
    big = warp_max(big);
    float total = 0.f;
    for (int s = lane; s < n_splits; s += 32) {
        const float l = ml[2 * s + 1];
        if (l > 0.f) total += l * expf(ml[2 * s] - big);
    }
    total = warp_sum(total);
    float acc[PER];
#pragma unroll
    for (int r = 0; r < PER; ++r) acc[r] = 0.f;
#pragma unroll 8
    for (int s = w; s < n_splits; s += COMBINE_WARPS) {
        // A split with no key (l = 0, max −inf) adds nothing.
        const float l = ml[2 * s + 1];
        const float f = l > 0.f ? expf(ml[2 * s] - big) : 0.f;
        const float* po = part_o + (th * n_splits + s) * D + lane;
#pragma unroll
        for (int r = 0; r < PER; ++r) acc[r] += f * po[32 * r];
    }
#pragma unroll
    for (int r = 0; r < PER; ++r) sums[w][lane + 32 * r] = acc[r];
    __syncthreads();
    if (w == 0) {
        const float inv = 1.f / total;
#pragma unroll
        for (int r = 0; r < PER; ++r) {
            float v = 0.f;
#pragma unroll
            for (int i = 0; i < COMBINE_WARPS; ++i) v += sums[i][lane + 32 * r];
            out[th * D + lane + 32 * r] = ACT_STORE(v * inv);
        }
    }
}

// The FFN activations over `rows` rows of `cols`: g and u rows are `ld` elements apart (`cols` when they are
// matrices of their own, 2·cols when one GEMM wrote gate|up side by side: g = y, u = y + cols), out's rows
// `cols` apart. A thread takes one column: blocks span the columns (grid.x) and the rows (grid.y, striding
// when there are more rows than grid.y), so no thread divides its index.

// out = silu(g) * u, rounded to the activation type.
extern "C" __global__ void swiglu(const float* __restrict__ g, const float* __restrict__ u,
                                  act_t* __restrict__ out, int cols, u64 ld, u64 rows) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (u64 t = blockIdx.y; t < rows; t += gridDim.y) {
        const float a = g[t * ld + j];
        out[t * cols + j] = ACT_STORE(a / (1.f + expf(-a)) * u[t * ld + j]);
    }
}

// out = max(u, 0)^2, rounded to the activation type.
extern "C" __global__ void relu2(const float* __restrict__ u, act_t* __restrict__ out, int cols, u64 ld,
                                 u64 rows) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= cols) return;
    for (u64 t = blockIdx.y; t < rows; t += gridDim.y) {
        const float r = fmaxf(u[t * ld + j], 0.f);
        out[t * cols + j] = ACT_STORE(r * r);
    }
}

// MoE token permutation: dst[i, :] = src[idx[i], :] (activation rows). One block per gathered row.
extern "C" __global__ void gather_rows(const act_t* __restrict__ src, const u32* __restrict__ idx, act_t* __restrict__ dst,
                                       int dim) {
    const u64 s = (u64)idx[blockIdx.x] * dim, o = (u64)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[o + i] = src[s + i];
}

// MoE combine: h[idx[i], :] += w[i] * y[i, :] in f32. The rows of one launch are one expert's tokens, so their
// idx are distinct and no two blocks write the same row; experts are combined in launch order.
extern "C" __global__ void scatter_add_rows(const float* __restrict__ y, const u32* __restrict__ idx,
                                            const float* __restrict__ w, float* __restrict__ h, int dim) {
    const u64 d = (u64)idx[blockIdx.x] * dim, s = (u64)blockIdx.x * dim;
    const float wt = w[blockIdx.x];
    for (int i = threadIdx.x; i < dim; i += blockDim.x) h[d + i] += wt * y[s + i];
}

// Greedy sampling: out[row] = first index of the largest logit. One block (1024 threads) per row. One block
// reads a row at the latency of its loads, so each thread keeps four 16-byte loads in flight (a 152K-logit row
// took ~95 µs with one 4-byte load at a time on the H200); rows whose length is not a multiple of 4 read scalars.
__device__ __forceinline__ void argmax_take(float v, int i, float& best, int& idx) {
    if (v > best || (v == best && i < idx)) { best = v; idx = i; }
}

extern "C" __global__ void argmax(const float* __restrict__ logits, int vocab, u32* __restrict__ out) {
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* x = logits + (u64)blockIdx.x * vocab;
    float best = NEG_INF;
    int idx = 0x7fffffff;
    const int n4 = (vocab & 3) == 0 ? vocab >> 2 : 0;
    const float4* x4 = (const float4*)x;
    const int nt = blockDim.x;
    int i = threadIdx.x;
    for (; i + 3 * nt < n4; i += 4 * nt) {
        float4 a[4];
#pragma unroll
        for (int u = 0; u < 4; u++) a[u] = x4[i + u * nt];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int b = 4 * (i + u * nt);
            argmax_take(a[u].x, b, best, idx);
            argmax_take(a[u].y, b + 1, best, idx);
            argmax_take(a[u].z, b + 2, best, idx);
            argmax_take(a[u].w, b + 3, best, idx);
        }
    }
    for (; i < n4; i += nt) {
        const float4 a = x4[i];
        argmax_take(a.x, 4 * i, best, idx);
        argmax_take(a.y, 4 * i + 1, best, idx);
        argmax_take(a.z, 4 * i + 2, best, idx);
        argmax_take(a.w, 4 * i + 3, best, idx);
    }
    for (int j = 4 * n4 + threadIdx.x; j < vocab; j += nt) argmax_take(x[j], j, best, idx);
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, best, o);
        const int oi = __shfl_xor_sync(FULL, idx, o);
        argmax_take(ov, oi, best, idx);
    }
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) { bv[w] = best; bi[w] = idx; }
    __syncthreads();
    if (w == 0) {
        best = lane < (int)(blockDim.x >> 5) ? bv[lane] : NEG_INF;
        idx = lane < (int)(blockDim.x >> 5) ? bi[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL, best, o);
            const int oi = __shfl_xor_sync(FULL, idx, o);
            argmax_take(ov, oi, best, idx);
        }
        if (lane == 0) out[blockIdx.x] = (u32)idx;
    }
}

// ---- Block-quantised matrices (GGUF q8_0 / q4_0, 32 elements per block: an f16 scale d, then the quants).
// q8_0: value = (signed char)q * d. q4_0: value = (nibble - 8) * d; byte j holds element j (low nibble) and
// element j + 16 (high nibble). Blocks are 34 / 18 bytes, so only 2-byte loads are aligned.
typedef unsigned char u8;
#define QMAX_T 8  // quant::EXACT_MAX_TOKENS

// Element i of a row of blocks, dequantised exactly in f32.
template <int Q4> __device__ __forceinline__ float qval(const u8* __restrict__ row, u64 i) {
    const u8* blk = row + (i >> 5) * (Q4 ? 18 : 34);
    const int e = (int)(i & 31);
    const float d = h2f(*(const u16*)blk);
    if (Q4) {
        const u8 q = blk[2 + (e & 15)];
        return (float)((e < 16 ? q & 15 : q >> 4) - 8) * d;
    }
    return (float)(signed char)blk[2 + e] * d;
}

// Decode GEMV: y[t, r] (+)= sum_i x[t, i] * w[r, i] for t < m <= QMAX_T tokens, x in activations, y f32.
// One warp per QROWS rows (they share each activation load and its conversion); four lanes per block (8
// elements each), so one warp step reads 8 consecutive blocks of every row, all loads issued before any math.
// Quants become exact f32 without int-to-float conversions (a quarter-rate instruction, which bounded the
// kernel): `prmt` places a byte in the mantissa of 2^23 (0x4B0000qq = 2^23 + qq), and one subtraction removes
// 2^23 and the format's offset (q4_0: 8; q8_0: 128, after flipping the sign bit of every byte).
// Per block the lane forms sum x*q, then scales by d (as the CPU kernels do).
#define QROWS 4  // cuda::GEMV_ROWS_PER_WARP
// MT: the most tokens the instance takes (1 for the single-token decode GEMV, which then keeps no
// accumulators for absent tokens and so fits more warps on an SM; QMAX_T otherwise).
template <int Q4, int MT>
__device__ __forceinline__ void gemv_q(const u8* __restrict__ w, const act_t* __restrict__ x, float* __restrict__ y,
                                       int n, int k, int m, int accumulate) {
    const int row0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * QROWS;
    const int lane = threadIdx.x & 31, p = lane & 3;
    if (row0 >= n) return;
    const int bb = Q4 ? 18 : 34, nb = k >> 5;
    const u8* wr[QROWS];
#pragma unroll
    for (int r = 0; r < QROWS; ++r) wr[r] = w + (u64)min(row0 + r, n - 1) * nb * bb;  // past n: re-read, not stored
    const float bias = Q4 ? 8388616.f : 8388736.f;  // 2^23 + 8, 2^23 + 128
    float acc[MT][QROWS];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int r = 0; r < QROWS; ++r) acc[t][r] = 0.f;
#pragma unroll 2
    for (int b = lane >> 2; b < nb; b += 8) {
        // The lane's 8 quants of every row, in the order of its 8 activations: q4_0 elements 4p..4p+3 (low
        // nibbles) and 16+4p..16+4p+3 (high nibbles); q8_0 elements 8p..8p+7. Blocks are 2-byte aligned only.
        u16 dbits[QROWS];
        u32 qw[QROWS][2];
#pragma unroll
        for (int r = 0; r < QROWS; ++r) {
            const u8* blk = wr[r] + (u64)b * bb;
            dbits[r] = *(const u16*)blk;
            const u16* q = (const u16*)(blk + 2 + (Q4 ? 4 : 8) * p);
            if (Q4) {
                const u32 v = (u32)q[0] | ((u32)q[1] << 16);
                qw[r][0] = v & 0x0f0f0f0fu;
                qw[r][1] = (v >> 4) & 0x0f0f0f0fu;
            } else {
                qw[r][0] = ((u32)q[0] | ((u32)q[1] << 16)) ^ 0x80808080u;
                qw[r][1] = ((u32)q[2] | ((u32)q[3] << 16)) ^ 0x80808080u;
            }
        }
        float wv[QROWS][8];
#pragma unroll
        for (int r = 0; r < QROWS; ++r)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                wv[r][j] = __int_as_float((int)__byte_perm(qw[r][j >> 2], 0x4b000000u, 0x7440u + (j & 3))) - bias;
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            if (t < m) {
                // Activation rows are 16-byte aligned (k is a multiple of 32): vector loads of 4 or 8 values.
                const act_t* xt = x + (u64)t * k + 32 * (u64)b;
                u32 xw[4];
                if (Q4) {
                    const uint2 a = *(const uint2*)(xt + 4 * p), c = *(const uint2*)(xt + 16 + 4 * p);
                    xw[0] = a.x; xw[1] = a.y; xw[2] = c.x; xw[3] = c.y;
                } else {
                    const uint4 a = *(const uint4*)(xt + 8 * p);
                    xw[0] = a.x; xw[1] = a.y; xw[2] = a.z; xw[3] = a.w;
                }
                float xf[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) xf[j] = ACT_LOAD((u16)(xw[j >> 1] >> (16 * (j & 1))));
#pragma unroll
                for (int r = 0; r < QROWS; ++r) {
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < 8; ++j) s = fmaf(xf[j], wv[r][j], s);
                    acc[t][r] = fmaf(s, h2f(dbits[r]), acc[t][r]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        if (t < m) {
#pragma unroll
            for (int r = 0; r < QROWS; ++r) {
                const float s = warp_sum(acc[t][r]);
                if (lane == 0 && row0 + r < n) {
                    float* o = y + (u64)t * n + row0 + r;
                    *o = accumulate ? *o + s : s;
                }
            }
        }
    }
}
extern "C" __global__ void gemv_q8_0(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q<0, QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv_q4_0(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q<1, QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q8_0(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q<0, 1>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q4_0(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q<1, 1>(w, x, y, n, k, m, acc);
}

// Prefill path: out[i] = w[i] dequantised and rounded to the activation type, for n elements (whole rows).
extern "C" __global__ void dequant_q8_0(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(qval<0>(w, i));
}
extern "C" __global__ void dequant_q4_0(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(qval<1>(w, i));
}

// h[t, :] = table[ids[t], :] for a quantised table (one block per token), exact in f32.
extern "C" __global__ void embed_q8_0(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 5) * 34;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = qval<0>(row, i);
}
extern "C" __global__ void embed_q4_0(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 5) * 18;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = qval<1>(row, i);
}

// ---- K-quants: 256-element super-blocks (quant::K_BLOCK_ELEMS), rows of whole super-blocks.
// q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
// nibbles (sub-blocks 2t and 2t+1 are the low and high nibbles of bytes 32t..32t+32); value = d*sc*q - dmin*m.
// q6_K (210 bytes): 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 signed 8-bit scales (one per 16
// elements), f16 d; value = d*scale*(q - 32). Super-blocks of q6_K are 2-byte aligned only.
#define QK_K 256

__device__ __forceinline__ void q4k_scale_min(int j, const u8* __restrict__ s, float& sc, float& m) {
    if (j < 4) { sc = (float)(s[j] & 63); m = (float)(s[j + 4] & 63); }
    else { sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)); m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4)); }
}

// Element i of a row of K-quant super-blocks, dequantised as ggml's dequantize_row_q4_K / _q6_K do (f32
// products in the reference's order; the explicit roundings keep the compiler from fusing them into an FMA, so
// the values equal the CPU's bit for bit).
template <int Q6> __device__ __forceinline__ float kval(const u8* __restrict__ row, u64 i) {
    const int e = (int)(i & (QK_K - 1));
    if (Q6) {
        const u8* blk = row + (i >> 8) * 210;
        const int n = e >> 7, c = (e >> 5) & 3, l = e & 31;
        const int lo = (blk[64 * n + 32 * (c & 1) + l] >> (4 * (c >> 1))) & 15;
        const int hi = (blk[128 + 32 * n + l] >> (2 * c)) & 3;
        const float sc = (float)(signed char)blk[192 + 8 * n + 2 * c + (l >> 4)];
        return __fmul_rn(__fmul_rn(h2f(*(const u16*)(blk + 208)), sc), (float)((lo | (hi << 4)) - 32));
    }
    const u8* blk = row + (i >> 8) * 144;
    const int t = e >> 6, half = (e >> 5) & 1, l = e & 31;
    float sc, m;
    q4k_scale_min(2 * t + half, blk + 4, sc, m);
    const float d1 = __fmul_rn(h2f(*(const u16*)blk), sc), m1 = __fmul_rn(h2f(*(const u16*)(blk + 2)), m);
    return __fsub_rn(__fmul_rn(d1, (float)((blk[16 + 32 * t + l] >> (4 * half)) & 15)), m1);
}

// Four bytes (each < 64) as exact f32 minus `off`, by the prmt trick of gemv_q.
__device__ __forceinline__ void bytes_to_f32(u32 v, float off, float* out) {
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = __int_as_float((int)__byte_perm(v, 0x4b000000u, 0x7440u + j)) - (8388608.f + off);
}

// Tensor-core pieces of the q4_K GEMV. Small integers are exact in the activation type, so a product of a
// quant and an activation is exact, and mma accumulates in f32: the same function as the f32 kernels, up to the
// order of additions. A quant q (< 128) becomes the 16-bit pattern MAGIC | q, which is MAGIC_VAL + q exactly
// (bf16: 128 + q, ulp 1 from 128 on; f16: 1024 + q), and one packed FMA (x1 − MAGIC_VAL) leaves q in each half.
#if ACT_BF16
#define MMA_TYPE "bf16"
#define MAGIC2 0x43004300u
#define ONE2 0x3F803F80u
#define NEG_MAGIC2 0xC300C300u
#else
#define MMA_TYPE "f16"
#define MAGIC2 0x64006400u
#define ONE2 0x3C003C00u
#define NEG_MAGIC2 0xE400E400u
#endif
// Two quants (low halves of v's 16-bit lanes, < 128) as two activation-type values.
__device__ __forceinline__ u32 q2act(u32 v) {
    u32 r;
#if ACT_BF16
    asm("{fma.rn.bf16x2 %0, %1, %2, %3;}" : "=r"(r) : "r"(v | MAGIC2), "r"(ONE2), "r"(NEG_MAGIC2));
#else
    asm("{fma.rn.f16x2 %0, %1, %2, %3;}" : "=r"(r) : "r"(v | MAGIC2), "r"(ONE2), "r"(NEG_MAGIC2));
#endif
    return r;
}
// d = a (16 x 16, row-major) * b (16 x 8) + c, in f32: the m16n8k16 fragments (lane g = lane >> 2, t = lane & 3:
// a0 = A[g][2t..2t+2], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]; b0 = B[2t..2t+2][g],
// b1 = B[2t+8..][g]; d0, d1 = D[g][2t], D[g][2t+1]; d2, d3 = D[g+8][2t], D[g+8][2t+1]).
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, const float* c) {
    asm volatile("{mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};}"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
// d·sc and dmin·m of the 8 sub-blocks of a q4_K header (words: d|dmin, then the 12 packed scale bytes), the
// 6-bit values unpacked four at a time (sc/m 0..4 in the low 6 bits of words 1 and 2; sc/m 4..8 in the nibbles
// of word 3 with their top bits in the top bits of words 1 and 2), made f32 by the prmt trick.
__device__ __forceinline__ void q4k_factors(uint4 hd, float* ds, float* dm) {
    const float d = h2f((u16)(hd.x & 0xffffu)), dmin = h2f((u16)(hd.x >> 16));
    float v[16];
    bytes_to_f32(hd.y & 0x3f3f3f3fu, 0.f, v);
    bytes_to_f32((hd.w & 0x0f0f0f0fu) | (((hd.y >> 6) & 0x03030303u) << 4), 0.f, v + 4);
    bytes_to_f32(hd.z & 0x3f3f3f3fu, 0.f, v + 8);
    bytes_to_f32(((hd.w >> 4) & 0x0f0f0f0fu) | (((hd.z >> 6) & 0x03030303u) << 4), 0.f, v + 12);
#pragma unroll
    for (int j = 0; j < 8; ++j) { ds[j] = d * v[j]; dm[j] = dmin * v[8 + j]; }
}

// Decode GEMV over q4_K rows on the tensor cores: a block of 4 warps takes 16 rows (the mma's M), warp w the
// super-blocks w, w + 4, …; the tokens are the mma's N (8, zero past m). Lane (g, t) holds rows g and g + 8 and
// bytes 8t..8t+8 of each 32-byte nibble chunk c: elements 64c + 8t.. (low nibbles, sub-block 2c) and
// 64c + 32 + 8t.. (high nibbles, sub-block 2c + 1), 4 per k-step. Within a k-step the lane's k slots
// (2t, 2t+1, 2t+8, 2t+9) are elements (0, 2, 1, 3) of its four, which the nibble masks give without moving
// bytes; the activations are permuted to match. Per sub-block: two mmas for Σ x·q, two with an all-ones A for
// Σ x (in the same fragment layout as the products), then d·sc·Σ x·q − dmin·m·Σ x per row and token. The 4
// warps' sums meet in shared memory.
template <int MT>
__device__ __forceinline__ void gemv_q4k(const u8* __restrict__ w, const act_t* __restrict__ x, float* __restrict__ y,
                                         int n, int k, int m, int accumulate) {
    __shared__ float part[4][32][4];
    // 16 rows a block (cuda::TC_GEMV_ROWS), launched with 128 threads.
    const int row0 = blockIdx.x * 16, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int nb = k >> 8;
    const u8* wa = w + (u64)min(row0 + g, n - 1) * nb * 144;
    const u8* wb = w + (u64)min(row0 + g + 8, n - 1) * nb * 144;
    // This lane's token for the B fragment (its activations), or none.
    const act_t* xg = g < m ? x + (u64)g * k + 8 * t : nullptr;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const float zero[4] = {0.f, 0.f, 0.f, 0.f};
    for (int b = warp; b < nb; b += 4) {
        const uint4 ha = *(const uint4*)(wa + (u64)b * 144), hb = *(const uint4*)(wb + (u64)b * 144);
        uint2 qa[4], qb[4], xw[8][2];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            qa[c] = *(const uint2*)(wa + (u64)b * 144 + 16 + 32 * c + 8 * t);
            qb[c] = *(const uint2*)(wb + (u64)b * 144 + 16 + 32 * c + 8 * t);
        }
        // Activations of sub-block s = 2c + h, k-steps e = 0, 1: 4 values each at 256b + 64c + 32h + 8t + 4e.
#pragma unroll
        for (int s = 0; s < 8; ++s)
#pragma unroll
            for (int e = 0; e < 2; ++e) xw[s][e] = xg ? *(const uint2*)(xg + QK_K * (u64)b + 32 * s + 4 * e) : make_uint2(0, 0);
        float dsa[8], dma[8], dsb[8], dmb[8];
        q4k_factors(ha, dsa, dma);
        q4k_factors(hb, dsb, dmb);
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const int c = s >> 1, sh = 4 * (s & 1);
            float dot[4], sum[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const u32 va = (e ? qa[c].y : qa[c].x) >> sh, vb = (e ? qb[c].y : qb[c].x) >> sh;
                // Slots (2t, 2t+1) take elements 0 and 2 of the four, (2t+8, 2t+9) elements 1 and 3.
                const u32 b0 = __byte_perm(xw[s][e].x, xw[s][e].y, 0x5410), b1 = __byte_perm(xw[s][e].x, xw[s][e].y, 0x7632);
                mma16816(dot, q2act(va & 0x000f000fu), q2act(vb & 0x000f000fu), q2act((va >> 8) & 0x000f000fu),
                         q2act((vb >> 8) & 0x000f000fu), b0, b1, e ? dot : zero);
                mma16816(sum, ONE2, ONE2, ONE2, ONE2, b0, b1, e ? sum : zero);
            }
            acc[0] = fmaf(dsa[s], dot[0], fmaf(-dma[s], sum[0], acc[0]));
            acc[2] = fmaf(dsb[s], dot[2], fmaf(-dmb[s], sum[2], acc[2]));
            if (MT > 1) {
                acc[1] = fmaf(dsa[s], dot[1], fmaf(-dma[s], sum[1], acc[1]));
                acc[3] = fmaf(dsb[s], dot[3], fmaf(-dmb[s], sum[3], acc[3]));
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) part[warp][lane][i] = acc[i];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            // Element i of the lane's D fragment: row g (+8 for i >= 2), token 2t (+1 for odd i).
            const int row = row0 + g + 8 * (i >> 1), tok = 2 * t + (i & 1);
            if (tok < m && row < n) {
                const float v = (part[0][lane][i] + part[1][lane][i]) + (part[2][lane][i] + part[3][lane][i]);
                float* o = y + (u64)tok * n + row;
                *o = accumulate ? *o + v : v;
            }
        }
    }
}

// Decode GEMV over q6_K rows: a warp step reads 2 super-blocks of every row. Lane l takes super-block l >> 4 of
// the step, half h = (l >> 3) & 1 and positions 4j..4j+4 (j = l & 7) of the half's four quarters of 32: 4
// low-nibble bytes at each of ql[64h+4j] and ql[64h+32+4j], 4 high-pair bytes at qh[32h+4j] (16 weights);
// quarter c's 4 weights share the scale 8h+2c+(j >> 2). Super-blocks are 210 bytes, so only 2-byte loads are
// aligned.
template <int MT>
__device__ __forceinline__ void gemv_q6k(const u8* __restrict__ w, const act_t* __restrict__ x, float* __restrict__ y,
                                         int n, int k, int m, int accumulate) {
    const int row0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * QROWS;
    const int lane = threadIdx.x & 31, h = (lane >> 3) & 1, j4 = 4 * (lane & 7);
    if (row0 >= n) return;
    const int nb = k >> 8;
    const u8* wr[QROWS];
#pragma unroll
    for (int r = 0; r < QROWS; ++r) wr[r] = w + (u64)min(row0 + r, n - 1) * nb * 210;
    float acc[MT][QROWS];
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
        for (int r = 0; r < QROWS; ++r) acc[tt][r] = 0.f;
    for (int b = lane >> 4; b < nb; b += 2) {
        u32 a0[QROWS], a1[QROWS], qh[QROWS];
        float ds[QROWS][4];
#pragma unroll
        for (int r = 0; r < QROWS; ++r) {
            const u8* blk = wr[r] + (u64)b * 210;
            const u16* l0 = (const u16*)(blk + 64 * h + j4);
            const u16* l1 = (const u16*)(blk + 64 * h + 32 + j4);
            const u16* q = (const u16*)(blk + 128 + 32 * h + j4);
            a0[r] = (u32)l0[0] | ((u32)l0[1] << 16);
            a1[r] = (u32)l1[0] | ((u32)l1[1] << 16);
            qh[r] = (u32)q[0] | ((u32)q[1] << 16);
            const float d = h2f(*(const u16*)(blk + 208));
#pragma unroll
            for (int c = 0; c < 4; ++c) ds[r][c] = d * (float)(signed char)blk[192 + 8 * h + 2 * c + (j4 >> 4)];
        }
#pragma unroll
        for (int tt = 0; tt < MT; ++tt) {
            if (tt < m) {
                const act_t* xt = x + (u64)tt * k + QK_K * (u64)b + 128 * h + j4;
                float xf[4][4];
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const uint2 xw = *(const uint2*)(xt + 32 * c);
                    xf[c][0] = ACT_LOAD((u16)(xw.x & 0xffffu));
                    xf[c][1] = ACT_LOAD((u16)(xw.x >> 16));
                    xf[c][2] = ACT_LOAD((u16)(xw.y & 0xffffu));
                    xf[c][3] = ACT_LOAD((u16)(xw.y >> 16));
                }
#pragma unroll
                for (int r = 0; r < QROWS; ++r) {
                    // Quarters 0..3: low nibbles of a0, a1, high nibbles of a0, a1; high pairs at bits 2c of qh.
                    const u32 v[4] = {
                        (a0[r] & 0x0f0f0f0fu) | ((qh[r] & 0x03030303u) << 4),
                        (a1[r] & 0x0f0f0f0fu) | (((qh[r] >> 2) & 0x03030303u) << 4),
                        ((a0[r] >> 4) & 0x0f0f0f0fu) | (qh[r] & 0x30303030u),
                        ((a1[r] >> 4) & 0x0f0f0f0fu) | ((qh[r] >> 2) & 0x30303030u),
                    };
                    float s = 0.f;
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        float wv[4];
                        bytes_to_f32(v[c], 32.f, wv);
                        float sc = 0.f;
#pragma unroll
                        for (int p = 0; p < 4; ++p) sc = fmaf(xf[c][p], wv[p], sc);
                        s = fmaf(ds[r][c], sc, s);
                    }
                    acc[tt][r] += s;
                }
            }
        }
    }
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
        if (tt < m) {
#pragma unroll
            for (int r = 0; r < QROWS; ++r) {
                const float s = warp_sum(acc[tt][r]);
                if (lane == 0 && row0 + r < n) {
                    float* o = y + (u64)tt * n + row0 + r;
                    *o = accumulate ? *o + s : s;
                }
            }
        }
    }
}

extern "C" __global__ void gemv_q4_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q4k<QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q4_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q4k<1>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv_q6_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q6k<QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q6_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_q6k<1>(w, x, y, n, k, m, acc);
}
// Prefill path and quantised embedding tables, as for q8_0/q4_0 (rows of whole super-blocks).
extern "C" __global__ void dequant_q4_k(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(kval<0>(w, i));
}
extern "C" __global__ void dequant_q6_k(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(kval<1>(w, i));
}
extern "C" __global__ void embed_q4_k(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 8) * 144;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = kval<0>(row, i);
}
extern "C" __global__ void embed_q6_k(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 8) * 210;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = kval<1>(row, i);
}

// ---- q2_K (84 bytes: 16 scale/min bytes, sc low nibble and m high nibble per 16 elements; 64 bytes of 2-bit
// quants; f16 d at 80, dmin at 82; value = d*sc*q - dmin*m) and q3_K (110 bytes: 32 bytes of high-bit mask, 64
// bytes of low 2 bits, 12 bytes of 6-bit scales, f16 d at 108; value = d*(sc - 32)*(q - 4), q = low bits + 4
// where the mask bit is set). Element e = 128n + 32j + l (half n, quarter j, lane l < 32) takes bits 2j..2j+2
// of quant byte 32n + l and, for q3_K, bit 4n + j of mask byte l; its group of 16 is e >> 4.
__device__ __forceinline__ int q3k_scale(const u8* __restrict__ s, int g) {
    const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
    return low | (((s[8 + (g & 3)] >> (2 * (g >> 2))) & 3) << 4);
}

// Element i of a row of q2_K / q3_K super-blocks, dequantised as ggml's dequantize_row_q2_K / _q3_K (f32
// products in the reference's order, unfused).
template <int Q3> __device__ __forceinline__ float k23val(const u8* __restrict__ row, u64 i) {
    const int e = (int)(i & (QK_K - 1)), n = e >> 7, j = (e >> 5) & 3, l = e & 31;
    if (Q3) {
        const u8* blk = row + (i >> 8) * 110;
        const int q = ((blk[32 + 32 * n + l] >> (2 * j)) & 3) - (((blk[l] >> (4 * n + j)) & 1) ? 0 : 4);
        const float dl = __fmul_rn(h2f(*(const u16*)(blk + 108)), (float)(q3k_scale(blk + 96, e >> 4) - 32));
        return __fmul_rn(dl, (float)q);
    }
    const u8* blk = row + (i >> 8) * 84;
    const int sc = blk[e >> 4], q = (blk[16 + 32 * n + l] >> (2 * j)) & 3;
    const float dl = __fmul_rn(h2f(*(const u16*)(blk + 80)), (float)(sc & 15));
    const float ml = __fmul_rn(h2f(*(const u16*)(blk + 82)), (float)(sc >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}

// The 8-bit activations of q2_K / q3_K GEMVs, bit for bit as the CPU's (quant::round_activations): per
// super-block, a = max |x|, dx = a / 127, inv = 127 / a (0 where not finite: a zero or tiny block), q = x * inv
// rounded to the nearest integer, ties to even; each step one correctly rounded f32 operation (`__f*_rn`: never
// fused into an FMA nor approximated). A super-block's 256 activations lie in the 16 lanes of a half-warp,
// `mask` (16 a lane); `amax` is the lane's largest |x|. Returns inv and sets dx.
__device__ __forceinline__ float k23_x_scale(float amax, u32 mask, float& dx) {
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    dx = __fdiv_rn(amax, 127.f);
    const float inv = __fdiv_rn(127.f, amax);
    return inv <= 3.40282347e38f ? inv : 0.f;
}
// q as an exact f32: |x * inv| <= 127.5, and adding 1.5 * 2^23 leaves no fraction bits, so the sum rounds it
// to the nearest integer, ties to even (the sum's parity is the integer's), as the CPU's conversion does.
__device__ __forceinline__ float k23_x_round(float x, float inv) {
    return __fsub_rn(__fadd_rn(__fmul_rn(x, inv), 12582912.f), 12582912.f);
}

// Decode GEMV over q2_K / q3_K rows, as gemv_q: one warp per QROWS rows; a warp step reads 2 super-blocks of
// every row. Lane l takes super-block l >> 4 of the step, half n = (l >> 3) & 1 and quant bytes 32n + 4i..+4
// (i = l & 7): 16 weights, 4 of each quarter j (elements 128n + 32j + 4i..+4, group 8n + 2j + (i >> 2)), and for
// q3_K mask bytes 4i..4i+4. q3_K super-blocks are 2-byte aligned only, so its loads are 2-byte ones. The
// activations are rounded to 8 bits per super-block first (k23_x_scale), as on the CPU: integer products summed
// exactly in f32, scaled by the super-block's dx.
template <int Q3, int MT>
__device__ __forceinline__ void gemv_k23(const u8* __restrict__ w, const act_t* __restrict__ x, float* __restrict__ y,
                                         int n, int k, int m, int accumulate) {
    const int row0 = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * QROWS;
    const int lane = threadIdx.x & 31, h = (lane >> 3) & 1, i4 = 4 * (lane & 7);
    if (row0 >= n) return;
    const int nb = k >> 8, bb = Q3 ? 110 : 84;
    const u32 half_mask = 0xffffu << (lane & 16);  // the lanes of this lane's super-block
    const u8* wr[QROWS];
#pragma unroll
    for (int r = 0; r < QROWS; ++r) wr[r] = w + (u64)min(row0 + r, n - 1) * nb * bb;
    float acc[MT][QROWS];
#pragma unroll
    for (int tt = 0; tt < MT; ++tt)
#pragma unroll
        for (int r = 0; r < QROWS; ++r) acc[tt][r] = 0.f;
    for (int b = lane >> 4; b < nb; b += 2) {
        u32 qw[QROWS], hw[QROWS];
        float ds[QROWS][4], dm[QROWS][4];
#pragma unroll
        for (int r = 0; r < QROWS; ++r) {
            const u8* blk = wr[r] + (u64)b * bb;
            const u16* q = (const u16*)(blk + (Q3 ? 32 : 16) + 32 * h + i4);
            qw[r] = (u32)q[0] | ((u32)q[1] << 16);
            if (Q3) {
                const u16* hm = (const u16*)(blk + i4);
                hw[r] = (u32)hm[0] | ((u32)hm[1] << 16);
                const float d = h2f(*(const u16*)(blk + 108));
#pragma unroll
                for (int j = 0; j < 4; ++j) { ds[r][j] = d * (float)(q3k_scale(blk + 96, 8 * h + 2 * j + (i4 >> 4)) - 32); dm[r][j] = 0.f; }
            } else {
                hw[r] = 0;
                const float d = h2f(*(const u16*)(blk + 80)), dmin = h2f(*(const u16*)(blk + 82));
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int sc = blk[8 * h + 2 * j + (i4 >> 4)];
                    ds[r][j] = d * (float)(sc & 15);
                    dm[r][j] = dmin * (float)(sc >> 4);
                }
            }
        }
#pragma unroll
        for (int tt = 0; tt < MT; ++tt) {
            if (tt < m) {
                const act_t* xt = x + (u64)tt * k + QK_K * (u64)b + 128 * h + i4;
                float xf[4][4], xs[4], amax = 0.f, dx;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint2 xw = *(const uint2*)(xt + 32 * j);
                    xf[j][0] = ACT_LOAD((u16)(xw.x & 0xffffu));
                    xf[j][1] = ACT_LOAD((u16)(xw.x >> 16));
                    xf[j][2] = ACT_LOAD((u16)(xw.y & 0xffffu));
                    xf[j][3] = ACT_LOAD((u16)(xw.y >> 16));
#pragma unroll
                    for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fabsf(xf[j][e]));
                }
                const float inv = k23_x_scale(amax, half_mask, dx);
#pragma unroll
                for (int j = 0; j < 4; ++j) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) xf[j][e] = k23_x_round(xf[j][e], inv);
                    xs[j] = (xf[j][0] + xf[j][1]) + (xf[j][2] + xf[j][3]);
                }
#pragma unroll
                for (int r = 0; r < QROWS; ++r) {
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        // Quarter j's 4 quants as bytes: low bits, plus 4 where q3_K's mask bit is set.
                        u32 v = (qw[r] >> (2 * j)) & 0x03030303u;
                        if (Q3) v |= ((hw[r] >> (4 * h + j)) & 0x01010101u) << 2;
                        float wv[4];
                        bytes_to_f32(v, Q3 ? 4.f : 0.f, wv);
                        float p = 0.f;
#pragma unroll
                        for (int e = 0; e < 4; ++e) p = fmaf(xf[j][e], wv[e], p);
                        s = fmaf(ds[r][j], p, s);
                        if (!Q3) s = fmaf(-dm[r][j], xs[j], s);
                    }
                    acc[tt][r] = fmaf(dx, s, acc[tt][r]);
                }
            }
        }
    }
#pragma unroll
    for (int tt = 0; tt < MT; ++tt) {
        if (tt < m) {
#pragma unroll
            for (int r = 0; r < QROWS; ++r) {
                const float s = warp_sum(acc[tt][r]);
                if (lane == 0 && row0 + r < n) {
                    float* o = y + (u64)tt * n + row0 + r;
                    *o = accumulate ? *o + s : s;
                }
            }
        }
    }
}

extern "C" __global__ void gemv_q2_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_k23<0, QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q2_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_k23<0, 1>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv_q3_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_k23<1, QMAX_T>(w, x, y, n, k, m, acc);
}
extern "C" __global__ void gemv1_q3_k(const u8* w, const act_t* x, float* y, int n, int k, int m, int acc) {
    gemv_k23<1, 1>(w, x, y, n, k, m, acc);
}
// For tests: the activations x [blocks super-blocks] as gemv_k23 rounds them, q (one signed byte each) and dx
// (one f32 a super-block); a half-warp a super-block, 16 consecutive elements a lane.
extern "C" __global__ void round_k23_x(const act_t* __restrict__ x, signed char* __restrict__ q, float* __restrict__ dx, u64 blocks) {
    const u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 4;
    const int lane = threadIdx.x & 31;
    if (b >= blocks) return;  // a whole half-warp: its super-block's lanes stay together
    const u64 at = b * QK_K + 16 * (lane & 15);
    float xf[16], amax = 0.f, d;
#pragma unroll
    for (int e = 0; e < 16; ++e) {
        xf[e] = ACT_LOAD(x[at + e]);
        amax = fmaxf(amax, fabsf(xf[e]));
    }
    const float inv = k23_x_scale(amax, 0xffffu << (lane & 16), d);
#pragma unroll
    for (int e = 0; e < 16; ++e) q[at + e] = (signed char)(int)k23_x_round(xf[e], inv);
    if ((lane & 15) == 0) dx[b] = d;
}
extern "C" __global__ void dequant_q2_k(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(k23val<0>(w, i));
}
extern "C" __global__ void dequant_q3_k(const u8* __restrict__ w, act_t* __restrict__ out, u64 n) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = ACT_STORE(k23val<1>(w, i));
}
extern "C" __global__ void embed_q2_k(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 8) * 84;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = k23val<0>(row, i);
}
extern "C" __global__ void embed_q3_k(const u8* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ h, int hidden) {
    const u8* row = table + (u64)ids[blockIdx.x] * (hidden >> 8) * 110;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) h[(u64)blockIdx.x * hidden + i] = k23val<1>(row, i);
}

// ---------------------------------------------------------------------------------------------------------------
// Weight formats of the routed-expert kernels (cuda::tiled_format): 0 the activation type, then
// quant::QFormat::ALL (1 q8_0, 2 q4_0, 3 q4_K, 4 q6_K, 5 q2_K, 6 q3_K). A row of k elements is te_row_bytes<F>(k)
// bytes; te_val<F> is its element i, dequantised exactly in f32.
template <int F> __device__ __forceinline__ u64 te_row_bytes(int k) {
    switch (F) {
        case 0: return 2ull * k;
        case 1: return (u64)(k >> 5) * 34;
        case 2: return (u64)(k >> 5) * 18;
        case 3: return (u64)(k >> 8) * 144;
        case 4: return (u64)(k >> 8) * 210;
        case 5: return (u64)(k >> 8) * 84;
        default: return (u64)(k >> 8) * 110;
    }
}
template <int F> __device__ __forceinline__ float te_val(const u8* __restrict__ row, u64 i) {
    switch (F) {
        case 1: return qval<0>(row, i);
        case 2: return qval<1>(row, i);
        case 3: return kval<0>(row, i);
        case 4: return kval<1>(row, i);
        case 5: return k23val<0>(row, i);
        default: return k23val<1>(row, i);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped routed experts (decode): one MoE layer's pinned picked experts in two launches, matrices in format F
// (0: the activation type; 1–4: q8_0, q4_0, q4_K, q6_K, dequantised exactly in f32 as the ≤ QMAX_T-token GEMVs
// use them — not q2_K/q3_K, whose GEMVs round the activations to 8 bits first). Expert g (0 ≤ g < groups,
// ascending expert ids) has its unit at device address base[g] and its entries first[g] .. first[g + 1] of idx
// (token rows of xn and h, ascending) and wts (routing weights): the host's token permutation, at most QMAX_T
// entries an expert. Entry p's SwiGLU row is act[p, :] (ffn wide). Rows are read 8 elements a lane at a time,
// a warp's 32 lanes 256 consecutive elements: hidden and ffn are multiples of 8 and activation rows 16-byte
// aligned (the launcher checks); F = 0 weight rows are 16-byte aligned too, quantised ones are read by bytes.
#define GX_WARPS 8  // warps a block

// 8 values of the activation type at p (16-byte aligned), as f32.
__device__ __forceinline__ void load8_act(const act_t* __restrict__ p, float* out) {
    const uint4 v = *(const uint4*)p;
    const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = ACT_LOAD((u16)(w[e >> 1] >> (16 * (e & 1))));
}

// Weights row[i0 .. i0 + 8) of a row in format F (i0 a multiple of 8), exact in f32. Eight such elements never
// straddle a block, so te_val reads them from their block's start: its address and scales are formed once.
// q4_K's are kval<0>'s products, with its sub-block's scale and min formed once: the compiler kept the scale
// byte loads of q4k_scale_min's two branches apart for each element (6 loads an element, not 1.6).
template <int F> __device__ __forceinline__ void load8_w(const u8* __restrict__ row, int i0, float* out) {
    constexpr int B = F <= 2 ? 32 : QK_K;  // elements a block
    const u8* blk = row + (u64)((u32)i0 / B) * te_row_bytes<F>(B);
    const int e0 = i0 & (B - 8);  // i0 mod B, its low 3 bits zero: e0 | e is element e of the 8
    if (F == 0) {
        load8_act((const act_t*)row + i0, out);
    } else if (F == 3) {
        const int t = e0 >> 6, half = (e0 >> 5) & 1;
        float sc, m;
        q4k_scale_min(2 * t + half, blk + 4, sc, m);
        const float d1 = __fmul_rn(h2f(*(const u16*)blk), sc), m1 = __fmul_rn(h2f(*(const u16*)(blk + 2)), m);
        const u8* q = blk + 16 + 32 * t + (e0 & 31);
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = __fsub_rn(__fmul_rn(d1, (float)((q[e] >> (4 * half)) & 15)), m1);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = te_val<F>(blk, (u64)(e0 | e));
    }
}

// Kernel A: act[p, j] = silu(gate_g[j, :] · xn[idx[p], :]) · (up_g[j, :] · xn[idx[p], :]), rounded to the
// activation type as `swiglu` rounds, for every entry p of every expert g. One warp per (g, j): it reads gate
// row j and up row j once for all of g's tokens (a register accumulator per token), every load of a step issued
// before its math. Grid: groups × ffn warps.
template <int F>
__device__ __forceinline__ void gx_gate_up(const u64* __restrict__ base, const u32* __restrict__ first,
                                           const u32* __restrict__ idx, const act_t* __restrict__ xn,
                                           act_t* __restrict__ act, u64 gate_off, u64 up_off, int hidden, int ffn,
                                           int groups) {
    const u64 wid = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const u64 g = wid / (u64)ffn;
    if (g >= (u64)groups) return;
    const u64 j = wid - g * (u64)ffn;
    const u32 p0 = first[g];
    const int c = (int)min(first[g + 1] - p0, (u32)QMAX_T);
    if (c <= 0) return;
    const u8* wg = (const u8*)(base[g] + gate_off) + j * te_row_bytes<F>(hidden);
    const u8* wu = (const u8*)(base[g] + up_off) + j * te_row_bytes<F>(hidden);
    const act_t* xr[QMAX_T];
    float ag[QMAX_T], au[QMAX_T];
#pragma unroll
    for (int t = 0; t < QMAX_T; ++t) {
        xr[t] = xn + (u64)idx[p0 + min(t, c - 1)] * hidden;  // past c: re-read, unused
        ag[t] = 0.f;
        au[t] = 0.f;
    }
    for (int i = 8 * lane; i < hidden; i += 256) {
        float gv[8], uv[8];
        load8_w<F>(wg, i, gv);
        load8_w<F>(wu, i, uv);
#pragma unroll
        for (int t = 0; t < QMAX_T; ++t) {
            if (t < c) {
                float xv[8];
                load8_act(xr[t] + i, xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    ag[t] = fmaf(xv[e], gv[e], ag[t]);
                    au[t] = fmaf(xv[e], uv[e], au[t]);
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < QMAX_T; ++t) {
        if (t < c) {
            const float a = warp_sum(ag[t]), u = warp_sum(au[t]);
            if (lane == 0) act[(u64)(p0 + t) * ffn + j] = ACT_STORE(a / (1.f + expf(-a)) * u);
        }
    }
}

// Kernel B: h[t, j] += wts[p] · (down_g[j, :] · act[p, :]) for every entry p (token t = idx[p]) of every
// expert g, experts in ascending order: exactly the sequence of `scatter_add_rows` launches, one an expert, and
// no float atomics. One warp per hidden column j; lane t < m holds h[t, j] in a register for the whole launch.
// For each expert the warp reads down row j once for all its tokens. Grid: hidden warps; m ≤ 32 tokens.
template <int F>
__device__ __forceinline__ void gx_down(const u64* __restrict__ base, const u32* __restrict__ first,
                                        const u32* __restrict__ idx, const float* __restrict__ wts,
                                        const act_t* __restrict__ act, float* __restrict__ h, u64 down_off,
                                        int hidden, int ffn, int groups, int m) {
    const u64 j = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (j >= (u64)hidden) return;
    const u64 row_bytes = te_row_bytes<F>(ffn);
    float hv = lane < m ? h[(u64)lane * hidden + j] : 0.f;
    for (int g = 0; g < groups; ++g) {
        const u32 p0 = first[g];
        const int c = (int)min(first[g + 1] - p0, (u32)QMAX_T);
        const u8* wd = (const u8*)(base[g] + down_off) + j * row_bytes;
        float acc[QMAX_T];
#pragma unroll
        for (int t = 0; t < QMAX_T; ++t) acc[t] = 0.f;
        for (int i = 8 * lane; i < ffn; i += 256) {
            float dv[8];
            load8_w<F>(wd, i, dv);
#pragma unroll
            for (int t = 0; t < QMAX_T; ++t) {
                if (t < c) {
                    float av[8];
                    load8_act(act + (u64)(p0 + t) * ffn + i, av);
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[t] = fmaf(av[e], dv[e], acc[t]);
                }
            }
        }
#pragma unroll
        for (int t = 0; t < QMAX_T; ++t) {
            if (t < c) {
                const float s = warp_sum(acc[t]);
                if (lane == (int)idx[p0 + t]) hv += wts[p0 + t] * s;
            }
        }
    }
    if (lane < m) h[(u64)lane * hidden + j] = hv;
}

#define GROUPED_EXPERTS(F, suffix)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GX_WARPS * 32) moe_gate_up_grouped##suffix(                       \
        const u64* base, const u32* first, const u32* idx, const act_t* xn, act_t* act, u64 gate_off, u64 up_off,  \
        int hidden, int ffn, int groups) {                                                                         \
        gx_gate_up<F>(base, first, idx, xn, act, gate_off, up_off, hidden, ffn, groups);                           \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(GX_WARPS * 32) moe_down_grouped##suffix(                          \
        const u64* base, const u32* first, const u32* idx, const float* wts, const act_t* act, float* h,           \
        u64 down_off, int hidden, int ffn, int groups, int m) {                                                    \
        gx_down<F>(base, first, idx, wts, act, h, down_off, hidden, ffn, groups, m);                               \
    }
// cuda::GROUPED_FORMATS, in order.
GROUPED_EXPERTS(0, )
GROUPED_EXPERTS(1, _q8_0)
GROUPED_EXPERTS(2, _q4_0)
GROUPED_EXPERTS(3, _q4_k)
GROUPED_EXPERTS(4, _q6_k)

// ---------------------------------------------------------------------------------------------------------------
// One-token decode GEMV over f16/bf16 rows (the activation type), with the unit's neighbours folded in:
//   prologue PRO: 0 the input is x (activations, staged in shared memory); 1 it is the unit's input norm
//     of the f32 residual h, computed as `norm_act` computes it (mean and sum of squares over the row, then
//     (h - mean)·inv·nw + nb, rounded to the activation type) into shared memory, once a block (every block
//     sums in the same order, so all agree), so the norm's own launch and its round trip through memory go;
//   epilogue EPI: 0 y[r] (+)= w[r, :] · x; 1 SwiGLU over gate|up stored back to back (rows o and n + o):
//     act[o] = silu(gate) · up, rounded as `swiglu` rounds; 2 squared ReLU of row o, as `relu2`.
// Each warp streams R weight rows together, 16 bytes a lane and U loads of every row in flight, and sums its
// lanes: no split-K partials, so the output projections add straight into the residual stream. A warp issues
// its first loads before the prologue (weights do not depend on the input), so the norm runs under them.
// Rows are 16-byte aligned and k a multiple of 8 (the launcher checks).
#define DG_WARPS 8  // cuda::DECODE_GEMV_WARPS
#define DG_NP 2  // float4 loads of the norm's row a thread keeps in flight

__device__ __forceinline__ uint4 ld_stream16(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The norm of the f32 row h (k elements, k/4 float4) into xs, as `norm_act`: its loads DG_NP float4 at a time.
__device__ __forceinline__ void norm_into(const float* __restrict__ h, const float* __restrict__ nw,
                                          const float* __restrict__ nb, float eps, int layer_norm, int k,
                                          act_t* xs) {
    const float4* h4 = (const float4*)h;
    const int k4 = k >> 2, nt = blockDim.x;
    float mean = 0.f;
    if (layer_norm) {
        float s = 0.f;
        for (int i0 = threadIdx.x; i0 < k4; i0 += DG_NP * nt) {
            float4 v[DG_NP];
#pragma unroll
            for (int j = 0; j < DG_NP; ++j) v[j] = i0 + j * nt < k4 ? h4[i0 + j * nt] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int j = 0; j < DG_NP; ++j) s += v[j].x + v[j].y + v[j].z + v[j].w;
        }
        mean = block_sum(s) / k;
    }
    float ss = 0.f;
    for (int i0 = threadIdx.x; i0 < k4; i0 += DG_NP * nt) {
        float4 v[DG_NP];
#pragma unroll
        for (int j = 0; j < DG_NP; ++j) v[j] = i0 + j * nt < k4 ? h4[i0 + j * nt] : make_float4(mean, mean, mean, mean);
#pragma unroll
        for (int j = 0; j < DG_NP; ++j) {
            const float a = v[j].x - mean, b = v[j].y - mean, c = v[j].z - mean, d = v[j].w - mean;
            ss += a * a + b * b + c * c + d * d;
        }
    }
    const float inv = 1.f / sqrtf(block_sum(ss) / k + eps);
    for (int i0 = threadIdx.x; i0 < k4; i0 += DG_NP * nt) {
        float4 v[DG_NP], g[DG_NP], b[DG_NP];
#pragma unroll
        for (int j = 0; j < DG_NP; ++j) {
            const int i = min(i0 + j * nt, k4 - 1);  // past k4: recomputed, not stored
            v[j] = h4[i];
            g[j] = ((const float4*)nw)[i];
            b[j] = nb ? ((const float4*)nb)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < DG_NP; ++j) {
            if (i0 + j * nt < k4) {
                const u32 lo = (u32)ACT_STORE((v[j].x - mean) * inv * g[j].x + b[j].x) |
                               ((u32)ACT_STORE((v[j].y - mean) * inv * g[j].y + b[j].y) << 16);
                const u32 hi = (u32)ACT_STORE((v[j].z - mean) * inv * g[j].z + b[j].z) |
                               ((u32)ACT_STORE((v[j].w - mean) * inv * g[j].w + b[j].w) << 16);
                ((uint2*)xs)[i0 + j * nt] = make_uint2(lo, hi);
            }
        }
    }
}

template <int PRO, int EPI, int R, int U>
__device__ __forceinline__ void decode_gemv(const act_t* __restrict__ w, const act_t* __restrict__ x,
                                            const float* __restrict__ h, const float* __restrict__ nw,
                                            const float* __restrict__ nb, float eps, int layer_norm,
                                            float* __restrict__ y, act_t* __restrict__ out, int n, int k,
                                            int accumulate) {
    extern __shared__ uint4 dg_smem[];
    const int k8 = k >> 3;
    const int lane = threadIdx.x & 31;
    const int job = blockIdx.x * DG_WARPS + (threadIdx.x >> 5);
    // Outputs of this warp: R rows (EPI 0, 2) or R/2 gate|up pairs (EPI 1).
    constexpr int OUTS = EPI == 1 ? R / 2 : R;
    const int o0 = job * OUTS;
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int o = min(o0 + (EPI == 1 ? r % OUTS : r), n - 1);  // past n: re-read, not stored
        const int row = EPI == 1 && r >= OUTS ? n + o : o;
        wr[r] = (const uint4*)(w + (u64)row * k);
    }
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
            wv[u][r] = lane + 32 * u < k8 && o0 < n ? ld_stream16(wr[r] + lane + 32 * u) : make_uint4(0, 0, 0, 0);
    // Everything above reads only the weights; the input comes from the kernels before this one.
    griddep_wait();
    griddep_launch_dependents();
    if (PRO == 1) {
        norm_into(h, nw, nb, eps, layer_norm, k, (act_t*)dg_smem);
    } else {
        for (int i0 = threadIdx.x; i0 < k8; i0 += DG_NP * blockDim.x) {
            uint4 v[DG_NP];
#pragma unroll
            for (int j = 0; j < DG_NP; ++j) v[j] = ((const uint4*)x)[min(i0 + j * (int)blockDim.x, k8 - 1)];
#pragma unroll
            for (int j = 0; j < DG_NP; ++j)
                if (i0 + j * (int)blockDim.x < k8) dg_smem[i0 + j * blockDim.x] = v[j];
        }
    }
    __syncthreads();
    const uint4* xv4 = dg_smem;
    if (o0 >= n) return;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int c = lane;;) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c + 32 * u < k8) {
                float xf[8];
                const uint4 xw = xv4[c + 32 * u];
                const u32 xs4[4] = {xw.x, xw.y, xw.z, xw.w};
#pragma unroll
                for (int e = 0; e < 8; ++e) xf[e] = ACT_LOAD((u16)(xs4[e >> 1] >> (16 * (e & 1))));
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const u32 ww[4] = {wv[u][r].x, wv[u][r].y, wv[u][r].z, wv[u][r].w};
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r] = fmaf(xf[e], ACT_LOAD((u16)(ww[e >> 1] >> (16 * (e & 1)))), acc[r]);
                }
            }
        }
        c += 32 * U;
        if (c >= k8) break;
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < R; ++r)
                wv[u][r] = c + 32 * u < k8 ? ld_stream16(wr[r] + c + 32 * u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = warp_sum(acc[r]);
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < OUTS; ++j) {
        const int o = o0 + j;
        if (o >= n) break;
        if (EPI == 0) {
            y[o] = accumulate ? y[o] + acc[j] : acc[j];
        } else if (EPI == 1) {
            const float a = acc[j];
            out[o] = ACT_STORE(a / (1.f + expf(-a)) * acc[j + OUTS]);
        } else {
            const float v = fmaxf(acc[j], 0.f);
            out[o] = ACT_STORE(v * v);
        }
    }
}

// Blocks an SM keeps resident at R rows a warp and U loads of each in flight: the registers a thread may use
// (R·U 4: 51, 8: 85, 16: 128), so that enough loads are in flight on every SM.
#define DG_BLOCKS(RU) ((RU) <= 4 ? 5 : (RU) <= 8 ? 3 : 2)
#define DECODE_GEMV(name, PRO, EPI, R, U)                                                                           \
    extern "C" __global__ void __launch_bounds__(DG_WARPS * 32, DG_BLOCKS((R) * (U))) name(                         \
        const act_t* w, const act_t* x, const float* h, const float* nw, const float* nb, float eps,               \
        int layer_norm, float* y, act_t* out, int n, int k, int acc) {                                              \
        decode_gemv<PRO, EPI, R, U>(w, x, h, nw, nb, eps, layer_norm, y, out, n, k, acc);                           \
    }
// cuda::GemvShape::ALL, in order, for each input and output: rows a warp × loads of a row in flight.
DECODE_GEMV(decode_gemv_x_1x4, 0, 0, 1, 4)
DECODE_GEMV(decode_gemv_x_2x4, 0, 0, 2, 4)
DECODE_GEMV(decode_gemv_x_4x4, 0, 0, 4, 4)
DECODE_GEMV(decode_gemv_x_2x8, 0, 0, 2, 8)
DECODE_GEMV(decode_gemv_norm_1x4, 1, 0, 1, 4)
DECODE_GEMV(decode_gemv_norm_2x4, 1, 0, 2, 4)
DECODE_GEMV(decode_gemv_norm_4x4, 1, 0, 4, 4)
DECODE_GEMV(decode_gemv_norm_2x8, 1, 0, 2, 8)
DECODE_GEMV(decode_gemv_norm_swiglu_2x4, 1, 1, 2, 4)
DECODE_GEMV(decode_gemv_norm_swiglu_4x4, 1, 1, 4, 4)
DECODE_GEMV(decode_gemv_norm_swiglu_2x8, 1, 1, 2, 8)
DECODE_GEMV(decode_gemv_norm_relu2_1x4, 1, 2, 1, 4)
DECODE_GEMV(decode_gemv_norm_relu2_2x4, 1, 2, 2, 4)
DECODE_GEMV(decode_gemv_norm_relu2_2x8, 1, 2, 2, 8)

// ---------------------------------------------------------------------------------------------------------------
// Tiled routed experts (steps of more tokens than the grouped kernels take, or quantised experts): a group of a
// MoE layer's pinned picked experts in three launches, whatever the number of experts — against `expert_ffn`'s
// 5–6 an expert, whose host enqueueing set a prefill chunk's pace (≈ 42 µs an expert on the H200's host against
// a few µs of GPU work). The host cuts each expert's entries into tiles of at most TE_ROWS entries (a tile
// never spans two experts) and the group's experts into groups whose entries fit the per-expert path's `moe_act`
// and `moe_y` rows. Weights are dequantised into shared memory as the `dequant_*` kernels round them (so the
// products are those of the dequantise + cuBLAS path) and multiplied on tensor cores (m16n8k16, f32
// accumulation): outputs equal that path's up to the order of the f32 additions.
#define TE_ROWS 128  // cuda::tiled::TILE_ENTRIES: 8 warps of 16 rows, so that an expert of a 1024-token chunk
                     // (≈ 63 ± 8 entries for qwen3-30b-a3b) is one tile, its weights dequantised once
#define TE_THREADS 256
#define TE_K 32     // k a step: a q8_0/q4_0 block, an eighth of a K-quant super-block
#define TE_LD 40    // shared row stride in 16-bit values: 80 bytes, so a warp's fragment loads hit 32 banks

struct ExpertTile {
    u64 unit;   // the expert unit's device address
    u32 first;  // its first entry (index into idx/wts; the group's act/y row is first - gfirst)
    u32 count;  // entries, 1..TE_ROWS
};

// Eight quants of one block as exact small integers (they share its scales): bytes b[0..8] read as 16-bit
// words from p (blocks are 2-byte aligned), each shifted right by `shift` and masked with `mask`.
__device__ __forceinline__ void te_bytes8(const u8* __restrict__ p, int shift, int mask, int* q) {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
        const u32 two = ((const u16*)p)[w];
        q[2 * w] = (int)((two >> shift) & mask);
        q[2 * w + 1] = (int)((two >> (8 + shift)) & mask);
    }
}

// Weights row[i0 .. i0 + 8) (i0 a multiple of 8) as activation-type values into dst (16-byte aligned shared
// memory). The eight lie in one block (q8_0, q4_0) or one 32-element sub-block (q4_K, q6_K), so its scales are
// read once and its quants as 16-bit words; each value is the product `qval`/`kval` computes, in their order
// (bit for bit the per-element dequantisation, which the q2_K/q3_K instances keep).
template <int F> __device__ __forceinline__ void te_load_w8(const u8* __restrict__ row, u64 i0, u16* dst) {
    float w[8];
    if (F == 0) {
        *(uint4*)dst = *(const uint4*)(row + 2 * i0);
        return;
    } else if (F == 1 || F == 2) {
        // q8_0: bytes e..e+8; q4_0: the low nibbles of bytes (e & 8).. for e < 16, their high nibbles above.
        const int e = (int)(i0 & 31);
        const u8* blk = row + (i0 >> 5) * (F == 2 ? 18 : 34);
        const float d = h2f(*(const u16*)blk);
        int q[8];
        te_bytes8(blk + 2 + (F == 2 ? (e & 8) : e), F == 2 ? (e & 16) >> 2 : 0, F == 2 ? 15 : 255, q);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = (float)(F == 2 ? q[j] - 8 : (int)(signed char)q[j]) * d;
    } else if (F == 3) {
        // q4_K: sub-block 2t + half of the super-block; its quants are the nibbles (half) of bytes 16 + 32t + l.
        const int e = (int)(i0 & (QK_K - 1)), t = e >> 6, half = (e >> 5) & 1, l = e & 31;
        const u8* blk = row + (i0 >> 8) * 144;
        float sc, m;
        q4k_scale_min(2 * t + half, blk + 4, sc, m);
        const float d1 = __fmul_rn(h2f(*(const u16*)blk), sc), m1 = __fmul_rn(h2f(*(const u16*)(blk + 2)), m);
        int q[8];
        te_bytes8(blk + 16 + 32 * t + l, 4 * half, 15, q);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = __fsub_rn(__fmul_rn(d1, (float)q[j]), m1);
    } else if (F == 4) {
        // q6_K: low nibbles (c >> 1 picks the nibble) and high 2-bit pairs of element l of quarter c, half n;
        // one signed scale per 16 elements.
        const int e = (int)(i0 & (QK_K - 1)), n = e >> 7, c = (e >> 5) & 3, l = e & 31;
        const u8* blk = row + (i0 >> 8) * 210;
        const float ds = __fmul_rn(h2f(*(const u16*)(blk + 208)), (float)(signed char)blk[192 + 8 * n + 2 * c + (l >> 4)]);
        int lo[8], hi[8];
        te_bytes8(blk + 64 * n + 32 * (c & 1) + l, 4 * (c >> 1), 15, lo);
        te_bytes8(blk + 128 + 32 * n + l, 2 * c, 3, hi);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = __fmul_rn(ds, (float)((lo[j] | (hi[j] << 4)) - 32));
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = te_val<F>(row, i0 + j);
    }
    u32 p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) p[j] = (u32)ACT_STORE(w[2 * j]) | ((u32)ACT_STORE(w[2 * j + 1]) << 16);
    *(uint4*)dst = make_uint4(p[0], p[1], p[2], p[3]);
}

// acc[j] = the 16 × 8 output block (entries 16w.., outputs 8j..) of x · wᵀ over k, for a block of 8 warps and
// a tile of n entries: thread t stages activation rows t/4 and t/4 + 64 (x0, x1: null past the tile's entries,
// which read as zeros), 8 values each a step, and 8 values of weight row t/4 (w_row; 64 rows). Warps whose 16
// rows are all past n skip their products.
template <int F>
__device__ __forceinline__ void te_tile(const act_t* __restrict__ x0, const act_t* __restrict__ x1,
                                        const u8* __restrict__ w_row, int k, int n, float acc[8][4]) {
    __shared__ __align__(16) u16 xs[TE_ROWS * TE_LD];
    __shared__ __align__(16) u16 ws[64 * TE_LD];
    const int t = threadIdx.x, lane = t & 31, w = t >> 5, g = lane >> 2, q = lane & 3;
    const int seg = 8 * (t & 3), r = t >> 2;
    const bool live = 16 * w < n;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int k0 = 0; k0 < k; k0 += TE_K) {
        *(uint4*)&xs[r * TE_LD + seg] = x0 ? *(const uint4*)(x0 + k0 + seg) : zero;
        *(uint4*)&xs[(r + 64) * TE_LD + seg] = x1 ? *(const uint4*)(x1 + k0 + seg) : zero;
        te_load_w8<F>(w_row, (u64)(k0 + seg), &ws[r * TE_LD + seg]);
        __syncthreads();
        if (live) {
#pragma unroll
            for (int kk = 0; kk < TE_K; kk += 16) {
                const u16* a = &xs[(16 * w + g) * TE_LD + kk + 2 * q];
                const u32 a0 = *(const u32*)a, a1 = *(const u32*)(a + 8 * TE_LD);
                const u32 a2 = *(const u32*)(a + 8), a3 = *(const u32*)(a + 8 * TE_LD + 8);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const u16* b = &ws[(8 * j + g) * TE_LD + kk + 2 * q];
                    mma16816(acc[j], a0, a1, a2, a3, *(const u32*)b, *(const u32*)(b + 8), acc[j]);
                }
            }
        }
        __syncthreads();
    }
}

// Kernel A: act[p - gfirst, c] = silu(gate[c] · xn[idx[p]]) · (up[c] · xn[idx[p]]), rounded as `swiglu`
// rounds, for the entries p of every tile and the 32 columns c of block column blockIdx.x (weight rows 0..32 of
// the tile are gate rows, 32..64 the same up rows). Grid: ffn / 32 × tiles; TE_THREADS threads.
template <int F>
__device__ __forceinline__ void te_gate_up(const ExpertTile* __restrict__ tiles, const u32* __restrict__ idx,
                                           const act_t* __restrict__ xn, act_t* __restrict__ act, u64 gate_off,
                                           u64 up_off, int hidden, int ffn, u32 gfirst) {
    const ExpertTile tile = tiles[blockIdx.y];
    const int t = threadIdx.x, c0 = 32 * blockIdx.x, r = t >> 2;
    const int n = (int)tile.count;
    const act_t* x0 = r < n ? xn + (u64)idx[tile.first + r] * hidden : nullptr;
    const act_t* x1 = r + 64 < n ? xn + (u64)idx[tile.first + r + 64] * hidden : nullptr;
    const u64 off = r < 32 ? gate_off : up_off;
    const u8* w_row = (const u8*)tile.unit + off + (u64)(c0 + (r & 31)) * te_row_bytes<F>(hidden);
    float acc[8][4];
    te_tile<F>(x0, x1, w_row, hidden, n, acc);
    const int lane = t & 31, w = t >> 5, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * w + g + 8 * h;
            if (r < n) {
                const float a0 = acc[j][2 * h], a1 = acc[j][2 * h + 1];
                const u32 o = (u32)ACT_STORE(a0 / (1.f + expf(-a0)) * acc[j + 4][2 * h]) |
                              ((u32)ACT_STORE(a1 / (1.f + expf(-a1)) * acc[j + 4][2 * h + 1]) << 16);
                *(u32*)(act + (u64)(tile.first + r - gfirst) * ffn + c0 + 8 * j + 2 * q) = o;
            }
        }
    }
}

// Kernel B: y[p - gfirst, c] = down[c] · act[p - gfirst] (f32, unweighted) for the entries p of every tile and
// the 64 columns c of block column blockIdx.x. Grid: hidden / 64 × tiles; TE_THREADS threads.
template <int F>
__device__ __forceinline__ void te_down(const ExpertTile* __restrict__ tiles, const act_t* __restrict__ act,
                                        float* __restrict__ y, u64 down_off, int hidden, int ffn, u32 gfirst) {
    const ExpertTile tile = tiles[blockIdx.y];
    const int t = threadIdx.x, c0 = 64 * blockIdx.x, r = t >> 2;
    const int n = (int)tile.count;
    const act_t* rows = act + (u64)(tile.first - gfirst) * ffn;
    const act_t* x0 = r < n ? rows + (u64)r * ffn : nullptr;
    const act_t* x1 = r + 64 < n ? rows + (u64)(r + 64) * ffn : nullptr;
    const u8* w_row = (const u8*)tile.unit + down_off + (u64)(c0 + r) * te_row_bytes<F>(ffn);
    float acc[8][4];
    te_tile<F>(x0, x1, w_row, ffn, n, acc);
    const int lane = t & 31, w = t >> 5, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = 16 * w + g + 8 * h;
            if (r < n)
                *(float2*)(y + (u64)(tile.first + r - gfirst) * hidden + c0 + 8 * j + 2 * q) =
                    make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        }
    }
}

#define TILED_EXPERTS(F, name)                                                                                      \
    extern "C" __global__ void __launch_bounds__(TE_THREADS) moe_gate_up_tiled_##name(                                     \
        const ExpertTile* tiles, const u32* idx, const act_t* xn, act_t* act, u64 gate_off, u64 up_off,            \
        int hidden, int ffn, u32 gfirst) {                                                                          \
        te_gate_up<F>(tiles, idx, xn, act, gate_off, up_off, hidden, ffn, gfirst);                                  \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(TE_THREADS) moe_down_tiled_##name(                                        \
        const ExpertTile* tiles, const act_t* act, float* y, u64 down_off, int hidden, int ffn, u32 gfirst) {       \
        te_down<F>(tiles, act, y, down_off, hidden, ffn, gfirst);                                                   \
    }
// cuda::TILED_FORMATS, in order.
TILED_EXPERTS(0, act)
TILED_EXPERTS(1, q8_0)
TILED_EXPERTS(2, q4_0)
TILED_EXPERTS(3, q4_k)
TILED_EXPERTS(4, q6_k)
TILED_EXPERTS(5, q2_k)
TILED_EXPERTS(6, q3_k)

// Kernel C: h[t, :] += wts[p] · y[p - gfirst, :] for token t's entries p of the group, tok_ent[tok_first[t] ..
// tok_first[t + 1]], in ascending expert order: the additions of `scatter_add_rows`, one launch an expert, in
// the same order. Grid: ceil(hidden / 256) × m; 256 threads.
extern "C" __global__ void moe_combine_tiled(const u32* __restrict__ tok_first, const u32* __restrict__ tok_ent,
                                             const float* __restrict__ wts, const float* __restrict__ y,
                                             float* __restrict__ h, int hidden, u32 gfirst) {
    const u32 a = tok_first[blockIdx.y], b = tok_first[blockIdx.y + 1];
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (a == b || j >= hidden) return;
    float* o = h + (u64)blockIdx.y * hidden + j;
    float v = *o;
    for (u32 e = a; e < b; ++e) {
        const u32 p = tok_ent[e];
        v += wts[p] * y[(u64)(p - gfirst) * hidden + j];
    }
    *o = v;
}
