#!/usr/bin/env python3
"""Writes a variant of a model's config.yaml for the benchmarks (standard library only):

    config_variant.py SRC DST [--no-batching] [--device D] [--precision P] [--threads N]

--no-batching drops the top-level dynamic_batching block (the key and its indented lines);
the others replace the instance's field of that name. Exits 1 when a change found nothing
to change, so a benchmark never runs on a config it did not mean to.
"""
import argparse
import re
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--no-batching", action="store_true")
    ap.add_argument("--device")
    ap.add_argument("--precision")
    ap.add_argument("--threads")
    args = ap.parse_args()
    fields = {k: v for k, v in (("device", args.device), ("precision", args.precision),
                                ("threads", args.threads)) if v is not None}
    out, skip, dropped, replaced = [], False, False, set()
    for line in open(args.src).read().splitlines():
        if args.no_batching and line.startswith("dynamic_batching:"):
            skip = dropped = True
            continue
        if skip and line[:1] in (" ", "\t"):
            continue
        skip = False
        for key, value in fields.items():
            if re.match(rf"^  {key}: ", line):
                line = f"  {key}: {value}"
                replaced.add(key)
        out.append(line)
    missing = [k for k in fields if k not in replaced]
    if (args.no_batching and not dropped) or missing:
        print(f"{args.src}: nothing to change for "
              f"{'dynamic_batching ' if args.no_batching and not dropped else ''}{' '.join(missing)}",
              file=sys.stderr)
        return 1
    open(args.dst, "w").write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
