"""One rank of the DDP / FSDP2 recipe tests (run by tests/test_recipes.py under torchrun, gloo, CPU).

Trains a tiny GPT (``ssdtrain.bench.models``, dropout on) for a few steps twice from the same weights
and seeds: as the recipe in docs/recipes.md says (``with off:`` around the wrapped model's
forward), and without offloading. Writes ``rank<N>.json`` with, per mode, the parameters that
are not ``torch.equal`` between the two runs (full tensors, gathered for FSDP2), whether training
changed them at all, and the bytes written.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _recipes_worker.py \\
        --modes ddp fsdp2 --storage DIR --out DIR
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ssdtrain

VOCAB = 128
SEQ = 32
STEPS = 3
BATCH = 2


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(a), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.dropout, self.training)


class TinyGPT(nn.Module):
    """A small decoder: embeddings, ``blocks`` (an ``nn.ModuleList``), final norm, head; the loss."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, VOCAB), targets.reshape(-1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.loss(x, targets)


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # in place: `model` is now the FSDP module
    return model


def train(base: TinyGPT, mode: str, rank: int, offloader_args: dict | None) -> tuple[dict, int]:
    model = copy.deepcopy(base)
    wrapped = wrap(model, mode)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    # Recipe: model= is the module itself (DDP: the one inside the wrapper; FSDP2: the root that
    # fully_shard changed in place), so its parameters are never written and its blocks are found.
    off = ssdtrain.Offloader(model, **offloader_args) if offloader_args is not None else None
    g = torch.Generator().manual_seed(1 + rank)
    torch.manual_seed(100 + rank)  # dropout: the same masks in both runs
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        targets = tokens.roll(-1, dims=1)
        if off is not None:
            with off:
                loss = wrapped(tokens, targets)
        else:
            loss = wrapped(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
    written = 0
    if off is not None:
        written = off.stats().written_bytes
        off.close()
    params = {}
    for name, p in model.named_parameters():
        t = p.detach()
        params[name] = t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
    return params, written


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modes", nargs="+", choices=("ddp", "fsdp2"), required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=90.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = TinyGPT()
    report: dict = {"rank": rank}
    for mode in args.modes:
        want, _ = train(base, mode, rank, None)
        storage = os.path.join(args.storage, mode, f"rank{rank}")
        got, written = train(base, mode, rank, {"path": storage, "min_bytes": 0})
        start = dict(base.named_parameters())
        report[mode] = {
            "names": sorted(want) == sorted(got) == sorted(start),
            "differ": sorted(n for n in want if not torch.equal(got[n], want[n])),
            "trained": all(not torch.equal(want[n], start[n].detach()) for n in want),
            "written_bytes": written,
            "left_behind": [os.path.join(d, f) for d, _, fs in os.walk(storage) for f in fs],
        }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
