"""One rank of the Lightning callback under DDP test (run by tests/test_lightning.py under torchrun:
2 ranks, gloo, CPU; Lightning sees torchrun's environment and starts no processes of its own).

Fits a tiny GPT (``_recipes_worker.TinyGPT``, dropout on) for a few steps with ``strategy="ddp"``
twice from the same weights and seed: with ``OffloadCallback`` and without. Writes
``rank<N>.json``: the parameters that are not ``torch.equal`` between the two runs, whether
training changed them, the offloaded ``training_step`` calls, the bytes written and read, and the
files left in the rank's offload directory.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _lightning_ddp_worker.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings

import _rank_report
import lightning.pytorch as pl
import torch
from _recipes_worker import SEQ, VOCAB, TinyGPT

from ssdtrain.integrations.lightning import OffloadCallback

STEPS, BATCH = 3, 2


class LitGPT(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return self.model(tokens, targets)

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        return self.model(tokens, targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(module, root: str, callbacks) -> tuple[dict, str]:
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=root, callbacks=list(callbacks))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2 * STEPS * BATCH, SEQ), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens.roll(-1, dims=1)),
                                         batch_size=BATCH)  # Lightning gives each rank its half
    torch.manual_seed(5 + trainer.global_rank)  # dropout: the same masks in both runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, type(trainer.strategy).__name__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    gpt = TinyGPT()
    start = {"model." + n: p.detach().clone() for n, p in gpt.named_parameters()}  # LitGPT's names

    want, _ = _fit(LitGPT(copy.deepcopy(gpt)), os.path.join(ns.out, "base"), [])
    act = os.path.join(ns.out, f"act{rank}")
    cb = OffloadCallback(path=act, min_bytes=0)
    with _rank_report.counted_entries() as entries:
        got, strategy = _fit(LitGPT(copy.deepcopy(gpt)), os.path.join(ns.out, "off"), [cb])
    _rank_report.write(ns.out, want=want, got=got, start=start, entries=entries, stats=cb.stats(), act_dir=act,
                       strategy=strategy)


if __name__ == "__main__":
    main()
