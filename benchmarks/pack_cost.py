"""The training thread's cost per save: what the offloader's pack and unpack hooks take from the
thread that launches the model's work (issue 29, item 4: at most 10 us a save at the GPU bench
shape).

On a GPU, every microsecond the training thread spends in a hook is a microsecond it does not
launch kernels; with about 325 saves a step at the bench's GPU shape, 37 us a save was 12 ms of a
12 ms forward on an H200 (2026-11-27). Most of that cost is Python, the same on any host: this
benchmark measures it on the CPU too, where the tier's logic can run on CPU tensors (as the CPU
tests run it).

It runs the bench's GPT (twelve blocks by default: the GPU shape's saves, small tensors) and
reports, per path, side by side in one run:

* ``identity``: hooks that hand the tensor back (autograd's own cost of a Python hook);
* ``tier``: the host tier on (on the CPU: CPU tensors let through it, as in tests/test_tier.py);
* ``drive``: the memory backend, every save written;
* ``kept``: every save kept at once (the copy budget closed: what most saves of a GPU forward
  meet once the tier has learned).

For each: training-thread CPU microseconds in pack per save and in unpack per save (per call of
the hook: parameters, which pack hands back at once, included), the Python and builtin calls
pack makes per save (a count that does not depend on the machine's noise), and the forward's and
backward's thread CPU time per step above ``identity`` divided by the saves; and the forward's
CPU time on all the process's threads (I/O threads included: on a GPU host, their Python holds
the GIL the training thread needs) above ``identity``, per save. Modes alternate over
``--rounds``; each figure is the median over rounds.

    python benchmarks/pack_cost.py [--layers 12] [--steps 20] [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
import types

import torch

import ssdtrain
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.bench.models import GPT, GPTConfig


def _timed(off: ssdtrain.Offloader, spent: dict, prof: cProfile.Profile) -> None:
    """Wraps the offloader's hooks to add their thread CPU time to ``spent``, and their Python
    calls to ``prof`` while ``spent["profile"]`` is set (a step of its own: cProfile's cost is
    not timed)."""
    for name in ("_pack", "_unpack"):
        fn = getattr(off, name)

        def run(_self, arg, fn=fn, name=name):
            if spent["profile"] and name == "_pack":
                prof.enable()
                try:
                    return fn(arg)
                finally:
                    prof.disable()
                    spent[name + "_calls_n"] += 1
            t = time.thread_time()
            try:
                return fn(arg)
            finally:
                spent[name] += time.thread_time() - t
                spent[name + "_n"] += 1
        setattr(off, name, types.MethodType(run, off))


def _calls(prof: cProfile.Profile, fn_name: str) -> int:
    """Python and builtin calls made under ``fn_name`` (the hook itself not counted)."""
    stats = pstats.Stats(prof).stats
    return sum(nc for (_, _, name), (_, nc, _, _, _) in stats.items() if name != fn_name)


def measure(mode: str, model, tokens, steps: int, path: str) -> dict:
    """One mode: ``steps`` timed steps after three to warm up, then one profiled step."""
    spent = dict.fromkeys(("_pack", "_unpack", "_pack_n", "_unpack_n", "_pack_calls_n", "_unpack_calls_n",
                           "profile"), 0)
    prof = cProfile.Profile()
    off = None
    if mode == "identity":
        def ctx():
            return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    else:
        kw = {"min_bytes": 0, "backend": "memory"}
        if mode in ("drive", "kept"):
            kw["host_bytes"] = 0
        off = ssdtrain.Offloader(model, path=path, **kw)
        if mode == "kept":
            off._kept_at_once = lambda t, nbytes: "budget_kept_bytes"  # the budget closed at once
        _timed(off, spent, prof)

        def ctx():
            return off
    fwd, bwd, fwd_all = [], [], []
    for i in range(steps + 4):
        if i == 3:
            for k in spent:
                spent[k] = 0
        spent["profile"] = i == steps + 3
        model.zero_grad(set_to_none=True)
        t, p = time.thread_time(), time.process_time()
        with ctx():
            loss = model(tokens, tokens)
        t1, p1 = time.thread_time(), time.process_time()
        loss.backward()
        t2 = time.thread_time()
        if off is not None:
            off.wait()
        if 3 <= i < steps + 3:
            fwd.append(t1 - t)
            bwd.append(t2 - t1)
            fwd_all.append(p1 - p)
    out = {"mode": mode, "forward_ms": statistics.median(fwd) * 1e3, "backward_ms": statistics.median(bwd) * 1e3,
           "forward_all_threads_ms": statistics.median(fwd_all) * 1e3}
    if off is not None:
        n = max(spent["_pack_n"], 1)
        out["saves"] = spent["_pack_n"] / steps
        out["pack_us"] = spent["_pack"] / n * 1e6
        out["unpack_us"] = spent["_unpack"] / max(spent["_unpack_n"], 1) * 1e6
        out["pack_calls"] = _calls(prof, "_pack") / max(spent["_pack_calls_n"], 1)
        st = off.stats()
        out["host_copied_bytes"], out["written_bytes"], out["kept_bytes"] = (
            st.host_copied_bytes, st.written_bytes, st.kept_bytes)
        off.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", default="identity,tier,drive,kept")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=a.seq, layers=a.layers, hidden=a.hidden, heads=a.heads)).to(dev)
    tokens = torch.randint(0, 512, (a.batch, a.seq), device=dev)
    modes = a.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    tier_devices = offloader_mod._TIER_DEVICES
    if dev.type == "cpu":
        offloader_mod._TIER_DEVICES = ("cuda", "cpu")  # the tier's logic on CPU tensors (as tests/test_tier.py)
    try:
        with tempfile.TemporaryDirectory(prefix="ssdtrain-pack-cost-") as path:
            for _ in range(a.rounds):  # alternated, medians over rounds: these VMs are noisy
                for mode in modes:
                    runs[mode].append(measure(mode, model, tokens, a.steps, path))
    finally:
        offloader_mod._TIER_DEVICES = tier_devices
    rows = []
    for mode in modes:
        row = dict(runs[mode][0])
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(r[k] for r in runs[mode])
        rows.append(row)
    ref = next((r for r in rows if r["mode"] == "identity"), None)
    print(f"{'mode':9s} {'saves':>6s} {'pack us':>8s} {'calls':>6s} {'unpack us':>10s} {'fwd ms':>8s} {'bwd ms':>8s}"
          f" {'fwd +us/save':>13s} {'bwd +us/save':>13s} {'fwd all threads +us/save':>25s}")
    for r in rows:
        extra = ""
        if ref is not None and "saves" in r:
            r["forward_extra_us_per_save"] = (r["forward_ms"] - ref["forward_ms"]) * 1e3 / r["saves"]
            r["backward_extra_us_per_save"] = (r["backward_ms"] - ref["backward_ms"]) * 1e3 / r["saves"]
            r["forward_all_threads_extra_us_per_save"] = (
                (r["forward_all_threads_ms"] - ref["forward_all_threads_ms"]) * 1e3 / r["saves"])
            extra = (f" {r['forward_extra_us_per_save']:13.1f} {r['backward_extra_us_per_save']:13.1f}"
                     f" {r['forward_all_threads_extra_us_per_save']:25.1f}")
        print(f"{r['mode']:9s} {r.get('saves', 0):6.0f} {r.get('pack_us', 0):8.1f} {r.get('pack_calls', 0):6.1f}"
              f" {r.get('unpack_us', 0):10.1f}"
              f" {r['forward_ms']:8.2f} {r['backward_ms']:8.2f}{extra}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(dev), "args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
