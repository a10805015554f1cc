#!/usr/bin/env python3
"""Builds the bge-m3-shaped encoder for the GPU benchmark and traces it to TorchScript.

XLM-R large geometry (24 layers, hidden 1024, 16 heads, FFN 4096, vocab 250002, 8194
positions) with random weights from a fixed seed: nothing is downloaded. Writes a kiln model
repository:

    OUT/bge_m3/config.yaml            sequence buckets, CUDA graphs, fp16 on cuda:0
    OUT/bge_m3/1/model.pt             fp16 TorchScript (about 1.1 GB), traced on the GPU
    OUT/bge_m3/weights_fp16.pt        the same weights as a state dict, for the fp32 reference

With --aoti-out DIR it also exports the same module with torch.export (batch 1..128 and
length 2..8192 dynamic) and compiles it with AOTInductor into a second repository:

    DIR/bge_m3/config.yaml            the same config with backend: aotinductor
    DIR/bge_m3/1/model.pt2            the AOTInductor package (kernels + fp16 weights)
    DIR/bge_m3/weights_fp16.pt        a link to the state dict above

The traced module takes input_ids and attention_mask (INT64 [batch, length]) and returns the
dense embedding bge-m3 serves: the L2-normalised hidden state of the first token.

    python3 bench/gpu/make_bge_m3.py --out /tmp/gpu-models
"""
import argparse
import os
import time

import torch


def build_model(seed, device="cpu"):
    from transformers import XLMRobertaConfig, XLMRobertaModel

    cfg = XLMRobertaConfig(
        vocab_size=250002,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=8194,
        type_vocab_size=1,
        pad_token_id=1,
        layer_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU takes seconds, not a minute
        model = XLMRobertaModel(cfg, add_pooling_layer=False)
    model.eval()
    return model


class DenseEmbedding(torch.nn.Module):
    """input_ids, attention_mask -> normalised first-token embedding (bge-m3's dense output)."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)
        cls = out[0][:, 0]
        return torch.nn.functional.normalize(cls.float(), dim=-1)


class DenseEmbeddingExport(DenseEmbedding):
    """The same computation for torch.export: the padding mask goes in already broadcastable
    ([batch, 1, 1, length], additive), so no mask-building code broadcasts the batch size against 1
    (export would then refuse batch 1)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # The two inputs share their sizes: said before any op broadcasts one against the
        # other, so export unifies the sizes instead of guarding that the batch is not 1.
        torch._check(attention_mask.size(0) == input_ids.size(0))
        torch._check(attention_mask.size(1) == input_ids.size(1))
        # Additive, as the spelled-out attention adds it to the scores (0 keep, -inf-ish drop).
        keep = attention_mask[:, None, None, :].to(self.encoder.dtype)
        mask4 = (1.0 - keep) * torch.finfo(self.encoder.dtype).min
        out = self.encoder(input_ids=input_ids, attention_mask=mask4, return_dict=False)
        cls = out[0][:, 0]
        return torch.nn.functional.normalize(cls.float(), dim=-1)


CONFIG = """name: bge_m3
backend: torchscript
max_batch_size: 128
input:
  - {name: input_ids, datatype: INT64, dims: [-1]}
  - {name: attention_mask, datatype: INT64, dims: [-1]}
output:
  - {name: embedding, datatype: FP32, dims: [1024]}
dynamic_batching:
  # No delay: a lone request runs at once, and requests that arrive while the GPU is busy
  # form the next batch (up to max_batch_size, same sequence bucket).
  max_queue_delay_microseconds: 0
  max_queue_size: 8192
sequence_buckets:
  lengths: [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
  pad: {input_ids: 1, attention_mask: 0}
instance:
  device: cuda:0
  precision: fp16
  jit_optimize: false
  freeze: false
  cuda_graphs:
    batch_sizes: [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    max_tokens: 16384
    warmup_iterations: 2
warmup:
  - {name: short, batch_size: 1, iterations: 1, inputs: {input_ids: {dims: [128]}, attention_mask: {dims: [128]}}, data: one}
"""


AOTI_CONFIG = CONFIG.replace("backend: torchscript", "backend: aotinductor").replace(
    "  jit_optimize: false\n  freeze: false\n", "").replace(
    "    warmup_iterations: 2\n", "    warmup_iterations: 1\n")


def export_aoti(wrapped, out, weights, gen, dev):
    """torch.export + AOTInductor -> OUT/bge_m3/1/model.pt2, checked against eager."""
    import torch._inductor
    from torch.export import Dim

    root = os.path.join(out, "bge_m3")
    os.makedirs(os.path.join(root, "1"), exist_ok=True)
    t0 = time.time()
    batch = Dim("batch", min=1, max=128)
    seq = Dim("seq", min=2, max=8192)
    ex_ids, ex_mask = random_inputs(2, 64, gen, dev)
    ex_mask[0, 40:] = 0
    from torch.fx.experimental import _config as fx_config

    # Size-oblivious shapes: without it export assumes every dynamic size is >= 2 and the
    # package refuses batch 1.
    # SDPA's kernel choice guards on batch == 1 under symbolic sizes, which makes export refuse
    # batch 1: the exported graph spells attention out (HF "eager", softmax in fp32) and
    # Inductor fuses it.
    try:
        wrapped.encoder.set_attn_implementation("eager")
    except Exception:  # older transformers
        wrapped.encoder.config._attn_implementation = "eager"
    exportable = DenseEmbeddingExport(wrapped.encoder).eval()
    with torch.no_grad():
        a = exportable(ex_ids, ex_mask)
        b = wrapped(ex_ids, ex_mask)
        print(f"4-d mask wrapper vs the traced one: max err {(a - b).abs().max().item():.2e}")
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        ep = torch.export.export(
            exportable, (ex_ids, ex_mask),
            dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
            strict=False)
    print("exported range constraints:", ep.range_constraints, flush=True)
    with torch.no_grad():
        t1 = time.time()
        path = os.path.join(root, "1", "model.pt2")
        configs = {"aot_inductor.metadata": {"kiln.precision": "fp16"}}
        # Compiled with the same size-oblivious shapes, or Inductor assumes batch >= 2 again.
        with fx_config.patch(backed_size_oblivious=True):
            torch._inductor.aoti_compile_and_package(ep, package_path=path,
                                                     inductor_configs=configs)
        t2 = time.time()
    with open(os.path.join(root, "config.yaml"), "w") as f:
        f.write(AOTI_CONFIG)
    link = os.path.join(root, "weights_fp16.pt")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(weights), link)
    # The package against eager, in a child process: a crash there (seen with PyTorch 2.11's
    # Python loader, while kiln's C++ loader serves the same file) is reported, not fatal;
    # check_bge_m3.py checks what kiln serves.
    import subprocess
    import sys

    rc = subprocess.call([sys.executable, os.path.abspath(__file__), "--out", os.path.dirname(
        os.path.dirname(weights)), "--aoti-out", out, "--aoti-check"])
    print(f"python-side package check: {'passed' if rc == 0 else f'FAILED (exit {rc})'}")
    size = os.path.getsize(path)
    print(f"bge_m3 aotinductor: {size / 1e9:.2f} GB package; export {t1 - t0:.1f} s, "
          f"compile {t2 - t1:.1f} s, check {time.time() - t2:.1f} s -> {root}")


