#!/usr/bin/env python3
"""Which attention kernel the traced bge-m3-shaped encoder runs, and what each choice costs.

In-process, no serving. The TorchScript file kiln serves, run as kiln runs it (not frozen,
TorchScript's optimiser off), CUDA-graphed per shape as kiln captures it (all-ones mask of the
bucket's length), timed by CUDA events (median of --iters replays). For each set of allowed
scaled_dot_product_attention kernels (the switches `instance.attention` sets in kiln):

- the kernels the profiler sees for one batch 1 x 512 forward (which kernel LibTorch picked);
- batch 1 at 512 and 4096 tokens, and batch 128 x 128 tokens (as seq/s);
- the largest difference from the `math` set's output on padded inputs (3 rows of 300 tokens
  with random padding): a kernel that mishandles the mask shows here.

What attention alone costs with and without the mask: bench/gpu/sdpa_masks.py.

    python3 bench/gpu/attention_study.py --repo /tmp/gpu-models --json out.json
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_bge_m3 import random_inputs  # noqa: E402
from pytorch_anchors import time_ms  # noqa: E402

SETS = {
    "default": None,
    "cudnn": ["cudnn"],
    "efficient": ["efficient"],
    "flash": ["flash"],
    "math": ["math"],
}
KERNEL_WORDS = ("fmha", "flash", "attn", "attention", "cudnn", "sdpa", "softmax")


def allow(kernels):
    names = kernels or ["cudnn", "flash", "efficient", "math"]
    torch.backends.cuda.enable_cudnn_sdp("cudnn" in names)
    torch.backends.cuda.enable_flash_sdp("flash" in names)
    torch.backends.cuda.enable_mem_efficient_sdp("efficient" in names)
    torch.backends.cuda.enable_math_sdp("math" in names)


def graph_ms(fn, args, iters):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    ms = time_ms(g.replay, iters, warmup=1)
    del g, out
    return ms


def attention_kernels(fn, args):
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    found = {}
    for e in prof.key_averages():
        name = e.key
        if any(w in name.lower() for w in KERNEL_WORDS):
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            found[name[:120]] = round(t / 1000.0, 3)
    return dict(sorted(found.items(), key=lambda kv: -kv[1])[:4])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    model_file = os.path.join(args.repo, "bge_m3", "1", "model.pt")
    torch._C._set_graph_executor_optimize(False)
    traced = torch.jit.load(model_file, map_location=dev).eval()
    gen = torch.Generator().manual_seed(7)
    padded = random_inputs(3, 300, gen, dev)

    def ones(rows, length):
        ids = torch.randint(5, 250000, (rows, length), device=dev)
        return ids, torch.ones_like(ids)

    shapes = {"b1_512": ones(1, 512), "b1_4096": ones(1, 4096), "b128_128": ones(128, 128)}
    results = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
               "device": torch.cuda.get_device_name(0), "sets": {}}
    print(f"torch {results['torch']}, cudnn {results['cudnn']}, {results['device']}", flush=True)
    reference = None
    with torch.inference_mode():
        allow(["math"])
        reference = traced(*padded).float()
        for name, kernels in SETS.items():
            allow(kernels)
            row = {}
            try:
                row["kernels_b1_512"] = attention_kernels(traced, shapes["b1_512"])
                row["max_err_vs_math_padded"] = (traced(*padded).float() - reference).abs().max().item()
                for sname, inp in shapes.items():
                    ms = graph_ms(traced, inp, args.iters)
                    row[sname + "_ms"] = round(ms, 3)
                row["b128_128_seq_per_s"] = round(128 / (row["b128_128_ms"] / 1000.0))
            except Exception as e:  # a set no kernel of which takes the mask
                row["error"] = str(e).splitlines()[0][:300]
            results["sets"][name] = row
            print(f"{name}: {json.dumps(row)}", flush=True)
        allow(None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
