"""The host tier's logic on the CPU: the pool, the copy clock, and the engine with CPU tensors let
through the tier (on a GPU only CUDA tensors use it; tests/gpu/test_gpu_tier.py runs it there)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

import ssdtrain
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.config import OffloadConfig
from ssdtrain.host.copy_clock import COPY_SHARE, DUE_MARGIN, HOST_STRETCH, PROBE_SHARE, CopyClock
from ssdtrain.host.host_pool import HostPool, auto_host_bytes

from _equiv import assert_same, exact_steps, step

MiB = 1 << 20


@pytest.fixture
def tier_on_cpu(monkeypatch):
    """CPU tensors go through the host tier, as CUDA tensors do on a GPU."""
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))


def _pool(capacity, slab=4 * MiB):
    return HostPool(capacity, pin=lambda n: torch.empty(n, dtype=torch.uint8), slab=slab, background=False)


def test_pool_pins_slabs_as_it_fills_and_never_beyond_capacity():
    pool = _pool(10 * MiB)
    assert pool.allocate(MiB) is None  # nothing pinned yet: the first slab is pinned now
    assert pool.pinned == 4 * MiB
    exts = [pool.allocate(MiB) for _ in range(3)]
    assert all(e is not None for e in exts) and pool.pinned == 4 * MiB  # 3 of 4 MiB: under GROW_AT
    exts.append(pool.allocate(MiB // 2))
    assert pool.pinned == 8 * MiB  # past GROW_AT of the first slab: a second one, ahead of need
    more = [pool.allocate(MiB) for _ in range(8)]
    got = [e for e in more if e is not None]
    assert pool.pinned == 10 * MiB  # the last slab is what the capacity leaves
    assert pool.used <= pool.pinned <= pool.capacity
    assert len(got) < 8  # beyond the capacity: no room, however often asked
    for e in exts + got:
        pool.free(e)
    assert pool.used == 0 and pool.peak >= 7 * MiB


def test_pool_extents_do_not_overlap_and_views_hold_their_bytes():
    pool = _pool(16 * MiB)
    pool.allocate(0)
    exts = [pool.allocate(300_000 + i) for i in range(12)]
    exts = [e for e in exts if e is not None]
    for i, e in enumerate(exts):
        pool.view(e).fill_(i)
    for i, e in enumerate(exts):
        v = pool.view(e)
        assert v.numel() == e.nbytes and bool((v == i).all())
        assert pool.address(e) == v.data_ptr()  # where the runtime's copies go


def test_a_save_larger_than_a_slab_gets_a_slab_of_its_size():
    pool = _pool(64 * MiB, slab=4 * MiB)
    assert pool.allocate(10 * MiB) is None  # pins a 10 MiB slab for it
    assert pool.allocate(10 * MiB) is not None


def test_the_pool_grows_to_what_was_asked_of_it_at_once_without_more_refusals():
    # Note [the pool grows to its demand]: refusals while a slab is being pinned are counted, and
    # the pin thread goes on pinning slabs until the pool holds them; not one slab per refusal.
    gate = threading.Event()
    pinned_sizes = []

    def pin(n):
        gate.wait(10)
        pinned_sizes.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = HostPool(64 * MiB, pin=pin, slab=4 * MiB, background=True)
    try:
        refused = [pool.allocate(3 * MiB) for _ in range(6)]  # 18 MiB asked while nothing is pinned
        assert refused == [None] * 6 and pool.wanted == 18 * MiB
        gate.set()
        deadline = time.monotonic() + 10
        while pool.pinned < 18 * MiB and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert pool.pinned == 20 * MiB  # five slabs of 4 MiB: the demand, rounded up to a slab
        assert pinned_sizes == [4 * MiB] * 5
        got = [pool.allocate(3 * MiB) for _ in range(5)]
        assert all(e is not None for e in got)  # what was refused now fits (a 3 MiB save a slab)
        for e in got:
            pool.free(e)
        assert pool.used == 0
        # Emptied, the pool forgets past refusals: the next step's are counted from nothing
        assert pool.allocate(3 * MiB) is not None and pool.wanted == 18 * MiB
    finally:
        gate.set()
        pool.close()


def test_pinning_refused_stops_growth_with_a_reason():
    def refuse(n):
        raise RuntimeError("cudaHostAlloc: out of memory")
    pool = HostPool(8 * MiB, pin=refuse, background=False)
    assert pool.allocate(MiB) is None
    assert pool.error is not None and "out of memory" in pool.error
    assert pool.allocate(MiB) is None and pool.pinned == 0


def test_copy_clock_budget_and_due_positions():
    clock = CopyClock()
    clock.begin()
    assert clock.allows(10**12)  # nothing learned yet: no limit
    clock.produced(500)
    # no rates yet: due at once (Note [a first step's copies are due at once])
    assert clock.schedule(100) == 500 and clock.is_due(500)
    clock.rate = 50e9
    clock.learn(0.03, 6 * 10**9)  # a forward that copied: not learned from
    assert clock.ratio is None and clock.limit is None
    clock.begin()
    assert clock.limit == 0 and not clock.allows(1)  # measured with no copy, for the reference
    clock.learn(0.02, 6 * 10**9)  # 300 GB/s produced against 50 GB/s of copy
    assert clock.ratio == pytest.approx(6.0)
    assert clock.limit == int(COPY_SHARE * 50e9 * 0.02)
    clock.begin()
    clock.produced(10**9)
    assert clock.allows(clock.limit // 4) and not clock.allows(clock.limit)
    clock.begin()
    clock.produced(5 * 10**9)  # late in forward: a copy due after its end is refused
    assert not clock.allows(200 * 10**6) and clock.closed
    clock.begin()
    clock.produced(1000)
    d1 = clock.schedule(1000)  # produced at 1000, copied in 1000 x 6 production bytes
    assert d1 == pytest.approx(1000 + 1000 * 6 * DUE_MARGIN)
    clock.produced(10)
    d2 = clock.schedule(10)  # queued behind the first copy
    assert d2 == pytest.approx(d1 + 10 * 6 * DUE_MARGIN)
    assert not clock.is_due(d1)
    clock.produced(int(d1))
    assert clock.is_due(d1)


def test_a_forward_whose_copies_are_cheap_is_its_own_reference():
    """Note [a forward whose copies are cheap is its own reference]: a forward that copied every
    save it offered, in at most a quarter of its device time, sets the budget; no forward is made
    to copy nothing (recompute+offload's few block inputs at a length only the tier fits)."""
    clock = CopyClock()
    clock.rate = 50e9
    clock.begin()
    assert clock.limit is None and not clock.wants_reference()  # no forward timed yet: copies
    clock.produced(3 * 10**9)
    assert clock.allows(3 * 10**9)
    clock.learn(0.5, 3 * 10**9)  # 3 GB in 60 ms of copy, a 500 ms forward
    assert clock.reference == 0.5 and not clock.wants_reference()
    assert clock.limit == int(COPY_SHARE * 50e9 * 0.5) and clock.ratio == pytest.approx(3e9 / 0.5 / 50e9)
    clock.begin()
    assert clock.limit > 0 and clock.allows(3 * 10**9)  # the next forward copies them again
    # Copies that took more than a quarter of forward (7 GB of the bench's saves in 140 ms), or a
    # forward the clock refused a copy: measured again, copying nothing
    for sent, refused in ((7 * 10**9, False), (10**9, True)):
        clock = CopyClock()
        clock.rate = 50e9
        clock.begin()
        clock.produced(sent)
        assert clock.allows(sent)
        if refused:  # a limit (as a deferred forward's would be) refused the rest
            clock.limit = sent
            assert not clock.allows(1) and clock.limited
        clock.learn(0.14, sent)
        assert clock.reference is None and clock.wants_reference()
        clock.begin()
        assert clock.limit == 0
    # A last save refused as due after forward's end does not make the copies dear
    clock = CopyClock()
    clock.rate, clock.ratio, clock.total = 50e9, 0.1, 3 * 10**9
    clock.begin()
    clock.produced(3 * 10**9)
    assert not clock.allows(10**9) and clock.closed and not clock.limited
    clock.learn(0.5, 3 * 10**9)
    assert clock.reference == 0.5


def _reference_clock(device_s: float, host_s: float) -> CopyClock:
    """A copy clock at 50 GB/s whose reference forward took ``device_s`` on the device and
    ``host_s`` on the host (6 GB produced: not cheap to copy)."""
    clock = CopyClock()
    clock.rate = 50e9
    clock.begin()
    clock.produced(6 * 10**9)
    assert clock.allows(6 * 10**9)
    clock.learn(0.03, 6 * 10**9, host=0.03)  # timed, its copies dear: the next forward is the reference
    clock.begin()
    assert clock.limit == 0
    clock.produced(10**6)  # two saves, as in every forward of _copying_forward
    clock.produced(6 * 10**9 - 10**6)
    clock.learn(device_s, 6 * 10**9, host=host_s)
    assert clock.reference == device_s and clock.host_reference == host_s
    return clock


def _copying_forward(clock: CopyClock, host_s: float, device_s: float = 0.03) -> int:
    """A forward that copies all its budget allows, whose host took ``host_s``; returns the bytes
    the next may copy."""
    clock.begin()
    clock.produced(10**6)
    sent = clock.limit - clock.limit % 1000
    assert clock.allows(sent)
    clock.produced(6 * 10**9 - 10**6)
    clock.learn(device_s, 6 * 10**9, host=host_s)
    return clock.limit


def test_the_host_paces_the_copies():
    """Note [the host paces the copies]: where the host sets forward's pace (its reference forward
    took 25 ms against the device's 20), a forward whose copies took the host 10 ms longer gives
    the next only what keeps the host within 5% (the host's time linear in the copies); under
    that, the budget grows again by at most x1.25 a forward, up to the copy engine's."""
    clock = _reference_clock(0.02, 0.025)
    engine = int(COPY_SHARE * 50e9 * 0.02)
    assert clock.limit == engine and clock.host_cost is None
    paced = _copying_forward(clock, host_s=0.035)
    target = 0.025 * (1 + HOST_STRETCH)
    assert paced == pytest.approx(engine * (target - 0.025) / 0.010, rel=0.01)  # an eighth of it
    grown = _copying_forward(clock, host_s=0.0255)  # well under the target: x1.25
    assert grown == pytest.approx(1.25 * paced, rel=0.01)
    # Far over, with little copied: never under PROBE_SHARE of the engine's budget (to measure again)
    clock.host_grow = clock.host_floor = clock.limit = 1000
    assert _copying_forward(clock, host_s=0.1) == int(PROBE_SHARE * engine)
    for _ in range(40):  # the host within its target: back up to the engine's budget, no further
        last = _copying_forward(clock, host_s=0.025)
    assert last == engine


def test_a_host_ahead_of_its_device_leaves_the_engines_budget():
    """A GPU-bound forward (the host 12 ms, the device 20): copies that take the host 6 ms more
    leave it within the device's time, so the copy engine's budget stands."""
    clock = _reference_clock(0.02, 0.012)
    engine = int(COPY_SHARE * 50e9 * 0.02)
    assert _copying_forward(clock, host_s=0.018) == engine
    assert _copying_forward(clock, host_s=0.0205) == engine  # within 5% of the device's 20 ms
    assert _copying_forward(clock, host_s=0.03) < engine  # past it: paced


def test_auto_size_is_a_share_of_ram_divided_among_local_ranks():
    one, why = auto_host_bytes({})
    four, _ = auto_host_bytes({"LOCAL_WORLD_SIZE": "4"})
    assert one > 0 and "local rank" in why
    assert four == pytest.approx(one / 4, rel=0.2)


def test_host_bytes_setting():
    assert OffloadConfig().host_bytes is None
    assert OffloadConfig(host_bytes="1GiB").host_bytes == 1 << 30
    assert OffloadConfig(host_bytes="auto").host_bytes is None
    with pytest.raises(ValueError, match="host_bytes"):
        OffloadConfig(host_bytes=-1)


def test_host_bytes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SSDTRAIN_HOST_BYTES", "0")
    assert OffloadConfig().host_bytes == 0
    monkeypatch.setenv("SSDTRAIN_HOST_BYTES", "many")
    with pytest.raises(ValueError, match="SSDTRAIN_HOST_BYTES"):
        OffloadConfig()


def _gpt():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=64, layers=3, hidden=64, heads=4, dropout=0.1)
    model = GPT(cfg)
    tok = torch.randint(0, 256, (4, 64))
    return model, (lambda: model(tok, tok))


