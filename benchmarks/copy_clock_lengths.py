"""The host tier's copy clock over steps of changing length, on a modelled H100 (issue 63, item 3).

Drives the engine's own :class:`ssdtrain.host.copy_clock.CopyClock` as the engine drives it
(``begin`` at a forward's start, ``produced`` at each save, ``allows`` for each new save the tier
may take, ``schedule`` when the copy is handed over one save later, ``is_due`` at each later save,
``learn`` with the forward's device and host seconds), over a modelled timeline of
Llama-3.1-8B-shaped recompute+offload (``offload``: every save of a block, ``BLOCK_SAVES``): per block its input (``s x 4096 x 2`` bytes) and the rotary
cos and sin (``s x 128 x 2`` bytes each, one storage shared by every block: saves after the first
find it in the cache), then the loss's input; a device forward of ``2 x 8e9 x s / 4e14`` seconds
split evenly over the blocks; copies one after another on a copy engine at 54.7 GB/s (the
modelled H100's rates, ``ssdtrain.device.rates.H100``), each from
when its block input was produced; a host ahead of its device (20 ms of launches a forward, 30 us
a save, 100 us a copy). This is a model of the clock's timeline, not of the GPU: it has no
allocator, no kernels and no second thread; the modelled device (issue 63, item 1) is not built.

For each step: what left the device before its peak (the copies the host released by the end of
forward: a copy is released, stream-ordered, once due) against its own bound (``min(rate x the
forward's device time, its block inputs)``), and its step (forward with the compute stream's waits
for copies released before they were done, plus a backward of three forwards: recompute and
backward) against the same step without the tier. Steps before the clock has learned a reference
are marked; with ``--clock FILE`` a copy clock from another file (the one of an older tree, say)
is run instead::

    python benchmarks/copy_clock_lengths.py
    git show d08dd78:ssdtrain/host/copy_clock.py > /tmp/old_clock.py
    python benchmarks/copy_clock_lengths.py --clock /tmp/old_clock.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import dataclass

from ssdtrain.device.rates import H100

HIDDEN, LAYERS, HEAD_DIM, ELEMENT = 4096, 32, 128, 2
FLOPS_PER_TOKEN, PEAK_FLOPS = 2 * 8e9, H100.flops_per_s  # the modelled GPU's H100 (ssdtrain.device.rates)
COPY_RATE = H100.d2h_bytes_per_s
MIN_BYTES = 1 << 20  # the engine's default: a smaller storage is a small save (no entry, no copy)
HOST_FIXED, HOST_SAVE, HOST_COPY = 0.020, 30e-6, 100e-6


@dataclass
class Step:
    seq: int
    learned: bool  # the clock had a reference before this step
    copied: int  # bytes released off the device before the peak
    bound: int
    forward_s: float  # the device's, without the tier
    backward_s: float
    stall_s: float  # the compute stream's waits for copies
    host_s: float  # the host's forward, without and with its copies
    host_copies_s: float

    @property
    def share(self) -> float:
        return self.copied / self.bound if self.bound else 1.0

    @property
    def ratio(self) -> float:
        """The step against the same step without the tier."""
        base = max(self.forward_s, self.host_s) + self.backward_s
        return (max(self.forward_s + self.stall_s, self.host_copies_s) + self.backward_s) / base


# Plain offload's saves in a Llama block, in units of ``s x hidden x 2`` bytes: the input norm's
# input and output, q, k and v (grouped: a quarter each), attention's output, the o-projection's
# input, the residual, the post-attention norm's input and output, gate, up and their product
# (3.5 each), the down projection's input.
BLOCK_SAVES = (1, 1, 1, 0.25, 0.25, 1, 1, 1, 1, 1, 3.5, 3.5, 3.5)


def _saves(seq: int, mode: str) -> list[tuple[int, bool]]:
    """``(bytes, new storage)`` of a forward's saves, in pack order: ``recompute+offload`` (each
    block's input, the rotary cos and sin shared by every block) or ``offload`` (every block's
    saves, ``BLOCK_SAVES``)."""
    block, rope = seq * HIDDEN * ELEMENT, seq * HEAD_DIM * ELEMENT
    out: list[tuple[int, bool]] = []
    for b in range(LAYERS):
        out += [(rope, b == 0), (rope, b == 0)]
        out += [(int(block * k), True) for k in BLOCK_SAVES] if mode == "offload" else [(block, True)]
    return out + [(block, True)]


def run_step(clock, seq: int, mode: str = "recompute+offload") -> Step:
    """One step of ``seq`` tokens through ``clock`` (which learns from its forward at the end, as
    the engine has it learn at the next forward's start)."""
    learned = clock.reference is not None
    clock.begin(True)
    saves = _saves(seq, mode)
    forward = FLOPS_PER_TOKEN * seq / PEAK_FLOPS
    per_save = forward / len(saves)  # the device's time between two saves
    device = 0.0  # the compute stream's time, waits included
    engine_free = 0.0  # when the copy engine is done with what it was given
    held = None  # a save the tier took, handed over at the next save
    copies: list[list] = []  # [due position, bytes, copy end (device time)]
    released = stall = 0
    n_copies = 0
    every = _counts_every_save(clock)

    def hand_over(nb: int, at: float) -> None:  # a copy queued behind the engine's, from its save's making
        nonlocal engine_free
        engine_free = max(engine_free, at) + nb / COPY_RATE
        copies.append([clock.schedule(nb), nb, engine_free])

    def release_due() -> None:  # copies due are released: the compute stream waits for each from here
        nonlocal device, stall, released
        for c in copies:
            if c[0] is not None and clock.is_due(c[0]):
                stall += max(0.0, c[2] - device)
                device = max(device, c[2])
                released += c[1]
                c[0] = None

    for nbytes, new in saves:
        made = device  # the save's producer ran up to here
        large = new and nbytes >= MIN_BYTES
        if every:
            clock.produced(nbytes if new else 0)
        elif large:
            clock.produced(nbytes)
        if held is not None:  # Note [the last save waits]: the previous save's copy is handed over now
            hand_over(*held)
            held = None
        if large and clock.allows(nbytes):
            held = (nbytes, made)
            n_copies += 1
        release_due()
        device += per_save
    if held is not None:  # the last save's copy, handed over at forward's end
        hand_over(*held)
    release_due()  # at the end of forward, only what is due (the host is ahead of its device)
    offloadable = sum(n for n, new in saves if new and n >= MIN_BYTES)
    host = HOST_FIXED + len(saves) * HOST_SAVE
    device = max(device, host + n_copies * HOST_COPY)  # a host behind its device sets the pace
    clock.learn(device, clock.pos, host + n_copies * HOST_COPY)
    backward = 3 * forward if mode == "recompute+offload" else 2 * forward
    return Step(seq, learned, released, int(min(COPY_RATE * forward, offloadable)), forward, backward, stall,
                host, host + n_copies * HOST_COPY)


def _counts_every_save(clock) -> bool:
    """Whether ``clock`` places a forward by its count of saves (then every save is counted, a
    save found in the cache as 0 bytes); a clock placing by bytes counts the tier's saves only."""
    return hasattr(clock, "saves")


def new_clock(path: str | None = None):
    if path is None:
        from ssdtrain.host.copy_clock import CopyClock
    else:
        spec = importlib.util.spec_from_file_location("other_copy_clock", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        CopyClock = module.CopyClock
    clock = CopyClock()
    clock.rate = COPY_RATE  # measured once per device, before the first forward's copies
    return clock


SCHEDULES = {
    "cycle": [1024, 8192, 2048, 16384, 4096] * 4,
    "long-after-short": [1024] * 50 + [16384],
    "short-after-long": [16384] * 4 + [1024, 2048],
    "steady-16k": [16384] * 6,
    "steady-1k": [1024] * 6,
}


MODES = ("recompute+offload", "offload")


def run_schedule(name: str, mode: str = "recompute+offload", path: str | None = None) -> list[Step]:
    clock = new_clock(path)
    return [run_step(clock, s, mode) for s in SCHEDULES[name]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clock", help="a copy_clock.py to run instead of the installed one")
    p.add_argument("--json")
    a = p.parse_args()
    out = {}
    print(f"modelled H100: {PEAK_FLOPS / 1e12:.0f} TFLOP/s, copy {COPY_RATE / 1e9:.0f} GB/s; Llama-3.1-8B-shaped; "
          f"clock {a.clock or 'ssdtrain.host.copy_clock'}")
    for mode, name in [(m, n) for m in MODES for n in SCHEDULES]:
        steps = run_schedule(name, mode, a.clock)
        name = f"{mode} {name}"
        out[name] = [vars(s) | {"share": s.share, "ratio": s.ratio} for s in steps]
        learned = [s for s in steps if s.learned]
        worst = min(learned, key=lambda s: s.share) if learned else None
        slowest = max(learned, key=lambda s: s.ratio) if learned else None
        print(f"\n{name}: {len(steps)} steps; after the reference, lowest share "
              f"{worst.share:.0%} (seq {worst.seq}), slowest x{slowest.ratio:.3f} (seq {slowest.seq})"
              if learned else f"\n{name}: no reference learned")
        shown = steps if len(steps) <= 10 else steps[:5] + steps[-3:]
        for s in shown:
            print(f"  seq {s.seq:6d}{'' if s.learned else ' (learning)':11s} copied {s.copied / 2**30:6.2f} "
                  f"of {s.bound / 2**30:5.2f} GiB ({s.share:4.0%})  step x{s.ratio:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
