// g++ -O2 -o /tmp/mmid scripts/artifact-mmid-sort.cpp && for t in 1024 64 16 4; do /tmp/mmid 128 $t 8; done
// Times the host-side bookkeeping of a CUDA `mul_mat_id` over several tokens in llama.cpp b6097 (the artifact's
// ggml/src/ggml-cuda/mmq.cu, ggml_cuda_mul_mat_q with ids): after copying the routing to the host and syncing,
// it finds, for each expert, each token's slot holding that expert by scanning the token's used experts, and
// builds the gather/scatter index lists and expert bounds it copies back. Our own replica of that loop nest,
// with random top-k routing (distinct experts per token).
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
int main(int argc, char** argv) {
  int E = atoi(argv[1]), T = atoi(argv[2]), K = atoi(argv[3]);
  std::mt19937 rng(7);
  std::vector<int32_t> ids((size_t)T * K);
  for (int t = 0; t < T; t++) {
    std::vector<int> perm(E);
    for (int e = 0; e < E; e++) perm[e] = e;
    for (int j = 0; j < K; j++) { std::swap(perm[j], perm[j + rng() % (E - j)]); ids[(size_t)t * K + j] = perm[j]; }
  }
  int reps = T >= 256 ? 50 : 2000;
  size_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; r++) {
    std::vector<int32_t> src, dst, per_expert(E), bounds(E + 1);
    src.reserve((size_t)T * K); dst.reserve((size_t)T * K);
    const int32_t* v = ids.data();
    for (int e = 0; e < E; e++)
      for (int t = 0; t < T; t++)
        for (int j = 0; j < K; j++)
          if (v[(size_t)t * K + j] == e) { src.push_back(t * K + j % K); dst.push_back(t * K + j); per_expert[e]++; break; }
    int32_t sum = 0;
    for (int e = 0; e < E; e++) { bounds[e] = sum; sum += per_expert[e]; }
    bounds[E] = sum;
    sink += src.size() + dst[0] + bounds[E];
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  printf("E=%d T=%d K=%d: %.1f us per mul_mat_id, %.3f ns per (expert, token) pair (sink %zu)\n", E, T, K, ns / 1e3,
         ns / ((double)E * T), sink);
}
