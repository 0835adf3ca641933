"""One rank of the DeepSpeed integration test (run by tests/test_deepspeed.py under torchrun).

For each scenario, trains the same model from the same seed twice on the same data: with
``deepspeed.initialize`` and with ``ssdtrain.integrations.deepspeed.initialize`` and an
``"ssdtrain"`` config section. Writes ``rank<N>.json`` with exact comparisons of the losses and
final parameters, the offloader's stats, the order of its micro-batch and prefetch calls, what
was left on disk, and whether the engine was restored by ``detach``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/_ds_worker.py \
        --storage DIR --out DIR --scenarios pipe,plain
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import traceback

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from deepspeed.runtime.pipe import schedule  # noqa: E402
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

from _slow_drive import slow_drive  # noqa: E402

from ssdtrain.integrations import deepspeed as ssd_deepspeed  # noqa: E402

MICRO = 2           # samples per micro-batch
MICROBATCHES = 4    # gradient accumulation steps = micro-batches per batch
STEPS = 3           # batches
WIDTH = 64

# name: (pipeline?, extra DeepSpeed config, PipelineModule kwargs)
# name: (pipeline?, extra DeepSpeed config, PipelineModule kwargs). Plain engines run first:
# DeepSpeed keeps a pipeline's model-parallel unit in a module global that a later plain engine
# would pick up.
ZERO = {"zero_allow_untested_optimizer": True}
SCENARIOS = {
    "plain": (False, {}, {}),
    "plain_zero1": (False, {"zero_optimization": {"stage": 1}, **ZERO}, {}),
    "plain_zero2": (False, {"zero_optimization": {"stage": 2}, **ZERO}, {}),
    "plain_zero3": (False, {"zero_optimization": {"stage": 3}, **ZERO}, {}),
    "plain_bf16": (False, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, **ZERO}, {}),
    "pipe": (True, {}, {}),
    # interval 1: the parameter-free layers (GELU, Tanh) are not checkpointed, so their saves reach
    # ssdtrain; DeepSpeed keeps the inputs of its checkpointed segments itself (ctx attributes).
    "pipe_ckpt": (True, {}, {"activation_checkpoint_interval": 1}),
    # torch's reentrant checkpoint saves segment inputs with save_for_backward: ssdtrain takes them.
    "pipe_ckpt_torch": (True, {}, {"activation_checkpoint_interval": 2,
                                   "activation_checkpoint_func": functools.partial(checkpoint, use_reentrant=True)}),
    "pipe_zero1": (True, {"zero_optimization": {"stage": 1}, **ZERO}, {}),
    "pipe_bf16": (True, {"bf16": {"enabled": True}}, {}),
    # On a 200 KB/s drive (names ending in _slow: a throttled posix store): what the drive cannot
    # take in time stays in memory, per micro-batch.
    "plain_slow": (False, {}, {}),
    "pipe_slow": (True, {}, {}),
}
SLOW_BPS = 2e5

OUR_ATTRIBUTES = ("forward", "destroy", "_INSTRUCTION_MAP", "_exec_schedule", "_ssdtrain_attachment")


class Net(nn.Module):
    """A small MLP that returns its loss, for the plain engine."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*_layers())
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.layers(x).float(), y)


def _layers() -> list[nn.Module]:
    return [nn.Linear(16, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.LayerNorm(WIDTH),
            nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4)]


def _pipe_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float(), y)


def batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(MICRO, 16, generator=g), torch.randint(0, 4, (MICRO,), generator=g)) for _ in range(n)]


def ds_config(extra: dict, dp: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": MICROBATCHES,
        "train_batch_size": MICRO * MICROBATCHES * dp,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **extra,
    }


def build(pipeline: bool, module_kwargs: dict) -> nn.Module:
    torch.manual_seed(0)
    if pipeline:
        return PipelineModule(layers=_layers(), num_stages=2, loss_fn=_pipe_loss, partition_method="uniform",
                              **module_kwargs)
    return Net()


