#!/usr/bin/env python3
"""Splits each Figure 2 TTFT speed-up miss into its two sources, per (model, context) group.

The speed-up is baseline TTFT / pshard TTFT. The paper gives both absolutes elsewhere: the baseline's own runs
(baseline_ngl_5090.csv, PromptEvalTime_ms, mean of the trials at the same ubatch) and pshard's Table 4 (TTFT,
ubatch 1024, rounded to 0.1 s). Per group this prints our Figure 2 hits, the median error of our `ngl` and
`pshard` TTFT against those absolutes (ubatch 1024), and how far the paper's Figure 2 is from the ratio of its
own absolutes (1.00 = consistent).

    python3 scripts/figure2-ttft-sources.py [PAPER_DIR] [RUNS_CSV]
"""
import collections
import statistics
import sys

from figure2_sources import load

paper = sys.argv[1] if len(sys.argv) > 1 else "../shared/paper"
runs_csv = sys.argv[2] if len(sys.argv) > 2 else "results/paper/figure2/runs.csv"
base, _, table4, fig2, ours = load(paper, runs_csv, "PromptEvalTime_ms", "TTFT(msec)", "TTFTSpeedup", "ttft_ms")

groups = collections.defaultdict(lambda: collections.defaultdict(list))
for (m, c, b), paper_su in fig2.items():
    g = groups[(m, c)]
    sus = [ours[(m, c, b, ub, "ngl")] / ours[(m, c, b, ub, "pshard")] for ub in ("1024", "2048")
           if (m, c, b, ub, "ngl") in ours and (m, c, b, ub, "pshard") in ours]
    g["cells"].append(1)
    if sus and abs(max(sus) / paper_su - 1) <= 0.2:
        g["hits"].append(1)
    paper_base = base.get((m, c, b, "1024"))
    if paper_base and (m, c, b, "1024", "ngl") in ours:
        g["ngl"].append(ours[(m, c, b, "1024", "ngl")] / statistics.mean(paper_base) - 1)
    if (m, c, b) in table4 and (m, c, b, "1024", "pshard") in ours:
        g["pshard"].append(ours[(m, c, b, "1024", "pshard")] / table4[(m, c, b)] - 1)
    if paper_base and (m, c, b) in table4:
        g["consistency"].append(paper_su / (statistics.mean(paper_base) / table4[(m, c, b)]))


def med(v, pct=True):
    if not v:
        return "–"
    x = statistics.median(v)
    return f"{x:+.0%}" if pct else f"{x:.2f}"


print("| model | ctx | Figure 2 TTFT hits | our ngl vs baseline CSV | our pshard vs Table 4 | Figure 2 ÷ (CSV ÷ Table 4) |")
print("|---|---|---|---|---|---|")
for (m, c), g in groups.items():
    print(f"| {m} | {c} | {len(g['hits'])}/{len(g['cells'])} | {med(g['ngl'])} | {med(g['pshard'])} | "
          f"{med(g['consistency'], pct=False)} |")
