"""What scripts/figure2-ttft-sources.py and figure2-tps-sources.py both read: the paper's baseline CSV, its
Table 4 and Figure 2 for one metric, and our simulated runs (`repro figure2`'s runs.csv), keyed alike by
(model, context, budget[, ubatch[, planner]])."""
import collections
import csv

ALIAS = {"minitron-4b": "nemo-4b", "minitron-8b": "nemo-8b", "qwen3-30b": "qwen3-30b-a3b",
         "qwen3-235b": "qwen3-235b-a22b", "qwen-30b": "qwen3-30b-a3b", "qwen-235b": "qwen3-235b-a22b"}
CTX = {"1024": "1K", "4096": "4K", "16384": "16K", "65536": "64K"}


def name(m):
    return ALIAS.get(m, m)


def load(paper, runs_csv, baseline_col, table4_col, figure2_col, ours_col):
    """(baseline trials per (model, ctx, budget, ubatch), the baseline's NGL per that key, Table 4 per
    (model, ctx, budget), Figure 2 per (model, ctx, budget), ours per (model, ctx, budget, ubatch, planner))."""
    base = collections.defaultdict(list)
    base_ngl = {}
    for r in csv.DictReader(open(f"{paper}/baseline_ngl_5090.csv")):
        if r["Status"] == "SUCCESS":
            key = (name(r["Model"]), CTX[r["Context"]], f"{int(r['MVA']) // 1000}G", r["Ubatch"])
            base[key].append(float(r[baseline_col]))
            base_ngl[key] = r["NGL"]
    table4 = {(name(r["Model"]), r["CtxSize"], r["Vram"]): float(r[table4_col])
              for r in csv.DictReader(open(f"{paper}/table4.csv"))}
    fig2 = {(name(r["Model"]), r["CtxK"], r["VramBudget"]): float(r[figure2_col])
            for r in csv.DictReader(open(f"{paper}/figure2.csv"))}
    ours = {}
    for r in csv.DictReader(open(runs_csv)):
        if r["status"] == "ok":
            key = (name(r["model"]), CTX[r["ctx"]], f"{int(r['vram_budget_bytes']) >> 30}G", r["ubatch"],
                   r["planner"])
            ours[key] = float(r[ours_col])
    return base, base_ngl, table4, fig2, ours
