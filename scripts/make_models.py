#!/usr/bin/python3
"""Generates kiln's demo and test models (TorchScript) and their reference outputs.

Run with a Python that has torch (Debian's python3-torch at /usr/bin/python3):
    /usr/bin/python3 scripts/make_models.py --out build/models

Writes a Triton-layout model repository:
    encoder/      a small BERT-like encoder, versions 1 and 2 (token ids + mask -> embedding)
    (OUT-faulty/encoder/3: the encoder failing requests that hold token 13, for canaries)
    addsub/       two FP32 vectors -> (sum, difference) as a tuple
    dictout/      no batch dimension, INT32 -> dict of outputs
    slow/         a model whose run time grows with its `work` input (drain and queue tests)
    tokens/       token ids + mask -> per-token and pooled outputs, with sequence buckets
and reference outputs for fixed inputs under encoder/reference/.
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn

VOCAB = 1000
HIDDEN = 64
HEADS = 4
LAYERS = 2
FFN = 128
MAX_POS = 256


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = HIDDEN
        self.heads = HEADS
        self.head_dim = HIDDEN // HEADS
        self.scale = 1.0 / math.sqrt(HIDDEN // HEADS)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.ff1 = nn.Linear(HIDDEN, FFN)
        self.ff2 = nn.Linear(FFN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        att = torch.matmul(q, k.transpose(-1, -2)) * self.scale + bias
        att = torch.softmax(att, dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, self.hidden)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_POS, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        pos = torch.arange(s, device=input_ids.device).unsqueeze(0)
        x = self.ln(self.tok(input_ids) + self.pos(pos))
        maskf = attention_mask.to(x.dtype)
        bias = ((1.0 - maskf) * -10000.0).unsqueeze(1).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, bias)
        summed = (x * maskf.unsqueeze(-1)).sum(dim=1)
        count = maskf.sum(dim=1, keepdim=True).clamp(min=1.0)
        return summed / count


class AddSub(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor):
        return a + b, a - b


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor):
        return {"doubled": x * 2, "total": x.sum().to(torch.int64).reshape(1)}


class Slow(nn.Module):
    """Runs `work` rounds of element-wise math (no BLAS, so its pace does not depend on which
    BLAS the machine has): about a third of a millisecond each."""

    def forward(self, x: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
        n = int(work.max().item())
        m = torch.ones(256, 256)
        for _ in range(n):
            m = torch.tanh(m * 0.5 + 1.0)
        return x + m[0, 0] * 0.0


class Tokens(nn.Module):
    """Exact, mask-respecting arithmetic for the sequence-bucket tests: per token
    hidden = [id * mask, mask] and pooled = the sum of hidden over the sequence, so padding
    (mask 0) changes neither the kept positions nor the pooled value, whatever the pad id."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        m = attention_mask.to(torch.float32)
        hidden = torch.stack([input_ids.to(torch.float32) * m, m], dim=-1)
        return hidden, hidden.sum(dim=1)


ENCODER_CONFIG = """name: encoder
backend: torchscript
max_batch_size: 32
input:
  - {name: input_ids, datatype: INT64, dims: [-1]}
  - {name: attention_mask, datatype: INT64, dims: [-1]}
output:
  - {name: embedding, datatype: FP32, dims: [64]}
dynamic_batching:
  preferred_batch_size: [8, 16, 32]
  max_queue_delay_microseconds: 2000
  priority_levels: 2
  default_priority_level: 2
  max_queue_size: 1024
response_cache:
  enable: false
  max_bytes: 16Mi
instance:
  device: cpu
  threads: 0
  precision: fp32
warmup:
  - {name: short, batch_size: 1, iterations: 3, inputs: {input_ids: {dims: [16]}, attention_mask: {dims: [16]}}}
  - {name: batch, batch_size: 8, iterations: 2, inputs: {input_ids: {dims: [32]}, attention_mask: {dims: [32]}}}
"""

ADDSUB_CONFIG = """name: addsub
backend: torchscript
max_batch_size: 8
input:
  - {name: INPUT0, datatype: FP32, dims: [4]}
  - {name: INPUT1, datatype: FP32, dims: [4]}
output:
  - {name: OUTPUT0, datatype: FP32, dims: [4]}
  - {name: OUTPUT1, datatype: FP32, dims: [4]}
dynamic_batching:
  max_queue_delay_microseconds: 500
response_cache:
  enable: true
  max_bytes: 1Mi
warmup:
  - {name: one, batch_size: 1, data: one}
"""

