"""One rank of the Hugging Face ``Trainer`` under DDP test (run by tests/test_transformers.py under
torchrun: 2 ranks, gloo, CPU).

Trains a tiny random Llama for a few optimizer steps of accumulated micro-batches twice from the
same weights and seed: with ``OffloadCallback`` and without. The Trainer wraps the model in
``DistributedDataParallel`` itself. Writes ``rank<N>.json``: the parameters that are not
``torch.equal`` between the two runs, whether training changed them, the offloaded forwards, the
bytes written and read, and the files left in the rank's offload directory.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _trainer_ddp_worker.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import os

import _rank_report
import torch
import transformers

from ssdtrain.integrations.transformers import OffloadCallback

SEQ, STEPS, ACCUM, BATCH = 32, 3, 2, 2


def _data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x, "attention_mask": torch.ones(SEQ, dtype=torch.long)} for x in ids]


def _train(model, out_dir: str, callbacks) -> tuple[dict, bool]:
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM,
        learning_rate=1e-2, seed=0, use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
        logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    # Two ranks each take their own half of the data.
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(2 * STEPS * ACCUM * BATCH),
                                   callbacks=list(callbacks))
    trainer.train()
    wrapped = isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    rank = int(os.environ["RANK"])
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=2 * SEQ, use_cache=False)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(config)
    start = {n: p.detach().clone() for n, p in llama.named_parameters()}

    want, _ = _train(copy.deepcopy(llama), os.path.join(ns.out, f"base{rank}"), [])
    act = os.path.join(ns.out, f"act{rank}")
    cb = OffloadCallback(path=act, min_bytes=0)
    with _rank_report.counted_entries() as entries:
        got, wrapped = _train(copy.deepcopy(llama), os.path.join(ns.out, f"off{rank}"), [cb])
    _rank_report.write(ns.out, want=want, got=got, start=start, entries=entries, stats=cb.stats(), act_dir=act,
                       ddp=wrapped)


if __name__ == "__main__":
    main()
