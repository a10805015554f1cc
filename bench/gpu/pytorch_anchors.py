#!/usr/bin/env python3
"""Re-measures the PyTorch paths kiln's GPU numbers are compared with, in the same run.

In-process, no serving: batch 1 at 512 and 4096 tokens for eager fp16, TorchScript frozen
fp16 (the same traced file kiln serves), torch.compile (default mode) and a CUDA graph of
eager; and eager fp16 throughput at 128 tokens for batch 1, 32 and 128. Times are CUDA-event
medians over --iters runs after warm-up; inputs are random token ids with an all-ones mask.
Also times a cold Python process loading the TorchScript file and serving one request.

    python3 bench/gpu/pytorch_anchors.py --repo /tmp/gpu-models [--compile] --json out.json
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_bge_m3 import DenseEmbedding, build_model  # noqa: E402


def time_ms(fn, iters, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


COLD = r"""
import sys, time, torch
t0 = time.time()
m = torch.jit.load(sys.argv[1], map_location="cuda:0")
ids = torch.randint(5, 250000, (1, 128), device="cuda:0")
mask = torch.ones_like(ids)
with torch.inference_mode():
    y = m(ids, mask)
    y.cpu()
print(time.time() - t0)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    results = {}
    model_file = os.path.join(args.repo, "bge_m3", "1", "model.pt")

    t = time.time()
    out = subprocess.run([sys.executable, "-c", COLD, model_file], capture_output=True, text=True,
                         timeout=300)
    results["python_cold_first_response_s"] = float(out.stdout.strip().splitlines()[-1])
    results["python_cold_process_wall_s"] = time.time() - t

    model = build_model(20261122, "cuda:0")
    state = torch.load(os.path.join(args.repo, "bge_m3", "weights_fp16.pt"), map_location="cpu")
    model.load_state_dict(state)
    eager = DenseEmbedding(model.half().to(dev)).eval()
    scripted = torch.jit.freeze(torch.jit.load(model_file, map_location=dev).eval())
    compiled = torch.compile(eager) if args.compile else None

    def inputs(rows, length):
        ids = torch.randint(5, 250000, (rows, length), device=dev)
        return ids, torch.ones_like(ids)

    with torch.inference_mode():
        for length in (512, 4096):
            ids, mask = inputs(1, length)
            row = {}
            row["eager_fp16"] = time_ms(lambda: eager(ids, mask), args.iters)
            row["torchscript_frozen_fp16"] = time_ms(lambda: scripted(ids, mask), args.iters,
                                                     warmup=10)
            if compiled is not None:
                t = time.time()
                compiled(ids, mask)
                row["torch_compile_first_call_s"] = time.time() - t
                row["torch_compile"] = time_ms(lambda: compiled(ids, mask), args.iters)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    eager(ids, mask)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static_out = eager(ids, mask)
            row["cuda_graph_eager_fp16"] = time_ms(lambda: g.replay(), args.iters)
            del g, static_out
            results[f"batch1_len{length}_ms"] = row
            print(f"batch 1 x {length}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                  flush=True)
        tput = {}
        for rows in (1, 32, 128):
            ids, mask = inputs(rows, 128)
            ms = time_ms(lambda: eager(ids, mask), max(10, args.iters // 2))
            tput[f"batch{rows}"] = rows / (ms / 1000.0)
        results["eager_fp16_len128_seq_per_s"] = tput
        print("eager fp16 at 128 tokens, seq/s: " +
              ", ".join(f"{k} {v:.0f}" for k, v in tput.items()), flush=True)
    print(f"python cold load + first response: {results['python_cold_first_response_s']:.2f} s "
          f"(process wall {results['python_cold_process_wall_s']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
