"""Note [saves handed over together share an entry]: the host tier's saves of a scope join one group
entry, copied, released, read back and freed as one; each save is still checked, rebuilt and
deduplicated by its own storage."""

from __future__ import annotations

import pytest
import torch

import ssdtrain
from ssdtrain.engine.cache import State
from ssdtrain.engine.group import GROUP_BYTES, GROUP_SAVES, Group

from _equiv import assert_same, step
from test_tier import _gpt, tier_on_cpu  # noqa: F401  (a fixture)


def _off(off_dir, model=None, group_saves=GROUP_SAVES):
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes="64MiB")
    off._group_saves = group_saves
    return off


@pytest.mark.parametrize("wait", [False, True])
def test_groups_are_exact_and_fewer_entries_than_saves(off_dir, tier_on_cpu, wait):
    """The GPT (attention, norms, dropout, views) through the tier in groups: gradients equal those
    without offloading and those of one entry a save; the copies are the same bytes, held in about
    GROUP_SAVES times fewer entries."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    seen = {}
    for group_saves in (1, GROUP_SAVES):
        off = _off(off_dir, model, group_saves)
        try:
            live = []
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                torch.manual_seed(1234)
                with off:
                    loss = loss_fn()
                    live.append(off.stats().live_entries)
                    if wait:
                        off.wait()
                loss.backward()
                assert_same(base, (loss.detach(), [p.grad.clone() for p in model.parameters()]))
            off.wait()
            s = off.stats()
        finally:
            off.close()
        seen[group_saves] = (max(live), s)
    (one, per_save), (grouped, groups) = seen[1], seen[GROUP_SAVES]
    assert groups.host_copied_bytes > 0 and groups.live_entries == 0
    assert groups.unique_bytes == per_save.unique_bytes and groups.saved_bytes == per_save.saved_bytes
    assert grouped * 4 <= one, (grouped, one)
    if wait:  # every copy landed before backward, and each came back by a read
        assert groups.host_read_bytes == groups.host_copied_bytes > 0
        assert groups.host_copied_bytes == per_save.host_copied_bytes


def _pack_all(off, tensors):
    return [off._pack(t) for t in tensors]


def test_a_group_is_read_back_whole_and_each_save_rebuilt(off_dir, tier_on_cpu):
    """Saves of several storages (views, a transpose, a dtype of their own, a repeated storage) join
    one group; once copied and released, one read brings them back, each rebuilt with its own view."""
    off = _off(off_dir)
    a = torch.randn(32, 32) * 1.0
    b = torch.randn(16, 8).to(torch.float64)
    c = torch.randn(8, 8, dtype=torch.complex64)
    d = torch.arange(64, dtype=torch.int32) * 1
    saves = [a, a.t(), b, c, c.conj(), d[16:48], a[3:5]]
    want = [t.clone() if not t.is_conj() else t.resolve_conj() for t in saves]
    try:
        with off:
            refs = _pack_all(off, saves)
            groups = {id(r.entry) for r in refs}
            assert len(groups) == 1 and type(refs[0].entry) is Group
            g = refs[0].entry
            assert len(g.parts) == 4  # a, b, c, d: one part a storage
            assert refs[1].part is refs[0].part and refs[6].part is refs[0].part
        off.wait()  # handed over, copied, its memory released
        assert g.state is State.ON_DISK and g.data is None and all(p.data is None for p in g.parts)
        del saves, a, b, c, d
        outs = [off._unpack(r) for r in reversed(refs)][::-1]
        for out, w in zip(outs, want):
            assert out.dtype == w.dtype and out.shape == w.shape
            assert torch.equal(out.resolve_conj(), w)
        assert off.stats().host_read_bytes == g.nbytes
    finally:
        off.close()


def test_an_in_place_change_taints_only_its_own_part(off_dir, tier_on_cpu):
    """Note [in-place after save] in a group: the part changed after its save raises at its unpack;
    the group's other saves unpack as saved."""
    off = _off(off_dir)
    x, y = torch.randn(64) * 1.0, torch.randn(64) * 1.0
    want = y.clone()
    try:
        with off:
            rx, ry = _pack_all(off, [x, y])
            assert rx.entry is ry.entry
            x.add_(1.0)
        off.wait()
        with pytest.raises(RuntimeError, match="modified"):
            off._unpack(rx)
        assert torch.equal(off._unpack(ry), want)
    finally:
        off.close()


