"""``ssdtrain bench --device sim:h100``: the bench's modes on a modelled GPU, on any machine.

Each mode trains the bench's GPT on its own :class:`~ssdtrain.device.model.ModelledGPU` without
data (meta tensors: Note [a modelled GPU without data]): the engine's GPU path runs unchanged
(the host tier, its copy clock and pacing, the offloader's decisions), every op is charged its
FLOPs or bytes at the preset's rates, and the host pays its set cost per launch, copy, event and
hook. A step's time is the virtual clock's from one synchronize to the next; its peak is the
modelled allocator's (weights, gradients and AdamW state included). No wall clock is read: the
same arguments give the same table, on a laptop or in CI. The table says it is modelled and
prints the rates it assumed; figures are as good as those rates (``ssdtrain/device/rates.py``
says where each came from). Not modelled: the drive (the tier's spill goes nowhere: give the
tier room, ``host_bytes``), kernels' launch overlap beyond ``Rates.launch_s``, the caching
allocator's rounding and fragmentation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ssdtrain._units import fmt_bytes
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.bench.modes import OFFLOAD_MODES, Mode
from ssdtrain.device import rates as _rates

__all__ = ["SIM_DEVICES", "SIM_MODES", "ModelledArgs", "format_modelled", "max_seq_modelled", "run_modelled",
           "sim_rates"]

SIM_DEVICES = {"sim:h100": _rates.H100, "sim:h200": _rates.H200}
"""What ``--device sim:...`` takes, and the rates each stands for."""
SIM_MODES = ("baseline", "recompute", "offload", "recompute+offload")
"""The modes the modelled bench runs (``save_on_cpu`` is torch's own hooks: not modelled)."""
DEFAULT_HOST_BYTES = 64 << 30
"""The host tier's size on the model unless given: a GPU host's share, not this machine's RAM."""


def sim_rates(name: str, memory_bytes: int | None = None, **changes: Any) -> _rates.Rates:
    """The rates ``--device name`` stands for, with the device memory capped at ``memory_bytes``.

    Raises:
        ValueError: ``name`` is not one of :data:`SIM_DEVICES`.
    """
    if name not in SIM_DEVICES:
        raise ValueError(f"device {name!r} is not a modelled GPU; use one of {', '.join(SIM_DEVICES)}")
    r = SIM_DEVICES[name]
    if memory_bytes is not None:
        changes["memory_bytes"] = memory_bytes
    return dataclasses.replace(r, **changes) if changes else r


@dataclass(frozen=True, kw_only=True)
class ModelledArgs:
    """One modelled run: the shape, the modes, the steps and the machine."""

    device: str = "sim:h100"
    model: GPTConfig
    batch: int = 4
    seq: int | None = None
    """Tokens a sequence (default ``model.seq``)."""
    steps: int = 3
    """Steps per mode after one warm-up; the last is reported (the clock has learned by then)."""
    modes: tuple[str, ...] = SIM_MODES
    dtype: torch.dtype = torch.bfloat16
    host_bytes: int = DEFAULT_HOST_BYTES
    rates: _rates.Rates | None = None
    """Overrides the device's preset rates (``sim_rates``)."""
    offload_fields: dict | None = None
    """Extra Offloader settings for the offload modes (as ``OffloadConfig`` takes them)."""
    configure: Any = None
    """Called with each Offloader made (a diagnostic's change, e.g. the host's pacing off)."""
    data: bool = False
    """``True``: the model computes on CPU tensors (its bytes, at shapes the CPU can run): the
    check that the run without data gives the same timeline and peaks."""
    seqs: tuple[int, ...] | None = None
    """Each step's sequence length in turn, the warm-up's first (default: ``seq`` for each of
    ``steps + 1``): steps of changing length, as a collator padding each batch to its longest."""

    def __post_init__(self) -> None:
        sim_rates(self.device)
        bad = [m for m in self.modes if m not in SIM_MODES]
        if bad or not self.modes:
            raise ValueError(f"modes {bad or '(none)'} are not modelled; choose from {', '.join(SIM_MODES)}")
        for name in ("batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


def _mode_steps(name: str, args: ModelledArgs) -> list[dict]:
    """Every step of one mode on its own modelled GPU (Note [a modelled GPU without data])."""
    import ssdtrain
    from ssdtrain.device.model import ModelledGPU, modelled
    from ssdtrain.device.model_ops import ModelledCompute

    rates = args.rates or sim_rates(args.device)
    seq = args.seq or args.model.seq
    seqs = args.seqs or (seq,) * (args.steps + 1)
    gpu = ModelledGPU(rates, data=args.data)
    where = "cpu" if args.data else "meta"
    steps = []
    with modelled(gpu):
        torch.manual_seed(0)
        with torch.device(where):
            model = GPT(args.model.replace(seq=max(*seqs, args.model.seq))).to(args.dtype)
        gpu.adopt(*model.parameters(), *model.buffers())

        def make(m: torch.nn.Module, fields: dict) -> Any:
            off = ssdtrain.Offloader(m, backend="memory", host_bytes=args.host_bytes,
                                     **{**fields, **(args.offload_fields or {})})
            if args.configure is not None:
                args.configure(off)
            return off

        mode = Mode(name, model, make)
        try:
            with ModelledCompute(gpu):
                for n in seqs:
                    tokens = torch.zeros(args.batch, n, dtype=torch.long, device=where)
                    gpu.adopt(tokens)
                    steps.append({"seq": n, **_step(gpu, mode, tokens)})
        finally:
            mode.close()
    return steps


class _Marks:
    """``Marks`` on the model: events on its compute stream."""

    def __init__(self, gpu: Any) -> None:
        self.gpu, self.events, self.host = gpu, {}, {}

    def mark(self, name: str) -> None:
        self.host[name] = self.gpu.host_now
        self.events[name] = self.gpu.compute.record_event()


def _step(gpu: Any, mode: Mode, tokens: torch.Tensor) -> dict:
    before = mode.off.stats() if mode.off is not None else None
    if mode.off is not None:
        mode.off.reset_peak()
    mode.opt.zero_grad(set_to_none=True)
    gpu.synchronize()
    gpu.reset_peak()
    start_bytes = gpu.allocated()
    marks = _Marks(gpu)
    marks.mark("start")
    t0 = gpu.host_now
    mode.forward_backward(tokens, tokens, marks)
    gpu.synchronize()
    step = {"seconds": gpu.host_now - t0, "peak_bytes": gpu.peak(), "start_bytes": start_bytes,
            "forward": marks.events["start"].elapsed_time(marks.events["forward_end"]) / 1e3,
            "host_forward": marks.host["forward_end"] - marks.host["start"]}
    if mode.off is not None:
        mode.off.wait()
        after = mode.off.stats()
        step.update(unique=after.unique_bytes - before.unique_bytes,
                    copied=after.host_copied_bytes - before.host_copied_bytes,
                    kept=after.kept_bytes - before.kept_bytes, limit=after.host_copy_limit_bytes,
                    spilled=after.spilled_bytes - before.spilled_bytes, pinned=after.host_tier_pinned_bytes)
    return step


def run_modelled(args: ModelledArgs) -> dict:
    """Each mode's steps on its own modelled GPU; the result's rows hold the last step of each,
    and its step's ratio to baseline's and recompute's where they ran."""
    rates = args.rates or sim_rates(args.device)
    rows = {}
    for name in args.modes:
        steps = _mode_steps(name, args)
        rows[name] = {"mode": name, **steps[-1], "steps": steps}
    for name, row in rows.items():
        for ref in ("baseline", "recompute"):
            if ref in rows:
                row[f"vs_{ref}"] = row["seconds"] / rows[ref]["seconds"]
        ref = rows.get("recompute" if name == "recompute+offload" else "baseline")
        if name in OFFLOAD_MODES and ref is not None:
            # benchmarks/tier_vs_peers.py's measures: the peak above the step's start, its fall
            # against the reference's, over what the copy engine could take in the reference's
            # forward (offload) or over the saves (recompute+offload: the checkpoints)
            row["fall"] = (ref["peak_bytes"] - ref["start_bytes"]) - (row["peak_bytes"] - row["start_bytes"])
            bound = row["unique"] if name == "recompute+offload" else min(
                rates.d2h_bytes_per_s * ref["forward"], row["unique"])
            row["bound"], row["of_bound"] = bound, row["fall"] / bound if bound else None
    return {"device": args.device, "modelled": True, "rates": dataclasses.asdict(rates),
            "model": dataclasses.asdict(args.model), "batch": args.batch, "seq": args.seq or args.model.seq,
            "dtype": str(args.dtype).removeprefix("torch."), "host_bytes": args.host_bytes, "rows": list(rows.values())}


def fits(args: ModelledArgs, name: str, budget: int) -> tuple[bool, dict]:
    """Whether ``name`` trains within ``budget`` device bytes at ``args.seq`` (every step's modelled
    peak, weights and optimizer state included), with its last step."""
    capped = dataclasses.replace(args.rates or sim_rates(args.device), memory_bytes=budget)
    steps = _mode_steps(name, dataclasses.replace(args, modes=(name,), rates=capped))
    return all(s["peak_bytes"] <= budget for s in steps), steps[-1]


def max_seq_modelled(args: ModelledArgs, name: str, budget: int, start: int, limit: int = 1 << 20) -> dict:
    """The longest sequence ``name`` trains within ``budget`` on the model: doubling from
    ``start``, then bisection to an eighth of the last step (as ``--max-seq``)."""
    probe = lambda s: fits(dataclasses.replace(args, seq=s, modes=(name,)), name, budget)  # noqa: E731
    ok, step = probe(start)
    if not ok:
        return {"mode": name, "seq": None, "failed": start}
    best, best_step, bad = start, step, None
    while bad is None and best * 2 <= limit:
        ok, step = probe(best * 2)
        if ok:
            best, best_step = best * 2, step
        else:
            bad = best * 2
    if bad is not None:
        stride = best // 8
        lo = best
        while lo + stride < bad:
            ok, step = probe(lo + stride)
            if not ok:
                bad = lo + stride
                break
            lo += stride
            best, best_step = lo, step
    return {"mode": name, "seq": best, "failed": bad, "step": best_step}


def format_modelled(result: dict) -> str:
    """The modelled table, headed by what was modelled and the rates assumed."""
    r = result["rates"]
    m = result["model"]
    lines = [
        f"MODELLED, not measured: {result['device']} (ssdtrain.device.model, no GPU used)",
        f"  rates: {r['flops_per_s'] / 1e12:.0f} TFLOP/s, HBM {r['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"d2h {r['d2h_bytes_per_s'] / 1e9:.1f} GB/s, h2d {r['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"memory {fmt_bytes(r['memory_bytes'])}; host per launch {r['launch_s'] * 1e6:.1f} us, per copy "
        f"{r['copy_issue_s'] * 1e6:.1f} us, per pack {r['pack_s'] * 1e6:.1f} us, per unpack {r['unpack_s'] * 1e6:.1f} us",
        f"  model: GPT {m['layers']} x {m['hidden']}, {m['heads']} heads, vocab {m['vocab']}, seq {result['seq']}, "
        f"batch {result['batch']}, {result['dtype']}; host tier {fmt_bytes(result['host_bytes'])}; not modelled: the "
        "drive, the allocator's rounding",
        "",
        f"{'mode':<20} {'step':>10} {'vs base':>8} {'vs recomp':>9} {'peak':>11} {'off GPU':>11} {'fall':>8}",
    ]
    for row in result["rows"]:
        vs = lambda k: f"x{row[k]:.3f}" if k in row else "-"  # noqa: E731
        off = row.get("copied")
        share = f"{row['of_bound']:.0%}" if row.get("of_bound") is not None else "-"
        lines.append(f"{row['mode']:<20} {row['seconds'] * 1e3:>8.2f}ms {vs('vs_baseline'):>8} {vs('vs_recompute'):>9} "
                     f"{fmt_bytes(row['peak_bytes']):>11} {fmt_bytes(off) if off is not None else '-':>11} {share:>8}")
    lines.append("")
    lines.append("step: the last of the steps (virtual time); peak: the modelled allocator's, weights and optimizer "
                 "state included; off GPU: bytes copied to the host tier in the step; fall: the peak's fall (above the "
                 "step's start) against the reference's, over what the copy engine could take in baseline's forward "
                 "(offload), over the checkpoints' bytes (recompute+offload)")
    return "\n".join(lines)
