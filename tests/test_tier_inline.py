"""Where the host tier's copies are made (Note [copies are made where they are handed over] in
``host/tier.py``): by default on the thread that hands a batch over, with ``inline_copies(False)``
on the copy threads, as before; both exact, with the same failure handling."""

from __future__ import annotations

import threading

import pytest
import torch

import ssdtrain
from ssdtrain.host import tier

from _equiv import assert_same, exact_steps, step
from test_tier import _gpt, tier_on_cpu  # noqa: F401  (a fixture)


def _threads_seen(monkeypatch) -> dict[str, set]:
    """The names of the threads that ran the tier's copies in and back, by direction."""
    seen: dict[str, set] = {"in": set(), "out": set()}
    real_in, real_out = tier.TieredBackend._copy_in, tier.TieredBackend._copy_out
    monkeypatch.setattr(tier.TieredBackend, "_copy_in",
                        lambda self, batch: (seen["in"].add(threading.current_thread().name), real_in(self, batch))[1])
    monkeypatch.setattr(tier.TieredBackend, "_copy_out",
                        lambda self, batch: (seen["out"].add(threading.current_thread().name), real_out(self, batch))[1])
    return seen


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "threads"])
@pytest.mark.parametrize("host_bytes", ["64MiB", "256KiB"])  # all in the tier; most spilled to the drive
def test_copies_are_exact_and_made_where_asked(off_dir, tier_on_cpu, monkeypatch, host_bytes, inline):
    seen = _threads_seen(monkeypatch)
    model, loss_fn = _gpt()
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes=host_bytes)
    off._tier.inline_copies(inline)
    s = exact_steps(model, loss_fn, off)
    assert s.host_copied_bytes > 0 and s.host_read_bytes > 0
    assert s.host_tier_bytes == 0 and s.live_entries == 0  # every graph gone: nothing held
    assert s.written_bytes == s.host_copied_bytes + sum(s.written_bytes_by_path.values())
    here = threading.current_thread().name
    if inline:  # the default: where they are handed over, never on the copy threads (a spill's drive
        # write, done, may hand the next batch over from the drive's I/O thread)
        assert here in seen["in"] and seen["out"] == {here}
        assert not any(name.startswith(("ssdtrain-d2h", "ssdtrain-h2d")) for name in seen["in"])
    else:  # the copy threads alone, one a direction
        assert [n.split("_")[0] for n in seen["in"]] == ["ssdtrain-d2h"], seen
        assert [n.split("_")[0] for n in seen["out"]] == ["ssdtrain-h2d"], seen


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "threads"])
def test_a_batch_that_fails_fails_its_future_and_keeps_the_next(off_dir, tier_on_cpu, monkeypatch, inline):
    """A failed batch fails its future (the writes' completion settles them as failed: kept in
    memory, with ``on_error="keep"`` one warning), as on the copy thread; the batches after it are
    made, and every step's gradients stay exact."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    real_in, failed = tier.TieredBackend._copy_in, []

    def copy_in(self, batch):
        if not failed:
            failed.append(len(batch))
            raise OSError(5, "a copy that failed")
        return real_in(self, batch)

    monkeypatch.setattr(tier.TieredBackend, "_copy_in", copy_in)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="64MiB", on_error="keep")
    off._tier.inline_copies(inline)
    try:
        with pytest.warns(RuntimeWarning, match="a copy that failed"):
            assert_same(base, step(model, loss_fn, off))
        assert_same(base, step(model, loss_fn, off))
        off.wait()
        s = off.stats()
    finally:
        off.close()
    assert failed and s.host_copied_bytes > 0 and s.failed_writes >= 1


def test_a_drain_cut_short_as_it_was_queued_is_undone(monkeypatch):
    """Note [a batch's drain is started or undone]: a KeyboardInterrupt as the copy thread's drain
    was being queued left every later batch waiting for ever; the next submission's drain now
    makes the one left pending, then its own."""
    from ssdtrain.store._pool import IOPool
    made: list[list] = []
    pool = IOPool(1, "test-drain")
    batches = tier._Batches(pool, made.append)
    batches.inline = False
    real, cut = IOPool.submit, [True]

    def submit(self, fn, *args):
        if cut and self is pool:
            cut.pop()
            raise KeyboardInterrupt
        return real(self, fn, *args)

    monkeypatch.setattr(IOPool, "submit", submit)
    try:
        with pytest.raises(KeyboardInterrupt):
            batches.submit(["first"])
        second = batches.submit(["second"])
        assert second.exception(timeout=10) is None
        assert made == [["first", "second"]] or made == [["first"], ["second"]]
    finally:
        pool.shutdown()


@pytest.mark.parametrize("cut", ["shrink", "split"])
def test_an_extent_cut_short_in_the_allocator_frees_what_it_holds(monkeypatch, cut):
    """Note [an extent says what its allocator holds]: a KeyboardInterrupt as the allocator freed
    a shrunk region's tail (or as it split one) left the extent's ``reserved`` as it was, and its
    free then raised; now the extent frees what the allocator holds (the tail leaked, never held
    twice)."""
    from ssdtrain.host.host_pool import HostPool
    from ssdtrain.store.allocator import ExtentAllocator
    pool = HostPool(8 << 20, pin=lambda n: torch.empty(n, dtype=torch.uint8), slab=8 << 20, background=False)
    pool.pin_first()
    ext = pool.allocate(4 << 20)
    real = getattr(ExtentAllocator, "free" if cut == "shrink" else "split")

    def interrupted(self, *args, **kwargs):
        if cut == "split":
            real(self, *args, **kwargs)  # the split is made, the interrupt comes as it returns
        raise KeyboardInterrupt

    monkeypatch.setattr(ExtentAllocator, "free" if cut == "shrink" else "split", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.shrink(ext, 1 << 20) if cut == "shrink" else pool.split(ext, 1 << 20)
    monkeypatch.undo()
    assert ext.reserved == 1 << 20
    pool.free(ext)  # raised ValueError before
    assert pool.used == (0 if cut == "shrink" else 3 << 20)  # a shrink's tail leaked; a split's still reserved
    pool.close()
