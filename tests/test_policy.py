"""Note [write only what comes back in time], end to end on a rate-limited test store: a drive
too slow to bring the bytes back in time is sent less (kept instead of waited for), and more
again when it speeds up; gradients stay exact throughout. Counters only, no timing asserted."""

import torch
from torch import nn

import ssdtrain
from ssdtrain.config import OffloadConfig
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
        after = off.stats()
        return (after.written_bytes - before.written_bytes, after.read_stall_seconds - before.read_stall_seconds,
                after.budget_kept_bytes - before.budget_kept_bytes)

    slow = [run() for _ in range(8)]
    full, first_stall = slow[0][0], slow[0][1]
    assert full > 0 and first_stall > 0                 # everything went out; backward waited
    assert off.stats().write_budget_bytes is not None   # ... so a budget was learned
    late = slow[4:]  # the budget probes upward now and then (a clean step grows it): averages
    assert sum(w for w, _, _ in late) / len(late) < full / 2, slow   # far less is sent to the slow drive,
    assert sum(kept for _, _, kept in late) > 0, slow                # the rest is kept in memory,
    assert sum(s for _, s, _ in late) / len(late) < first_stall / 2, slow  # and backward waits less
    store._read.bps = store._write.bps = 1e12          # the drive becomes fast
    fast = [run() for _ in range(8)]
    assert fast[-1][0] == full and fast[-1][2] == 0, fast  # everything is sent again, nothing held back
    off.close()
    store.close()
