#!/usr/bin/env python3
"""Checks kiln's served bge_m3 embeddings against an fp32 reference on fresh random inputs.

The reference is the same weights (the fp16 values, upcast) run eagerly in fp32 on the GPU,
with TF32 off. Requests go to kiln-runtime's REST endpoint (OIP v2 JSON), with random lengths
that land in different sequence buckets, some batched, some with padding inside the request.

Tolerance: every embedding's cosine similarity to the reference >= 0.999 and the relative L2
error of the whole set <= 1e-2 (fp16 weights and activations through 24 layers).

    python3 bench/gpu/check_bge_m3.py --repo /tmp/gpu-models --http 127.0.0.1:8000
"""
import argparse
import json
import os
import sys
import time
import urllib.request

import torch

sys.path.insert(0, os.path.dirname(__file__))
from make_bge_m3 import DenseEmbedding, build_model, random_inputs  # noqa: E402


def infer(http, ids, mask):
    body = {
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape),
             "data": ids.flatten().tolist()},
            {"name": "attention_mask", "datatype": "INT64", "shape": list(mask.shape),
             "data": mask.flatten().tolist()},
        ]
    }
    req = urllib.request.Request(f"http://{http}/v2/models/bge_m3/infer",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    o = out["outputs"][0]
    return torch.tensor(o["data"], dtype=torch.float32).reshape(o["shape"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--http", required=True)
    ap.add_argument("--seed", type=int, default=int(time.time()))
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda:0")
    model = build_model(20261122, "cuda:0")
    state = torch.load(os.path.join(args.repo, "bge_m3", "weights_fp16.pt"), map_location="cpu")
    model.load_state_dict({k: v.float() for k, v in state.items()})
    ref_model = DenseEmbedding(model.float().to(dev)).eval()
    gen = torch.Generator().manual_seed(args.seed)
    cases = [(1, 5), (1, 33), (1, 128), (1, 500), (3, 77), (4, 512), (2, 1500), (1, 4096),
             (8, 100), (1, 8000)]
    got, want = [], []
    worst = 1.0
    for rows, length in cases:
        ids, mask = random_inputs(rows, length, gen, "cpu")
        served = infer(args.http, ids, mask)
        with torch.inference_mode():
            ref = ref_model(ids.to(dev), mask.to(dev)).cpu()
        if served.shape != ref.shape:
            raise SystemExit(f"{rows}x{length}: shape {list(served.shape)} != {list(ref.shape)}")
        if not torch.isfinite(served).all():
            raise SystemExit(f"{rows}x{length}: non-finite output")
        cos = torch.nn.functional.cosine_similarity(served, ref, dim=-1)
        worst = min(worst, cos.min().item())
        print(f"  {rows}x{length}: min cosine {cos.min().item():.6f}, "
              f"max abs err {(served - ref).abs().max().item():.2e}")
        got.append(served)
        want.append(ref)
    g, w = torch.cat(got), torch.cat(want)
    rel = ((g - w).norm() / w.norm()).item()
    ok = worst >= 0.999 and rel <= 1e-2
    print(f"check: {len(cases)} requests ({g.shape[0]} sequences), seed {args.seed}: "
          f"min cosine {worst:.6f}, relative L2 error {rel:.2e} -> {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
