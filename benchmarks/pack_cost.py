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
* ``copies``: identity's hooks, and the bytes a tier step moves moved by two threads with no
  engine (Note [the copies' own floor]: on a CPU host the copies slow the model's own ops);
* ``tier``: the host tier on (on the CPU: CPU tensors let through it, as in tests/test_tier.py);
* ``tier-per-save``: the tier with an entry a save, as before group entries (Note [saves handed over
  together share an entry]); ``tier-threads``: the tier with its copies made on its copy threads,
  as before 2026-11-30 (Note [copies are made where they are handed over]: now the thread that
  hands a batch over makes it);
* ``drive``: the memory backend, every save written;
* ``kept``: every save kept at once (the copy budget closed: most saves of a GPU forward once learned);
* ``tier-python``, ``kept-python``: the same with the compiled pack off (pure Python: Note [a
  compiled pack for the common save] in ``ssdtrain/engine/native.py``); the other engine modes use
  the compiled pack where it is built (the header says whether).

For each: training-thread CPU microseconds in pack per save and in unpack per save (per call of
the hook: parameters, which pack hands back at once, included), the Python and builtin calls
pack makes per save (a count that does not depend on the machine's noise), and the forward's and
backward's thread CPU time per step above ``identity`` divided by the saves; and the forward's
CPU time on all the process's threads (I/O threads included: on a GPU host, their Python holds
the GIL the training thread needs) above ``identity``, per save. Modes alternate over ``--rounds``;
each figure is the median over rounds.

    python benchmarks/pack_cost.py [--layers 12] [--steps 20] [--device cpu|cuda] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import pstats
import resource
import statistics
import sys
import tempfile
import threading
import time
import types
from collections import deque

import torch

import ssdtrain
from ssdtrain.engine import hooks as hooks_mod
from ssdtrain.engine import native
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.bench.models import GPT, GPTConfig


class _Hooks:
    """Hooks given as two callables (``identity``; a peer's own), timed as the offloader's are."""

    def __init__(self, pack, unpack) -> None:
        self._pack, self._unpack = pack, unpack


def _timed(off, spent: dict, prof: dict) -> None:
    """Wraps ``off``'s hooks (``_pack``, ``_unpack``) to add their thread CPU time to ``spent``, and
    each one's Python calls to ``prof[name]`` while ``spent["profile"]`` is set (a step of its own:
    cProfile's cost is not timed). Every mode, ``identity`` included, goes through this wrapper: its
    own cost (two clock reads, about 1 us here) is in the identity floor printed beside."""
    for name in ("_pack", "_unpack"):
        fn = getattr(off, name)

        def run(_self, arg, fn=fn, name=name):
            if spent["profile"]:
                prof[name].enable()
                try:
                    return fn(arg)
                finally:
                    prof[name].disable()
                    spent[name + "_calls_n"] += 1
            t = time.thread_time()
            try:
                return fn(arg)
            finally:
                spent[name] += time.thread_time() - t
                spent[name + "_n"] += 1
        setattr(off, name, types.MethodType(run, off))  # a bound method, as keep.untraced wants


def _calls(prof: cProfile.Profile, fn_name: str) -> int:
    """Python and builtin calls made under ``fn_name`` (the hook itself not counted)."""
    return sum(nc for (_, _, name), (_, nc, _, _, _) in pstats.Stats(prof).stats.items() if name != fn_name)


def _torchtune():
    """torchtune's ``OffloadActivations`` class and version, or why not."""
    try:
        from torchtune.training import OffloadActivations
        import torchtune
    except Exception as exc:  # an import error of torchtune or of what it imports
        return None, f"torchtune does not import ({type(exc).__name__}: {str(exc)[:80]}); {TORCHTUNE_HINT}"
    return OffloadActivations, torchtune.__version__


# Note [the copies' own floor]
# On a CPU host a copy is a memmove on another thread, and it slows the training thread's own ops:
# a memmove loop in another process took identity's step from 80 to 126 us a save of CPU here
# (2026-11-29, cProfile: the backward engine 45 -> 67 us a save, linear 14 -> 17: the two cores
# share the memory bus and the last-level cache). That is the copies' cost, not the engine's, and
# "beyond the copy" (the bytes over the memcpy rate) did not count it. The ``copies`` mode moves
# the bytes a tier step moves (each storage saved, once, to a pool on one thread in forward, and
# back into fresh buffers on another as backward begins) with identity's hooks and no engine:
# its step above identity's is the copies' own cost, interference included, and the tier's step
# above it is the engine's.
class _Mover:
    """Identity's hooks, and the tier's bytes moved as its two copy threads move them."""

    def __init__(self) -> None:
        self.pool = torch.empty(256 << 20, dtype=torch.uint8)
        self.pending: deque = deque()  # append and popleft: safe between the two threads
        self.handed = self.done = 0  # storages handed to the copy thread, and copied (or seen before)
        self.taken: list = []
        self.seen: set = set()
        self.used = 0
        self.running = True
        self.back = None
        self.copier = threading.Thread(target=self._copy_in, daemon=True)
        self.copier.start()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and not (t.requires_grad and t.is_leaf) and t.nbytes:
            self.pending.append(t.untyped_storage())
            self.handed += 1
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self.back is None:  # backward began: the copies back, on a thread of their own
            self.back = threading.Thread(target=self._copy_out, daemon=True)
            self.back.start()
        return t

    def _copy_in(self) -> None:
        base = self.pool.data_ptr()
        while self.running:
            if not self.pending:
                time.sleep(0.0002)
                continue
            s = self.pending.popleft()
            key = s.data_ptr()
            if key not in self.seen:
                self.seen.add(key)
                n = s.nbytes()
                off = self.used % (self.pool.numel() - n)
                ctypes.memmove(base + off, key, n)
                self.used += n
                self.taken.append((off, n))
            self.done += 1

    def _copied(self) -> None:
        while self.done < self.handed:  # every storage handed over copied
            time.sleep(0.0002)

    def _copy_out(self) -> None:
        self._copied()  # forward's copies first, as the tier's reads wait for theirs
        base = self.pool.data_ptr()
        for off, n in reversed(self.taken):
            buf = torch.empty(n, dtype=torch.uint8)
            ctypes.memmove(buf.data_ptr(), base + off, n)

    def step_done(self) -> int:
        """The step's bytes moved (in and back), and a fresh start for the next step."""
        self._copied()
        if self.back is not None:
            self.back.join()
        moved = 2 * sum(n for _, n in self.taken)
        self.taken, self.seen, self.back, self.used = [], set(), None, 0
        return moved


TORCHTUNE_HINT = ("pip install torchtune==0.6.1 torchao==0.10.0 datasets omegaconf sentencepiece tiktoken blobfile "
                  "(in a venv of its own: peft refuses torchao below 0.16, and tests/test_transformers.py fails)")
PEERS = ("save_on_cpu", "torchtune")


def _peer_hooks(mode: str, device: torch.device):
    """The peer's own context manager, its hooks wrapped for timing (``_Hooks``), and a note."""
    if mode == "save_on_cpu":
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
        note = f"torch {torch.__version__} save_on_cpu" + (" (on the CPU its .cpu() copies nothing)"
                                                          if device.type == "cpu" else "")
    else:
        cls, version = _torchtune()
        if cls is None:
            return None, None, version
        if device.type == "cuda":
            ctx, note = cls(), f"torchtune {version} OffloadActivations()"
        else:
            # Its __init__ asks torch.cuda.default_stream(), which a CPU torch cannot answer: None
            # stands in for it (its hooks use no stream with use_streams=False). Its unpack moves
            # to "cuda": on the CPU only its pack runs (forward only, a new instance a step).
            real = torch.cuda.default_stream
            torch.cuda.default_stream = lambda *a, **k: None
            try:
                ctx = cls(use_pin_memory=False, use_streams=False)
            finally:
                torch.cuda.default_stream = real
            note = (f"torchtune {version} OffloadActivations(use_pin_memory=False, use_streams=False); "
                    "on the CPU its pack only (its unpack moves to cuda)")
    hooks = _Hooks(ctx.pack_hook, ctx.unpack_hook)
    return ctx, hooks, note


def measure(mode: str, model, tokens, steps: int, path: str, setup=None) -> dict:
    """One mode: ``steps`` timed steps after three to warm up, then one profiled step; ``setup``:
    called with the offloader once it is made (an engine's mode only: a variant of it). A mode
    ending in ``-python``: its engine mode with the compiled pack off."""
    if mode.endswith("-python"):
        compiled, hooks_mod._native_pack = hooks_mod._native_pack, None
        try:
            out = measure(mode[:-len("-python")], model, tokens, steps, path, setup)
        finally:
            hooks_mod._native_pack = compiled
        out["mode"] = mode
        return out
    spent = dict.fromkeys(("_pack", "_unpack", "_pack_n", "_unpack_n", "_pack_calls_n", "_unpack_calls_n",
                           "profile"), 0)
    prof = {"_pack": cProfile.Profile(), "_unpack": cProfile.Profile()}
    off = None
    note = ""
    backward = True
    dev = tokens.device
    mover = None
    if mode in ("identity", "copies"):
        mover = _Mover() if mode == "copies" else None  # Note [the copies' own floor]
        hooks = _Hooks(mover.pack, mover.unpack) if mover else _Hooks(lambda t: t, lambda t: t)
        _timed(hooks, spent, prof)

        def ctx():
            return torch.autograd.graph.saved_tensors_hooks(hooks._pack, hooks._unpack)
    elif mode in PEERS:
        first, _, note = _peer_hooks(mode, dev)
        if first is None:
            return {"mode": mode, "unavailable": note}
        backward = not (mode == "torchtune" and dev.type != "cuda")

        def ctx():  # a fresh instance a step (torchtune's pack-only steps leave it tracking saves)
            c, h, _ = _peer_hooks(mode, dev)
            _timed(h, spent, prof)
            c.pack_hook, c.unpack_hook = h._pack, h._unpack
            return c
    else:
        kw = {"min_bytes": 0, "backend": "memory"}
        if mode in ("drive", "kept"):
            kw["host_bytes"] = 0
        off = ssdtrain.Offloader(model, path=path, **kw)
        if mode == "kept":
            off._kept_at_once = lambda t, nbytes: "budget_kept_bytes"  # the budget closed at once
        if mode == "tier-per-save":  # the tier with an entry a save (Note [saves handed over together share an entry])
            off._group_saves = 1
        if mode == "tier-threads":
            off._tier.inline_copies(False)  # Note [copies are made where they are handed over]
        if setup is not None:
            setup(off)
        _timed(off, spent, prof)

        def ctx():
            return off
    fwd, bwd, step_all, step_training = [], [], [], []
    slept = 0
    for i in range(steps + 4):
        if i in (3, steps + 3):  # Note [a wake-up is dear here]: the timed steps' sleeps
            slept = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - slept
        if i == 3:
            for k in spent:
                spent[k] = 0
        spent["profile"] = i == steps + 3
        model.zero_grad(set_to_none=True)
        t, p = time.thread_time(), time.process_time()
        with ctx():
            loss = model(tokens, tokens)
        t1 = time.thread_time()
        if backward:
            loss.backward()
        t2 = time.thread_time()
        if off is not None:
            off.wait()
        moved = mover.step_done() if mover is not None else 0
        p2, t3 = time.process_time(), time.thread_time()
        del loss
        if 3 <= i < steps + 3:
            fwd.append(t1 - t)
            bwd.append(t2 - t1)
            step_all.append(p2 - p)
            step_training.append(t3 - t)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731 (ms)
    out = {"mode": mode, "note": note, "forward_ms": med(fwd), "backward_ms": med(bwd) if backward else None,
           "step_all_threads_ms": med(step_all), "sleeps_per_step": slept / steps, "step_training_thread_ms": med(step_training)}
    n = max(spent["_pack_n"], 1)
    out["saves"] = spent["_pack_n"] / steps
    out["pack_us"] = spent["_pack"] / n * 1e6
    out["unpack_us"] = spent["_unpack"] / spent["_unpack_n"] * 1e6 if spent["_unpack_n"] else None
    # less the hook itself and the profiler's disable, one each a save
    out["pack_calls"] = _calls(prof["_pack"], "run") / max(spent["_pack_calls_n"], 1) - 2
    out["unpack_calls"] = _calls(prof["_unpack"], "run") / spent["_unpack_calls_n"] - 2 if spent["_unpack_calls_n"] else None
    out["copied_bytes_per_step"] = moved
    if mover is not None:
        mover.running = False
    if off is not None:
        st = off.stats()
        out["host_copied_bytes"], out["written_bytes"], out["kept_bytes"] = (
            st.host_copied_bytes, st.written_bytes, st.kept_bytes)
        out["copied_bytes_per_step"] = (st.written_bytes + st.read_bytes) / (steps + 4)
        off.close()
    return out


def alternate(variants: dict, rounds: int = 7, steps: int = 20, mode: str = "tier") -> dict:
    """Variants of one engine's mode in one process, rounds alternated: ``variants`` maps a name to
    a setup (called with each new offloader); prints each one's medians and the first's ratios to
    the others pair by pair (the in-process A/B of a change with a switch). The bench's GPT at 12
    blocks on the CPU, one intra-op thread, the tier's logic on CPU tensors."""
    offloader_mod._TIER_DEVICES = ("cuda", "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
    tokens = torch.randint(0, 512, (2, 64))
    runs: dict = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as path:
        for _ in range(rounds):
            for name, setup in variants.items():
                runs[name].append(measure(mode, model, tokens, steps, path, setup))
    keys = ("pack_us", "pack_calls", "unpack_us", "step_all_threads_ms")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        print(f"{name:20s}: pack {med['pack_us']:.2f} us ({med['pack_calls']:.1f} calls), unpack {med['unpack_us']:.2f} us, "
              f"step (all threads) {med['step_all_threads_ms']:.2f} ms; pack rounds " + " ".join(f"{r['pack_us']:.1f}" for r in rs))
    first, *others = runs
    for other in others:
        pairs = [a["pack_us"] / b["pack_us"] for a, b in zip(runs[first], runs[other])]
        steps_ = [a["step_all_threads_ms"] / b["step_all_threads_ms"] for a, b in zip(runs[first], runs[other])]
        print(f"{first} over {other}, median of pairs: pack x{statistics.median(pairs):.3f}, "
              f"step all threads x{statistics.median(steps_):.3f}")
    return runs


def memcpy_rate(nbytes: int, count: int = 512) -> float:
    """This machine's copy rate (bytes/s) for ``count`` distinct tensors of ``nbytes`` each into
    distinct buffers (beyond the caches at the default sizes): the best of five passes."""
    n = max(1, nbytes)
    src = [torch.empty(n, dtype=torch.uint8).fill_(1) for _ in range(count)]
    dst = [torch.empty(n, dtype=torch.uint8) for _ in range(count)]
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for d, s_ in zip(dst, src):
            d.copy_(s_)
        best = min(best, time.perf_counter() - t)
    return n * count / best


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
    ap.add_argument("--modes", default="identity,copies,kept,kept-python,tier,tier-python,tier-per-save,tier-threads,drive,"
                                       "save_on_cpu,torchtune")
    ap.add_argument("--intra-op-threads", type=int, default=1,
                    help="torch's intra-op threads while measuring (0: torch's default)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    threads = torch.get_num_threads()
    if a.intra_op_threads:
        # Note [the all-threads figure counts our threads, not torch's spinning]: with torch's
        # intra-op pool as wide as the machine, its workers spin while the offloader's I/O threads
        # hold a core (2 cores here): the model's own ops then cost up to x2.5 their CPU time
        # (linear 2.7 -> 7.4 ms a step, yappi, 2026-11-28), charged to "all threads" as if it were
        # ours. One intra-op thread leaves the model's CPU time its own; --intra-op-threads 0 keeps
        # torch's default.
        torch.set_num_threads(a.intra_op_threads)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=a.seq, layers=a.layers, hidden=a.hidden, heads=a.heads)).to(dev)
    tokens = torch.randint(0, 512, (a.batch, a.seq), device=dev)
    modes = a.modes.split(",")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    rates: list[float] = []
    save_bytes = a.batch * a.seq * a.hidden * 4  # a float32 activation of the block
    tier_devices = offloader_mod._TIER_DEVICES
    if dev.type == "cpu":
        offloader_mod._TIER_DEVICES = ("cuda", "cpu")  # the tier's logic on CPU tensors (as tests/test_tier.py)
    try:
        with tempfile.TemporaryDirectory(prefix="ssdtrain-pack-cost-") as path:
            for _ in range(a.rounds):  # alternated, medians over rounds: these VMs are noisy
                for mode in modes:
                    runs[mode].append(measure(mode, model, tokens, a.steps, path))
                rates.append(memcpy_rate(save_bytes))  # the bytes' rate, a round at a time
    finally:
        offloader_mod._TIER_DEVICES = tier_devices
        torch.set_num_threads(threads)
    rows = []
    for mode in modes:
        if "unavailable" in runs[mode][0]:
            rows.append(runs[mode][0])
            continue
        row = dict(runs[mode][0])
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(r[k] for r in runs[mode])
        rows.append(row)
    ref = next((r for r in rows if r["mode"] == "identity"), None)
    rate = statistics.median(rates)
    print(f"pack: {native.native_pack_status()} (the -python modes: pure Python)")
    print(f"memcpy: {rate / 1e9:.2f} GB/s for copies of {save_bytes} B (one activation of this model), the median "
          f"of one a round ({min(rates) / 1e9:.2f}-{max(rates) / 1e9:.2f}), each the best of five passes over 512 "
          "distinct tensors")
    print(f"{'mode':13s} {'saves':>6s} {'pack us':>8s} {'calls':>6s} {'unpack us':>10s} {'calls':>6s} {'fwd ms':>8s} {'bwd ms':>8s}"
          f" {'fwd +us/save':>13s} {'all threads +us/save':>21s} {'of it copying':>14s} {'beyond':>7s}")
    for r in rows:
        if "unavailable" in r:
            print(f"{r['mode']:13s} unavailable: {r['unavailable']}")
            continue
        extra = ""
        if ref is not None and r["saves"] and r is not ref:
            r["forward_extra_us_per_save"] = (r["forward_ms"] - ref["forward_ms"]) * 1e3 / r["saves"]
            extra = f" {r['forward_extra_us_per_save']:13.1f}"
            if r["backward_ms"] is not None:  # a whole step against identity's
                r["all_threads_extra_us_per_save"] = (
                    (r["step_all_threads_ms"] - ref["step_all_threads_ms"]) * 1e3 / r["saves"])
                r["copy_us_per_save"] = r["copied_bytes_per_step"] / rate * 1e6 / r["saves"]
                r["all_threads_beyond_copy_us_per_save"] = r["all_threads_extra_us_per_save"] - r["copy_us_per_save"]
                extra += (f" {r['all_threads_extra_us_per_save']:21.1f} {r['copy_us_per_save']:14.1f}"
                          f" {r['all_threads_beyond_copy_us_per_save']:7.1f}")
        unpack = (f"{r['unpack_us']:10.1f} {r['unpack_calls']:6.1f}" if r["unpack_us"] is not None
                  else f"{'-':>10s} {'-':>6s}")
        bwd = f"{r['backward_ms']:8.2f}" if r["backward_ms"] is not None else f"{'-':>8s}"
        print(f"{r['mode']:13s} {r['saves']:6.0f} {r['pack_us']:8.1f} {r['pack_calls']:6.1f} {unpack}"
              f" {r['forward_ms']:8.2f} {bwd}{extra}")
    floor = next((r for r in rows if r["mode"] == "copies" and "all_threads_extra_us_per_save" in r), None)
    if floor is not None:  # Note [the copies' own floor]
        for r in rows:
            if r["mode"].startswith(("tier", "drive")) and "all_threads_extra_us_per_save" in r:
                r["all_threads_beyond_copies_us_per_save"] = (r["all_threads_extra_us_per_save"]
                                                              - floor["all_threads_extra_us_per_save"])
                print(f"{r['mode']}: all threads +{r['all_threads_beyond_copies_us_per_save']:.1f} us a save above "
                      f"copies' (the same bytes moved by two threads with no engine: "
                      f"+{floor['all_threads_extra_us_per_save']:.1f} above identity)")
    # Note [the all-threads figure round by round]: it moves with the VM (the copies' own floor by
    # a third between runs a minute apart, 2026-11-29): each round's, against identity's of the
    # same round, shows how far one run's median can be trusted.
    if ref is not None:
        for r in rows:
            rounds = runs.get(r["mode"], [])
            if "all_threads_beyond_copy_us_per_save" in r and len(rounds) == len(runs["identity"]) > 1:
                each = sorted((m["step_all_threads_ms"] - i["step_all_threads_ms"]) * 1e3 / r["saves"] - r["copy_us_per_save"]
                              for m, i in zip(rounds, runs["identity"]))
                r["all_threads_beyond_copy_rounds"] = each
                print(f"{r['mode']}: all threads beyond the copy, round by round against identity's: "
                      + " ".join(f"{v:.1f}" for v in each))
    # Note [a wake-up is dear here]
    # A thread that sleeps (for work, a lock, the GIL) and is woken costs this VM's CPU 10-30 us in the
    # kernel, both sides counted (2026-11-30: the copies mode's mover, which polls every 0.2 ms, spent 3
    # ms a step beyond its memmoves in slow phases), and a hand-over to the tier's sleeping copy thread
    # about 60 us of the training thread's (Note [copies are made where they are handed over]): the
    # all-threads figure moves with what a wake-up costs, times how often threads sleep. Printed.
    if ref is not None:  # where the all-threads figure goes: the thread that runs the model, the others
        for r in rows:
            if "all_threads_extra_us_per_save" in r and r["mode"] != "copies":
                r["training_thread_extra_us_per_save"] = (
                    (r["step_training_thread_ms"] - ref["step_training_thread_ms"]) * 1e3 / r["saves"])
                print(f"{r['mode']}: of all threads' +{r['all_threads_extra_us_per_save']:.1f} us a save, the training "
                      f"thread +{r['training_thread_extra_us_per_save']:.1f} (its whole step, hooks included), the "
                      f"others +{r['all_threads_extra_us_per_save'] - r['training_thread_extra_us_per_save']:.1f}")
    print("sleeps a step (voluntary context switches, all threads): "
          + ", ".join(f"{r['mode']} {r['sleeps_per_step']:.0f}" for r in rows if "sleeps_per_step" in r))
    for r in rows:
        if r.get("note"):
            print(f"  {r['mode']}: {r['note']}")
    print("pack us, unpack us: the training thread's CPU time a call, through one timing wrapper (identity: the floor, the "
          "wrapper included); calls: Python and builtin calls a call of pack, of unpack; all threads: the step's process "
          "CPU time above identity's, a save; of it copying: the bytes copied and read back a save at the memcpy rate above")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(dev), "args": vars(a), "memcpy_bps": rate, "memcpy_bps_rounds": rates, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
