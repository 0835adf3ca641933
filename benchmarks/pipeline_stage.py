"""One pipeline stage under 1F1B on a drive of set speed: does the stage wait for the drive?

Runs the first stage of a ``--stages``-stage 1F1B schedule (warm-up forwards, then one forward and
one backward per slot, then the cool-down backwards) over ``--microbatches`` micro-batches of the
bench's GPT, each forward in ``off.microbatch(i)`` and ``off.prefetch(i)`` a slot before its
backward (as the Megatron integration does). The drive is a ``ThrottledBackend`` of
``--drive-mbps`` each way around the memory backend, so the figures do not depend on this
machine's disk. Rounds without offloading and with it alternate; the report gives, per round,
the step time of each, the time backward waited on reads, and the bytes written per
micro-batch, and the peak of saved bytes resident against ``stages`` micro-batches' worth.

    python benchmarks/pipeline_stage.py --stages 4 --microbatches 8 --drive-mbps 200 --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.config import OffloadConfig
from ssdtrain.store import make_backend
from ssdtrain.store.throttle import ThrottledBackend


def one_f_one_b(stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The first stage's order: ``("F", i)`` and ``("B", i)``."""
    warm = min(stages - 1, microbatches)
    ops = [("F", i) for i in range(warm)]
    f = warm
    for b in range(microbatches):
        if f < microbatches:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
    return ops


def run_round(model, tokens, ops, off, tag, times=None) -> float:
    """One step of the schedule; returns its seconds (and appends each forward's and backward's
    to ``times["F"]`` and ``times["B"]`` if given)."""
    losses = {}
    start = time.perf_counter()
    for k, (kind, i) in enumerate(ops):
        began = time.perf_counter()
        if kind == "F":
            if off is not None and k + 1 < len(ops) and ops[k + 1][0] == "B":
                off.prefetch((tag, ops[k + 1][1]))  # a slot early: the backward after this forward
            if off is None:
                losses[i] = model(tokens[i], tokens[i])
            else:
                with off.microbatch((tag, i)):
                    losses[i] = model(tokens[i], tokens[i])
        else:
            if off is not None:
                off.prefetch((tag, i))
            losses.pop(i).backward()
        if times is not None:
            times[kind].append(time.perf_counter() - began)
    return time.perf_counter() - start


def predicted(args, cfg, forward_s: float, backward_s: float, handoff: int) -> dict:
    """``ssdtrain plan``'s drive model for one micro-batch of this stage, at the measured times."""
    from ssdtrain.planner import plan_saves, plan_simulate

    flops = plan_saves.forward_flops(layers=cfg.layers, seq=cfg.seq, hidden=cfg.hidden, vocab=cfg.vocab,
                                     micro_batch=args.batch)
    saves, fwd, bwd = plan_saves.saves(
        layers=cfg.layers, seq=cfg.seq, hidden=cfg.hidden, heads=cfg.heads, vocab=cfg.vocab, micro_batch=args.batch,
        dtype_bytes=4, flash=cfg.flash, dropout=False, checkpoint=False, head=True,
        tflops=flops / forward_s / 1e12, backward_tflops=2 * flops / backward_s / 1e12)
    out = {}
    for name, pipelined in (("pipelined", True), ("one step", False)):
        d = plan_simulate.simulate(saves, forward_s=fwd, backward_s=bwd, write_bps=args.drive_mbps * 1e6,
                                   read_bps=args.drive_mbps * 1e6, handoff_bytes=handoff, min_bytes=0,
                                   pipelined=pipelined)
        out[name] = {"written_mib": d.written_bytes / 2**20, "free_mib": d.free_bytes / 2**20,
                     "capacity_mib": d.capacity_bytes / 2**20}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--drive-mbps", type=float, default=200.0, help="drive speed each way, MB/s")
    p.add_argument("--rounds", type=int, default=6, help="rounds of each (baseline and offload alternate)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 leaves a core to the I/O threads)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=2048, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=4)
    model = GPT(cfg)
    tokens = [torch.randint(0, cfg.vocab, (args.batch, cfg.seq)) for _ in range(args.microbatches)]
    ops = one_f_one_b(args.stages, args.microbatches)
    bps = args.drive_mbps * 1e6
    store = ThrottledBackend(make_backend(OffloadConfig(backend="memory")), write_bps=bps, read_bps=bps)
    off = ssdtrain.Offloader(model, store=store, min_bytes=0)
    run_round(model, tokens, ops, None, None)  # warm-up, not reported
    rows = []
    times = {"F": [], "B": []}
    for r in range(args.rounds):
        base = run_round(model, tokens, ops, None, None, times)
        before = off.stats()
        off.reset_peak()
        t = run_round(model, tokens, ops, off, r)
        after = off.stats()
        mbs = [after.microbatches[(r, i)] for i in range(args.microbatches)]
        rows.append({
            "baseline_s": base, "offload_s": t, "ratio": t / base,
            "read_stall_s": after.read_stall_seconds - before.read_stall_seconds,
            "written_mib_per_mb": statistics.mean(m["written_bytes"] for m in mbs) / 2**20,
            "saved_mib_per_mb": statistics.mean(m["saved_bytes"] for m in mbs) / 2**20,
            "peak_resident_mib": after.peak_resident_bytes / 2**20,
            "write_budget_mib": None if after.write_budget_bytes is None else after.write_budget_bytes / 2**20,
        })
    off.close()
    store.close()
    print(f"1F1B, stage 1 of {args.stages}, {args.microbatches} micro-batches, drive {args.drive_mbps:g} MB/s each way")
    print("round  baseline  offload  ratio  read stall  written/mb  saved/mb  peak resident (of stages x saved)  budget")
    for r, row in enumerate(rows):
        budget = "-" if row["write_budget_mib"] is None else f"{row['write_budget_mib']:.0f} MiB"
        print(f"{r:5d}  {row['baseline_s']:7.2f}s  {row['offload_s']:6.2f}s  {row['ratio']:5.2f}  {row['read_stall_s']:9.2f}s"
              f"  {row['written_mib_per_mb']:7.1f} MiB  {row['saved_mib_per_mb']:5.1f} MiB"
              f"  {row['peak_resident_mib']:6.0f} MiB ({row['peak_resident_mib'] / (args.stages * row['saved_mib_per_mb']):.2f})"
              f"  {budget}")
    late = rows[len(rows) // 2:]
    print(f"second half: median ratio {statistics.median(r['ratio'] for r in late):.3f}, "
          f"read stall {sum(r['read_stall_s'] for r in late) / len(late):.2f} s per step, "
          f"written {statistics.mean(r['written_mib_per_mb'] for r in late):.1f} MiB per micro-batch")
    fwd, bwd = statistics.median(times["F"]), statistics.median(times["B"])
    handoff = 2 * off.config.chunk_bytes * off.config.io_threads
    plan = predicted(args, cfg, fwd, bwd, handoff)
    print(f"planner at forward {fwd * 1e3:.0f} ms, backward {bwd * 1e3:.0f} ms: " + "; ".join(
        f"{name}: writes {v['written_mib']:.1f} MiB, frees {v['free_mib']:.1f}, carries {v['capacity_mib']:.1f}"
        for name, v in plan.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rows, "forward_s": fwd, "backward_s": bwd, "planner": plan}, f,
                      indent=1)


if __name__ == "__main__":
    main()