@pytest.mark.parametrize("host_bytes", ["64MiB", "256KiB"])
def test_tier_is_exact_and_the_drive_takes_what_it_cannot_hold(off_dir, tier_on_cpu, host_bytes):
    model, loss_fn = _gpt()
    s = exact_steps(model, loss_fn, ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes=host_bytes))
    cap = ssdtrain.config.parse_bytes(host_bytes)
    assert s.host_copied_bytes > 0 and s.host_read_bytes > 0
    assert s.host_tier_peak_bytes <= s.host_tier_pinned_bytes <= cap
    assert s.host_tier_bytes == 0 and s.live_entries == 0  # every graph gone: nothing held
    drive = sum(s.written_bytes_by_path.values())
    assert s.written_bytes == s.host_copied_bytes + drive
    if cap < s.unique_bytes // 3:  # a small tier: the drive took the rest
        assert s.spilled_bytes > 0 and drive > 0
    else:
        assert drive == 0 and s.spilled_bytes == 0


def test_tier_off_sends_everything_to_the_drive(off_dir, tier_on_cpu):
    model, loss_fn = _gpt()
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes=0)
    try:
        step(model, loss_fn, off, wait=True)
        s = off.stats()
    finally:
        off.close()
    assert s.host_copied_bytes == 0 and s.written_bytes == sum(s.written_bytes_by_path.values()) > 0