def check_aoti(wrapped, out, gen, dev):
    """The package in OUT against the eager module on fresh shapes, batch 1 included."""
    import torch._inductor

    path = os.path.join(out, "bge_m3", "1", "model.pt2")
    with torch.no_grad():
        runner = torch._inductor.aoti_load_package(path)
        for rows, length in [(3, 300), (5, 1024), (1, 7), (1, 8192)]:
            ids, mask = random_inputs(rows, length, gen, dev)
            a = runner(ids, mask)
            b = wrapped(ids, mask)
            err = (a - b).abs().max().item()
            print(f"package vs eager at {rows}x{length}: max err {err:.2e}", flush=True)
            if not err < 1e-2:
                raise SystemExit(f"the AOTInductor package is off at {rows}x{length}: max err {err}")


def random_inputs(rows, length, gen, device):
    ids = torch.randint(5, 250000, (rows, length), generator=gen).to(device)
    mask = torch.ones(rows, length, dtype=torch.int64)
    for r in range(rows):
        keep = int(torch.randint(max(1, length // 2), length + 1, (1,), generator=gen))
        mask[r, keep:] = 0
    ids = ids.masked_fill(mask.to(device) == 0, 1)
    return ids, mask.to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--config-only", action="store_true", help="rewrite config.yaml only")
    ap.add_argument("--aoti-out", help="also export an AOTInductor package into this repository")
    ap.add_argument("--aoti-only", action="store_true",
                    help="only the AOTInductor export, from the weights already in --out")
    ap.add_argument("--aoti-check", action="store_true",
                    help="only check the package in --aoti-out against eager")
    args = ap.parse_args()
    if args.config_only:
        with open(os.path.join(args.out, "bge_m3", "config.yaml"), "w") as f:
            f.write(CONFIG)
        if args.aoti_out and os.path.isdir(os.path.join(args.aoti_out, "bge_m3")):
            with open(os.path.join(args.aoti_out, "bge_m3", "config.yaml"), "w") as f:
                f.write(AOTI_CONFIG)
        return
    dev = torch.device("cuda:0")
    t0 = time.time()
    model = build_model(args.seed, dev).half()
    wrapped = DenseEmbedding(model).eval()
    root = os.path.join(args.out, "bge_m3")
    weights = os.path.join(root, "weights_fp16.pt")
    if args.aoti_only or args.aoti_check:
        model.load_state_dict(torch.load(weights, map_location=dev))
    if args.aoti_check:
        check_aoti(wrapped, args.aoti_out, torch.Generator().manual_seed(3), dev)
        return
    if args.aoti_only:
        export_aoti(wrapped, args.aoti_out, weights, torch.Generator().manual_seed(2), dev)
        return
    os.makedirs(os.path.join(root, "1"), exist_ok=True)
    gen = torch.Generator().manual_seed(1)
    # A mask with padding while tracing, so no all-ones shortcut is baked into the trace.
    ex_ids, ex_mask = random_inputs(2, 64, gen, dev)
    ex_mask[0, 40:] = 0
    with torch.inference_mode():
        traced = torch.jit.trace(wrapped, (ex_ids, ex_mask), check_trace=False)
        # The trace must generalise over batch and length: compare with eager elsewhere.
        for rows, length in [(1, 7), (3, 300), (5, 1024)]:
            ids, mask = random_inputs(rows, length, gen, dev)
            a = traced(ids, mask)
            b = wrapped(ids, mask)
            err = (a - b).abs().max().item()
            if not err < 1e-2:
                raise SystemExit(f"trace does not generalise at {rows}x{length}: max err {err}")
    traced.save(os.path.join(root, "1", "model.pt"))
    torch.save(model.state_dict(), weights)
    with open(os.path.join(root, "config.yaml"), "w") as f:
        f.write(CONFIG)
    size = os.path.getsize(os.path.join(root, "1", "model.pt"))
    print(f"bge_m3: {size / 1e9:.2f} GB fp16 TorchScript in {time.time() - t0:.1f} s -> {root}")
    if args.aoti_out:
        export_aoti(wrapped, args.aoti_out, weights, gen, dev)


if __name__ == "__main__":
    main()
