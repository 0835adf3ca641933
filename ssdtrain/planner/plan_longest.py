"""The longest sequence each mode trains on one GPU: ``ssdtrain plan``'s section for long-context
users (micro-batch 1; PEFT, sharded states and a chunked loss as ``Inputs`` says), on the memory
model of ``plan_model.py`` and the host tier's and the drive's share of ``plan_drive.py``."""

from __future__ import annotations

import math
from dataclasses import replace

from ssdtrain.planner.plan_drive import _fits
from ssdtrain.planner.plan_model import _stage_memory, _usable_bytes, evaluate

__all__ = ["LONGEST_MODES", "longest", "format_longest"]

LONGEST_MODES = ("baseline", "recompute", "offload", "recompute+offload")
_SEQ_STEP = 256  # sequence lengths are searched in multiples of this


def _memory_at(inp, mode: str, seq: int) -> float:
    """Peak bytes per GPU for micro-batches of one sequence of ``seq`` tokens at ``inp.stages or 1``
    stages; the offload modes free what the host tier and the drive take (:func:`_fits`)."""
    one = replace(inp, seq=seq)
    p = inp.stages or 1
    m = max(1, one.global_batch // max(1, one.gpus // p))
    if mode in ("baseline", "recompute"):
        return _stage_memory(one, mode, p, 1, m)
    return _fits(one, mode, p, 1, m)[0]


def longest(inp) -> dict:
    """Per mode, the longest sequence (micro-batch 1) that fits a GPU's usable memory, in multiples
    of 256 tokens, with the step time there (the underlying mode's: offloading is free in this
    model); and for checkpointing, what offloading the blocks' inputs buys:
    ``(L x input + block) / block`` at recompute's longest sequence."""
    usable = _usable_bytes(inp)
    p = inp.stages or 1
    rows: dict[str, dict | None] = {}
    for mode in LONGEST_MODES:
        if _memory_at(inp, mode, _SEQ_STEP) > usable:
            rows[mode] = None
            continue
        lo, hi = _SEQ_STEP, 2 * _SEQ_STEP
        while hi <= 1 << 24 and _memory_at(inp, mode, hi) <= usable:
            lo, hi = hi, 2 * hi
        while hi - lo > _SEQ_STEP:
            mid = (lo + hi) // 2 // _SEQ_STEP * _SEQ_STEP
            lo, hi = (mid, hi) if _memory_at(inp, mode, mid) <= usable else (lo, mid)
        base = "recompute" if mode in ("recompute", "recompute+offload") else "baseline"
        cfg = evaluate(replace(inp, seq=lo), base, p, 1)
        rows[mode] = {"max_seq": lo, "capped": hi > 1 << 24, "step_time_s": cfg.step_time_s if cfg else None,
                      "memory_gib": _memory_at(inp, mode, lo) / (1 << 30)}
    out: dict = {"stages": p, "usable_gib": usable / (1 << 30), "modes": rows, "gain": None}
    rec, ro = rows.get("recompute"), rows.get("recompute+offload")
    if rec:
        one = replace(inp, seq=rec["max_seq"])
        layers = math.ceil(inp.layers / p)
        block = one.act_layer(1)
        inputs = layers * inp.dtype_bytes * one.seq * inp.hidden
        out["gain"] = {"predicted": (inputs + block) / block,
                       "model": ro["max_seq"] / rec["max_seq"] if ro else None}
    return out


def format_longest(section: dict) -> list[str]:
    """Lines of the human-readable plan for :func:`longest`'s section."""
    lines = [f"longest sequence per GPU (micro-batch 1, {section['stages']} stage(s), "
             f"{section['usable_gib']:.1f} GiB usable):"]
    for mode, row in section["modes"].items():
        if row is None:
            lines.append(f"  {mode}: not even {_SEQ_STEP} tokens fit")
            continue
        step = "" if row["step_time_s"] is None else f", step {row['step_time_s']:.3f}s per sequence"
        lines.append(f"  {mode}: {row['max_seq']}{'+' if row['capped'] else ''} tokens "
                     f"({row['memory_gib']:.1f} GiB{step})")
    gain = section["gain"]
    if gain and gain["model"]:
        lines.append(f"  offloading the checkpoints: x{gain['model']:.2f} recompute's sequence here (the host tier's and "
                     f"the drive's share included); all of them off the GPU would give (L x input + block) / block = "
                     f"x{gain['predicted']:.2f}")
    return lines