def test_tier_micro_batches_backward_in_reverse(off_dir, tier_on_cpu):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    xs = [torch.randn(32, 64) for _ in range(3)]

    def run(off):
        model.zero_grad(set_to_none=True)
        losses = []
        for i, x in enumerate(xs):
            if off is None:
                losses.append(model(x).square().mean())
            else:
                with off.microbatch(i):
                    losses.append(model(x).square().mean())
        for i in reversed(range(3)):
            if off is not None:
                off.prefetch(i)
            losses[i].backward()
        return [p.grad.clone() for p in model.parameters()]
    want = run(None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="16MiB")
    try:
        got = run(off)
        off.wait()
        s = off.stats()
    finally:
        off.close()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert s.host_copied_bytes > 0 and s.live_entries == 0


def test_tier_failing_drive_keeps_the_spill_in_memory(off_dir, tier_on_cpu, monkeypatch):
    """The tier full, the drive failing (on_error="keep"): what could not be placed stays, exact."""
    from ssdtrain.store import posix

    def broken(fd, data, offset):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(posix, "_pwrite", broken)
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="256KiB", on_error="keep")
    try:
        with pytest.warns(RuntimeWarning, match="a write failed"):
            got = step(model, loss_fn, off, wait=True)
        assert_same(base, got)
        s = off.stats()
    finally:
        off.close()
    assert s.failed_writes > 0 and s.host_copied_bytes > 0


def _tier_setup(off_dir):
    """The GPT, its loss, its gradients without offloading, an Offloader through a 64 MiB tier, and
    a step with it that returns its stats before, during forward and after."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="64MiB")

    def forward():
        before = off.stats()
        with off:
            loss = loss_fn()
            during = off.stats()
        loss.backward()
        off.wait()
        return before, during, off.stats()
    return model, loss_fn, base, off, forward


def _copied(stats):
    """The bytes the tier copied in a step, from ``forward()``'s stats."""
    before, _, after = stats
    return after.host_copied_bytes - before.host_copied_bytes


def test_a_closed_copy_budget_keeps_the_rest_of_forward_without_entries(off_dir, tier_on_cpu):
    """Note [a save the budget keeps skips the cache]: once the tier's budget refused a save, the
    rest of that forward is held as small saves are (no entry), counted as kept by the budget."""
    model, loss_fn, base, off, forward = _tier_setup(off_dir)
    try:
        _, open_, _ = forward()  # no limit learned: every save has an entry
        off._tier.clock.limit = 200_000  # as if learned: this much of a forward is copied
        before, during, after = forward()
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()
    copied = after.host_copied_bytes - before.host_copied_bytes
    assert 0 < copied <= 200_000
    assert after.budget_kept_bytes - before.budget_kept_bytes > 0
    assert during.live_entries < open_.live_entries / 2
    assert after.live_entries == 0


