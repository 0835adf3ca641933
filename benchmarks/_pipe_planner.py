"""``ssdtrain plan`` beside the pipeline benchmark's measurements (issue 66): the planner given this
machine's measured rates chooses each mode's configuration and predicts its step, and the report
sets that beside what the probes measured.

The rates, as a user would measure them on their own machine:

* compute: the achieved rate at each micro-batch size (``Inputs.tflops_at``) from the probes that
  run without a pipeline and without offloading (baseline, the ranks data-parallel), whether they
  fit the budget or not: the planner's FLOPs of the forwards and backwards over their measured
  seconds (``pipe_s``). Every other configuration (pipelines, interleaving, recompute, offload) is
  then a prediction;
* the data-parallel all-reduce (``Inputs.allreduce_gbps``): from the rest of those probes' step
  (``step_s - pipe_s``: the gradients' reduction and the optimizer's step);
* the drive: 2 GB/s (this VM's), no host tier (the CPU has no device to copy from);
* memory: the budget is the planner's ``gpu_mem_gib`` (it keeps its reserve of a tenth for what it
  does not count: here the allocator's and Python's own); both models' heads are weights of their
  own (``tied_head`` off).
"""

from __future__ import annotations

import statistics

from ssdtrain.planner.plan_inputs import Inputs
from ssdtrain.planner.plan_model import MODES, best_config, evaluate

__all__ = ["beside", "calibrated", "choices"]

RANKS = 2
DRIVE_GBPS = 2.0


def _key(cfg: dict) -> tuple:
    return cfg["stages"], cfg["virtual"], cfg["micro_batch"]


def _medians(records: list[dict], mode: str) -> dict[tuple, float]:
    """Median step seconds of each configuration of ``mode`` among ``records``."""
    runs: dict[tuple, list[float]] = {}
    for r in records:
        if r["mode"] == mode:
            runs.setdefault(_key(r), []).append(r["step_s"])
    return {k: statistics.median(v) for k, v in runs.items()}


def calibrated(records: list[dict], budget_mib: float, engine: str) -> Inputs | None:
    """The planner's inputs for ``engine``'s records: the shape, 2 ranks, the budget, the drive, and
    the compute rate per micro-batch size from the baseline probes without a pipeline (``None`` if
    there are none)."""
    ok = [r for r in records if r["engine"] == engine and "error" not in r]
    if not ok:
        return None
    s = ok[0]["shape"]
    base = dict(layers=s["layers"], hidden=s["hidden"], heads=s["heads"], seq=s["seq"], vocab=s["vocab"], gpus=RANKS,
                global_batch=ok[0]["global_batch"], dtype="fp32", flash=engine != "megatron", dropout=False,
                drive_gbps=DRIVE_GBPS, host_gib=0.0, host_gbps=0.0, min_bytes=0,
                gpu_mem_gib=budget_mib / 1024, tied_head=False,
                virtual_stages=2 if engine == "megatron" else 1)
    plain = [r for r in ok if r["mode"] == "baseline" and r["stages"] == 1 and "events_by_stage" in r]
    if not plain:
        return None
    forward: dict[int, list[float]] = {}
    backward: dict[int, list[float]] = {}
    for r in plain:  # the forwards' and the backwards' seconds of the last step (one rank's timeline)
        events = r["events_by_stage"]["0"]
        forward.setdefault(r["micro_batch"], []).append(sum(t1 - t0 for kind, _, t0, t1 in events if kind == "F"))
        backward.setdefault(r["micro_batch"], []).append(sum(t1 - t0 for kind, _, t0, t1 in events if kind == "B"))
    unit = Inputs(**base, tflops=1.0)  # its step seconds are TFLOPs: a third forward's, two thirds backward's
    flops = {b: evaluate(unit, "baseline", 1, b).step_time_s for b in forward}
    rates = tuple((b, flops[b] / 3 / statistics.median(v)) for b, v in sorted(forward.items()))
    slower = statistics.median(flops[b] * 2 / 3 / statistics.median(backward[b]) / dict(rates)[b] for b in backward)
    rest = statistics.median(max(x["step_s"] - x["pipe_s"] for x in r["ranks"]) for r in plain)
    top = max(r for _, r in rates)
    # The bandwidth at which the planner's all-reduce of this step's gradients takes ``rest`` seconds.
    gbps = Inputs(**base, tflops=1.0, allreduce_gbps=1.0)
    per_gbps = evaluate(gbps, "baseline", 1, 1).step_time_s - evaluate(unit, "baseline", 1, 1).step_time_s
    return Inputs(**base, tflops=top, backward_tflops=top * slower, tflops_at=rates,
                  allreduce_gbps=per_gbps / rest if rest > 0 else 0.0)


