"""Note [deaths that hold no memory wait] (``ssdtrain/engine/ref.py``): in backward, a dying save
whose entry still holds its bytes is settled at the next unpack; the others, a batch at a time."""

from __future__ import annotations

import torch

import ssdtrain
from ssdtrain.engine import unpack as unpack_mod
from ssdtrain.engine.cache import State

from _equiv import assert_same
from test_tier import _gpt, tier_on_cpu  # noqa: F401  (a fixture)


def _off(off_dir, model=None):
    return ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="64MiB")


def test_a_death_that_holds_memory_is_settled_at_the_next_unpack(off_dir, tier_on_cpu):
    off = _off(off_dir)
    big, other = torch.randn(1 << 20) * 1.0, torch.randn(256) * 1.0
    try:
        with off:
            kept = off._pack(big)  # a lone group as forward ends: kept in memory (adaptive keep)
        with off:
            written = off._pack(other)
            off.wait()  # copied, its memory released
        assert kept.entry.state is State.KEPT and kept.entry.data is not None
        assert written.entry.state is State.ON_DISK
        probe = off._pack(other)  # a save kept as it is would not unpack through the engine
        del probe
        off._drain()
        del kept
        assert off._graveyard.urgent and len(off._graveyard) == 1
        assert torch.equal(off._unpack(written), other)
        assert len(off._graveyard) == 0 and not off._graveyard.urgent  # settled: the memory went
    finally:
        off.close()


def test_deaths_of_saves_on_the_host_are_settled_a_batch_at_a_time(off_dir, tier_on_cpu, monkeypatch):
    """Every save copied before backward: its deaths hold no memory, and backward's unpacks drain
    about GRAVEYARD_BATCH times less often than once a death; gradients the same either way."""
    model, loss_fn = _gpt()
    drains = {}
    results = {}
    for batch in (1, unpack_mod.GRAVEYARD_BATCH):
        monkeypatch.setattr(unpack_mod, "GRAVEYARD_BATCH", batch)
        off = _off(off_dir, model)
        count = [0]
        real = off._drain

        def counted(*args, count=count, real=real, **kwargs):
            count[0] += 1
            return real(*args, **kwargs)
        try:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1234)
                with off:
                    loss = loss_fn()
                    off.wait()  # every copy landed and released before backward
                off._drain = counted
                count[0] = 0
                loss.backward()
                off._drain = real
                results[batch] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
            off.wait()
            assert off.stats().live_entries == 0
        finally:
            off.close()
        drains[batch] = count[0]
    assert_same(results[1], results[unpack_mod.GRAVEYARD_BATCH])
    assert drains[1] >= 10 and drains[unpack_mod.GRAVEYARD_BATCH] * 4 <= drains[1], drains