def test_the_copy_clock_counts_saves_kept_at_once(off_dir, tier_on_cpu):
    """Note [the copy clock counts every save]: the forward measured with no copy (limit 0, closed
    at its first save) counts every save, so the clock learns forward's whole length and the next
    forward copies. Counting entries alone, that forward counted one save and the tier then
    refused every copy (on the H200, 2026-11-27)."""
    model, loss_fn, base, off, steps = _tier_setup(off_dir)
    clock = off._tier.clock

    def forward():
        return _copied(steps())
    try:
        assert forward() > 0  # nothing learned: every save copied, each with an entry
        produced = clock.pos
        clock.rate = 1e9  # the copy rate is known, and that forward's time (not cheap: 6 MB of copies)
        clock.learn(0.01, produced)
        assert clock.reference is None  # so the next forward is measured, copying nothing
        assert forward() == 0 and clock.limit == 0 and clock.closed
        # (views of one storage saved with different extents count once kept at once)
        assert clock.pos == pytest.approx(produced, rel=0.01)
        clock.learn(0.01, clock.pos)  # its device time (on a GPU, from timing events)
        assert clock.total == clock.pos and clock.ratio == pytest.approx(clock.pos / 0.01 / 1e9)
        clock.ratio = 0.1  # production at a tenth of the copy rate: the first saves are due in time
        assert forward() > 0
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()


class _TenMsTimer:
    """A GpuTimer's fake: every forward took 10 ms on the device."""

    def __init__(self, dev):
        pass

    def stop(self, dev):
        pass

    def seconds(self):
        return 0.01

    def host_seconds(self):
        return None  # the host's time not given: the copies are not paced by it


def test_the_reference_forward_waits_for_room(off_dir, tier_on_cpu, monkeypatch):
    """Note [the reference forward needs room]: the forward measured with no copy keeps on the
    device what the tier took off the last peak; where the device has no room for that, the forward
    copies as before (and says so once), meanwhile with due positions from the forward before, and
    is measured once there is room."""
    room = {"bytes": 0}
    monkeypatch.setattr(offloader_mod.measure, "GpuTimer", _TenMsTimer)
    monkeypatch.setattr(offloader_mod.measure, "room_above_peak", lambda *args: room["bytes"])
    monkeypatch.setattr(offloader_mod.measure, "allocator_peak", lambda dev: 0)
    monkeypatch.setattr(offloader_mod.measure, "allocated", lambda dev: 0)
    model, loss_fn, base, off, steps = _tier_setup(off_dir)
    clock = off._tier.clock

    def forward():
        return _copied(steps())
    try:
        first = forward()  # the copy rate not known yet: every save copied
        assert first > 0
        off._fwd_dev = torch.device("cpu")  # as a CUDA save sets it: timed from the next forward on
        clock.rate = 1e9
        # Its forward was not timed: the next copies as before, and is timed (its copies are not
        # cheap: 6 MB against a quarter of 10 ms at 1 GB/s), so it is not the reference itself
        assert forward() == first and clock.limit is None and clock.deferred == 0
        with pytest.warns(RuntimeWarning, match="no room to measure a forward without it"):
            again = forward()
        assert again == first and clock.limit is None and clock.deferred == 1 and clock.ratio is None
        assert clock.reference is None and clock.timed
        # Still no room: copied, due by the last forward (the saves whose copy would end after it
        # refused: how many depends on how far the hand-over lags the packs, Note [a copy is due
        # from its hand-over]; never more than half, at this ratio, if nothing were handed over)
        assert first // 2 < forward() < first and clock.deferred == 2
        produced = clock.pos
        assert clock.ratio == pytest.approx(produced / 0.01 / 1e9) and clock.total == produced
        assert clock.reference is None
        room["bytes"] = int(offloader_mod.REFERENCE_ROOM * clock.sent)  # short of the allocator's slack
        assert forward() > 0 and clock.limit is None and clock.deferred == 3
        room["bytes"] = int(offloader_mod.REFERENCE_ROOM * clock.sent + offloader_mod.REFERENCE_SLACK)
        # room now: measured, no copy
        assert forward() == 0 and clock.limit == 0 and clock.deferred == 3
        assert forward() > 0 and clock.reference == 0.01  # learned
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()


def test_an_offloader_whose_copies_are_cheap_never_keeps_a_forward_on_the_device(off_dir, tier_on_cpu,
                                                                                 monkeypatch):
    """Note [a forward whose copies are cheap is its own reference], through the engine: forwards
    of 10 s on the device, a few MB of copies at 1 GB/s: every forward copies, none is made to
    copy nothing, and the budget is learned from the first one timed."""
    class LongForward(_TenMsTimer):
        def seconds(self):
            return 10.0
    monkeypatch.setattr(offloader_mod.measure, "GpuTimer", LongForward)
    monkeypatch.setattr(offloader_mod.measure, "allocated", lambda dev: 0)
    monkeypatch.setattr(offloader_mod.measure, "allocator_peak", lambda dev: 0)
    monkeypatch.setattr(offloader_mod.measure, "room_above_peak", lambda *args: 1 << 40)  # room: not asked
    model, loss_fn, base, off, steps = _tier_setup(off_dir)
    clock = off._tier.clock
    try:
        copied = [_copied(steps())]
        off._fwd_dev = torch.device("cpu")  # as the first CUDA save sets it
        clock.rate = 1e9
        for _ in range(3):
            copied.append(_copied(steps()))
        # Each forward copies about what the first did, none nothing: a batch not yet handed over
        # when backward begins is kept (adaptive keep), on a loaded machine a group's 256 KiB (4%)
        assert min(copied) >= 0.9 * copied[0] > 0, copied
        assert clock.reference == 10.0 and clock.deferred == 0 and clock.limit == int(COPY_SHARE * 1e9 * 10)
        assert off.stats().host_copy_limit_bytes == clock.limit
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()


