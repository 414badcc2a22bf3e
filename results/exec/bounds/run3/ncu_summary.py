"""Per-layer kernel times of fused one-token decode from ncu-decode-kernels.csv (ncu --csv, gpu__time_duration).

Usage: python3 ncu_summary.py > ncu-summary.md. A layer starts at the attention's norm_act (the norm_act that
is followed by the q|k|v GEMM); only whole layers are counted.
"""
import csv
import statistics
from collections import defaultdict

rows = list(csv.reader(open("ncu-decode-kernels.csv")))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
h = rows[head]
ki, vi = h.index("Kernel Name"), h.index("Metric Value")
ks = [(r[ki], float(r[vi].replace(",", "")) / 1e3) for r in rows[head + 1 :]]

# Role of each kernel in a decode layer, in launch order.
ROLES = ["attn norm_act", "q+k+v GEMM (6144×4096)", "rope q", "rope k", "store_kv", "attention",
         "attn_combine", "o GEMM (4096×4096, accumulate)", "o splitK reduce", "ffn norm_act",
         "gate+up GEMM (23040×4096)", "swiglu", "down GEMM (4096×11520, accumulate)", "down splitK reduce"]
MB = {1: 6144 * 4096 * 2e-6, 7: 4096 * 4096 * 2e-6, 10: 23040 * 4096 * 2e-6, 12: 4096 * 11520 * 2e-6}
starts = [i for i in range(len(ks) - 1) if ks[i][0] == "norm_act" and ks[i + 1][0].startswith("nvjet")
          and "64x16" in ks[i + 1][0]]
per = defaultdict(list)
layers = 0
for s in starts:
    seg = ks[s : s + len(ROLES)]
    if len(seg) < len(ROLES):
        break
    layers += 1
    for role, (_, us) in zip(ROLES, seg):
        per[role].append(us)
print(f"{layers} whole decode layers of nemo-8b (bf16, all pinned, one sequence, 16-token prompt), median µs a kernel\n")
print("| kernel | µs | weight MB | TB/s |")
print("| --- | ---: | ---: | ---: |")
total = 0.0
for i, role in enumerate(ROLES):
    us = statistics.median(per[role])
    total += us
    mb = MB.get(i)
    print(f"| {role} | {us:.1f} | {mb:.0f} | {mb / us:.2f} |" if mb else f"| {role} | {us:.1f} | | |")
print(f"| **layer total** | **{total:.1f}** | 363 | {363 / total:.2f} |")
