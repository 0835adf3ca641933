"""Where the host tier's pack and unpack spend the training thread's time, section by section.

``benchmarks/pack_cost.py`` says how much a save costs; cProfile says which functions are called,
but its own cost triples every figure and flattens the difference between a Python call and a
torch call. This wraps the engine's sections (pack, the new entry or group part, the safe point,
the write queue's pump, read-ahead, the host pool's allocation, Ref) in thread-CPU timers on the
training thread and prints each section's microseconds a save (of all pack calls: parameters
included, as ``pack_cost``'s figures are) and a call. The wrappers add about a microsecond a call:
read the proportions, not the sums. Also counts, per step, which condition made a pack or an
unpack call the safe point (and drain) in forward and in backward.

    python benchmarks/investigations/pack_sections.py [--per-save] [--steps 30]

``--per-save``: an entry a save (``Offloader._group_saves = 1``), as before group entries (Note
[saves handed over together share an entry]).
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import threading
import time

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.engine import hooks as hooks_mod
from ssdtrain.engine import offloader as offloader_mod

SECTIONS = {"off": ("_pack", "_pack_plain", "_new_entry", "_join_group", "_safe_point", "_drain", "_unpack",
                    "_unpack_entry"),
            "_writer": ("pump", "hold", "hand_over_group"), "_tier": ("allocate_host",), "_policy": ("decide",),
            "_cache": ("new",), "_reader": ("prefetch", "claim", "finish")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-save", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args(argv)
    offloader_mod._TIER_DEVICES = ("cuda", "cpu")  # the tier's logic on CPU tensors (as pack_cost does)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))  # pack_cost's shape
    tokens = torch.randint(0, 512, (2, 64))
    path = tempfile.mkdtemp(prefix="ssdtrain-sections-")
    off = ssdtrain.Offloader(model, path=path, min_bytes=0, backend="memory")
    if a.per_save:
        off._group_saves = 1
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    main_thread = threading.get_ident()

    def timed(owner, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if threading.get_ident() != main_thread:
                return fn(*args, **kwargs)
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - t
                calls[name] += 1
        setattr(owner, name, run)

    for attr, names in SECTIONS.items():
        for name in names:
            timed(off if attr == "off" else getattr(off, attr), name)
    real_ref = hooks_mod.Ref

    class TimedRef(real_ref):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            t = time.thread_time()
            super().__init__(*args, **kwargs)
            spent["Ref"] += time.thread_time() - t
            calls["Ref"] += 1
    hooks_mod.Ref = TimedRef
    why: collections.Counter = collections.Counter()
    safe_point = off._safe_point

    def counted_safe_point(*, raise_errors: bool):
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        c = off._cache
        for name, pending in (("graveyard", off._graveyard), ("completed", off._writer.completed),
                              ("late", c.late), ("small.dead", c.small.dead), ("lagging", c.lagging)):
            if pending:
                why[phase, name] += 1
        return safe_point(raise_errors=raise_errors)
    off._safe_point = counted_safe_point

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(tokens, tokens)
        loss.backward()
        off.wait()
    try:
        for _ in range(3):
            step()
        spent.clear()
        calls.clear()
        why.clear()
        for _ in range(a.steps):
            step()
    finally:
        hooks_mod.Ref = real_ref
        off.close()
    saves = calls["_pack"] / a.steps
    print(f"{'per-save' if a.per_save else 'groups'}: {saves:.0f} pack calls a step, {a.steps} steps")
    print(f"{'section':16s} {'us/save':>8s} {'calls/step':>11s} {'us/call':>8s}")
    for name, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"{name:16s} {secs / a.steps / saves * 1e6:8.2f} {calls[name] / a.steps:11.1f} "
              f"{secs / calls[name] * 1e6:8.2f}")
    print("safe points a step, by what was pending: "
          + ", ".join(f"{p} {n} {c / a.steps:.1f}" for (p, n), c in sorted(why.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
