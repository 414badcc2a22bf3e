// g++ -O2 -o /tmp/walk scripts/artifact-kv-walk.cpp && for r in 4 16 64; do /tmp/walk $r 889 64; done
// Times the artifact's unified-KV upload bookkeeping (llama-pipeline-executor.cpp
// pipeline_upload_kv_cells_for_seqs + llama-kv-cells.h get_cells_for_seq + cells_upload's sort/ranges)
// for R sequences of `per_seq` used cells each, laid out as llama-batched-bench fills a unified cache.
#include <algorithm>
#include <bitset>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>
int main(int argc, char** argv) {
  int R = atoi(argv[1]), pp = atoi(argv[2]), tg = atoi(argv[3]);
  size_t size = (size_t)R * 1024;
  std::vector<std::bitset<64>> seq(size);
  std::set<uint32_t> used;
  uint32_t c = 0;
  for (int j = 0; j < R; j++) for (int i = 0; i < pp; i++) { seq[c].set(j); used.insert(c); c++; }
  for (int i = 0; i < tg; i++) for (int j = 0; j < R; j++) { seq[c].set(j); used.insert(c); c++; }
  size_t ranges_total = 0;
  int reps = 20;
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; r++) {
    std::vector<uint32_t> all;
    for (int s = 0; s < R; s++) {
      std::vector<uint32_t> res; res.reserve(used.size());
      for (uint32_t i : used) if (seq[i].test(s)) res.push_back(i);
      all.insert(all.end(), res.begin(), res.end());
    }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    std::vector<uint32_t> sorted = all; std::sort(sorted.begin(), sorted.end());
    size_t n = 1; for (size_t i = 1; i < sorted.size(); i++) if (sorted[i] != sorted[i-1] + 1) n++;
    ranges_total += n;
  }
  double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  printf("R=%d used=%zu: %.2f ms per layer upload, %.2f ns per visited cell (R x used), ranges %zu\n", R, used.size(), ns / 1e6, ns / ((double)R * used.size()), ranges_total / reps);
}