def choices(records: list[dict], budget_mib: float, engine: str) -> dict[str, dict]:
    """Each planner mode's chosen configuration, as the benchmark names one (``stages``,
    ``virtual``, ``micro_batch``), with its predicted step and peak."""
    inp = calibrated(records, budget_mib, engine)
    return {} if inp is None else _chosen(inp)


def _chosen(inp: Inputs) -> dict[str, dict]:
    out = {}
    for mode in MODES:
        cfg = best_config(inp, mode)
        if cfg is not None:
            out[mode] = {"stages": cfg.stages, "virtual": cfg.virtual_stages, "micro_batch": cfg.micro_batch,
                         "step_s": cfg.step_time_s, "peak_mib": cfg.memory_gib * 1024,
                         "bubble": cfg.bubble_fraction, "microbatches": cfg.num_microbatches}
    return out


def _name(k: tuple) -> str:
    stages, virtual, mb = k
    return f"pp{stages}{f'x{virtual}' if virtual > 1 else ''} mb{mb}"


def beside(records: list[dict], budget_mib: float, engine: str) -> list[str]:
    """Report lines: the calibration, the predicted peak beside the measured one, and per mode the
    planner's choice beside the measured best (medians over every run of a configuration), then the
    choice across modes."""
    inp = calibrated(records, budget_mib, engine)
    if inp is None:
        return [f"planner ({engine}): no baseline probe without a pipeline to calibrate on"]
    ok = [r for r in records if r["engine"] == engine and "error" not in r]
    rates = ", ".join(f"mb{b} {r * 1e3:.1f}" for b, r in inp.tflops_at)
    lines = [f"planner ({engine}): forward GFLOP/s a rank measured without a pipeline: {rates}, backward "
             f"x{inp.backward_tflops / inp.tflops:.2f} that; all-reduce "
             f"{inp.allreduce_gbps:.2f} GB/s; drive {DRIVE_GBPS:g} GB/s, no host tier, {budget_mib:g} MiB usable"]
    errors = []
    for r in ok:
        if r["mode"] in MODES:
            cfg = evaluate(inp, r["mode"], r["stages"], r["micro_batch"], virtual=r["virtual"])
            if cfg is not None:
                errors.append(cfg.memory_gib * 2**30 / r["peak_bytes"] - 1)
    if errors:
        lines.append(f"  predicted peak against measured, {len(errors)} probes: median {statistics.median(errors):+.0%}, "
                     f"from {min(errors):+.0%} to {max(errors):+.0%}")
    chosen = _chosen(inp)
    overall = []
    for mode in MODES:
        medians = _medians(ok, mode)
        fits = {k: v for k, v in medians.items()
                if all(r["peak_bytes"] <= budget_mib * 2**20 for r in ok if r["mode"] == mode and _key(r) == k)}
        best = min(fits, key=fits.get) if fits else None
        if best is not None:
            overall.append((fits[best], mode, best))
        if mode not in chosen:
            lines.append(f"  {mode:10} no configuration fits; measured best {_name(best) if best else '-'}")
            continue
        c = chosen[mode]
        k = _key(c)
        measured = medians.get(k)
        err = f"{measured:.2f} s measured ({c['step_s'] / measured - 1:+.0%})" if measured else "not measured"
        same = "the same" if k == best else (f"measured best {_name(best)} ({fits[best]:.2f} s)" if best else "none fits")
        lines.append(f"  {mode:10} chooses {_name(k)} m{c['microbatches']}, bubble {c['bubble']:.2f}, "
                     f"peak {c['peak_mib']:.0f} MiB, step {c['step_s']:.2f} s predicted, {err}; {same}")
    if chosen and overall:
        plan_mode = min(chosen, key=lambda m: chosen[m]["step_s"])
        _, mode, k = min(overall)
        lines.append(f"  across modes: the planner chooses {plan_mode} {_name(_key(chosen[plan_mode]))}; "
                     f"measured best {mode} {_name(k)}")
    return lines
