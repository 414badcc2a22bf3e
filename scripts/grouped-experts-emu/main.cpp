// Driver of the grouped-expert kernels emulation (run.sh): appended after kernels.cu's grouped section.
#include <thread>
#include <vector>
#include <cstdio>
#include <cstdint>
thread_local dim3 threadIdx, blockIdx; dim3 blockDim, gridDim;
std::barrier<>* warp_bar; float warp_xch[32];
// Runs a kernel warp by warp (32 threads, lockstep only at shuffles) over `warps` warps of 8-warp blocks.
template <class F> void launch(u64 warps, F f) {
    blockDim = {256, 1, 1};
    for (u64 w = 0; w < warps; ++w) {
        std::barrier<> bar(32); warp_bar = &bar;
        std::vector<std::thread> ts;
        for (int l = 0; l < 32; ++l) ts.emplace_back([&, l] {
            blockIdx = {(unsigned)(w / 8), 0, 0}; threadIdx = {(unsigned)((w % 8) * 32 + l), 0, 0}; f(); });
        for (auto& t : ts) t.join();
    }
}
static float rnd(uint32_t& s) { s = s * 1664525u + 1013904223u; return ((s >> 8) & 0xffff) / 32768.f - 1.f; }
static float bfr(float f) { return bf2f(f2bf(f)); }
typedef void (*GateUp)(const u64*, const u32*, const u32*, const act_t*, act_t*, u64, u64, int, int, int);
typedef void (*Down)(const u64*, const u32*, const u32*, const float*, const act_t*, float*, u64, int, int, int, int);

// A matrix of n rows of k elements in format F: bf16 values, or random quants whose f16 scales (and q4_K's
// mins) are set to small finite values; `at(row, i)` is its element, exact in f32.
template <int F> struct Mat {
    std::vector<u8> b; u64 row_bytes;
    Mat(int n, int k, uint32_t& s) : row_bytes(te_row_bytes<F>(k)) {
        b.resize(n * row_bytes);
        if (F == 0) { for (size_t i = 0; i < b.size() / 2; ++i) ((u16*)b.data())[i] = f2bf(rnd(s) * 0.1f); return; }
        for (auto& v : b) { s = s * 1664525u + 1013904223u; v = (u8)(s >> 24); }
        const int bb = (int)te_row_bytes<F>(F <= 2 ? 32 : QK_K);
        const int scales[4][2] = {{0, -1}, {0, -1}, {0, 2}, {208, -1}};  // f16 offsets in a block
        for (size_t o = 0; o < b.size(); o += bb)
            for (int j : scales[F - 1]) if (j >= 0) { const u16 d = 0x1800 + (u16)(rnd(s) * 512.f + 512.f); memcpy(&b[o + j], &d, 2); }
    }
    float at(int r, int i) const {
        const u8* row = b.data() + r * row_bytes;
        return F == 0 ? bf2f(((const u16*)row)[i]) : te_val<F>(row, (u64)i);
    }
};

