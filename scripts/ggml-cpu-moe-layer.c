// Times ggml's CPU decode of qwen3-30b-a3b layers as stock llama.cpp b6097 builds them for `llama-batched-bench
// -fa` without `-kvu` (`llm_build_qwen3moe`, `build_attn` over per-sequence KV streams, `build_moe_ffn`): R
// identical tokens (the bench feeds token 0 to every sequence, so all R route to the same 8 experts), q8_0
// attention projections, f32 router, q4_0 experts, f16 KV of 1024 cells a stream with USED of them filled.
// LAYERS layers with weights of their own, so weights and KV come from DRAM as in a model.
//
// `mat` builds the attention without `-fa` (KQ `mul_mat`, `soft_max_ext`, KQV `mul_mat` over a transposed V).
// It prints the whole graph's time a layer, then each op kind's time a layer, timed node by node (each node a
// graph of its own, so each pays one fork/join of the thread pool: the RESHAPE and VIEW rows are that cost
// alone), then what a layer reads and the DRAM rate of a plain read at the same thread count.
//
// Build against ggml of the artifact (github deepshnv/pipeshard-mlsys26-ae), as scripts/ggml-cpu-attention.c:
//   git -C MIRROR archive HEAD ggml | tar -x -C /tmp/src && touch /tmp/src/ggml/ggml.pc.in
//   cmake -S /tmp/src/ggml -B /tmp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
//       -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
//   cmake --build /tmp/build -j && B=/tmp/build/src
//   gcc -O2 -o /tmp/moe scripts/ggml-cpu-moe-layer.c -I/tmp/src/ggml/include $B/libggml.a $B/libggml-cpu.a
//       $B/libggml-base.a -lstdc++ -lm -fopenmp
//   for t in 1 2; do for m in fa mat; do for r in 1 4 16; do /tmp/moe $m $r 8 $t 5; done; done; done
// usage: moe fa|mat R LAYERS THREADS REPS
#include "ggml.h"
#include "ggml-cpu.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { HD = 128, N_HEAD = 32, N_HEAD_KV = 4, N_EMBD = 2048, N_FF = 768, N_EXPERT = 128, N_USED = 8 };
enum { KV_SIZE = 1024, USED = 953, N_KV = 1024 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static float frand(void) { return rand() / (float) RAND_MAX - 0.5f; }

// Random weights in `type`: f32/f16 values in ±0.5, block formats random quants under a small scale.
static void fill(struct ggml_tensor *t) {
    const int64_t n = ggml_nelements(t);
    if (t->type == GGML_TYPE_F32) {
        for (int64_t i = 0; i < n; i++) ((float *) t->data)[i] = frand();
        return;
    }
    if (t->type == GGML_TYPE_F16) {
        for (int64_t i = 0; i < n; i++) ((ggml_fp16_t *) t->data)[i] = ggml_fp32_to_fp16(frand());
        return;
    }
    uint8_t *p = t->data;
    const size_t bs = ggml_type_size(t->type), nb = ggml_nbytes(t) / bs;
    const ggml_fp16_t d = ggml_fp32_to_fp16(0.01f);
    uint64_t s = 0x9e3779b97f4a7c15u;
    for (size_t b = 0; b < nb; b++) {
        memcpy(p + b * bs, &d, sizeof d); // q4_0 and q8_0 blocks start with their f16 scale
        for (size_t j = sizeof d; j < bs; j++) {
            s = s * 6364136223846793005u + 1442695040888963407u;
            p[b * bs + j] = (uint8_t) (s >> 56);
        }
    }
}

static struct ggml_tensor *weight(struct ggml_context *ctx, enum ggml_type type, int64_t k, int64_t n, int64_t e) {
    struct ggml_tensor *t = e > 1 ? ggml_new_tensor_3d(ctx, type, k, n, e) : ggml_new_tensor_2d(ctx, type, k, n);
    fill(t);
    return t;
}

static struct ggml_tensor *rms(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *w) {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, 1e-6f), w);
}

static struct ggml_tensor *rope(struct ggml_context *ctx, struct ggml_tensor *x, struct ggml_tensor *pos) {
    return ggml_rope_ext(ctx, x, pos, NULL, HD, GGML_ROPE_TYPE_NEOX, 262144, 1e7f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f);
}

