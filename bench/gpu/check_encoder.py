#!/usr/bin/env python3
"""Sends every reference input of the demo encoder to a running kiln-runtime over REST and
compares the embeddings with the reference outputs (made on the CPU in FP32 by
scripts/make_models.py). Prints the largest absolute difference; exits 1 above --tol.
Standard library only.

    check_encoder.py --http 127.0.0.1:18000 --reference MODELS/encoder/reference/v2.json --tol 1e-4
"""
import argparse
import json
import sys
import urllib.request


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--model", default="encoder")
    ap.add_argument("--version", default="2")
    ap.add_argument("--tol", type=float, required=True)
    args = ap.parse_args()
    cases = json.load(open(args.reference))
    worst = 0.0
    for case in cases:
        ids, mask = case["input_ids"], case["attention_mask"]
        shape = [len(ids), len(ids[0])]
        body = {"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": shape,
             "data": [v for row in ids for v in row]},
            {"name": "attention_mask", "datatype": "INT64", "shape": shape,
             "data": [v for row in mask for v in row]}]}
        req = urllib.request.Request(
            f"http://{args.http}/v2/models/{args.model}/versions/{args.version}/infer",
            data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            out = json.load(resp)["outputs"][0]["data"]
        want = [v for row in case["embedding"] for v in row]
        if len(out) != len(want):
            print(f"case with shape {shape}: {len(out)} values, want {len(want)}")
            return 1
        worst = max(worst, max(abs(a - b) for a, b in zip(out, want)))
    ok = worst <= args.tol
    print(f"{len(cases)} cases: max abs difference {worst:.3g} (tolerance {args.tol:g}): "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
