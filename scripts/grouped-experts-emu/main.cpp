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
int main() {
    const int hidden = 512, ffn = 264, m = 3, E = 4;  // hidden > 256 and ffn not a multiple of 256: tails
    uint32_t s = 7;
    std::vector<std::vector<u16>> units(E);
    const u64 gate_off = 0, up_off = (u64)ffn * hidden * 2, down_off = 2 * up_off;
    for (auto& u : units) { u.resize(3 * (size_t)ffn * hidden); for (auto& v : u) v = f2bf(rnd(s) * 0.1f); }
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
    launch((u64)groups * ffn, [&] { moe_gate_up_grouped(base.data(), first.data(), idx.data(), xn.data(), act.data(), gate_off, up_off, hidden, ffn, groups); });
    launch(hidden, [&] { moe_down_grouped(base.data(), first.data(), idx.data(), wts.data(), act.data(), h.data(), down_off, hidden, ffn, groups, m); });
    // Reference in double, with the same rounding of the SwiGLU row.
    std::vector<double> want(h0.begin(), h0.end());
    double num = 0, den = 0;
    for (int g = 0; g < groups; ++g) {
        const u16* w = units[ex[g]].data();
        for (size_t i = 0; i < toks[g].size(); ++i) {
            int t = toks[g][i]; size_t p = first[g] + i;
            std::vector<float> a(ffn);
            for (int j = 0; j < ffn; ++j) {
                double gs = 0, us = 0;
                for (int k = 0; k < hidden; ++k) {
                    double x = bf2f(xn[t * hidden + k]);
                    gs += x * bf2f(w[gate_off / 2 + (size_t)j * hidden + k]);
                    us += x * bf2f(w[up_off / 2 + (size_t)j * hidden + k]);
                }
                a[j] = bfr((float)(gs / (1 + std::exp(-gs)) * us));
                double d = std::fabs(a[j] - bf2f(act[p * ffn + j]));
                if (!(d <= 1e-2 * std::fabs(a[j]) + 1e-3)) { printf("act mismatch g%d t%d j%d: %g vs %g\n", g, t, j, a[j], bf2f(act[p * ffn + j])); return 1; }
            }
            for (int j = 0; j < hidden; ++j) {
                double y = 0;
                for (int k = 0; k < ffn; ++k) y += (double)a[k] * bf2f(w[down_off / 2 + (size_t)j * ffn + k]);
                want[t * hidden + j] += wts[p] * y;
            }
        }
    }
    for (int i = 0; i < m * hidden; ++i) { num += (h[i] - want[i]) * (h[i] - want[i]); den += (want[i] - h0[i]) * (want[i] - h0[i]); }
    double rel = std::sqrt(num / den);
    printf("grouped emulation: %d experts, %d entries, rel err of the residual's change %.2e\n", groups, (int)idx.size(), rel);
    return rel < 1e-3 ? 0 : 1;
}