// One layer on `x` [N_EMBD, R]; returns its output. Weight bytes a decode step reads go to *bytes.
static struct ggml_tensor *layer(struct ggml_context *ctx, struct ggml_cgraph *gf, struct ggml_tensor *x,
                                 struct ggml_tensor *pos, struct ggml_tensor *idxs, struct ggml_tensor *mask,
                                 int fa, int R, double *bytes) {
    struct ggml_tensor *attn_norm = weight(ctx, GGML_TYPE_F32, N_EMBD, 1, 1);
    struct ggml_tensor *wq = weight(ctx, GGML_TYPE_Q8_0, N_EMBD, HD * N_HEAD, 1);
    struct ggml_tensor *wk = weight(ctx, GGML_TYPE_Q8_0, N_EMBD, HD * N_HEAD_KV, 1);
    struct ggml_tensor *wv = weight(ctx, GGML_TYPE_Q8_0, N_EMBD, HD * N_HEAD_KV, 1);
    struct ggml_tensor *wo = weight(ctx, GGML_TYPE_Q8_0, HD * N_HEAD, N_EMBD, 1);
    struct ggml_tensor *q_norm = weight(ctx, GGML_TYPE_F32, HD, 1, 1);
    struct ggml_tensor *k_norm = weight(ctx, GGML_TYPE_F32, HD, 1, 1);
    struct ggml_tensor *ffn_norm = weight(ctx, GGML_TYPE_F32, N_EMBD, 1, 1);
    struct ggml_tensor *gate_inp = weight(ctx, GGML_TYPE_F32, N_EMBD, N_EXPERT, 1);
    struct ggml_tensor *up_exps = weight(ctx, GGML_TYPE_Q4_0, N_EMBD, N_FF, N_EXPERT);
    struct ggml_tensor *gate_exps = weight(ctx, GGML_TYPE_Q4_0, N_EMBD, N_FF, N_EXPERT);
    struct ggml_tensor *down_exps = weight(ctx, GGML_TYPE_Q4_0, N_FF, N_EMBD, N_EXPERT);
    const int n_gqa = HD * N_HEAD_KV;
    struct ggml_tensor *kc = weight(ctx, GGML_TYPE_F16, n_gqa, KV_SIZE, R);
    // `-fa` keeps V as K; without it the cache is transposed: per stream, KV_SIZE cells contiguous a channel.
    struct ggml_tensor *vc = fa ? weight(ctx, GGML_TYPE_F16, n_gqa, KV_SIZE, R)
                                : weight(ctx, GGML_TYPE_F16, KV_SIZE, n_gqa, R);
    *bytes += ggml_nbytes(wq) + ggml_nbytes(wk) + ggml_nbytes(wv) + ggml_nbytes(wo) + ggml_nbytes(gate_inp) +
              3.0 * N_USED * ggml_nbytes(up_exps) / N_EXPERT + 2.0 * R * USED * n_gqa * sizeof(ggml_fp16_t);

    struct ggml_tensor *cur = rms(ctx, x, attn_norm);
    struct ggml_tensor *q = ggml_mul_mat(ctx, wq, cur), *k = ggml_mul_mat(ctx, wk, cur), *v = ggml_mul_mat(ctx, wv, cur);
    q = ggml_reshape_3d(ctx, q, HD, N_HEAD, R);
    k = ggml_reshape_3d(ctx, k, HD, N_HEAD_KV, R);
    v = ggml_reshape_3d(ctx, v, HD, N_HEAD_KV, R);
    q = rope(ctx, rms(ctx, q, q_norm), pos);
    k = rope(ctx, rms(ctx, k, k_norm), pos);
    ggml_build_forward_expand(gf, q);
    ggml_build_forward_expand(gf, k);
    ggml_build_forward_expand(gf, v);
    // cpy_k / cpy_v: one row a token into its own stream's cells
    const size_t es = sizeof(ggml_fp16_t);
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, kc, n_gqa, KV_SIZE * R),
                                                ggml_reshape_2d(ctx, k, n_gqa, R), idxs));
    struct ggml_tensor *kv_out;
    struct ggml_tensor *kv = ggml_view_4d(ctx, kc, HD, N_HEAD_KV, N_KV, R, es * HD, es * n_gqa, es * n_gqa * KV_SIZE, 0);
    q = ggml_permute(ctx, ggml_reshape_4d(ctx, q, HD, N_HEAD, 1, R), 0, 2, 1, 3);
    kv = ggml_permute(ctx, kv, 0, 2, 1, 3);
    const float scale = 1.0f / sqrtf((float) HD);
    if (fa) {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, vc, n_gqa, KV_SIZE * R),
                                                    ggml_reshape_2d(ctx, v, n_gqa, R), idxs));
        struct ggml_tensor *vv =
            ggml_view_4d(ctx, vc, HD, N_HEAD_KV, N_KV, R, es * HD, es * n_gqa, es * n_gqa * KV_SIZE, 0);
        vv = ggml_permute(ctx, vv, 0, 2, 1, 3);
        kv_out = ggml_flash_attn_ext(ctx, q, kv, vv, mask, scale, 0.0f, 0.0f);
        ggml_flash_attn_ext_set_prec(kv_out, GGML_PREC_F32);
        kv_out = ggml_reshape_2d(ctx, kv_out, HD * N_HEAD, R);
    } else {
        // The transposed V store (512 one-element rows a token, ≈ 1 µs) is left out.
        struct ggml_tensor *vv = ggml_view_4d(ctx, vc, N_KV, N_HEAD_KV, HD, R, es * KV_SIZE * HD, es * KV_SIZE,
                                              es * KV_SIZE * n_gqa, 0);
        vv = ggml_permute(ctx, vv, 0, 2, 1, 3);
        struct ggml_tensor *kq = ggml_mul_mat(ctx, kv, q);
        ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
        kq = ggml_soft_max_ext(ctx, kq, mask, scale, 0.0f);
        struct ggml_tensor *kqv = ggml_mul_mat(ctx, vv, kq);
        kv_out = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), HD * N_HEAD, R);
    }
    cur = ggml_mul_mat(ctx, wo, kv_out);
    struct ggml_tensor *ffn_inp = ggml_add(ctx, cur, x);
    cur = rms(ctx, ffn_inp, ffn_norm);
    // build_moe_ffn: softmax gating, top-8, renormalised weights, SiLU GLU
    struct ggml_tensor *probs = ggml_soft_max(ctx, ggml_mul_mat(ctx, gate_inp, cur));
    struct ggml_tensor *sel = ggml_top_k(ctx, probs, N_USED);
    struct ggml_tensor *w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, N_EXPERT, R), sel);
    w = ggml_reshape_2d(ctx, w, N_USED, R);
    w = ggml_reshape_3d(ctx, ggml_div(ctx, w, ggml_sum_rows(ctx, w)), 1, N_USED, R);
    cur = ggml_reshape_3d(ctx, cur, N_EMBD, 1, R);
    struct ggml_tensor *up = ggml_mul_mat_id(ctx, up_exps, cur, sel);
    struct ggml_tensor *gate = ggml_mul_mat_id(ctx, gate_exps, cur, sel);
    struct ggml_tensor *experts = ggml_mul(ctx, ggml_mul_mat_id(ctx, down_exps, ggml_swiglu_split(ctx, gate, up), sel), w);
    struct ggml_tensor *views[N_USED];
    for (int i = 0; i < N_USED; i++) {
        views[i] = ggml_view_2d(ctx, experts, N_EMBD, R, experts->nb[2], i * experts->nb[1]);
        ggml_build_forward_expand(gf, views[i]);
    }
    struct ggml_tensor *moe = views[0];
    for (int i = 1; i < N_USED; i++) moe = ggml_add(ctx, moe, views[i]);
    return ggml_add(ctx, moe, ffn_inp);
}

