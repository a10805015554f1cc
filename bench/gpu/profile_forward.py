#!/usr/bin/env python3
"""Where the GPU time of one forward of the traced bge-m3-shaped encoder goes.

The TorchScript file kiln serves, run as kiln runs it (not frozen, optimiser off), all-ones
mask. For batch 1 x 512, batch 1 x 4096 and batch 128 x 128: the kernels of one forward
(after warm-up) by total device time, with their count, and the share of the forward each
kind of kernel takes (GEMM, attention, layer norm, elementwise, other).

    python3 bench/gpu/profile_forward.py --repo /tmp/gpu-models
"""
import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

KINDS = (
    ("attention", ("fmha", "flash", "sdpa", "attention")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet")),
    ("layer_norm", ("layer_norm", "layernorm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "gelu", "reduce")),
)


def kind_of(name):
    low = name.lower()
    for kind, words in KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    torch._C._set_graph_executor_optimize(False)
    model = torch.jit.load(os.path.join(args.repo, "bge_m3", "1", "model.pt"), map_location=dev)
    with torch.inference_mode():
        for rows, length in ((1, 512), (1, 4096), (128, 128)):
            ids = torch.randint(5, 250000, (rows, length), device=dev)
            mask = torch.ones_like(ids)
            for _ in range(5):
                model(ids, mask)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model(ids, mask)
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages()
                      if (getattr(e, "device_time_total", 0) or 0) > 0 and e.count > 0]
            total = sum(e.device_time_total for e in events if not e.key.startswith("aten::"))
            by_kind = {}
            kernels = [e for e in events if not e.key.startswith("aten::")]
            for e in kernels:
                k = kind_of(e.key)
                by_kind[k] = by_kind.get(k, 0) + e.device_time_total
            print(f"== batch {rows} x {length}: {len(kernels)} kernel names, "
                  f"{sum(e.count for e in kernels)} launches, {total / 1000:.2f} ms of kernels")
            print("   " + ", ".join(f"{k} {v / 1000:.2f} ms ({100 * v / total:.0f}%)"
                                   for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
            for e in sorted(kernels, key=lambda e: -e.device_time_total)[:args.top]:
                print(f"   {e.device_time_total / 1000:7.3f} ms x{e.count:4d}  {e.key[:110]}")


if __name__ == "__main__":
    main()