def train(name: str, offload_section: dict | None, rank: int, config_dir: str) -> dict:
    pipeline, extra, module_kwargs = SCENARIOS[name]
    model = build(pipeline, module_kwargs)
    dp = 1 if pipeline else torch.distributed.get_world_size()
    config = ds_config(extra, dp)
    params = [p for p in model.parameters() if p.requires_grad]
    if offload_section is None:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    else:
        config["ssdtrain"] = offload_section
        if pipeline:  # the config as a JSON file, the way most DeepSpeed users give it
            config_path = os.path.join(config_dir, f"ds_config_{name}_rank{rank}.json")
            with open(config_path, "w") as f:
                json.dump(config, f)
            config = config_path
        engine, *_ = ssd_deepspeed.initialize(model=model, model_parameters=params, config=config)
    dtype = next(engine.module.parameters()).dtype

    calls: list[list] = []
    off = ssd_deepspeed.get_offloader(engine)
    if off is not None:  # record the order of the calls the integration makes (instance attributes)
        real_microbatch, real_prefetch = off.microbatch, off.prefetch

        def microbatch(mb):
            calls.append(["forward", mb])
            return real_microbatch(mb)

        def prefetch(mb):
            calls.append(["prefetch", mb])
            return real_prefetch(mb)

        off.microbatch, off.prefetch = microbatch, prefetch

    losses = []
    if pipeline:
        data = iter([(x.to(dtype), y) for x, y in batches(0, STEPS * MICROBATCHES)])
        for _ in range(STEPS):
            losses.append(engine.train_batch(data).float().item())
            calls.append(["step"])
    else:
        data = batches(rank, STEPS * MICROBATCHES)
        for step in range(STEPS):
            for i in range(MICROBATCHES):
                x, y = data[step * MICROBATCHES + i]
                loss = engine(x.to(dtype), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.float().item())

    if off is not None:
        del off.microbatch, off.prefetch
    result: dict = {
        "losses": [float.hex(v) for v in losses],
        "params": [p.detach().float().clone() for p in engine.module.parameters()],
        "calls": calls,
    }
    if off is not None:
        storage = offload_section["path"]
        result["visible_while_open"] = _files_under(storage)
        stats = off.stats()
        result["stats"] = {k: stats.as_dict()[k] for k in ("saved_bytes", "written_bytes", "read_bytes",
                                                            "kept_bytes", "forwarded_bytes", "live_entries",
                                                            "budget_kept_bytes", "adaptive_keep_bytes")}
        result["microbatches"] = sorted(stats.microbatches, key=repr)
        engine.destroy()                      # must close the offloader
        try:
            with off.microbatch(0):
                pass
            result["closed_by_destroy"] = False
        except RuntimeError as exc:
            result["closed_by_destroy"] = "closed" in str(exc)
        off.close()                           # idempotent
        torch.distributed.barrier()
        result["left_on_disk"] = _files_under(storage) + _dirs_under(storage)
        detached = ssd_deepspeed.detach(engine)
        result["restored"] = (
            detached is off
            and not any(name in vars(engine) for name in OUR_ATTRIBUTES)
            and PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] is PipelineEngine._exec_forward_pass
            and PipelineEngine._INSTRUCTION_MAP[schedule.BackwardPass] is PipelineEngine._exec_backward_pass
            and ssd_deepspeed.get_offloader(engine) is None
        )
    else:
        engine.destroy()
    return result


def _files_under(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]


def _dirs_under(root: str) -> list[str]:
    return [os.path.join(d, s) for d, subdirs, _ in os.walk(root) for s in subdirs]


def run(name: str, storage: str, rank: int, config_dir: str) -> dict:
    base = train(name, None, rank, config_dir)
    path = os.path.join(storage, name)
    section = {"enabled": True, "path": path, "min_bytes": 0, "backend": "posix"}
    with slow_drive(SLOW_BPS) if name.endswith("_slow") else contextlib.nullcontext():
        off = train(name, section, rank, config_dir)
    base_params, off_params = base.pop("params"), off.pop("params")
    return {
        "losses_base": base["losses"],
        "losses_off": off["losses"],
        "params_equal": len(base_params) == len(off_params)
        and all(torch.equal(a, b) for a, b in zip(base_params, off_params)),
        **{k: v for k, v in off.items() if k != "losses"},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=60.0, help="gloo timeout, seconds")
    args = p.parse_args()
    # DeepSpeed's CPU backend compiles a shared-memory op (~40 s, needs a C++ compiler) that only
    # inference_all_reduce uses; training never does. DeepSpeed probes which ops can be built once,
    # caches the answer in deepspeed.ops, and reads it before building: mark this one unbuildable.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = torch.distributed.get_rank()
    results = {}
    for name in args.scenarios.split(","):
        try:
            results[name] = {"ok": True, **run(name, args.storage, rank, args.out)}
        except Exception as exc:  # reported per scenario; the test shows the traceback
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        torch.distributed.barrier()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
