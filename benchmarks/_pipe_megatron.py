"""One rank of the pipeline-bubble benchmark (``benchmarks/pipeline_bubbles.py``, issue 66) on
Megatron-Core: a GPTModel (local layer spec, no dropout) trained by Megatron's own schedules over
gloo on the CPU: 1F1B with ``--stages`` > 1, interleaved 1F1B with ``--virtual`` > 1 too, and the
schedule without pipelining (gradient accumulation) with one stage; the ranks that are not
pipeline stages are data-parallel, their gradients summed by one all-reduce a step (flattened, in
float32) and averaged, then each rank takes torch's AdamW step.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/_pipe_megatron.py \
        --mode offload --stages 2 --micro-batch 1 --global-batch 8 --storage DIR --out DIR

Modes: ``recompute`` is Megatron's full recompute, one layer a checkpoint (each layer keeps its
input: Megatron's CheckpointFunction saves it with ``save_for_backward``, so ssdtrain takes it);
the offload modes patch Megatron's schedules with ``ssdtrain.integrations.megatron.patch`` (the
``--ssdtrain`` flag's code) on a posix store under ``--storage``, every save offloadable
(``min_bytes=0``; ssdtrain's defaults otherwise). The
timeline times Megatron's ``forward_step`` and ``backward_step`` as the schedule calls them (the
wrappers sit above ssdtrain's: its cost a micro-batch is the rank's busy time). The result and the
memory measured: ``_pipe_common``'s docstring. Megatron-Core's few hard-coded CUDA calls are mapped
to the CPU by the test suite's ``cpu_megatron`` (tests/_megatron_shim.py)."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _pipe_common as common  # noqa: E402
from _megatron_shim import cpu_megatron  # noqa: E402


def build(shape: common.Shape, stages: int, virtual: int, recompute: bool) -> list:
    """This rank's model chunks (one a virtual stage), seeded alike in every mode."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import initialize_rng_tracker
    from megatron.core.transformer.transformer_config import TransformerConfig

    vp = virtual if virtual > 1 else None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=stages,
                                             virtual_pipeline_model_parallel_size=vp)
    initialize_rng_tracker(inference_rng_tracker=True)  # no CUDA generators
    config = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, ffn_hidden_size=4 * shape.hidden,
        num_attention_heads=shape.heads, hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, pipeline_model_parallel_size=stages,
        virtual_pipeline_model_parallel_size=vp, deallocate_pipeline_outputs=True,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}))
    torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
    chunks = []
    for v in range(virtual):
        chunks.append(GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shape.vocab,
            max_sequence_length=shape.seq,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            share_embeddings_and_output_weights=False, vp_stage=v if vp else None))
    return chunks


def data(shape: common.Shape, step: int, m: int, dp_rank: int, size: int):
    """The step's micro-batches as Megatron's forward step takes them."""
    mask = torch.ones(shape.seq, shape.seq, dtype=torch.bool).triu(1).expand(size, 1, shape.seq, shape.seq)
    positions = torch.arange(shape.seq).expand(size, shape.seq)
    for i in range(m):
        tokens, labels = common.batch(shape, step, i, dp_rank, size, m)
        yield {"tokens": tokens, "labels": labels, "position_ids": positions, "attention_mask": mask}


def forward_step_func(data_iterator, model):
    b = next(data_iterator)
    out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
    if not model.post_process:
        return out, None

    def loss_func(per_token):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def _microbatch_of(*args, **kwargs):
    return kwargs.get("current_microbatch")


def main(argv=None) -> int:
    args = common.add_arguments(argparse.ArgumentParser()).parse_args(argv)
    torch.set_num_threads(1)  # a core a rank
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shape = common.shape_of(args)
    dp, m = common.microbatches(args, world)
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules

    from ssdtrain.bench._measure import RssSampler
    from ssdtrain.integrations import megatron as ssd_megatron

    result = common.header(args, "megatron", world)
    with cpu_megatron():
        chunks = build(shape, args.stages, args.virtual, "recompute" in args.mode)
        params = [p for c in chunks for p in c.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-4)
        dp_group = parallel_state.get_data_parallel_group()
        dp_rank = parallel_state.get_data_parallel_rank()
        stage = parallel_state.get_pipeline_model_parallel_rank()
        # min_bytes 0: the benchmark's model is small (a layer's input is 512 KiB at the default shape
        # and micro-batch 1), below the default threshold of 1 MiB
        handle = (ssd_megatron.patch(path=os.path.join(args.storage, f"rank{rank}"), backend="posix", min_bytes=0,
                                     **args.offload_config)
                  if "offload" in args.mode else None)
        timeline = common.Timeline()
        plain = (schedules.forward_step, schedules.backward_step)
        schedules.forward_step = timeline.wrap("F", plain[0], _microbatch_of)
        schedules.backward_step = timeline.wrap("B", plain[1])
        run = get_forward_backward_func()
        sampler = RssSampler()
        steps, losses, held, growth = [], [], 0, 0
        try:
            for step in range(args.warmup + args.steps):
                measured = step >= args.warmup
                opt.zero_grad(set_to_none=True)
                iters = [data(shape, step, m, dp_rank, args.micro_batch) for _ in chunks]
                if measured:
                    held = max(held, common.held_bytes(params, opt))
                    sampler.start()
                timeline.begin_step()
                t0 = time.perf_counter()
                out = run(forward_step_func=forward_step_func,
                          data_iterator=iters if args.virtual > 1 else iters[0],
                          model=chunks if args.virtual > 1 else chunks[0],
                          num_microbatches=m, seq_length=shape.seq, micro_batch_size=args.micro_batch)
                t1 = time.perf_counter()
                if dp > 1:  # the data-parallel gradients, one all-reduce
                    grads = [p.grad for p in params if p.grad is not None]
                    flat = torch._utils._flatten_dense_tensors(grads)
                    torch.distributed.all_reduce(flat, group=dp_group)
                    flat /= dp
                    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                        g.copy_(r)
                    del flat
                opt.step()
                t2 = time.perf_counter()
                losses.append(float(torch.stack([d["loss"] for d in out]).mean()) if out else None)
                if measured:
                    growth = max(growth, sampler.stop() or 0)
                    busy = timeline.busy()
                    steps.append({"step_s": t2 - t0, "pipe_s": t1 - t0, "busy_s": busy,
                                  "idle_share": max(0.0, 1 - busy / (t1 - t0)),
                                  "forwards": sum(e[0] == "F" for e in timeline.events),
                                  "backwards": sum(e[0] == "B" for e in timeline.events)})
            if handle is not None:
                handle.offloader.wait()
            stats = handle.offloader.stats() if handle is not None else None
        finally:
            schedules.forward_step, schedules.backward_step = plain
            if handle is not None:
                handle.unpatch()
    result.update(rank=rank, stage=stage, dp_rank=dp_rank, steps=steps, events=timeline.events, losses=losses,
                  held_bytes=held, growth_bytes=growth, peak_bytes=held + growth,
                  offloaded_bytes=int(stats.written_bytes) if stats else 0,
                  kept_bytes=int(stats.kept_bytes) if stats else 0, offload_stats=common.offload_stats(stats))
    common.write(args.out, rank, result)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