def test_the_reference_forward_judges_room_by_the_peak_seen_in_backward(off_dir, tier_on_cpu, monkeypatch):
    """Note [the step's peak, seen in backward]: a loop that resets the allocator's peak between
    steps leaves only the model's bytes in it when the next forward begins; the room for a forward
    copying nothing is judged from the peak read at backward's unpacks, before the reset, as its
    growth above that step's start on top of what is allocated now (the optimizer's state, made
    after the first step, counts)."""
    GiB = 1 << 30
    mem = {"now": GiB, "peak": GiB}  # the allocator: bytes allocated, and its high-water mark since a reset
    looks = []

    def allocator_peak(dev):
        looks.append(mem["peak"])
        return mem["peak"]
    monkeypatch.setattr(offloader_mod.measure, "GpuTimer", _TenMsTimer)
    monkeypatch.setattr(offloader_mod.measure, "device_limit", lambda dev: 8 * GiB)
    monkeypatch.setattr(offloader_mod.measure, "allocator_peak", allocator_peak)
    monkeypatch.setattr(offloader_mod.measure, "allocated", lambda dev: mem["now"])
    model, loss_fn, base, off, steps = _tier_setup(off_dir)
    clock = off._tier.clock

    def user_step(growth):
        """A step whose peak is ``growth`` above its start, then the user's reset of the peak."""
        mem["peak"] = mem["now"] + growth  # reached in this step, seen at its unpacks
        copied = _copied(steps())
        mem["peak"] = mem["now"]  # torch.cuda.reset_peak_memory_stats()
        return copied
    try:
        off._fwd_dev = torch.device("cpu")  # as the first CUDA save sets it: its forwards are watched
        slack = offloader_mod.REFERENCE_SLACK
        # The first step (no copy rate yet: it copies everything) peaks 1 GiB above its start; then
        # the optimizer makes its state, and the user resets the peak.
        first = user_step(GiB)
        need = int(offloader_mod.REFERENCE_ROOM * clock.sent) + slack
        state = 8 * GiB - 2 * GiB - need + (1 << 20)
        mem["now"] += state
        mem["peak"] = mem["now"]
        assert 8 * GiB - 2 * GiB >= need  # the step's peak alone left room: the state did not
        clock.rate = 1e9  # measured on the copy thread
        with pytest.warns(RuntimeWarning, match="no room to measure a forward without it"):
            assert user_step(GiB) == first
        assert looks and clock.limit is None and clock.deferred == 1
        # The same growth, seen at that step's unpacks though the user reset the peak after it
        assert user_step(GiB - (2 << 20)) > first // 2 and clock.limit is None and clock.deferred == 2
        # That step grew 2 MiB less: room now, so the next forward is measured, copying nothing
        assert user_step(0) == 0 and clock.limit == 0 and clock.deferred == 2
        seen = len(looks)
        assert user_step(0) > 0 and clock.reference == 0.01  # learned
        assert len(looks) == seen  # and the allocator's statistics are not read again
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()


def test_the_first_cuda_save_finds_the_first_slab_pinned(monkeypatch):
    """Note [the first step's saves find the pool pinned]: at the first CUDA save the first slab
    is pinned on the calling thread, so that save already goes to the pool (pinned in the
    background, the first step's saves went to the drive); later slabs on the pin thread."""
    import threading

    from ssdtrain.host import tier as tier_mod

    threads = []

    def pin(n):
        threads.append(threading.current_thread().name)
        return torch.empty(n, dtype=torch.uint8)
    monkeypatch.setattr(tier_mod.device, "pinned_empty", pin)
    monkeypatch.setattr(tier_mod.TieredBackend, "_measure_rate", lambda self, dev: None)  # no device to time

    class Drive:
        name = "drive"

        def close(self):
            pass
    tier = tier_mod.TieredBackend(Drive(), 8 * MiB)
    try:
        first = tier.allocate_host(MiB, torch.device("cuda", 0))
        assert first is not None and tier.spilled == 0
        assert threads == [threading.current_thread().name] and tier.pool.pinned == 8 * MiB
        tier.pool.pin_first()  # once only
        assert len(threads) == 1
    finally:
        tier.close()


def test_the_first_slab_refused_leaves_the_saves_to_the_drive():
    """``pin_first`` where pinning is refused (a container's cap): no slab, the reason kept, and
    every allocation after it answered with ``None`` (the drive takes the save), never an error."""
    def refuse(n):
        raise RuntimeError("cudaHostAlloc: operation not permitted")
    pool = HostPool(8 * MiB, pin=refuse, background=True)
    try:
        pool.pin_first()
        assert pool.pinned == 0 and "not permitted" in pool.error
        assert pool.allocate(MiB) is None and pool.pinned == 0
    finally:
        pool.close()


