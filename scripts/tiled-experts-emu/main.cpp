// Driver of the loader check (run.sh): appended after kernels.cu's dequantisers and tiled helpers.
#include <cstdio>
template <int F> static int check(const char* name, int row_bytes) {
    const int k = 512;  // two K-quant super-blocks, sixteen q8_0/q4_0 blocks
    uint32_t seed = 12345u + F;
    int bad = 0;
    for (int trial = 0; trial < 2000; ++trial) {
        alignas(16) u8 row[1024 + 16];
        for (int i = 0; i < row_bytes; ++i) { seed = seed * 1664525u + 1013904223u; row[i] = (u8)(seed >> 24); }
        for (int i0 = 0; i0 < k; i0 += 8) {
            alignas(16) u16 got[8];
            te_load_w8<F>(row, (u64)i0, got);
            for (int j = 0; j < 8; ++j) {
                const u16 want = ACT_STORE(te_val<F>(row, (u64)(i0 + j)));
                if (got[j] != want && bad++ < 5)
                    printf("%s: element %d: loader %04x, per element %04x\n", name, i0 + j, got[j], want);
            }
        }
    }
    printf("%s (%s activations): %s\n", name, ACT_BF16 ? "bf16" : "f16", bad ? "MISMATCH" : "bit-identical");
    return bad;
}
int main() {
    int bad = check<1>("q8_0", 16 * 34) + check<2>("q4_0", 16 * 18) + check<3>("q4_K", 2 * 144) +
              check<4>("q6_K", 2 * 210);
    return bad ? 1 : 0;
}
