#!/usr/bin/env python3
"""What scaled_dot_product_attention alone costs for the bge-m3 geometry (16 heads of 64, fp16)
with no mask and with the masks a padded batch can carry, at 512 and 4096 tokens, batch 1,
LibTorch's default kernel choice. One call at a time, CUDA-event medians of 30 (launch
included, so the 512-token figures are launch-bound). Then the call the traced model makes,
from its graph (what mask it hands SDPA).

    python3 bench/gpu/sdpa_masks.py [--model /tmp/gpu-models/bge_m3/1/model.pt]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from pytorch_anchors import time_ms  # noqa: E402


def t(fn):
    return time_ms(fn, 30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/gpu-models/bge_m3/1/model.pt")
    args = ap.parse_args()
    dev = "cuda:0"
    for L in (512, 4096):
        q, k, v = [torch.randn(1, 16, L, 64, device=dev, dtype=torch.half) for _ in range(3)]
        bm = torch.ones(1, 1, L, L, device=dev, dtype=torch.bool)
        fm = torch.zeros(1, 1, L, L, device=dev, dtype=torch.half)
        km = torch.zeros(1, 1, 1, L, device=dev, dtype=torch.half)
        with torch.inference_mode():
            r = {}
            r["none"] = t(lambda: F.scaled_dot_product_attention(q, k, v))
            r["bool_qk"] = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bm))
            r["float_qk"] = t(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=fm))
            r["float_1k_bcast"] = t(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=km.expand(1, 1, L, L)))
            r["float_qk_per_head"] = t(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=fm.expand(1, 16, L, L)))
        print(L, {name: round(x, 4) for name, x in r.items()}, "x24 layers none/bool:",
              round(24 * r["none"], 2), round(24 * r["bool_qk"], 2), flush=True)
    m = torch.jit.load(args.model, map_location=dev)
    g = m.inlined_graph if hasattr(m, "inlined_graph") else m.graph
    for n in g.nodes():
        if "scaled_dot_product" in n.kind():
            print(n)
            break


if __name__ == "__main__":
    main()
