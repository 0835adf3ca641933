"""Soak on the modelled GPU: seeded schedules of models, sequence lengths, pool sizes, drive
speeds and interrupts; every step exact, nothing left behind, no copy read before its end.

    python benchmarks/model_soak.py --seeds 2000 [--start 0] [--planted]
    python benchmarks/model_soak.py --seed N           # replays one seed, with what it drew

A seed draws everything from ``random.Random(seed)`` (:func:`draw`): a tiny GPT or Llama from
``ssdtrain.bench.models`` (dropout, naive or flash attention, checkpointed blocks or not),
float32 or bfloat16, the batch, each step's sequence length, ``min_bytes``, the host tier's pool
(from smaller than one save to one holding every save; sometimes one large enough for the tier's
rate probe), the drive (the memory backend, sometimes behind a ``ThrottledBackend``), one
to four steps, and in some seeds an interrupt (``KeyboardInterrupt`` from a forward hook, or an
error from a backward hook, at a drawn block) that abandons a step. Each step that completes is
compared with the same model trained without ssdtrain on the same modelled H100 (the same
dropout seed): the loss and every gradient ``torch.equal``. The modelled GPU records any op or
copy that reads memory before the copy writing it is ordered before it, and any device buffer
released while a copy may still read it (``gpu.races``, Note [a modelled copy lands when it is
seen] in ``ssdtrain/device/model.py``); a seed fails on any. After the last step: no entry,
nothing in the pool, nothing on the drive; after ``close()``, no pinned byte and no device byte
but the parameters.

``--planted`` (``run_seed(seed, planted=True)``) plants a race, for the soak to catch: the
offloader's stream-ordered release of a save whose copy is due (``Offloader._copy_due``, Note [a
tier copy is released in stream order]) orders the compute stream after the *previous* copy
batch's event instead of this one's: the release comes one event early.

What is not modelled: the drive is the memory backend (host RAM; posix and kvikio do not run on
the model), a throttled drive runs on the wall clock (its timing, unlike the GPU's, varies
between runs: a replay takes the same decisions, not the same I/O timeline).
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import sys
import time
import traceback

import torch

import ssdtrain
from ssdtrain.bench import models as bench_models
from ssdtrain.bench.models import GPT, GPTConfig, Llama, LlamaConfig
from ssdtrain.config import OffloadConfig
from ssdtrain.device.model import ModelledGPU, modelled
from ssdtrain.device.model_ops import ModelledCompute
from ssdtrain.device.rates import H100
from ssdtrain.host import tier
from ssdtrain.store.memory import MemoryBackend
from ssdtrain.store.throttle import ThrottledBackend

LR = 0.05  # a plain SGD step between steps: each step's weights differ

# Found by this soak (2026-11-28) and fixed: a backward cut short left the host tier's copies back
# unordered, and their pool extents were given back at once, to be overwritten by the next step's
# copies in while the copies back still read them (Note [a pool extent outlives its copy back] in
# ``ssdtrain/host/tier.py``); seeds 4, 20, 31, 53 and 86 of the first 100 showed it.


class Interrupted(RuntimeError):
    """Raised from a backward hook: the step is abandoned mid-backward."""


def draw(seed: int) -> dict:
    """What seed ``seed`` runs: every choice from ``random.Random(seed)``, nothing else."""
    rng = random.Random(seed)
    arch = rng.choice(["gpt", "llama"])
    layers = rng.randint(1, 2)
    hidden, heads = rng.choice([(32, 2), (32, 4), (64, 4)])
    max_seq = rng.choice([16, 32])
    p = dict(seed=seed, arch=arch, layers=layers, hidden=hidden, heads=heads, max_seq=max_seq,
             vocab=rng.choice([64, 128]), recompute=rng.random() < 0.4,
             dtype=rng.choice(["float32", "float32", "bfloat16"]), batch=rng.randint(1, 3))
    if arch == "gpt":
        p.update(dropout=rng.choice([0.0, 0.0, 0.1]), flash=rng.random() < 0.6)
    else:
        p.update(kv_heads=rng.choice([0, 1, heads]), tie=rng.random() < 0.3)
    steps = rng.randint(1, 3)
    p["seqs"] = [rng.randint(4, max_seq) for _ in range(steps)]
    # The largest save is about batch x seq x 4 x hidden elements (the MLP's); all saves of a step a
    # few dozen of those. The pool: smaller than one save, a few saves, all of them, or past the
    # 64 MiB the tier's rate probe takes (then copies are due by the learned copy clock).
    one = p["batch"] * max(p["seqs"]) * 4 * hidden * (2 if p["dtype"] == "bfloat16" else 4)
    p["host_bytes"] = rng.choice([
        rng.randint(1, max(1, one // 2)),          # smaller than one save
        rng.randint(one, 4 * one),                 # a few saves
        rng.randint(40 * one, 80 * one),           # every save of a step
        rng.randint(64 << 20, 96 << 20) if rng.random() < 0.3 else rng.randint(40 * one, 80 * one),
    ])
    p["min_bytes"] = rng.choice([0, 0, 512, 4096, one // 2])
    p["drive_bps"] = rng.choice([None, None, 20e6, 200e6, 2e9])  # bytes/s each way (None: unthrottled)
    if rng.random() < 0.35:
        p["interrupt"] = dict(step=rng.randrange(steps), phase=rng.choice(["forward", "backward"]),
                              block=rng.randrange(layers))
    else:
        p["interrupt"] = None
    return p


def _model(p: dict) -> torch.nn.Module:
    torch.manual_seed(p["seed"])
    if p["arch"] == "gpt":
        cfg = GPTConfig(vocab=p["vocab"], seq=p["max_seq"], layers=p["layers"], hidden=p["hidden"],
                        heads=p["heads"], dropout=p["dropout"], flash=p["flash"])
        model = GPT(cfg, recompute=p["recompute"])
    else:
        cfg = LlamaConfig(vocab=p["vocab"], seq=p["max_seq"], layers=p["layers"], hidden=p["hidden"],
                          heads=p["heads"], kv_heads=p["kv_heads"], tie=p["tie"])
        model = Llama(cfg, recompute=p["recompute"])
    return model.to(getattr(torch, p["dtype"]))


class _OneEventEarly:
    """The planted race: stands for ``copies.OrderOnce`` in the offloader's release of a due save,
    and orders the stream after the fence of the copy batch *before* this save's (none for the
    first): the save's memory goes one event early."""

    def __init__(self) -> None:
        self.previous = self.current = None

    def __call__(self, fence, stream) -> None:
        if fence is not self.current:
            self.previous, self.current = self.current, fence
        if self.previous is not None:
            self.previous.order(stream)