template <int F> int run(const char* name, GateUp gate_up, Down down, int hidden, int ffn) {
    const int m = 3, E = 4;
    uint32_t s = 7;
    std::vector<std::vector<u8>> units(E);
    std::vector<Mat<F>> gates, ups, downs;
    for (int e = 0; e < E; ++e) { gates.emplace_back(ffn, hidden, s); ups.emplace_back(ffn, hidden, s); downs.emplace_back(hidden, ffn, s); }
    // A unit: gate, up, down back to back (quantised rows need no alignment: none but 2 bytes here).
    const u64 gate_off = 0, up_off = gates[0].b.size(), down_off = 2 * up_off;
    for (int e = 0; e < E; ++e) {
        units[e] = gates[e].b;
        units[e].insert(units[e].end(), ups[e].b.begin(), ups[e].b.end());
        units[e].insert(units[e].end(), downs[e].b.begin(), downs[e].b.end());
    }
    std::vector<u16> xn(m * hidden); for (auto& v : xn) v = f2bf(rnd(s));
    std::vector<float> h(m * hidden); for (auto& v : h) v = rnd(s);
    std::vector<float> h0 = h;
    // experts 0, 2, 3 picked: tokens {0, 2}, {1}, {0, 1, 2}
    std::vector<int> ex = {0, 2, 3};
    std::vector<std::vector<int>> toks = {{0, 2}, {1}, {0, 1, 2}};
    std::vector<u64> base; std::vector<u32> first = {0}, idx; std::vector<float> wts;
    for (size_t g = 0; g < ex.size(); ++g) {
        base.push_back((u64)(uintptr_t)units[ex[g]].data());
        for (int t : toks[g]) { idx.push_back(t); wts.push_back(0.3f + 0.1f * g + 0.01f * t); }
        first.push_back(idx.size());
    }
    const int groups = ex.size();
    std::vector<u16> act(idx.size() * ffn, 0xffff);
    launch((u64)groups * ffn, [&] { gate_up(base.data(), first.data(), idx.data(), xn.data(), act.data(), gate_off, up_off, hidden, ffn, groups); });
    launch(hidden, [&] { down(base.data(), first.data(), idx.data(), wts.data(), act.data(), h.data(), down_off, hidden, ffn, groups, m); });
    // Reference in double, with the same rounding of the SwiGLU row.
    std::vector<double> want(h0.begin(), h0.end());
    double num = 0, den = 0;
    for (int g = 0; g < groups; ++g) {
        const int e = ex[g];
        for (size_t i = 0; i < toks[g].size(); ++i) {
            int t = toks[g][i]; size_t p = first[g] + i;
            std::vector<float> a(ffn);
            for (int j = 0; j < ffn; ++j) {
                double gs = 0, us = 0;
                for (int k = 0; k < hidden; ++k) {
                    double x = bf2f(xn[t * hidden + k]);
                    gs += x * gates[e].at(j, k);
                    us += x * ups[e].at(j, k);
                }
                a[j] = bfr((float)(gs / (1 + std::exp(-gs)) * us));
                double d = std::fabs(a[j] - bf2f(act[p * ffn + j]));
                if (!(d <= 1e-2 * std::fabs(a[j]) + 1e-3)) { printf("%s: act mismatch g%d t%d j%d: %g vs %g\n", name, g, t, j, a[j], bf2f(act[p * ffn + j])); return 1; }
            }
            for (int j = 0; j < hidden; ++j) {
                double y = 0;
                for (int k = 0; k < ffn; ++k) y += (double)a[k] * downs[e].at(j, k);
                want[t * hidden + j] += wts[p] * y;
            }
        }
    }
    for (int i = 0; i < m * hidden; ++i) { num += (h[i] - want[i]) * (h[i] - want[i]); den += (want[i] - h0[i]) * (want[i] - h0[i]); }
    double rel = std::sqrt(num / den);
    printf("grouped emulation, %s (hidden %d, ffn %d): %d experts, %d entries, rel err of the residual's change %.2e\n",
           name, hidden, ffn, groups, (int)idx.size(), rel);
    return rel < 1e-3 ? 0 : 1;
}

int main() {
    int bad = 0;
    bad |= run<0>("bf16", moe_gate_up_grouped, moe_down_grouped, 512, 264);  // ffn not a multiple of 256: tails
    bad |= run<1>("q8_0", moe_gate_up_grouped_q8_0, moe_down_grouped_q8_0, 512, 160);
    bad |= run<2>("q4_0", moe_gate_up_grouped_q4_0, moe_down_grouped_q4_0, 512, 160);
    bad |= run<3>("q4_k", moe_gate_up_grouped_q4_k, moe_down_grouped_q4_k, 512, 512);  // two super-blocks a row
    bad |= run<4>("q6_k", moe_gate_up_grouped_q6_k, moe_down_grouped_q6_k, 512, 512);
    return bad;
}