def _exact_tier_steps(off_dir, steps=2, group_saves=None):
    """An Offloader with a 128 MiB tier after ``steps`` exact steps of the GPT, waited for
    (``group_saves``: its saves a group, 1 for an entry a save)."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="128MiB")
    if group_saves is not None:
        off._group_saves = group_saves
    try:
        for _ in range(steps):
            assert_same(base, step(model, loss_fn, off))
        off.wait()
    except BaseException:
        off.close()
        raise
    return off


def test_tier_copies_are_handed_over_a_batch_at_a_time(off_dir, tier_on_cpu, monkeypatch):
    """Note [tier copies are handed over a batch at a time]: small saves wait in the queue until
    HAND_OVER_SAVES of them are there, and go to the copy thread together, settled by one
    completion each batch; HAND_OVER_BYTES, or a save packed HAND_OVER_SECONDS ago, make them go
    sooner. Exact all the same. (The per-save path: a save the tier takes has an entry of its own
    where it joins no group, Note [saves handed over together share an entry].)"""
    from ssdtrain.host import tier
    from ssdtrain.engine import writer
    batches, finishes = [], []
    real_copy_in, real_finish_all = tier.TieredBackend._copy_in, writer.WriteQueue._finish_all
    monkeypatch.setattr(tier.TieredBackend, "_copy_in",
                        lambda self, batch: (batches.append(len(batch)), real_copy_in(self, batch))[1])
    monkeypatch.setattr(writer.WriteQueue, "_finish_all",
                        lambda self, entries, fut: (finishes.append(len(entries)), real_finish_all(self, entries, fut))[1])
    monkeypatch.setattr(writer, "HAND_OVER_SECONDS", 3600.0)  # batches by count: not by this VM's pace
    off = _exact_tier_steps(off_dir, group_saves=1)
    try:
        copies = off.stats().host_copied_bytes
        assert copies > 0
        assert sum(batches) == sum(finishes)  # every copy settled by a batch's one completion
        assert 2 * len(finishes) <= sum(finishes)
        assert max(batches) >= writer.HAND_OVER_SAVES  # not one copy a batch
        assert sum(batches) >= 4 * len(batches)  # one at a time before (2026-11-27)

        # Small saves stay queued (not handed over) until HAND_OVER_SAVES of them wait, or
        # HAND_OVER_BYTES, or the oldest was packed HAND_OVER_SECONDS ago.
        x = torch.randn(64, 64, requires_grad=True)
        State = ssdtrain.engine.cache.State
        seen, enough_bytes = {}, writer.HAND_OVER_BYTES

        def handed_over(refs):
            deadline = time.monotonic() + 10
            while any(r.entry.state is State.QUEUED for r in refs) and time.monotonic() < deadline:
                time.sleep(0.01)
            return all(r.entry.state is not State.QUEUED for r in refs)

        with off:
            for criterion, setting, value in (("seconds", "HAND_OVER_SECONDS", 0.0),
                                              ("bytes", "HAND_OVER_BYTES", 1)):
                monkeypatch.setattr(writer, "HAND_OVER_SECONDS", 3600.0)
                refs = [off._pack(x * (i + 1.0)) for i in range(3)]  # two queued, the last held
                seen[criterion, "before"] = [r.entry.state for r in refs[:2]]
                monkeypatch.setattr(writer, setting, value)
                refs.append(off._pack(x * 5.0))
                seen[criterion, "after"] = handed_over(refs[:3])
                monkeypatch.setattr(writer, "HAND_OVER_BYTES", enough_bytes)
            del refs
        off.wait()
    finally:
        off.close()
    for criterion in ("seconds", "bytes"):
        assert seen[criterion, "before"] == [State.QUEUED] * 2, criterion
        assert seen[criterion, "after"], criterion


class _Runtime:
    """The CUDA runtime's calls the tier makes, recorded in ``calls``; a copy returns ``fail``."""

    fail = 0

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event, flags))
        return 0

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):
        self.calls.append(("copy", dst, src, n, kind, stream))
        return self.fail

    def cudaGetLastError(self):
        self.calls.append(("clear",))
        return 0

    def cudaGetErrorString(self, err):
        return b"an illegal memory access was encountered"


class _Stream:
    cuda_stream = 0x5000


class _Event:
    def __init__(self, handle):
        self.cuda_event = handle


class _Fence:
    def __init__(self, handle, stream=None):
        self.event, self.stream = _Event(handle), stream


