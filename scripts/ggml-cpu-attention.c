// Times ggml's CPU attention for one decode step of R sequences, each with its own KV stream (llama.cpp's
// non-unified cache layout: cache [n_embd_gqa, kv_size, R], viewed per head), with flash attention
// (FLASH_ATTN_EXT) or without (MUL_MAT + SOFT_MAX + MUL_MAT over a transposed V cache, + CONT), at
// qwen3-30b-a3b's shapes (32 query heads, 4 KV heads, head dim 128, 1024 cells a stream, f16 KV).
// With LAYERS > 1, that many attentions with their own caches run in one graph (KV read cold, as in a model).
// With `unified`, the R sequences share one cache (`-kvu`): one stream of R x 1024 cells, sequence s in cells
// [1024 s, 1024 s + USED), the R queries in that stream, each masked to its own block.
//
// Build against ggml of the artifact (b6097; github deepshnv/pipeshard-mlsys26-ae):
//   git -C MIRROR archive HEAD ggml | tar -x -C /tmp/src && touch /tmp/src/ggml/ggml.pc.in
//   cmake -S /tmp/src/ggml -B /tmp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
//   cmake --build /tmp/build -j && B=/tmp/build/src
//   gcc -O2 -o /tmp/attn scripts/ggml-cpu-attention.c -I/tmp/src/ggml/include $B/libggml.a $B/libggml-cpu.a
//       $B/libggml-base.a -lstdc++ -lm -fopenmp
//   for r in 1 4 16; do for m in fa mat; do /tmp/attn $m $r 953 1024 1 7 $((r < 12 ? 48 / r : 4)); done; done
//   for r in 4 16; do /tmp/attn fa $r 953 1024 1 5 $((r < 12 ? 48 / r : 4)) unified; done
// usage: attn fa|mat R USED_CELLS N_KV THREADS REPS [LAYERS [unified]]
#include "ggml.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// CPU time of the process: with THREADS = 1 on a shared machine, the kernel's own time, not other jobs'.
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: %s fa|mat R USED N_KV THREADS REPS [LAYERS [unified]]\n", argv[0]);
        return 1;
    }
    const int fa = strcmp(argv[1], "fa") == 0;
    const int R = atoi(argv[2]), used = atoi(argv[3]);
    const int threads = atoi(argv[5]), reps = atoi(argv[6]);
    const int layers = argc > 7 ? atoi(argv[7]) : 1;
    const int unified = argc > 8 && strcmp(argv[8], "unified") == 0;
    const int hd = 128, n_head = 32, n_head_kv = 4, n_gqa = hd * n_head_kv;
    // streams, query tokens per stream, cells per stream, cells the kernel is given per stream
    const int S = unified ? 1 : R, T = unified ? R : 1, kv_size = unified ? R * 1024 : 1024;
    const int n_kv = unified ? R * atoi(argv[4]) : atoi(argv[4]);

    struct ggml_init_params ip = {(size_t) 1 << 34, NULL, false};
    struct ggml_context *ctx = ggml_init(ip);

    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    for (int layer = 0; layer < layers; layer++) {
    struct ggml_tensor *kc = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, n_gqa, kv_size, S);
    struct ggml_tensor *vc = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, n_gqa, kv_size, S);
    struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, hd, T, n_head, S);
    const int pad = GGML_PAD(T, GGML_KQ_MASK_PAD);
    struct ggml_tensor *mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, pad, 1, S);

    srand(1);
    for (int64_t i = 0; i < ggml_nelements(kc); i++) {
        ((ggml_fp16_t *) kc->data)[i] = ggml_fp32_to_fp16((rand() / (float) RAND_MAX - 0.5f));
        ((ggml_fp16_t *) vc->data)[i] = ggml_fp32_to_fp16((rand() / (float) RAND_MAX - 0.5f));
    }
    for (int64_t i = 0; i < ggml_nelements(q); i++) ((float *) q->data)[i] = rand() / (float) RAND_MAX - 0.5f;
    for (int s = 0; s < S; s++)
        for (int r = 0; r < pad; r++)
            for (int j = 0; j < n_kv; j++) {
                const int own = unified ? j / 1024 == r && j % 1024 < used : j < used;
                ((ggml_fp16_t *) mask->data)[(s * pad + r) * n_kv + j] = ggml_fp32_to_fp16(own ? 0.0f : -INFINITY);
            }

    const size_t es = ggml_element_size(kc);
    // [hd, n_head_kv, n_kv, S] views of the caches, permuted to [hd, n_kv, n_head_kv, S]
    struct ggml_tensor *k = ggml_view_4d(ctx, kc, hd, n_head_kv, n_kv, S, es * hd, es * n_gqa,
                                         es * n_gqa * kv_size, 0);
    k = ggml_permute(ctx, k, 0, 2, 1, 3);
    struct ggml_tensor *out;
    const float scale = 1.0f / sqrtf((float) hd);
    if (fa) {
        struct ggml_tensor *v = ggml_view_4d(ctx, vc, hd, n_head_kv, n_kv, S, es * hd, es * n_gqa,
                                             es * n_gqa * kv_size, 0);
        v = ggml_permute(ctx, v, 0, 2, 1, 3);
        out = ggml_flash_attn_ext(ctx, q, k, v, mask, scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    } else {
        // transposed V cache: per stream, kv_size cells contiguous for each of the n_gqa channels
        struct ggml_tensor *v = ggml_view_4d(ctx, vc, n_kv, n_head_kv, hd, S, es * kv_size * hd, es * kv_size,
                                             es * kv_size * n_gqa, 0);
        v = ggml_permute(ctx, v, 0, 2, 1, 3);
        struct ggml_tensor *kq = ggml_mul_mat(ctx, k, q);
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx, kq, mask, scale, 0.0f);
        struct ggml_tensor *kqv = ggml_mul_mat(ctx, v, kq);
        out = ggml_cont(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3));
    }
    ggml_build_forward_expand(gf, out);
    }

    double *t = malloc(sizeof(double) * reps);
    for (int i = 0; i < 3; i++) ggml_graph_compute_with_ctx(ctx, gf, threads);
    for (int i = 0; i < reps; i++) {
        double t0 = now_s();
        ggml_graph_compute_with_ctx(ctx, gf, threads);
        t[i] = now_s() - t0;
    }
    qsort(t, reps, sizeof(double), cmp_d);
    const double cell_heads = (double) layers * R * n_head * used;
    printf("%s layers=%d %s R=%d used=%d n_kv=%d threads=%d min_cpu_us_per_layer=%.1f med_cpu_us_per_layer=%.1f cpu_ns_per_cell_head=%.2f (min) %.2f (med)\n",
           unified ? "unified" : "per-seq", layers, fa ? "fa " : "mat", R, used, n_kv, threads, t[0] * 1e6 / layers, t[reps / 2] * 1e6 / layers,
           t[0] * 1e9 / cell_heads, t[reps / 2] * 1e9 / cell_heads);
    return 0;
}