def test_groups_close_at_their_size_and_a_small_save_leaves_a_large_one_open(off_dir, tier_on_cpu):
    """A group takes GROUP_SAVES storages (or GROUP_BYTES), then the next save opens another; where
    the open group must close, a save under a quarter of its last one is an entry of its own and the
    large save stays open (Note [the last save waits]: backward needs it first)."""
    off = _off(off_dir)
    small = [torch.randn(256) * 1.0 for _ in range(GROUP_SAVES + 1)]
    large, tiny = torch.randn(GROUP_BYTES // 4 + 1024) * 1.0, torch.randn(256) * 1.0
    try:
        with off:
            refs = _pack_all(off, small)
            first, second = refs[0].entry, refs[-1].entry
            assert first is not second and len(first.parts) == GROUP_SAVES and len(second.parts) == 1
            assert first.state is not State.KEPT  # handed over
            big = off._pack(large)  # more than GROUP_BYTES with the open group: a group of its own
            third = big.entry
            assert third is not second and second.state is not State.KEPT and third.state is State.KEPT
            alone = off._pack(tiny)
            assert alone.entry is not third and type(alone.entry) is not Group
            assert third.state is State.KEPT and off._scopes.active[-1][1].group is third
        # forward ended, backward begins (``__exit__``): the open group stays, not copied
        assert third.state is State.KEPT and third.extent is None
        off.wait()
        assert third.state is State.KEPT
        assert torch.equal(off._unpack(big), large) and torch.equal(off._unpack(alone), tiny)
    finally:
        off.close()


def test_a_group_open_when_backward_begins_stays_in_memory(off_dir, tier_on_cpu):
    """Adaptive keep: a forward's open group (its last save) is not copied once backward began; its
    host extent goes back to the pool. The GPT's forward ends with such a group, and is exact."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    off = _off(off_dir, model)
    x = torch.randn(4096) * 1.0
    try:
        with off:
            r = off._pack(x)
            g = r.entry
            assert type(g) is Group and g.state is State.KEPT and g.extent is not None
            used = off._tier.pool.used
        # backward begins as forward ends (``__exit__``)
        assert g.state is State.KEPT and g.extent is None and off._tier.pool.used < used
        assert torch.equal(off._unpack(r), x)
        del r
        off.wait()
        for _ in range(2):
            assert_same(base, step(model, loss_fn, off))
        off.wait()
        assert off.stats().live_entries == 0 and off._tier.pool.used == 0
    finally:
        off.close()


def test_a_group_whose_saves_all_died_holds_no_storage(off_dir, tier_on_cpu):
    """A group freed (its saves died: a graph dropped before backward) lets go of every part's
    storage, though the scope still lists it."""
    from ssdtrain.engine.small import StorageRef
    off = _off(off_dir)
    tensors = [torch.randn(256) * 1.0 for _ in range(3)]
    alive = [StorageRef() for _ in tensors]
    for w, t in zip(alive, tensors):
        w.cdata = t.untyped_storage()._weak_ref()
    del t
    try:
        with off:
            refs = _pack_all(off, tensors)
            g = refs[0].entry
            assert type(g) is Group and len(g.parts) == 3
        del refs, tensors
        off.wait()
        assert g.state is State.FREED and all(p.data is None and p.guard is None for p in g.parts)
        assert all(w.expired() for w in alive)
    finally:
        off.close()


def test_a_groups_parts_are_carved_from_one_region_and_its_tail_goes_back(off_dir, tier_on_cpu):
    """Note [a group's parts are carved from one region]: a group's first save keeps its own extent
    and reserves the rest of GROUP_BYTES; the saves that join take its next aligned bytes (no extent
    of their own); at hand-over the region keeps only what they use, and freeing the group gives
    back all of it."""
    from ssdtrain.host.host_pool import ALIGN
    off = _off(off_dir)
    saves = [torch.randn(1000) * 1.0 for _ in range(4)]  # 4000 B each: a 4 KiB slot
    want = [t.clone() for t in saves]
    try:
        with off:
            refs = _pack_all(off, saves)
            g = refs[0].entry
            gx = g.extent
            assert all(r.entry is g for r in refs) and gx.region is not None
            pool = off._tier.pool
            first, region = gx.parts[0], gx.region
            assert first.reserved == ALIGN and region.reserved == -(-(GROUP_BYTES - 4000) // ALIGN) * ALIGN
            assert [p.reserved for p in gx.parts[1:]] == [0, 0, 0]
            assert [p.offset - region.offset for p in gx.parts[1:]] == [0, ALIGN, 2 * ALIGN]
            assert pool.used == first.reserved + region.reserved
            off._writer.release_held(list(off._scopes.by_id.values()), None)  # handed over: the tail goes back
            assert region.reserved == 3 * ALIGN and pool.used == 4 * ALIGN
        off.wait()
        outs = [off._unpack(r) for r in reversed(refs)][::-1]
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        del refs, outs
        off.wait()
        assert off._tier.pool.used == 0 and gx.region is None
        assert all(alloc.consistent() for _, alloc in off._tier.pool._slabs)
    finally:
        off.close()


def test_a_groups_region_passes_on_to_the_next_group(off_dir, tier_on_cpu):
    """Note [a group's region passes on]: groups of small saves, one after another, share one
    reservation: each new group's region is the closing group's unused tail (its first save carved
    at the tail's start: Note [a group is started in one function]), the pool's use does not grow
    for it, every save comes back exact, and freeing them all leaves the pool empty."""
    from ssdtrain.host.host_pool import ALIGN
    off = _off(off_dir)
    saves = [torch.randn(1000) * 1.0 for _ in range(4 * GROUP_SAVES)]  # 4000 B each: a 4 KiB slot
    want = [t.clone() for t in saves]
    try:
        with off:
            refs = _pack_all(off, saves)
            groups = list(dict.fromkeys(r.entry for r in refs))
            assert len(groups) == 4 and all(len(g.parts) == GROUP_SAVES for g in groups)
            pool = off._tier.pool
            first = groups[0].extent
            for g in groups[1:]:
                gx = g.extent
                # the first part is carved at the region's start, and the region begins where the
                # group before it stopped using its own
                assert gx.parts[0].reserved == 0 and gx.parts[0].offset == gx.region.offset
                assert gx.region.offset == first.region.offset + first.used
                assert [p.offset - gx.region.offset for p in gx.parts] == [i * ALIGN for i in range(GROUP_SAVES)]
                first = gx
            # the general path's first part has an extent of its own; every other byte is a region's
            assert pool.used == groups[0].extent.parts[0].reserved + sum(g.extent.region.reserved for g in groups)
            assert pool.used <= ALIGN + GROUP_BYTES  # one reservation, passed on
        off.wait()
        outs = [off._unpack(r) for r in reversed(refs)][::-1]
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
        del refs, outs
        off.wait()
        assert off._tier.pool.used == 0
        assert all(alloc.consistent() for _, alloc in off._tier.pool._slabs)
    finally:
        off.close()


@pytest.mark.parametrize("host_bytes", ["64MiB", "1MiB"])
def test_carved_parts_are_exact_and_a_small_pool_gives_each_part_its_own_extent(off_dir, tier_on_cpu, host_bytes):
    """The GPT through the tier with parts carved from regions and with an extent a part gives the
    gradients of no offloading, and leaves the pool empty; a pool with no room for a region (1 MiB:
    a region is up to 4 MiB) gives each part its own extent and is not grown for the refusal."""
    model, loss_fn = _gpt()
    base = step(model, loss_fn, None)
    for carve in (True, False):
        off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, host_bytes=host_bytes)
        off._carve = carve
        regions = []
        real = off._join_group

        def spy(*a, **k):
            part = real(*a, **k)
            if part is not None:
                regions.append(part.entry.extent.region is not None)
            return part
        off._join_group = spy
        try:
            for _ in range(3):
                assert_same(base, step(model, loss_fn, off))
            off.wait()
            pool = off._tier.pool
            assert off.stats().host_copied_bytes > 0 and pool.used == 0
            assert any(regions) == (carve and host_bytes == "64MiB")
            if host_bytes == "1MiB":  # a region refused asks for no growth
                wanted, refused = pool.wanted, pool._refused
                assert pool.allocate(GROUP_BYTES, wanted=False) is None
                assert (pool.wanted, pool._refused) == (wanted, refused)
        finally:
            off.close()


def test_a_region_granted_or_refused_makes_the_pool_grow_for_nothing_and_shrinks_to_its_use():
    """Note [a group's parts are carved from one region], in the pool: a region (``wanted=False``)
    past GROW_AT of the pinned bytes pins no slab ahead (an ordinary extent there does), a refused
    one counts as no demand, and shrinking it gives its tail back to the pool's count and its
    allocator."""
    from ssdtrain.host.host_pool import ALIGN, HostPool
    MiB = 1 << 20
    pool = HostPool(64 * MiB, pin=lambda n: torch.empty(n, dtype=torch.uint8), slab=8 * MiB, background=False)
    pool.pin_first()
    assert pool.pinned == 8 * MiB
    region = pool.allocate(7 * MiB, wanted=False)  # past GROW_AT (0.85) of 8 MiB
    assert region is not None and pool.pinned == 8 * MiB  # no slab pinned ahead for it
    assert pool.allocate(4 * MiB, wanted=False) is None and pool.wanted == 0 and pool._refused == 0
    pool.shrink(region, 3 * ALIGN + 1)
    assert region.reserved == 4 * ALIGN and pool.used == 4 * ALIGN
    other = pool.allocate(7 * MiB)  # the tail was given back: there is room for it
    assert other is not None and pool.pinned == 16 * MiB  # an ordinary extent past GROW_AT pins ahead
    pool.free(region)
    pool.free(other)
    assert pool.used == 0 and all(alloc.consistent() and alloc.used_bytes == 0 for _, alloc in pool._slabs)