def test_copies_to_the_pool_call_the_runtime_directly_and_fall_back_to_torch(monkeypatch, caplog):
    """Note [the copy thread issues copies without the GIL], with the CUDA runtime, the side
    stream and the fences stood in for: one wait per producer fence (a fence shared by neighbours
    waited on once), then one copy per save, to the pool's address, of the save's bytes, on the
    side stream; a call that fails clears its error, warns, returns None (the caller goes through
    torch) and leaves the runtime unused from then on."""
    import contextlib

    from ssdtrain.device import copies

    calls = []
    fences = []
    monkeypatch.setattr(copies, "_on", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(copies, "side_stream", lambda dev: _Stream())
    monkeypatch.setattr(copies, "Fence", lambda stream: fences.append(stream) or "landed")
    monkeypatch.setattr(copies, "_FENCE", _Fence)
    rt = _Runtime(calls)
    monkeypatch.setattr(copies, "_runtime", rt)
    srcs = [torch.zeros(n, dtype=torch.uint8) for n in (100, 200, 300)]
    first, second = _Fence(0xA1), _Fence(0xA2)
    assert copies.queue_to_host([0x10000, 0x20000, 0x30000], srcs, [first, first, second]) == "landed"
    assert calls == [("wait", 0x5000, 0xA1, 0), ("wait", 0x5000, 0xA2, 0)] + [
        ("copy", a, s.data_ptr(), s.nbytes, 4, 0x5000) for a, s in zip((0x10000, 0x20000, 0x30000), srcs)]
    assert len(fences) == 1 and isinstance(fences[0], _Stream)
    calls.clear()  # a ready that is not a fence (a host wait): torch's way
    assert copies.queue_to_host([0x10000], srcs[:1], [lambda: None]) is None and calls == []

    calls.clear()
    rt.fail = 700
    with caplog.at_level("WARNING", logger="ssdtrain.device.copies"):
        assert copies.queue_to_host([0x10000], srcs[:1], [None]) is None
    assert calls[-1] == ("clear",) and "illegal memory access" in caplog.text
    assert copies._cudart() is None  # torch's way from now on
    calls.clear()
    assert copies.queue_to_host([0x10000], srcs[:1], [None]) is None and calls == []


def test_copies_back_to_the_device_call_the_runtime_directly(monkeypatch):
    """Note [reads back are issued without the GIL too], with the runtime, the side stream and the
    fences stood in for: one wait per fence (allocation points, the copy in), one copy per buffer
    from the pool's address into the buffer, of the buffer's bytes, on the side stream; each buffer
    tied to that stream; a ready that is not a fence (a host wait) leaves them to torch."""
    import contextlib

    from ssdtrain.device import copies

    calls = []

    class Buffer:  # a device buffer: its address, its size, the streams it was tied to
        def __init__(self, ptr, n):
            self.ptr, self.nbytes, self.streams = ptr, n, []
            self.device = torch.device("cpu")

        def data_ptr(self):
            return self.ptr

        def record_stream(self, stream):
            self.streams.append(stream)

    side = _Stream()
    monkeypatch.setattr(copies, "_on", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(copies, "side_stream", lambda dev: side)
    monkeypatch.setattr(copies, "Fence", lambda stream: _Fence(0xF0, stream))
    monkeypatch.setattr(copies, "_FENCE", _Fence)
    monkeypatch.setattr(copies, "_runtime", _Runtime(calls))
    dsts = [Buffer(0x90000, 100), Buffer(0xA0000, 300)]
    alloc, landed = _Fence(0xA1), _Fence(0xA2)
    fence = copies.queue_to_device(dsts, [0x10000, 0x20000], [alloc, landed, landed])
    assert isinstance(fence, _Fence) and fence.stream is side
    assert calls == [("wait", 0x5000, 0xA1, 0), ("wait", 0x5000, 0xA2, 0),
                     ("copy", 0x90000, 0x10000, 100, 4, 0x5000), ("copy", 0xA0000, 0x20000, 300, 4, 0x5000)]
    assert [d.streams for d in dsts] == [[side], [side]]

    calls.clear()
    assert copies.queue_to_device(dsts, [0x10000, 0x20000], [alloc, lambda: None]) is None
    assert calls == [] and [d.streams for d in dsts] == [[side], [side]]


def test_no_runtime_calls_where_native_code_is_disabled(monkeypatch):
    from ssdtrain.device import copies
    monkeypatch.setenv("SSDTRAIN_NO_EXT", "1")
    assert copies._load_cudart() is None


def test_the_runtime_called_is_the_one_torch_was_built_with(monkeypatch):
    """Another package may have loaded another CUDA runtime: the one of torch's major version is
    called, and none where torch has no CUDA."""
    import ctypes
    import io

    from ssdtrain.device import copies
    maps = ("7f00-7f01 r-xp 0 00:00 1 /site/nvidia/cu12/lib/libcudart.so.12\n"
            "7f02-7f03 r-xp 0 00:00 2 /site/nvidia/cu13/lib/libcudart.so.13\n")
    monkeypatch.setattr(copies, "open", lambda path: io.StringIO(maps), raising=False)
    opened = []

    class Lib:
        def __init__(self, path):
            opened.append(path)
            self.cudaMemcpyAsync = self.cudaStreamWaitEvent = self.cudaGetErrorString = lambda *a: 0

    monkeypatch.setattr(ctypes, "CDLL", Lib)
    monkeypatch.delenv("SSDTRAIN_NO_EXT", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert isinstance(copies._load_cudart(), Lib) and opened == ["/site/nvidia/cu13/lib/libcudart.so.13"]
    monkeypatch.setattr(torch.version, "cuda", None)
    assert copies._load_cudart() is None and len(opened) == 1


def test_a_safe_point_drains_for_a_lagging_copy_only_once_it_may_go(off_dir, tier_on_cpu, monkeypatch):
    """Note [a lagging copy is looked at without the lock]: while the oldest lagging copy is
    neither due by the clock nor past its fence, a safe point does not drain."""
    from types import SimpleNamespace

    from ssdtrain.host.host_pool import HostExtent
    off = ssdtrain.Offloader(nn.Linear(4, 4), path=str(off_dir), min_bytes=0)
    try:
        drains = []
        monkeypatch.setattr(off, "_drain", lambda **kw: drains.append(1))
        passed = [False]
        ext = HostExtent(0, 0, 4096, 100)
        ext.landed = SimpleNamespace(passed=lambda: passed[0])
        ext.due = off._tier.clock.pos + 1000
        off._cache.lagging.append(SimpleNamespace(extent=ext))
        off._safe_point(raise_errors=False)
        assert drains == []  # not due, not passed
        passed[0] = True
        off._safe_point(raise_errors=False)
        assert drains == [1]  # its fence passed
        passed[0] = False
        off._tier.clock.produced(1000)
        off._safe_point(raise_errors=False)
        assert drains == [1, 1]  # due by the clock
        off._cache.lagging.clear()
    finally:
        off.close()


def test_tier_reads_are_issued_a_batch_at_a_time(off_dir, tier_on_cpu, monkeypatch):
    """Note [tier reads are issued a batch at a time]: backward's window moves once a quarter of
    it is free, and the reads it picks go to the copy-back thread together; exact all the same,
    and backward still finds its saves read ahead."""
    from ssdtrain.host import tier
    batches = []
    real = tier.TieredBackend._copy_out
    monkeypatch.setattr(tier.TieredBackend, "_copy_out", lambda self, batch: (batches.append(len(batch)),
                                                                               real(self, batch))[1])
    off = _exact_tier_steps(off_dir)
    try:
        s = off.stats()
    finally:
        off.close()
    assert s.host_read_bytes > 0
    assert sum(batches) >= 2 * len(batches)  # one read a request before (2026-11-27)
    assert s.prefetch_misses <= s.prefetch_hits / 10


def test_the_copy_clock_counts_copies_not_handed_over_yet():
    """Note [a copy is due from its hand-over]: bytes allowed and not handed over yet are queued
    ahead of a new copy when the clock judges whether it ends before forward's end; a copy's due
    position is counted from where forward is when it is handed over."""
    clock = CopyClock()
    clock.begin()
    clock.ratio, clock.total = 2.0, 10_000
    clock.produced(1000)
    assert clock.allows(1000) and clock.pending == 1000
    # 1000 now + (1000 pending + 2000) x 2 x 1.1 = 7600: still before the end
    assert clock.allows(2000) and clock.pending == 3000
    # + 1500 more would end at 1000 + 4500 x 2.2 = 10900: refused (scheduled at once, it would not be)
    assert not clock.allows(1500) and clock.closed
    clock.produced(3000)  # handed over only now, at 4000
    assert clock.schedule(1000) == pytest.approx(4000 + 1000 * 2 * DUE_MARGIN)
    assert clock.schedule(2000) == pytest.approx(4000 + 3000 * 2 * DUE_MARGIN) and clock.pending == 0
    clock.begin()
    assert clock.allows(100) and clock.pending == 100
    clock.dropped(100)  # the pool had no room: never handed over
    assert clock.pending == 0
    clock.dropped(100)
    assert clock.pending == 0


def test_a_tier_copy_is_due_from_its_hand_over(off_dir, tier_on_cpu, monkeypatch):
    """Note [a copy is due from its hand-over], through the engine: a save held and queued while
    forward goes on gets its due position when the queue hands it to the copy thread, from
    forward's position then, not from where it was packed (there it would be due, and released,
    as soon as it was copied, the compute stream waiting for the whole copy). The per-save path
    (Note [saves handed over together share an entry]: a group is due from its hand-over alike)."""
    from ssdtrain.engine import writer
    from ssdtrain.host.host_pool import HostExtent
    State = ssdtrain.engine.cache.State
    model, loss_fn, base, off, forward = _tier_setup(off_dir)
    off._group_saves = 1
    try:
        forward()  # the pool pinned, the engine warm
        clock = off._tier.clock
        monkeypatch.setattr(writer, "HAND_OVER_SECONDS", 3600.0)
        monkeypatch.setattr(writer, "HAND_OVER_SAVES", 10**6)
        x = torch.randn(64, 64, requires_grad=True)
        with off:
            clock.rate, clock.limit, clock.ratio, clock.total = None, None, 2.0, 10**12
            first = off._pack(x * 1.0)
            n, at_pack = first.entry.nbytes, clock.pos
            refs = [off._pack(x * (i + 2.0)) for i in range(6)]  # first queued behind no batch: not handed over
            assert type(first.entry.extent) is HostExtent and first.entry.state is State.QUEUED
            assert first.entry.extent.due == float("inf") and clock.pending >= 2 * n
            monkeypatch.setattr(writer, "HAND_OVER_SAVES", 1)
            refs.append(off._pack(x * 9.0))  # now the queue goes, forward at ``now``
            now = clock.pos
            assert first.entry.state is not State.QUEUED
            due = first.entry.extent.due
            assert due == pytest.approx(now + n * 2.0 * DUE_MARGIN)
            assert due > at_pack + 6 * n  # from its pack it would have been due long ago
            assert refs[0].entry.extent.due == pytest.approx(due + n * 2.0 * DUE_MARGIN)
            del refs, first
        off.wait()
        assert_same(base, step(model, loss_fn, off))
    finally:
        off.close()


def test_checkpoints_beyond_host_bytes_spill_to_the_drive_exactly(off_dir, tier_on_cpu, capsys):
    """recompute+offload whose block inputs are four times ``host_bytes`` (issue 50, item 4): the
    host tier takes what it holds, the drive the rest; gradients exact over steps; ``stats()`` says
    how much went where, and what backward waited for."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=256, layers=8, hidden=64, heads=4, loss_chunk=64)
    model = GPT(cfg, recompute=True)
    tok = torch.randint(0, 256, (4, 256))
    checkpoints = cfg.layers * 4 * 256 * 64 * 4  # every block's input, fp32
    base = step(model, lambda: model(tok, tok), None)
    host = checkpoints // 4
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes=host)
    try:
        for i in range(3):
            assert_same(base, step(model, lambda: model(tok, tok), off, wait=i % 2 == 0))
        s = off.stats()
    finally:
        off.close()
    drive = sum(s.written_bytes_by_path.values())
    assert s.host_tier_peak_bytes <= host and s.host_copied_bytes > 0
    assert s.spilled_bytes > 0 and drive > 0  # spilled: sent to the drive (some cancelled as backward began)
    assert s.written_bytes == s.host_copied_bytes + drive
    assert s.read_bytes > 0 and s.host_read_bytes > 0
    with capsys.disabled():
        print(f"\n  checkpoints {checkpoints >> 10} KiB a step, host_bytes {host >> 10} KiB: host tier took "
              f"{s.host_copied_bytes >> 10} KiB, spilled to the drive {s.spilled_bytes >> 10} KiB over 3 steps; "
              f"backward waited {s.read_stall_seconds * 1e3:.1f} ms on reads ({s.prefetch_misses} misses, "
              f"{s.prefetch_hits} hits)")
