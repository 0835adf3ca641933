"""One rank of the pipeline-bubble benchmark on DeepSpeed's ``PipelineEngine`` (CPU, gloo).

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/_pipe_deepspeed.py \
        --mode offload --stages 2 --micro-batch 1 --global-batch 4 --storage DIR --out DIR

Arguments, data and the result (``rank<N>.json``) are ``_pipe_common``'s. The model is a GPT of
``Shape`` as a ``PipelineModule``: an embedding layer, ``layers`` blocks, a head; the blocks are
split evenly over the stages (``partition_method="type:Block"``), the embedding goes to the first
stage and the head to the last. Layers are ``LayerSpec``s, so a rank builds (and holds) only its
stage's, each from its own seed: the weights do not depend on the partition. With ``--stages 1`` the two ranks are data-parallel
(a one-stage ``PipelineEngine``: DeepSpeed accepts it). ``--chunks`` must be 1: DeepSpeed has no
interleaved schedule.

Modes: ``baseline``; ``recompute``: each block checkpointed (``activation_checkpoint_interval=1``,
see ``CHECKPOINT``); ``offload``: an ``"ssdtrain"`` config section (posix files under
``--storage``/rank<N>); ``recompute+offload``: both, so that what checkpointing keeps (each
block's input) is offloaded.

Times. DeepSpeed runs the gradients' reduction and the optimizer's step inside ``train_batch``,
as the last instructions of its schedule, so they are timed as instructions: ``step_s`` is all of
``train_batch``; ``reduce_s`` its ``ReduceTiedGrads`` and ``ReduceGrads``, ``optimizer_s`` its
``OptimizerStep``; ``pipe_s = step_s - reduce_s - optimizer_s`` (forwards, backwards, their
sends and receives, and the loss's broadcast after the schedule); ``busy_s`` the
``ForwardPass`` and ``BackwardPass`` instructions (an offloader's per-micro-batch work included);
``idle_share = 1 - busy_s / pipe_s``. An event's micro-batch is its rank in the step among the
forwards (or backwards): DeepSpeed's 1F1B schedule runs backwards in the order of the forwards.

Memory: DeepSpeed's optimizer step ends with ``zero_grad`` (``set_to_none``), so no gradients
are held between steps. ``offloaded_bytes`` and ``kept_bytes`` are the offloader's
``written_bytes`` and ``kept_bytes`` over the whole run (warm-up included), its last writes
waited for.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402
from deepspeed.runtime.pipe import schedule  # noqa: E402

import _pipe_common as common  # noqa: E402  (benchmarks/ is on sys.path: this file is run as a script)
from ssdtrain.bench._measure import RssSampler  # noqa: E402
from ssdtrain.integrations import deepspeed as ssd_deepspeed  # noqa: E402

# Checkpointing for the recompute modes: torch's reentrant checkpoint, not DeepSpeed's default
# (deepspeed.checkpointing.checkpoint). DeepSpeed's keeps each segment's inputs as attributes of
# its autograd ctx, out of reach of saved-tensor hooks, so recompute+offload would offload
# nothing; torch's reentrant one saves them with save_for_backward, which ssdtrain takes (the
# checkpoints are offloaded). Both recompute modes use it, so their losses compare exactly.
CHECKPOINT = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, s: common.Shape, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # each layer its own seed: the same weights whatever the partition
        self.tokens = nn.Embedding(s.vocab, s.hidden)
        self.positions = nn.Embedding(s.seq, s.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, a GELU MLP of 4x, residuals."""

    def __init__(self, s: common.Shape, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # each layer its own seed: the same weights whatever the partition
        self.heads = s.heads
        self.ln1 = nn.LayerNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden)
        self.proj = nn.Linear(s.hidden, s.hidden)
        self.ln2 = nn.LayerNorm(s.hidden)
        self.fc1 = nn.Linear(s.hidden, 4 * s.hidden)
        self.fc2 = nn.Linear(4 * s.hidden, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(h, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary."""

    def __init__(self, s: common.Shape, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # each layer its own seed: the same weights whatever the partition
        self.ln = nn.LayerNorm(s.hidden)
        self.out = nn.Linear(s.hidden, s.vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(args: argparse.Namespace, s: common.Shape) -> PipelineModule:
    # LayerSpecs: a stage builds only its own layers, so a rank holds only its stage's weights
    layers = [LayerSpec(Embedding, s, 0), *(LayerSpec(Block, s, 1 + i) for i in range(s.layers)),
              LayerSpec(Head, s, 1 + s.layers)]
    recompute = args.mode.startswith("recompute")
    return PipelineModule(
        layers=layers, num_stages=args.stages, loss_fn=loss_fn,
        # Balances the Block layers only (the embedding and the head weigh nothing here).
        partition_method=f"type:{Block.__name__}",
        activation_checkpoint_interval=1 if recompute else 0,
        activation_checkpoint_func=CHECKPOINT,
        # Only blocks: a reentrant checkpoint of the embedding, whose input (tokens) needs no
        # gradient, would cut the embedding off from backward.
        checkpointable_layers=[Block.__name__])


def ds_config(args: argparse.Namespace, microbatches: int, rank: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": microbatches,
        "train_batch_size": args.global_batch,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.mode.endswith("offload"):
        # min_bytes 0: most of the benchmark's activations are small (a block's input is 256 KiB
        # at the default shape and micro-batch 1), below the default threshold of 1 MiB.
        config["ssdtrain"] = {"enabled": True, "backend": "posix", "min_bytes": 0,
                              "path": os.path.join(args.storage, f"rank{rank}"), **args.offload_config}
    return config


def instrument(engine, timeline: common.Timeline, spent: dict) -> None:
    """Times the engine's instructions. Wraps whatever its ``_INSTRUCTION_MAP`` now holds (with an
    offloader, the integration's per-engine map, whose forward and backward wrap DeepSpeed's), as
    a new instance attribute of the same kind, so what is timed is what runs."""
    instructions = dict(engine._INSTRUCTION_MAP)
    for kind, instr in (("F", schedule.ForwardPass), ("B", schedule.BackwardPass)):
        def index(*_a, _kind=kind, **_k) -> int:  # called before the event is appended
            return sum(e[0] == _kind for e in timeline.events)
        instructions[instr] = timeline.wrap(kind, instructions[instr], index)
    for field, instr in (("reduce_s", schedule.ReduceTiedGrads), ("reduce_s", schedule.ReduceGrads),
                         ("optimizer_s", schedule.OptimizerStep)):
        instructions[instr] = accumulated(instructions[instr], spent, field)
    engine._INSTRUCTION_MAP = instructions


def accumulated(fn, spent: dict, field: str):
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[field] += time.perf_counter() - t0
    return timed


def main() -> None:
    args = common.add_arguments(argparse.ArgumentParser()).parse_args()
    if args.virtual != 1:
        raise SystemExit("--chunks: DeepSpeed's PipelineEngine has no interleaved schedule (1 chunk a stage)")
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    torch.set_num_threads(1)  # one core a rank
    # DeepSpeed's CPU accelerator would compile a shared-memory op that only inference's
    # all-reduce uses (as tests/_ds_worker.py does): mark it unbuildable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group above
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shape = common.shape_of(args)
    _, m = common.microbatches(args, world)

    module = build(args, shape)
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)  # torch's: DeepSpeed's AdamW would build an op
    engine, *_ = ssd_deepspeed.initialize(model=module, model_parameters=params, optimizer=optimizer,
                                          config=ds_config(args, m, rank))
    offloader = ssd_deepspeed.get_offloader(engine)
    stage, dp_rank = engine.stage_id, engine.grid.get_data_parallel_id()

    timeline = common.Timeline()
    spent = {"reduce_s": 0.0, "optimizer_s": 0.0}
    instrument(engine, timeline, spent)
    sampler = RssSampler()
    steps, losses = [], []
    held_max = growth_max = peak_max = 0
    for step in range(args.warmup + args.steps):
        data = [common.batch(shape, step, i, dp_rank, args.micro_batch, m) for i in range(m)]
        held = common.held_bytes(engine.module.parameters(), optimizer)
        spent.update(reduce_s=0.0, optimizer_s=0.0)
        sampler.start()
        timeline.begin_step()
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=iter(data))
        step_s = time.perf_counter() - t0
        growth = sampler.stop() or 0
        losses.append(loss.item() if engine.is_last_stage() else None)
        if step < args.warmup:
            continue
        busy = timeline.busy()
        pipe_s = step_s - spent["reduce_s"] - spent["optimizer_s"]
        steps.append({"step_s": step_s, "pipe_s": pipe_s, "busy_s": busy, "idle_share": 1 - busy / pipe_s,
                      "forwards": sum(e[0] == "F" for e in timeline.events),
                      "backwards": sum(e[0] == "B" for e in timeline.events), **spent})
        held_max, growth_max = max(held_max, held), max(growth_max, growth)
        peak_max = max(peak_max, held + growth)
    sampler.close()

    if offloader is not None:
        offloader.wait()  # the last step's writes, counted
    stats = offloader.stats() if offloader is not None else None
    result = common.header(args, "deepspeed", world)
    result.update(rank=rank, stage=stage, dp_rank=dp_rank, steps=steps, events=timeline.events, losses=losses,
                  held_bytes=held_max, growth_bytes=growth_max, peak_bytes=peak_max,
                  offloaded_bytes=stats.written_bytes if stats else 0,
                  kept_bytes=stats.kept_bytes if stats else 0, offload_stats=common.offload_stats(stats))
    common.write(args.out, rank, result)
    engine.destroy()  # closes the offloader too
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
