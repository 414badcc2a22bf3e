#!/usr/bin/env python3
"""Compare pipeshard-exec logits with PyTorch/transformers on the same weights.

For each model folder written by the GPU test (PIPESHARD_HF_DIR/<model>/: config.json, model.safetensors,
run.json, logits_gpu.f32, logits_cpu.f32), build the transformers model from config.json in float32, load the
weights (upcast exactly from bf16/f16), run the whole sequence (prompt + generated tokens) with eager attention,
and compare the logits at the prompt's last position and every decode step: rel err = ||ours - hf|| / ||hf||.
Exit status 1 if any rel err >= 1e-2.  Usage: hf_compare.py DIR
"""
import json
import pathlib
import re
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import load_file


def fuse_experts(state, model_keys):
    """Our export keeps one module per expert (mlp.experts.E.{gate,up,down}_proj.weight, the classic checkpoint
    layout). transformers >= 5 keeps a layer's experts as 3-D tensors: experts.gate_up_proj [E, 2F, H] (gate rows
    first) and experts.down_proj [E, H, F]. Stack ours into that form when the model has it."""
    if not any(k.endswith("mlp.experts.gate_up_proj") for k in model_keys):
        return state
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    layers = sorted({int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.\d+\.", k))})
    for layer in layers:
        p = f"model.layers.{layer}.mlp.experts"
        n = sum(1 for k in state if k.startswith(p + ".") and k.endswith(".gate_proj.weight"))
        stack = lambda proj: torch.stack([state[f"{p}.{e}.{proj}.weight"] for e in range(n)])
        out[f"{p}.gate_up_proj"] = torch.cat([stack("gate_proj"), stack("up_proj")], dim=1)
        out[f"{p}.down_proj"] = stack("down_proj")
    return out


def main(root):
    worst = 0.0
    rows = []
    for d in sorted(p for p in pathlib.Path(root).iterdir() if (p / "run.json").exists()):
        run = json.loads((d / "run.json").read_text())
        cfg_json = json.loads((d / "config.json").read_text())
        cfg = transformers.AutoConfig.for_model(**cfg_json)
        if hasattr(cfg, "rope_parameters") and cfg.rope_parameters is not None:
            cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg_json["rope_theta"]}
            if "partial_rotary_factor" in cfg_json:
                cfg.rope_parameters["partial_rotary_factor"] = cfg_json["partial_rotary_factor"]
        cfg._attn_implementation = "eager"
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        state = {k: v.to(torch.float32) for k, v in load_file(str(d / "model.safetensors"), device="cuda").items()}
        state = fuse_experts(state, model.state_dict().keys())
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if "rotary" not in m]
        if missing or unexpected:
            raise SystemExit(f"{d.name}: missing {missing} unexpected {unexpected}")
        model.eval()
        ids = torch.tensor([run["input_ids"]], device="cuda")
        with torch.no_grad():
            hf = model(ids).logits[0].double().cpu().numpy()
        p, steps, vocab = run["prompt_tokens"], run["steps"], run["vocab"]
        ref = hf[p - 1 : p - 1 + steps]
        for name in ("gpu", "cpu"):
            ours = np.fromfile(d / f"logits_{name}.f32", dtype="<f4").reshape(steps, vocab).astype(np.float64)
            errs = np.linalg.norm(ours - ref, axis=1) / np.linalg.norm(ref, axis=1)
            agree = int((ours.argmax(1) == ref.argmax(1)).sum())
            worst = max(worst, float(errs.max()))
            rows.append((d.name, name, float(errs.max()), float(errs.mean()), f"{agree}/{steps}"))
        del model, state
        torch.cuda.empty_cache()
    print(f"{'model':<22} {'path':<5} {'max_rel_err':>12} {'mean_rel_err':>13} {'argmax':>7}   (transformers {transformers.__version__}, torch {torch.__version__})")
    for r in rows:
        print(f"{r[0]:<22} {r[1]:<5} {r[2]:>12.3e} {r[3]:>13.3e} {r[4]:>7}")
    print(f"worst rel err {worst:.3e}: {'PASS' if worst < 1e-2 else 'FAIL'} (threshold 1e-2)")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
