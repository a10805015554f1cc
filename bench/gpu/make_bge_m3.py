#!/usr/bin/env python3
"""Builds the bge-m3-shaped encoder for the GPU benchmark and traces it to TorchScript.

XLM-R large geometry (24 layers, hidden 1024, 16 heads, FFN 4096, vocab 250002, 8194
positions) with random weights from a fixed seed: nothing is downloaded. Writes a kiln model
repository:

    OUT/bge_m3/config.yaml            sequence buckets, CUDA graphs, fp16 on cuda:0
    OUT/bge_m3/1/model.pt             fp16 TorchScript (about 1.1 GB), traced on the GPU
    OUT/bge_m3/weights_fp16.pt        the same weights as a state dict, for the fp32 reference

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
    args = ap.parse_args()
    if args.config_only:
        with open(os.path.join(args.out, "bge_m3", "config.yaml"), "w") as f:
            f.write(CONFIG)
        return
    dev = torch.device("cuda:0")
    t0 = time.time()
    model = build_model(args.seed, dev).half()
    wrapped = DenseEmbedding(model).eval()
    root = os.path.join(args.out, "bge_m3")
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
    torch.save(model.state_dict(), os.path.join(root, "weights_fp16.pt"))
    with open(os.path.join(root, "config.yaml"), "w") as f:
        f.write(CONFIG)
    size = os.path.getsize(os.path.join(root, "1", "model.pt"))
    print(f"bge_m3: {size / 1e9:.2f} GB fp16 TorchScript in {time.time() - t0:.1f} s -> {root}")


if __name__ == "__main__":
    main()