def _interrupt_hooks(model: torch.nn.Module, spec: dict | None, armed: list) -> None:
    if spec is None:
        return
    block = model.blocks[spec["block"]]
    if spec["phase"] == "forward":
        def hook(module, args, out):
            if armed[0]:
                armed[0] = False
                raise KeyboardInterrupt
        block.register_forward_hook(hook)
    else:
        def hook(module, grad_in, grad_out):
            if armed[0]:
                armed[0] = False
                raise Interrupted("planned")
        block.register_full_backward_hook(hook)


def _grads(model: torch.nn.Module) -> list:
    return [None if q.grad is None else q.grad for q in model.parameters()]


def _same(a: list, b: list) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if (x is None) != (y is None):
            return f"gradient {i}: one is None"
        if x is not None and not torch.equal(x, y):
            return f"gradient {i} differs (max abs {(x.float() - y.float()).abs().max().item():.3g})"
    return None


def _sgd(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for q in model.parameters():
            if q.grad is not None:
                q.sub_(q.grad, alpha=LR)
    model.zero_grad(set_to_none=True)


def run_seed(seed: int, planted: bool = False) -> dict:
    """Runs seed ``seed`` (see the module's docstring); returns what it drew (``params``), whether
    it passed (``ok``), why not (``reason``: the first check that failed), and counters of what
    it exercised (the offloader's stats, the races the model recorded)."""
    floor = tier.PROBE_MIN_BYTES
    try:
        return _run_seed(seed, planted)
    finally:
        tier.PROBE_MIN_BYTES = floor


def _run_seed(seed: int, planted: bool) -> dict:
    p = draw(seed)
    result = dict(seed=seed, params=p, ok=False, reason=None, planted=planted)
    try:
        result.update(_run(p, planted))
    except Exception as e:  # noqa: BLE001 -- a seed's error is its failure, reported with where it came from
        tb = traceback.extract_tb(e.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        result["reason"] = f"{type(e).__name__}: {e}{where}"
    result["ok"] = result["reason"] is None
    return result


def _run(p: dict, planted: bool) -> dict:
    base = _model(p)
    model = copy.deepcopy(base)
    gpu = ModelledGPU(H100, seed=p["seed"], jitter=0.1)
    dtype = getattr(torch, p["dtype"])
    out: dict = dict(reason=None, steps_done=0, interrupted=False)

    def fail(why: str) -> dict:
        out["reason"] = why
        return out

    armed = [False]
    _interrupt_hooks(model, p["interrupt"], armed)
    with modelled(gpu):
        gpu.adopt(*base.parameters(), *base.buffers(), *model.parameters(), *model.buffers())
        cfg = OffloadConfig(backend="memory", min_bytes=p["min_bytes"], host_bytes=p["host_bytes"], io_threads=1)
        store = MemoryBackend(cfg)
        if p["drive_bps"] is not None:
            store = ThrottledBackend(store, write_bps=p["drive_bps"], read_bps=p["drive_bps"])
        # The draw's pool past 64 MiB stood for "the rate probe runs" when the probe took 64 MiB;
        # it now takes what is allocated, none under 1 MiB (Note [the rate probe stays under the
        # step's peak]): these tiny models get it at the same seeds by lowering that floor.
        tier.PROBE_MIN_BYTES = 1 if p["host_bytes"] >= 64 << 20 else 1 << 30
        off = ssdtrain.Offloader(model, config=cfg, store=store)
        if planted:
            off._ordered = _OneEventEarly()
        try:
            with ModelledCompute(gpu):
                for i, s in enumerate(p["seqs"]):
                    g = torch.Generator().manual_seed(p["seed"] * 1000 + i)
                    x = torch.randint(0, p["vocab"], (p["batch"], s), generator=g)
                    y = torch.randint(0, p["vocab"], (p["batch"], s), generator=g)
                    gpu.adopt(x, y)
                    cut = p["interrupt"] is not None and p["interrupt"]["step"] == i
                    if cut:
                        armed[0] = True
                        try:
                            torch.manual_seed(i)
                            with off:
                                loss = model(x, y)
                            loss.backward()
                            return fail(f"step {i}: the planned interrupt never came")
                        except (KeyboardInterrupt, Interrupted):
                            out["interrupted"] = True
                        loss = None
                        model.zero_grad(set_to_none=True)
                        gc.collect()
                    torch.manual_seed(i)
                    loss0 = base(x, y)
                    loss0.backward()
                    torch.manual_seed(i)
                    with off:
                        loss = model(x, y)
                    loss.backward()
                    if gpu.races:
                        return fail(f"step {i} (seq {s}): race: {gpu.races[0]}")
                    if not torch.equal(loss.detach(), loss0.detach()):
                        return fail(f"step {i} (seq {s}): loss differs ({loss.item()} vs {loss0.item()})")
                    why = _same(_grads(model), _grads(base))
                    if why is not None:
                        return fail(f"step {i} (seq {s}): {why}")
                    loss = loss0 = None
                    _sgd(base)
                    _sgd(model)
                    out["steps_done"] += 1
                del x, y
            off.wait()
            s = off.stats()
            out.update(host_copied=s.host_copied_bytes, spilled=s.spilled_bytes, read=s.read_bytes,
                       kept=s.budget_kept_bytes)
            if s.live_entries or s.resident_bytes:
                return fail(f"after the last step: {s.live_entries} entries, {s.resident_bytes} bytes resident left")
            if s.host_tier_bytes:
                return fail(f"after the last step: {s.host_tier_bytes} bytes left in the pool")
            inner = store.inner if isinstance(store, ThrottledBackend) else store
            if s.live_disk_bytes or inner._blobs:
                return fail(f"after the last step: {s.live_disk_bytes} bytes, {len(inner._blobs)} blobs on the drive")
        finally:
            off.close()
        gpu.synchronize()
        if gpu.races:
            return fail(f"race: {gpu.races[0]}")
        # The bench Llama's RoPE frequencies are cached per shape (``models._inverse_frequencies``);
        # one made during this seed is the model's memory, not the engine's. Kept, it failed seed 0
        # run alone (32 bytes), and passed it after any test that had filled the cache on the CPU.
        bench_models._inverse_frequencies.cache_clear()
        gc.collect()
        if gpu.pinned_bytes():
            return fail(f"after close: {gpu.pinned_bytes()} pinned bytes left")
        params = sum(t.untyped_storage().nbytes() for m in (base, model)
                     for t in {id(q.untyped_storage()): q for q in [*m.parameters(), *m.buffers()]}.values())
        if gpu.allocated() != params:
            return fail(f"after close: {gpu.allocated()} device bytes allocated, the parameters are {params}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--seed", type=int, default=None, help="replay this one seed and print what it drew")
    ap.add_argument("--planted", action="store_true", help="plant the race (a copy released one event early)")
    args = ap.parse_args(argv)
    # The ops are tiny: with several intra-op threads each one waited for a thread team (1.9 s
    # against 0.35 s a seed on 2 busy cores, 2026-11-28).
    torch.set_num_threads(1)
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    failed, t0 = [], time.perf_counter()
    for seed in seeds:
        r = run_seed(seed, planted=args.planted)
        if args.seed is not None:
            print(r)
        if not r["ok"]:
            failed.append(seed)
            print(failure_line(r), flush=True)
    took = time.perf_counter() - t0
    n = len(seeds)
    print(f"{n - len(failed)} of {n} seeds passed{' (race planted)' if args.planted else ''} in "
          f"{took:.1f} s ({took / max(n, 1) * 1e3:.0f} ms a seed); failed: {len(failed)} (first: "
          f"{failed[0] if failed else None})", flush=True)
    return 1 if failed else 0


def failure_line(r: dict) -> str:
    """The line a failing seed prints: its reason and the command that replays it."""
    flag = " --planted" if r.get("planted") else ""
    return f"FAILED seed {r['seed']}: {r['reason']}; replay: python benchmarks/model_soak.py --seed {r['seed']}{flag}"


if __name__ == "__main__":
    sys.exit(main())
