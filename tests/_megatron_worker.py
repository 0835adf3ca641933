"""One pipeline stage of the Megatron-Core integration test (run by tests/test_megatron.py).

Trains a tiny GPTModel (local layer spec) for a few steps with one of Megatron-Core's schedules,
five times from the same initial weights and seed: unpatched; patched with everything offloaded
(``min_bytes=0``); patched with everything kept in memory; patched with a 1 MB/s drive (a
throttled posix store); and after ``unpatch()``. Writes
``rank<N>.json`` with exact comparisons (``torch.equal``) of the losses and of every parameter's
gradient at every step, the bytes this stage wrote and read, whether each backward was announced
to the offloader (checked from below the patch by :class:`Spy`), whether files were left behind,
and whether Megatron's functions are the originals again.

    python -m torch.distributed.run --standalone --nproc_per_node=2 _megatron_worker.py \
        --schedule 1f1b --storage DIR --out DIR
    python _megatron_worker.py --schedule none --storage DIR --out DIR      # one process
    (add --recompute for full activation recompute: each layer saves only its input; with
    --schedule none under torchrun, --tensor-parallel 2 splits every layer over the 2 ranks)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _megatron_shim import cpu_megatron  # noqa: E402
from _slow_drive import slow_drive  # noqa: E402

SEQ = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 4
VOCAB = 64
HIDDEN = 32
STEPS = 2
LR = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--schedule", choices=("none", "1f1b", "interleaved"), required=True)
    p.add_argument("--storage", required=True, help="directory for the offloaded activations")
    p.add_argument("--out", required=True, help="directory for rank<N>.json")
    p.add_argument("--timeout", type=float, default=90.0, help="gloo timeout, seconds")
    p.add_argument("--tensor-parallel", type=int, default=1, help="tensor-parallel size (ranks)")
    p.add_argument("--recompute", action="store_true",
                   help="full activation recompute (Megatron's checkpointing): only block inputs are saved")
    return p.parse_args(argv)


def init_distributed(args):
    timeout = datetime.timedelta(seconds=args.timeout)
    if "RANK" in os.environ:  # under torchrun
        torch.distributed.init_process_group("gloo", timeout=timeout)
    else:
        rdzv = os.path.join(args.out, "rendezvous")
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{rdzv}", rank=0, world_size=1, timeout=timeout
        )


def build(schedule, recompute=False, tp=1):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp = 1 if schedule == "none" else 2
    vp = 2 if schedule == "interleaved" else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
    )
    initialize_rng_tracker(inference_rng_tracker=True)  # no CUDA generators
    config = TransformerConfig(
        num_layers=2 * pp * (vp or 1),
        hidden_size=HIDDEN,
        ffn_hidden_size=2 * HIDDEN,
        num_attention_heads=4,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        deallocate_pipeline_outputs=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
    )
    rank = torch.distributed.get_rank()
    torch.manual_seed(1234 + rank)
    chunks = []
    for vp_stage in range(vp or 1):
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(),
                vocab_size=VOCAB,
                max_sequence_length=SEQ,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=False,
                vp_stage=vp_stage if vp else None,
            )
        )
    return chunks


def batches(step):
    """The micro-batches of one step, the same on every stage (each uses what it needs)."""
    gen = torch.Generator().manual_seed(1000 + step)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(MICRO_BATCH, 1, SEQ, SEQ)
    for _ in range(NUM_MICROBATCHES):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=gen)
        yield {
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ),
            "attention_mask": mask,
        }


def forward_step_func(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    if not model.post_process:
        # tanh saves its own output for backward, so the tensor this stage sends (and Megatron
        # then hollows out with deallocate_output_tensor) is itself a saved, offloaded tensor.
        return torch.tanh(out), None

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def train(chunks, initial, schedule):
    """STEPS steps of forward/backward + SGD from ``initial``; returns (losses, grads per step)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk, state in zip(chunks, initial):
        chunk.load_state_dict(state)
        chunk.train()
    torch.manual_seed(7)  # dropout
    losses, grads = [], []
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
        iters = [batches(step) for _ in chunks]
        out = get_forward_backward_func()(
            forward_step_func=forward_step_func,
            data_iterator=iters if schedule == "interleaved" else iters[0],
            model=chunks if schedule == "interleaved" else chunks[0],
            num_microbatches=NUM_MICROBATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
        )
        losses.extend(d["loss"] for d in out)
        step_grads = {}
        for i, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                step_grads[f"{i}.{name}"] = None if p.grad is None else p.grad.clone()
        grads.append(step_grads)
        with torch.no_grad():
            for chunk in chunks:
                for p in chunk.parameters():
                    if p.grad is not None:
                        p -= LR * p.grad
    return losses, grads