static void compute(struct ggml_cgraph *g, int threads, uint8_t **work, size_t *work_size) {
    struct ggml_cplan plan = ggml_graph_plan(g, threads, NULL);
    if (plan.work_size > *work_size) {
        *work = realloc(*work, plan.work_size);
        *work_size = plan.work_size;
    }
    plan.work_data = *work;
    ggml_graph_compute(g, &plan);
}

// Read bandwidth of `threads` threads over a buffer far larger than the caches, GB/s.
static double read_gbps(int threads) {
    const size_t n = (size_t) 1 << 28;
    uint64_t *buf = malloc(n * sizeof *buf);
    for (size_t i = 0; i < n; i++) buf[i] = i;
    double best = 0.0;
    for (int rep = 0; rep < 3; rep++) {
        uint64_t sum = 0;
        const double t0 = now_s();
#pragma omp parallel for num_threads(threads) reduction(+ : sum)
        for (size_t i = 0; i < n; i++) sum += buf[i];
        const double gbps = n * sizeof *buf / (now_s() - t0) / 1e9;
        if (sum == 42) printf(" ");
        best = gbps > best ? gbps : best;
    }
    free(buf);
    return best;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s fa|mat R LAYERS THREADS REPS\n", argv[0]);
        return 1;
    }
    const int fa = strcmp(argv[1], "fa") == 0, R = atoi(argv[2]), layers = atoi(argv[3]);
    const int threads = atoi(argv[4]), reps = atoi(argv[5]);
    struct ggml_init_params ip = {(size_t) 6 << 30, NULL, false};
    struct ggml_context *ctx = ggml_init(ip);
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, 8192, false);
    srand(1);

    // identical tokens: one hidden state repeated, at position USED in every stream
    struct ggml_tensor *x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, N_EMBD, R);
    for (int i = 0; i < N_EMBD; i++) {
        const float v = frand();
        for (int r = 0; r < R; r++) ((float *) x->data)[r * N_EMBD + i] = v;
    }
    struct ggml_tensor *pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, R);
    struct ggml_tensor *idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, R);
    for (int r = 0; r < R; r++) {
        ((int32_t *) pos->data)[r] = USED;
        ((int64_t *) idxs->data)[r] = (int64_t) r * KV_SIZE + USED;
    }
    // the f32 mask cast to f16 once a graph, a block a stream
    const int pad = GGML_PAD(1, GGML_KQ_MASK_PAD);
    struct ggml_tensor *mask32 = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, N_KV, pad, 1, R);
    for (int64_t i = 0; i < ggml_nelements(mask32); i++)
        ((float *) mask32->data)[i] = i % N_KV <= USED ? 0.0f : -INFINITY;
    struct ggml_tensor *mask = fa ? ggml_cast(ctx, mask32, GGML_TYPE_F16) : mask32;
    double bytes = 0.0;
    struct ggml_tensor *h = x;
    for (int l = 0; l < layers; l++) h = layer(ctx, gf, h, pos, idxs, mask, fa, R, &bytes);
    ggml_build_forward_expand(gf, h);

    uint8_t *work = NULL;
    size_t work_size = 0;
    for (int i = 0; i < 2; i++) compute(gf, threads, &work, &work_size);
    double best = 1e9;
    for (int i = 0; i < reps; i++) {
        const double t0 = now_s();
        compute(gf, threads, &work, &work_size);
        const double t = now_s() - t0;
        best = t < best ? t : best;
    }
    const int n = ggml_graph_n_nodes(gf);
    printf("%s R=%d layers=%d threads=%d nodes/layer=%.1f graph_us/layer=%.1f\n", fa ? "fa" : "mat", R, layers,
           threads, (double) n / layers, best * 1e6 / layers);

    // node by node: the best of REPS a node, summed by op
    struct ggml_cgraph **one = malloc(sizeof(*one) * n);
    for (int i = 0; i < n; i++) {
        one[i] = ggml_new_graph_custom(ctx, 1, false);
        ggml_graph_add_node(one[i], ggml_graph_node(gf, i));
    }
    double *node_best = malloc(sizeof(double) * n);
    for (int i = 0; i < n; i++) node_best[i] = 1e9;
    for (int rep = 0; rep < reps; rep++)
        for (int i = 0; i < n; i++) {
            const double t0 = now_s();
            compute(one[i], threads, &work, &work_size);
            const double t = now_s() - t0;
            node_best[i] = t < node_best[i] ? t : node_best[i];
        }
    const char *names[64];
    double sums[64];
    int counts[64], kinds = 0;
    double total = 0.0;
    for (int i = 0; i < n; i++) {
        const char *name = ggml_op_desc(ggml_graph_node(gf, i));
        int j = 0;
        while (j < kinds && strcmp(names[j], name) != 0) j++;
        if (j == kinds) {
            names[kinds] = name;
            sums[kinds] = 0.0;
            counts[kinds++] = 0;
        }
        sums[j] += node_best[i];
        counts[j]++;
        total += node_best[i];
    }
    for (int j = 0; j < kinds; j++)
        printf("  %-16s nodes/layer=%5.1f us/layer=%8.1f\n", names[j], (double) counts[j] / layers,
               sums[j] * 1e6 / layers);
    const double gbps = read_gbps(threads);
    printf("  node by node: us/layer=%.1f; a layer reads %.1f MB (weights touched + KV); plain read %.1f GB/s -> "
           "%.1f us\n",
           total * 1e6 / layers, bytes / layers / 1e6, gbps, bytes / layers / gbps / 1e3);
    return 0;
}
