"""One rank of the DDP / FSDP2 / tensor-parallel (and 2-D) recipe tests (run by tests/test_recipes.py under
torchrun, gloo, CPU).

Trains a tiny GPT (dropout on) for a few steps twice from the same weights and seeds: as the
recipe in docs/recipes.md says (``with off:`` around the wrapped model's forward), and without
offloading. Writes ``rank<N>.json`` with, per mode, the parameters that are not ``torch.equal``
between the two runs (full tensors, gathered for FSDP2 and TP), whether training changed them at
all, and the bytes written. The tensor-parallel modes (``tp``; ``tp_sp``, with sequence
parallelism; ``fsdp2_tp_sp``, both inside FSDP2 on a (ranks/2 x 2) mesh) train a third time with
DTensor saves kept in memory, as before Note [a DTensor is saved by its parts], and report what
that run wrote.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _recipes_worker.py \\
        --modes ddp fsdp2 tp tp_sp --storage DIR --out DIR
    (fsdp2_tp_sp: --nproc_per_node=4)
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


class TPBlock(nn.Module):
    """A decoder block in torchtitan's shape for tensor parallelism: separate q, k and v (their
    columns split by heads), the head count taken from the local width."""

    def __init__(self, hidden: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.head_dim, self.dropout = hidden // heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden) for _ in range(4))
        self.w1, self.w2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (w(y).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + F.dropout(self.wo(a), self.dropout, self.training)
        return x + F.dropout(self.w2(F.gelu(self.w1(self.ln2(x)))), self.dropout, self.training)


class TinyGPT(nn.Module):
    """A small decoder: embeddings, ``blocks`` (an ``nn.ModuleList``), final norm, head; the loss.
    With ``sequence_parallel`` set to a mesh (by :func:`tensor_parallel`), the blocks run on the
    sequence sharded over it (a DTensor), gathered again before the head."""

    def __init__(self, layers: int = 2, hidden: int = 64, heads: int = 4, dropout: float = 0.1,
                 block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.sequence_parallel = None
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, hidden), nn.Embedding(SEQ, hidden)
        self.blocks = nn.ModuleList(block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, VOCAB)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.ln_f(x)).reshape(-1, VOCAB), targets.reshape(-1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mesh = self.sequence_parallel
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Replicate, Shard

            x = DTensor.from_local(x, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
        for block in self.blocks:
            x = block(x)
        if mesh is not None:
            x = x.full_tensor()
        return self.loss(x, targets)


def tensor_parallel(model: TinyGPT, mesh, sequence_parallel: bool) -> None:
    """Shards ``model``'s :class:`TPBlock` s over ``mesh`` with ``parallelize_module``, in place:
    q, k, v and the first MLP linear by columns, the output projections by rows; with
    ``sequence_parallel`` the norms and residuals run on the sequence's shard, as in torchtitan."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    if sequence_parallel:
        col, row = ColwiseParallel(input_layouts=Shard(1)), RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        plan = {"ln1": SequenceParallel(), "ln2": SequenceParallel()}
        model.sequence_parallel = mesh
    else:
        col, row, plan = ColwiseParallel(), RowwiseParallel(), {}
    plan.update({"wq": col, "wk": col, "wv": col, "wo": row, "w1": col, "w2": row})
    for block in model.blocks:
        parallelize_module(block, mesh, plan)


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if mode == "fsdp2_tp_sp":  # 2-D, as torchtitan: tensor (and sequence) parallel in, FSDP2 across
        mesh2 = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh2["tp"], True)
        mesh = mesh2["dp"]
    else:
        mesh = init_device_mesh("cpu", (world,))
    if mode in ("tp", "tp_sp"):
        tensor_parallel(model, mesh, mode == "tp_sp")
        return model
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
    # Data parallel: each rank its own batches. Tensor parallel: the ranks of a group see the
    # same batch and draw the same dropout masks.
    tp = {"tp": dist.get_world_size(), "tp_sp": dist.get_world_size(), "fsdp2_tp_sp": 2}.get(mode, 1)
    seed = rank // tp
    g = torch.Generator().manual_seed(1 + seed)
    torch.manual_seed(100 + seed)  # dropout: the same masks in both runs
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
    p.add_argument("--modes", nargs="+", choices=("ddp", "fsdp2", "tp", "tp_sp", "fsdp2_tp_sp"), required=True)
    p.add_argument("--storage", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=90.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    report: dict = {"rank": rank}
    for mode in args.modes:
        torch.manual_seed(0)
        base = TinyGPT(block=TPBlock) if "tp" in mode else TinyGPT()
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
        if "tp" in mode:
            by_parts, ssdtrain.engine.keep._BY_PARTS = ssdtrain.engine.keep._BY_PARTS, ()  # DTensors kept as they are
            try:
                kept, report[mode]["written_bytes_dtensors_kept"] = train(
                    base, mode, rank, {"path": storage + "-kept", "min_bytes": 0})
            finally:
                ssdtrain.engine.keep._BY_PARTS = by_parts
            report[mode]["differ_dtensors_kept"] = sorted(n for n in want if not torch.equal(kept[n], want[n]))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