def same(a, b):
    """Exact equality of two train() results, with the first difference named."""
    (la, ga), (lb, gb) = a, b
    if len(la) != len(lb) or not all(torch.equal(x, y) for x, y in zip(la, lb)):
        return False, f"losses differ: {[x.item() for x in la]} vs {[y.item() for y in lb]}"
    for step, (sa, sb) in enumerate(zip(ga, gb)):
        if sa.keys() != sb.keys():
            return False, f"step {step}: different parameters"
        for name in sa:
            x, y = sa[name], sb[name]
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return False, f"step {step}: gradient of {name} differs"
    return True, ""


class Spy:
    """Installed under the patch: records, independently of it, which micro-batch each forward and
    backward of the real schedule ran, and which micro-batches ssdtrain was told to prefetch."""

    def __init__(self, schedules):
        import inspect

        self.schedules = schedules
        self.forward_step, self.backward_step = schedules.forward_step, schedules.backward_step
        self.sig = inspect.signature(self.forward_step)
        self.events = []
        self.by_output = {}  # id(output) -> (output, mb); the output is held so the id stays unique

        def forward_step(*args, **kwargs):
            bound = self.sig.bind_partial(*args, **kwargs).arguments
            vp, index = bound.get("vp_stage"), bound.get("current_microbatch")
            mb = index if vp is None else (vp, index)
            result = self.forward_step(*args, **kwargs)
            out = result[0]
            while isinstance(out, list):
                out = out[0]
            self.by_output[id(out)] = (out, mb)
            self.events.append(("F", mb))
            return result

        def backward_step(input_tensor, output_tensor, *rest):
            out = output_tensor
            while isinstance(out, list):
                out = out[0]
            self.events.append(("B", self.by_output.pop(id(out))[1]))
            return self.backward_step(input_tensor, output_tensor, *rest)

        self.installed = (forward_step, backward_step)
        schedules.forward_step, schedules.backward_step = forward_step, backward_step

    def watch(self, off):
        prefetch = off.prefetch

        def spy_prefetch(mb_id):
            self.events.append(("P", mb_id))
            return prefetch(mb_id)

        off.prefetch = spy_prefetch

    def remove(self):
        self.schedules.forward_step, self.schedules.backward_step = self.forward_step, self.backward_step

    def check(self, last_step_from):
        """Whether every backward was preceded by a prefetch of its micro-batch (after its forward);
        and how many look-ahead hints (a prefetch right after a backward), from event
        ``last_step_from`` on, named the backward that came next (the first step of the
        interleaved schedule may guess wrong: the order is learned from it)."""
        ev = self.events
        backwards = [k for k, (kind, _) in enumerate(ev) if kind == "B"]
        announced = True
        for b in backwards:
            f = max(k for k in range(b) if ev[k] == ("F", ev[b][1]))
            announced &= ("P", ev[b][1]) in ev[f + 1:b]
        good = bad = 0
        for a, b in zip(backwards, backwards[1:]):
            if a >= last_step_from and ev[a + 1][0] == "P":
                good += ev[a + 1][1] == ev[b][1]
                bad += ev[a + 1][1] != ev[b][1]
        return announced, good, bad


