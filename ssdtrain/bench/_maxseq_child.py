"""What a ``ssdtrain bench --max-seq`` probe runs in its child process (``maxseq.probe_in_child``
starts it: ``python -m ssdtrain.bench._maxseq_child``, the probe's spec as JSON on stdin, its result
as one JSON line on stdout): a step of a mode at one length (:func:`_child`), or one block's bytes
for the bound (:func:`_blocks_child`). The rules of a probe are the Notes below.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import Any

from ssdtrain.bench.maxseq import _config, base_mode


def _child(spec: dict) -> dict:
    import torch

    from ssdtrain.bench import _device
    from ssdtrain.bench._measure import RssSampler
    from ssdtrain.bench.models import make_model
    from ssdtrain.bench.modes import Mode, offloader_factory
    from ssdtrain.bench.tiled_models import block_sizes, tile_layers, tile_mlps

    cfg = _config(spec.get("arch", "gpt"), spec["model"])
    name, tiled = base_mode(spec["mode"])
    dev = _device.resolve_device(spec["device"])  # "cuda" gets its index: the memory fraction's calls want one
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    out: dict[str, Any] = {"seq": cfg.seq, "fits": False, "oom": False, "peak_bytes": None, "step_s": None,
                           "error": None}
    sampler = RssSampler()
    try:
        if dev.type == "cuda" and spec["budget"] is not None:  # at most the GPU's memory: the command checks it
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(spec["budget"] / total, dev)
        model = make_model(cfg).to(dtype).to(dev)
        if tiled in ("layer", "heads"):
            heads = tiled == "heads"
            tile, memory = spec.get("tile_tokens"), spec.get("layer_memory")
            groups = (spec.get("head_groups") or cfg.heads) if heads else None
            if heads and memory:  # Note [a sized probe runs its length's form]
                like = torch.empty((spec["batch"], cfg.seq, cfg.hidden), dtype=dtype, device="meta")
                sizes = block_sizes(model.blocks[0], like, tile, groups, memory)
                out["whole_layer"], out["tile_tokens"], out["head_groups"] = sizes
                tile, groups = sizes.tile_tokens, sizes.groups
            if not out.get("whole_layer"):
                tile_layers(model, tile, groups)
        elif tiled:
            tile_mlps(model, spec.get("tile_tokens"))
        mode = Mode(name, model, offloader_factory(spec.get("path"), None))
        tokens = torch.randint(0, cfg.vocab, (spec["batch"], cfg.seq), device=dev)
        out["per_step"] = steps = []
        cpu_budget = spec["budget"] if dev.type == "cpu" else None

        def held() -> int:
            """What the model holds between steps: weights, optimizer state and gradients."""
            return sum(p.numel() * p.element_size() + (0 if p.grad is None else p.grad.numel() * p.grad.element_size())
                       for p in mode.model.parameters()) + _state_bytes(mode.opt)

        def step(slack: float = 1.0) -> float:
            """One step, its record appended to ``steps`` first (an out-of-memory leaves it there,
            partial); returns its seconds. On the CPU the sampler measures its resident growth, and
            with a budget it stops the probe once the step is over ``slack`` times it (Note [a CPU
            probe stops at its budget])."""
            rec: dict[str, Any] = {"step": len(steps) + 1}
            steps.append(rec)
            # as users do each step: the engine must not rely on the peak's age
            rec["start_bytes"] = _device.reset_memory_peaks(dev)
            before = mode.off.stats() if mode.off is not None else None
            rec["held_bytes"] = holding = held()
            sampler.start(None if cpu_budget is None else int(cpu_budget * slack) - holding,
                          lambda growth: _over_budget(out, rec, holding, growth, slack))
            try:
                t0 = time.perf_counter()
                mode.forward_backward(tokens, tokens)
                _device.synchronize(dev)
                rec["step_s"] = time.perf_counter() - t0
                return rec["step_s"]
            finally:
                rec["growth_bytes"] = sampler.stop()
                rec["peak_bytes"] = _device.memory_peaks(dev)["max_memory_allocated_bytes"]
                if before is not None:
                    rec.update(_where_saves_went(mode, before))

        if cpu_budget is not None:  # Note [a CPU probe stops at its budget]: first-time costs out of its steps
            short = tokens[:, :PRE_WARM_TOKENS]  # without the offloader, which would learn its forward
            mode.forward_backward(short, short, hooks=contextlib.nullcontext())
        step(WARMUP_SLACK)  # warm-up: the first step pays its first allocations
        mode.drain()
        while len(steps) < WARMUP_MAX and _learning(mode):  # Note [a probe measures the steady state]
            step(WARMUP_SLACK)
            mode.drain()
        mode.opt.zero_grad(set_to_none=True)
        out["step_s"] = step()
        # with no gradients, what the model held before the step: its weights and AdamW state
        growth, model_bytes = steps[-1]["growth_bytes"], steps[-1]["held_bytes"]
        mode.drain()
        if "host_copied_bytes" in steps[-1]:
            out["offload"] = steps[-1]
        if dev.type == "cuda":
            out["peak_bytes"] = steps[-1]["peak_bytes"]
            out["fits"] = True
        else:
            out["peak_bytes"] = (growth or 0) + model_bytes
            out["model_bytes"], out["growth_bytes"] = model_bytes, growth
            out["fits"] = spec["budget"] is None or out["peak_bytes"] <= spec["budget"]
        out["start_bytes"] = steps[-1]["start_bytes"]
        mode.close()
    except torch.OutOfMemoryError as exc:
        out["oom"], out["error"] = True, f"step {len(out.get('per_step') or [])}: " + str(exc).splitlines()[0]
    finally:
        sampler.close()
    return out


def _state_bytes(opt) -> int:
    """The optimizer state's bytes (AdamW's two moments a parameter, and its step counts)."""
    import torch

    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


# Note [a sized probe runs its length's form]: a +tiled-heads layer sized to its memory
# (ssdtrain.longctx.sizing) chooses its form at each call from the length, so the probe's 64-token
# pre-warm (Note [a CPU probe stops at its budget]) would run the layer untiled and leave the
# grouped path's first costs to the steps at the probe's length: at 22528 tokens on the CPU
# (2026-11-29) three probes sized so went over the 64 MiB budget where the same layers tiled by
# hand peaked at 54-59 MiB. A probe therefore takes the form its length gets, tiles and groups or
# the layer untiled, for every step.


# Note [a CPU probe stops at its budget]: on a GPU a step over the budget fails at the allocation
# that passes it (the memory fraction), partway through. A CPU probe does the same: the sampling
# thread, once the step's resident growth plus what the model held before it passes the budget,
# writes the probe's result (does not fit, the growth seen so far) and ends the process at once,
# instead of finishing a step that could take minutes at a length already known not to fit (the
# warm-up too, as on a GPU, with the slack below). The offloader's files need no cleanup (they are
# unlinked at creation: ssdtrain/store/_arena.py), and the parent reads the line as it reads any.
# A first step costs more than the steps after it, whatever its length: the optimizer's state,
# lazy imports, thread pools (the Llama model's first step at 4096 tokens grew 21 MiB more than its
# second, 13 of them AdamW's moments). So a CPU probe with a budget first takes one step of
# PRE_WARM_TOKENS, unmeasured and without the offloader (whose write rule learns how long a
# forward takes: a 64-token forward taught it that a 4096-token one ends at once, and it kept all
# 35 MiB of checkpoints). The warm-up at the probe's length still pays first costs at that length:
# at 4096 tokens its peak was 6 MiB (recompute) and 14 MiB (recompute+offload+tiled: 46 against
# 32) over the measured step's. So a warm-up is stopped only at WARMUP_SLACK times the budget (a
# length that does not fit by that much is known not to fit), and the measured step at the budget.
PRE_WARM_TOKENS = 64
WARMUP_SLACK = 1.5


def _over_budget(out: dict, rec: dict, held: int, growth: int, slack: float) -> None:
    result = {"seq": out["seq"], "fits": False, "oom": False, "over_budget": True, "step_s": None,
              "peak_bytes": held + growth, "growth_bytes": growth, "held_bytes": held, "stopped_at_step": rec["step"],
              "error": f"step {rec['step']}: resident growth {growth >> 20} MiB over what the model held "
                       f"({held >> 20} MiB) passed " + ("the budget" if slack == 1 else f"{slack} times the budget")
                       + "; stopped there"}
    os.write(1, (json.dumps(result) + "\n").encode())
    os._exit(0)


def _where_saves_went(mode, before) -> dict:
    """A step's offloading, in bytes: where its saves went (the host tier, the drives, kept on
    the device), and the tier's state: so that a probe whose peak is not what the mode
    promises says why (H200, 2026-11-27: recompute+offload's peak grew 47 KB a token where the
    block inputs it offloads are 48 of recompute's 60)."""
    after = mode.off.stats()
    diff = {f: getattr(after, f) - getattr(before, f)
            for f in ("saved_bytes", "unique_bytes", "host_copied_bytes", "written_bytes", "spilled_bytes",
                      "kept_bytes", "budget_kept_bytes", "peak_kept_bytes")}
    diff["drive_bytes"] = diff.pop("written_bytes") - diff["host_copied_bytes"]
    diff.update(host_tier_pinned_bytes=after.host_tier_pinned_bytes, host_tier_peak_bytes=after.host_tier_peak_bytes,
                peak_resident_bytes=after.peak_resident_bytes)
    tier = getattr(mode.off, "_tier", None)
    if tier is not None:  # the copy clock as this step's forward began (0: the forward measured copying nothing)
        clock = tier.clock
        diff.update(copy_limit_bytes=clock.limit, copy_deferred=clock.deferred, copy_rate=clock.rate,
                    host_tier_wanted_bytes=tier.pool.wanted if tier.pool is not None else None)
    return diff


# Note [a probe measures the steady state]: an offloader with the host tier learns its copy
# budget over its first steps (the copy rate, measured once the first pinned slab is in; then a
# forward measured with no copy where the device has room: Note [the reference forward needs
# room]), so a probe's measured step comes after that: at most ``WARMUP_MAX`` warm-up steps. On an
# H200 (2026-11-27) a probe with one warm-up measured the forward that copies nothing: its peak was
# recompute's.
WARMUP_MAX = 5


def _learning(mode) -> bool:
    """Whether ``mode``'s host tier is still learning its copy budget, or its pool is still being
    pinned up to what a step asked of it (Note [the pool grows to its demand])."""
    tier = getattr(mode.off, "_tier", None)
    if tier is None or tier.pool is None:
        return False
    clock, pool = tier.clock, tier.pool
    growing = pool.pinned < min(pool.wanted, pool.capacity) and pool.error is None
    return clock.rate is None or clock.ratio is None and not clock.deferred or growing


def _blocks_child(spec: dict) -> dict:
    """One block's bytes at ``seq`` tokens: its input, and what its recomputation and backward
    hold (``torch.utils.checkpoint`` of the block, then backward from a gradient of its output),
    untiled and with its MLP tiled: the peak over ``reps`` runs, after one warm-up each; plus the
    output's gradient, which exists while a block runs backward in a model."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from ssdtrain.bench import _device
    from ssdtrain.bench._measure import RssSampler
    from ssdtrain.bench.models import make_model
    from ssdtrain.bench.tiled_models import tile_layers, tile_mlps

    cfg = _config(spec.get("arch", "gpt"), spec["model"]).replace(layers=1)
    dev = _device.resolve_device(spec["device"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    model = make_model(cfg).to(dtype).to(dev)
    block = model.blocks[0]
    b, s, h = spec["batch"], cfg.seq, cfg.hidden
    x = torch.randn(b, s, h, dtype=dtype, device=dev, requires_grad=True)
    g = torch.randn(b, s, h, dtype=dtype, device=dev)
    out = {"seq": s, "input_bytes": x.numel() * x.element_size()}
    sampler = RssSampler()
    try:
        keys = (("block_bytes", "block_tiled_bytes") + (("block_layer_bytes",) if spec.get("layer") else ())
                + (("block_heads_bytes",) if spec.get("heads") else ()))
        for key in keys:
            if key == "block_tiled_bytes":
                tile_mlps(model, spec.get("tile_tokens"))
            elif key == "block_layer_bytes":
                tile_layers(model, spec.get("tile_tokens"))  # the block's own forward, tiled whole
            elif key == "block_heads_bytes":
                tile_layers(model, spec.get("tile_tokens"), spec.get("head_groups") or cfg.heads)  # a group at a time
            peaks = []
            for rep in range(spec.get("reps", 3) + 1):
                block.zero_grad(set_to_none=True)
                x.grad = None
                start = _device.reset_memory_peaks(dev)
                sampler.start()
                y = checkpoint(block, x, use_reentrant=False)
                y.backward(g)
                _device.synchronize(dev)
                growth = sampler.stop()
                del y
                if dev.type == "cuda":
                    growth = _device.memory_peaks(dev)["max_memory_allocated_bytes"] - start
                if rep:  # the first is a warm-up
                    peaks.append(growth or 0)
            out[key] = max(peaks) + g.numel() * g.element_size()
            out[key + "_runs"] = peaks
    finally:
        sampler.close()
    return out


def main() -> int:
    spec = json.loads(sys.stdin.read())
    sys.stdout.write(json.dumps(_blocks_child(spec) if spec.get("kind") == "blocks" else _child(spec)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
