"""Note [write only what comes back in time]: a drive too slow to bring the bytes back in time
is sent less (kept instead of waited for), and more again when it speeds up.

Two tests: a closed loop of the budget on a modelled drive and step (a fake clock: every figure
is deterministic), and the same end to end on a rate-limited test store, where gradients stay
exact and only byte counters are asserted (its waits are real time, so they are never compared).
"""

import torch
from torch import nn

import ssdtrain
from ssdtrain.config import OffloadConfig
from ssdtrain.schedule import WriteBudget
from ssdtrain.store.memory import MemoryBackend
from ssdtrain.store.throttle import ThrottledBackend

from _equiv import assert_same, step


def test_a_slow_drive_is_sent_less_and_a_fast_one_more():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    x = torch.randn(256, 256)
    loss_fn = lambda: model(x).sum()  # noqa: E731
    base = step(model, loss_fn, None)
    # Reads at 4 MB/s: the ~3 MiB a step saves take most of a second to come back, while the
    # step computes for milliseconds. Writes are fast, so forward writes everything.
    store = ThrottledBackend(MemoryBackend(OffloadConfig(backend="memory")), write_bps=1e9, read_bps=4e6)
    off = ssdtrain.Offloader(model, store=store, min_bytes=0)

    def run():
        before = off.stats()
        assert_same(base, step(model, loss_fn, off))
        off.wait()  # this step's writes are counted in this step, however slowly the I/O threads ran
        after = off.stats()
        return (after.written_bytes - before.written_bytes, after.read_stall_seconds - before.read_stall_seconds,
                after.budget_kept_bytes - before.budget_kept_bytes)

    slow = [run() for _ in range(8)]
    full = slow[0][0]
    assert full > 0 and slow[0][2] == 0, slow            # the first step sends everything it may
    assert off.stats().write_budget_bytes is not None    # backward waited, so a budget was learned
    later = slow[1:]  # the budget probes upward now and then (a clean step grows it): sums
    assert sum(w for w, _, _ in later) <= 0.75 * full * len(later), slow   # less is sent to the slow drive,
    assert sum(kept for _, _, kept in later) > 0, slow                     # and the rest is kept in memory
    store._read.bps = store._write.bps = 1e12          # the drive becomes fast
    fast = [run() for _ in range(12)]
    assert any(w == full and kept == 0 for w, _, kept in fast[3:]), fast  # everything is sent again
    off.close()
    store.close()


def test_the_budget_converges_to_what_the_drive_carries_and_follows_it():
    """The budget in a closed loop with a modelled step and drive, on a fake clock. Forward takes
    0.3 s and offers 100 saves of 10 MiB; backward computes for 0.6 s, so a drive reading R bytes/s
    brings back R * 0.6 s in time, and backward waits for the rest. The budget must learn that
    capacity from the waits alone (no rates are given to it), keep rather than stall, and follow
    the drive when it slows down and speeds up mid-run."""
    mib = 1 << 20
    budget = WriteBudget(0.0, mib)
    clock = 0.0

    def step(read_bps):
        nonlocal clock
        sent = sum(10 * mib for _ in range(100) if budget.allows(10 * mib))
        stall = max(0.0, sent / read_bps - 0.6)
        budget.written(sent)
        budget.stalled(stall)
        clock += 0.3 + 0.6 + stall
        budget.new_step(clock)
        return sent, stall

    def settled(read_bps, steps):
        runs = [step(read_bps) for _ in range(steps)]
        late = runs[-6:]
        capacity = read_bps * 0.6
        mean_sent = sum(s for s, _ in late) / len(late)
        mean_stall = sum(w for _, w in late) / len(late)
        assert 0.8 * capacity <= mean_sent <= 1.2 * capacity, runs   # about what the drive carries,
        assert mean_stall <= 0.05 * 0.9, runs                           # with waits of a few % at most
        return runs

    first = step(500 * mib)
    assert first == (1000 * mib, 1000 / 500 - 0.6)   # no budget yet: everything, and a 1.4 s wait
    settled(500 * mib, 14)                           # 300 MiB come back in time
    slower = settled(250 * mib, 12)                  # the drive halves its speed mid-run
    assert slower[0][1] > 0.5 and slower[-1][1] < 0.1, slower  # one long wait, then it adapts
    faster = [step(4000 * mib) for _ in range(40)]   # a drive fast enough for everything
    assert faster[-1] == (1000 * mib, 0.0), faster   # everything is sent again, nothing waited
    assert [s for s, _ in faster] == sorted(s for s, _ in faster)   # growing all the way back
