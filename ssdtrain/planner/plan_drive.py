"""The drive-limited part of ``ssdtrain plan``: what a drive can take off a step at no cost.

A GPU makes activations 20-60x faster than one NVMe drive takes them, so the drive, not the
memory, decides what can be offloaded. In one micro-batch's step, roughly::

    offloadable at no cost ~ min(B_write * T_forward, B_read * T_backward)

bytes can go out during forward and come back during backward without compute waiting, less
what the order of the saves forbids. The planner works that out save by save, from the model's
dimensions, the achieved compute rate and the drive: ``plan_saves.py`` lays out a micro-batch's
saves in time, ``plan_simulate.py`` plays the offloader's rules on them (the rules, and what is not
modelled, are in their docstrings). This module asks that of the plan's configurations: per mode,
the fastest one that fits once offloading frees what the drive carries, its largest micro-batch,
and the drives full offload needs (as a sizing rule, the saved bytes of a micro-batch over what one
drive carries in its step, or slot); and it adds the drive's flags to ``ssdtrain plan``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

from ssdtrain.planner.plan_model import _divisors, _stage_counts, _stage_memory, _usable_bytes, evaluate
from ssdtrain.planner.plan_saves import saves
from ssdtrain.planner.plan_simulate import DriveStep, simulate

__all__ = ["DRIVE_MODES", "add_arguments", "drive_limited", "drive_step", "format_drive", "input_fields"]

MIB = 1 << 20
DRIVE_MODES = ("offload", "recompute+offload")


def drive_step(inp, mode: str, stages: int, micro_batch: int, *, head: bool | None = None,
               inflight: int = 1) -> DriveStep:
    """:func:`simulate` for ``inp`` (a :class:`ssdtrain.planner.plan_inputs.Inputs`): one micro-batch of the
    first of ``stages`` pipeline stages (the whole model, head included, when ``stages == 1``;
    under 1F1B otherwise), ``inflight`` micro-batches sharing the host tier."""
    if mode not in DRIVE_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {DRIVE_MODES}")
    layers = math.ceil(inp.layers / stages)
    list_, fwd, bwd = saves(
        layers=layers, seq=inp.seq, hidden=inp.hidden, heads=inp.heads, vocab=inp.vocab, micro_batch=micro_batch,
        dtype_bytes=inp.dtype_bytes, flash=inp.flash, dropout=inp.dropout, checkpoint=mode != "offload",
        head=stages == 1 if head is None else head, tflops=inp.rate(micro_batch),
        backward_tflops=inp.backward_rate(micro_batch), arch=inp.arch, kv_heads=inp.kv_heads,
        ffn_hidden=inp.ffn_hidden)
    return simulate(list_, forward_s=fwd, backward_s=bwd, write_bps=inp.drive_gbps * inp.drives * 1e9,
                    read_bps=inp.read_gbps * inp.drives * 1e9, handoff_bytes=inp.handoff_bytes * inp.drives,
                    min_bytes=inp.min_bytes, pipelined=stages > 1,
                    host_bps=inp.host_gbps * 1e9 if inp.host_tier else 0.0,
                    host_capacity=inp.host_gib * (1 << 30) / inflight if inp.host_tier else 0)


def _fits(inp, mode: str, p: int, b: int, m: int) -> tuple[float, DriveStep]:
    """Peak bytes per GPU at (p, b) when each micro-batch in flight frees what the host tier and the
    drive can take."""
    inflight = min(m, p)
    step = drive_step(inp, mode, p, b, inflight=inflight)
    if mode == "offload":
        layer_act = math.ceil(inp.layers / p) * inp.act_layer(b)
        return _stage_memory(inp, "offload", p, b, m, min(1.0, step.free_bytes / layer_act)), step
    return _stage_memory(inp, "recompute", p, b, m) - inflight * step.free_bytes, step


def _best(inp, mode: str) -> dict | None:
    usable = _usable_bytes(inp)
    best = None
    for p in _stage_counts(inp):
        dp = inp.gpus // p
        if inp.global_batch % dp:
            continue
        for b in _divisors(inp.global_batch // dp):
            cfg = evaluate(inp, "baseline" if mode == "offload" else "recompute", p, b)
            if cfg is None:
                continue
            memory, step = _fits(inp, mode, p, b, cfg.num_microbatches)
            if memory > usable:
                continue
            key = (float(f"{cfg.step_time_s:.9g}"), p, -b)
            if best is None or key < best[0]:
                best = (key, cfg, memory, step)
    if best is None:
        return None
    _, cfg, memory, step = best
    m = cfg.num_microbatches
    return {"stages": cfg.stages, "data_parallel": cfg.data_parallel, "micro_batch": cfg.micro_batch,
            "num_microbatches": m, "bubble_fraction": cfg.bubble_fraction, "memory_gib": memory / (1 << 30),
            "step_time_s": cfg.step_time_s, "free_bytes_per_step": step.free_bytes * m,
            "written_bytes_per_step": step.written_bytes * m, "saved_bytes_per_step": step.saved_bytes * m,
            "drive": asdict(step)}


def _max_micro_batch(inp, mode: str, p: int) -> int:
    usable = _usable_bytes(inp)
    if _fits(inp, mode, p, 1, p)[0] > usable:
        return 0
    lo, hi = 1, 2
    while hi < 1 << 20 and _fits(inp, mode, p, hi, p)[0] <= usable:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(inp, mode, p, mid, p)[0] <= usable else (lo, mid)
    return lo


def drive_limited(inp) -> dict:
    """The drive-limited section of the plan: per mode, at its fastest fitting configuration,
    the bytes a step offloads at no cost, the micro-batch and bubble that buys, and the drives
    needed to offload everything."""
    out: dict = {"drives": inp.drives, "write_gbps_per_drive": inp.drive_gbps, "read_gbps_per_drive": inp.read_gbps,
                 "handoff_bytes_per_drive": inp.handoff_bytes, "min_bytes": inp.min_bytes,
                 "host_gbps": inp.host_gbps if inp.host_tier else 0.0, "host_gib": inp.host_gib if inp.host_tier else 0.0}
    for mode in DRIVE_MODES:
        best = _best(inp, mode)
        row: dict = {"best": best, "max_micro_batch": None, "drives_for_full_offload": None}
        if best is not None:
            row["max_micro_batch"] = _max_micro_batch(inp, mode, best["stages"])
            one = inp.__class__(**{**asdict(inp), "drives": 1, "host_gbps": 0.0})  # a drive's own carry
            per_drive = drive_step(one, mode, best["stages"], best["micro_batch"]).capacity_bytes
            need = best["drive"]["saved_bytes"]
            row["drives_for_full_offload"] = math.ceil(need / per_drive) if per_drive > 0 else None
        out[mode] = row
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


def format_drive(section: dict) -> list[str]:
    """Lines of the human-readable plan for :func:`drive_limited`'s section."""
    tier = (f"; host tier {section['host_gbps']:g} GB/s, {section['host_gib']:g} GiB per GPU in front of it"
            if section.get("host_gbps") else "; no host tier")
    lines = [f"drive-limited (at no cost: never waits on the drive): {section['drives']} drive(s) per GPU, "
             f"{section['write_gbps_per_drive']:g} GB/s write, {section['read_gbps_per_drive']:g} GB/s read each"
             + tier]
    for mode in DRIVE_MODES:
        row = section[mode]
        best = row["best"]
        if best is None:
            lines.append(f"  {mode}: does not fit at any configuration")
            continue
        d = best["drive"]
        share = d["free_bytes"] / d["saved_bytes"] if d["saved_bytes"] else 0.0
        possible = d["free_bytes"] / d["possible_bytes"] if d["possible_bytes"] else 0.0
        lines.append(
            f"  {mode}: the peak falls by {_gib(d['free_bytes'])} per micro-batch at no cost ({share:.0%} of "
            f"{_gib(d['saved_bytes'])} saved; {possible:.0%} of the possible {_gib(d['possible_bytes'])}, what the "
            f"{'host tier and the drive take' if section.get('host_gbps') else 'drive takes'} in "
            f"{'a slot' if best['stages'] > 1 else 'forward'}); "
            f"{_gib(best['free_bytes_per_step'])} of {_gib(best['saved_bytes_per_step'])} per step; "
            f"{best['stages']} stage(s), micro-batch {best['micro_batch']} (max {row['max_micro_batch']}), "
            f"bubble {best['bubble_fraction']:.1%}, {best['memory_gib']:.1f} GiB/GPU, step {best['step_time_s']:.3f}s")
        if best["stages"] > 1:
            carry = (f"per micro-batch (1F1B): drive could carry {_gib(d['capacity_bytes'])} = min(write, read) x "
                     f"slot {d['forward_s'] + d['backward_s']:.3f}s (forward {d['forward_s']:.3f}s + backward "
                     f"{d['backward_s']:.3f}s)")
        else:
            carry = (f"per micro-batch: drive could carry {_gib(d['capacity_bytes'])} = min(write x forward "
                     f"{d['forward_s']:.3f}s, read x backward {d['backward_s']:.3f}s)")
        if section.get("host_gbps"):
            lines.append(f"    host tier: {_gib(d['host_bytes'])} copied before the peak, {_gib(d['spilled_bytes'])} it "
                         "had no room for handed to the drive")
        lines.append(
            f"    {carry}; full offload needs {row['drives_for_full_offload']} drive(s) per GPU"
            + ("; reads would not come back in time: the write budget keeps the rest" if d["budget_bound"] else ""))
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The drive-limited model's flags on ``ssdtrain plan``'s parser."""
    ap.add_argument("--drives", type=int, default=1, help="drives per GPU, each of --drive-gbps (default 1)")
    ap.add_argument("--drive-read-gbps", type=float, default=None,
                    help="sustained read GB/s of one drive (default: --drive-gbps)")
    ap.add_argument("--backward-tflops", type=float, default=None,
                    help="achieved TFLOPS in backward (default: --tflops); with --tflops, the compute rate "
                    "measured on a machine (FLOPs of forward over its seconds, 2x that for backward)")
    ap.add_argument("--host-gbps", type=float, default=25.0,
                    help="the host tier's copy rate between a GPU and pinned host memory, GB/s each way (default 25: "
                    "PCIe 4.0 x16; an H100's PCIe 5.0 measured 54; `ssdtrain probe` measures it); 0: no host tier")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="pinned host memory per GPU for the tier (host_bytes; default 64: a quarter of 2 TB among 8 "
                    "GPUs, ssdtrain's default share); 0: no host tier")
    ap.add_argument("--node-host-gib", type=float, default=None, metavar="GIB",
                    help="pinned host memory of one node for the tier, all its GPUs together: each GPU's share is "
                    "this over --gpus-per-node (instead of --host-gib)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per node sharing --node-host-gib (default: --gpus, at most 8)")
    ap.add_argument("--min-bytes", type=int, default=1 << 20,
                    help="saves under this many bytes stay in memory (the offloader's min_bytes; default 1 MiB)")
    ap.add_argument("--handoff-mib", type=float, default=64.0,
                    help="MiB the offloader hands to one drive at once: 2 x chunk_bytes x io_threads "
                    "(default 64: 8 MiB chunks, 4 threads)")


def input_fields(args: argparse.Namespace) -> dict:
    """:class:`ssdtrain.planner.plan_inputs.Inputs` fields from :func:`add_arguments`'s flags."""
    if args.host_gib is not None and args.node_host_gib is not None:
        raise ValueError("give --host-gib (per GPU) or --node-host-gib (per node), not both")
    return {"drives": args.drives, "drive_read_gbps": args.drive_read_gbps, "backward_tflops": args.backward_tflops,
            "min_bytes": args.min_bytes, "handoff_bytes": int(args.handoff_mib * MIB), "host_gbps": args.host_gbps,
            "host_gib": 64.0 if args.host_gib is None else args.host_gib, "node_host_gib": args.node_host_gib,
            "gpus_per_node": args.gpus_per_node}