def files_under(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None):
    args = parse_args(argv)
    init_distributed(args)
    rank = torch.distributed.get_rank()
    from megatron.core.pipeline_parallel import schedules

    from ssdtrain.integrations import megatron as ssd_megatron

    originals = (schedules.forward_step, schedules.backward_step)
    report = {"rank": rank, "schedule": args.schedule, "checks": {}, "notes": {}}
    checks, notes = report["checks"], report["notes"]
    storage = os.path.join(args.storage, f"rank{rank}")
    with cpu_megatron():
        chunks = build(args.schedule, args.recompute, args.tensor_parallel)
        initial = [copy.deepcopy(c.state_dict()) for c in chunks]

        plain = train(chunks, initial, args.schedule)

        # 1. Everything offloaded (min_bytes=0), with the real schedule watched from below.
        spy = Spy(schedules)
        handle = ssd_megatron.patch(path=storage, min_bytes=0, backend="posix")
        checks["patch_wraps_functions"] = (
            schedules.forward_step.__wrapped__ is spy.installed[0]
            and schedules.backward_step.__wrapped__ is spy.installed[1]
        )
        spy.watch(handle.offloader)
        patched = train(chunks, initial, args.schedule)
        handle.offloader.wait()
        stats = handle.offloader.stats()
        report["written_bytes"] = int(stats.written_bytes)
        report["read_bytes"] = int(stats.read_bytes)
        report["written_bytes_by_path"] = stats.written_bytes_by_path
        report["microbatches"] = sorted(map(str, stats.microbatches))
        checks["nothing_pending_after_step"] = handle.pending() == {}
        handle.unpatch()
        spy.remove()
        checks["no_files_left"] = files_under(storage) == []
        notes["no_files_left"] = str(files_under(storage))
        forwards = [k for k, e in enumerate(spy.events) if e[0] == "F"]
        last_step_from = forwards[len(forwards) // STEPS * (STEPS - 1)]
        announced, good, bad = spy.check(last_step_from)
        checks["each_backward_prefetched_first"] = announced
        checks["lookahead_hints_right"] = bad == 0
        report["lookahead_hints"] = {"right": good, "wrong": bad}
        report["events"] = spy.events

        # 2. Everything kept in memory (min_bytes above every tensor): the keep path.
        with ssd_megatron.patch(path=storage, min_bytes="1GiB", backend="posix") as h2:
            kept = train(chunks, initial, args.schedule)
            report["kept_bytes"] = int(h2.offloader.stats().kept_bytes)
        checks["unpatch_restores_functions"] = (
            schedules.forward_step is originals[0] and schedules.backward_step is originals[1]
        )

        # 3. A drive far slower than the stage (1 MB/s each way): the write budget and adaptive
        #    keep decide per micro-batch what goes, and gradients stay exact.
        with slow_drive(1e6), ssd_megatron.patch(path=storage, min_bytes=0, backend="posix") as h3:
            slow = train(chunks, initial, args.schedule)
            h3.offloader.wait()
            s3 = h3.offloader.stats()
        report["slow_drive"] = {k: getattr(s3, k) for k in (
            "written_bytes", "read_bytes", "kept_bytes", "budget_kept_bytes", "adaptive_keep_bytes",
            "cancelled_writes", "forwarded_bytes", "stall_seconds", "unique_bytes")}
        checks["slow_drive_no_files_left"] = files_under(storage) == []

        after = train(chunks, initial, args.schedule)

    for name, other in (("patched_equals_plain", patched), ("kept_equals_plain", kept),
                        ("slow_drive_equals_plain", slow), ("after_unpatch_equals_plain", after)):
        checks[name], notes[name] = same(plain, other)
    report["losses"] = [x.item() for x in plain[0]]

    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