DICTOUT_CONFIG = """name: dictout
backend: torchscript
max_batch_size: 0
input:
  - {name: x, datatype: INT32, dims: [3]}
output:
  - {name: doubled, datatype: INT32, dims: [3]}
  - {name: total, datatype: INT64, dims: [1]}
"""

SLOW_CONFIG = """name: slow
backend: torchscript
max_batch_size: 4
input:
  - {name: x, datatype: FP32, dims: [1]}
  - {name: work, datatype: INT64, dims: [1]}
output:
  - {name: y, datatype: FP32, dims: [1]}
dynamic_batching:
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 2
  max_queue_size: 4
"""

TOKENS_CONFIG = """name: tokens
backend: torchscript
max_batch_size: 8
input:
  - {name: input_ids, datatype: INT64, dims: [-1]}
  - {name: attention_mask, datatype: INT64, dims: [-1]}
output:
  - {name: hidden, datatype: FP32, dims: [-1, 2]}
  - {name: pooled, datatype: FP32, dims: [2]}
dynamic_batching:
  max_queue_delay_microseconds: 1000
sequence_buckets:
  lengths: [4, 8, 16]
  pad: {input_ids: 99, attention_mask: 0}
warmup:
  - {name: short, batch_size: 2, inputs: {input_ids: {dims: [3]}, attention_mask: {dims: [3]}}}
"""


class FaultyEncoder(nn.Module):
    """The encoder, but it fails every request holding token 13: a bad release for canary
    tests (it lives in its own repository, OUT-faulty, so no test serves it by accident)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if bool((input_ids == 13).any()):
            raise RuntimeError("faulty release: token 13")
        return self.inner(input_ids, attention_mask)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def save(module, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.jit.script(module.eval()).save(path)


def encoder_references(model, seed):
    """Fixed requests of mixed lengths and batch sizes with their expected embeddings."""
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i in range(64):
        length = 3 + (i * 7) % 29
        rows = 1 + (i % 3)
        ids = torch.randint(1, VOCAB, (rows, length), generator=g)
        mask = torch.ones(rows, length, dtype=torch.int64)
        if length > 4 and i % 4 == 0:
            mask[:, length - 2:] = 0  # padded tail
        with torch.no_grad():
            emb = model(ids, mask)
        cases.append({
            "input_ids": ids.tolist(),
            "attention_mask": mask.tolist(),
            "embedding": emb.tolist(),
        })
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = args.out
    torch.set_num_threads(1)

    write(os.path.join(out, "encoder/config.yaml"), ENCODER_CONFIG)
    for version, seed in (("1", 1), ("2", 2)):
        torch.manual_seed(seed)
        model = Encoder().eval()
        save(model, os.path.join(out, f"encoder/{version}/model.pt"))
        refs = encoder_references(model, 1000 + seed)
        write(os.path.join(out, f"encoder/reference/v{version}.json"), json.dumps(refs))

    write(os.path.join(out, "addsub/config.yaml"), ADDSUB_CONFIG)
    save(AddSub(), os.path.join(out, "addsub/1/model.pt"))

    write(os.path.join(out, "dictout/config.yaml"), DICTOUT_CONFIG)
    save(DictOut(), os.path.join(out, "dictout/1/model.pt"))

    write(os.path.join(out, "slow/config.yaml"), SLOW_CONFIG)
    save(Slow(), os.path.join(out, "slow/1/model.pt"))

    write(os.path.join(out, "tokens/config.yaml"), TOKENS_CONFIG)
    save(Tokens(), os.path.join(out, "tokens/1/model.pt"))

    faulty = out.rstrip("/") + "-faulty"
    write(os.path.join(faulty, "encoder/config.yaml"), ENCODER_CONFIG)
    torch.manual_seed(1)
    save(FaultyEncoder(Encoder().eval()), os.path.join(faulty, "encoder/3/model.pt"))
    print(f"models written to {out}")


if __name__ == "__main__":
    main()
