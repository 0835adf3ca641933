"""ExtentAllocator (ssdtrain/store/allocator.py) and the filesystem helpers (ssdtrain/store/_fs.py)."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from ssdtrain.store import _fs
from ssdtrain.store import allocator as allocator_module
from ssdtrain.store.allocator import ExtentAllocator


A = 4096


def test_rounds_up_and_aligns():
    a = ExtentAllocator()
    assert a.allocate(1) == (0, A)
    assert a.allocate(A) == (A, A)
    assert a.allocate(A + 1) == (2 * A, 2 * A)
    assert a.end == 4 * A and a.used_bytes == 4 * A and a.free_bytes == 0


def test_reuses_freed_space_before_growing():
    a = ExtentAllocator()
    x = a.allocate(3 * A)
    y = a.allocate(A)
    assert a.free(*x) == [x]
    assert a.free_bytes == 3 * A
    # best fit: the hole is reused, split, and the end does not move
    assert a.allocate(A) == (0, A)
    assert a.allocate(2 * A) == (A, 2 * A)
    assert a.end == 4 * A and a.free_bytes == 0
    assert y == (3 * A, A)


def test_best_fit_prefers_the_smallest_hole():
    a = ExtentAllocator()
    big, _, small, _ = a.allocate(4 * A), a.allocate(A), a.allocate(2 * A), a.allocate(A)
    a.free(*big)
    a.free(*small)
    assert a.allocate(2 * A) == small


def test_coalesces_and_shrinks_end():
    a = ExtentAllocator()
    xs = [a.allocate(A) for _ in range(4)]
    a.free(*xs[1])
    a.free(*xs[2])
    assert a.free_ranges() == [(A, 2 * A)]
    a.free(*xs[3])  # top range touches the end: end falls back to the first live extent
    assert a.end == A and a.free_ranges() == []
    a.free(*xs[0])
    assert a.end == 0 and a.used_bytes == 0 and a.free_bytes == 0


def test_free_accepts_the_requested_nbytes():
    a = ExtentAllocator()
    off, length = a.allocate(100)
    assert a.free(off, 100) == [(off, length)]


def test_zero_bytes_occupy_nothing():
    a = ExtentAllocator()
    assert a.allocate(0) == (0, 0)
    assert a.free(0, 0) == []
    assert a.end == 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="nbytes"):
        ExtentAllocator().allocate(bad)


@pytest.mark.parametrize("bad", [0, 3, 4095, -4096, 1.0])
def test_bad_alignment_is_refused(bad):
    with pytest.raises(ValueError, match="alignment"):
        ExtentAllocator(bad)


def test_misuse_raises_value_error():
    a = ExtentAllocator()
    x = a.allocate(2 * A)
    with pytest.raises(ValueError, match="never allocated"):
        a.free(A, A)  # inside an extent, but not one
    with pytest.raises(ValueError, match="allocated with length"):
        a.free(x[0], A)
    a.free(*x)
    with pytest.raises(ValueError, match="already free"):
        a.free(*x)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_untrimmed_space_is_tracked_and_cleared_by_reuse():
    clock = FakeClock()
    a = ExtentAllocator(clock=clock)
    x, y, z = a.allocate(4 * A), a.allocate(A), a.allocate(A)
    a.free(*x)
    assert a.untrimmed_bytes == 4 * A
    a.allocate(2 * A)  # reuses (and will overwrite) the first half
    assert a.untrimmed_bytes == 2 * A
    a.free(*y, trimmed=True)  # the caller punched it itself
    assert a.untrimmed_bytes == 2 * A


def test_begin_trim_reserves_only_space_that_stayed_free():
    clock = FakeClock()
    a = ExtentAllocator(clock=clock)
    x, y, z = a.allocate(4 * A), a.allocate(A), a.allocate(2 * A)
    a.free(*x)
    clock.t = 10
    a.free(*z)  # freed later; touches the end, so end shrinks to 5 A
    assert a.end == 5 * A
    assert not a.trim_due(min_age=20) and a.trim_due(min_age=5)
    assert a.begin_trim(min_age=5) == [(0, 4 * A)]
    # reserved: nothing can land there while it is being punched; the end grows instead,
    # over z's old place, which then needs no punch (it is overwritten)
    assert a.allocate(A) == (5 * A, A)
    clock.t = 30
    got = a.begin_trim(min_age=15)
    assert got == [(6 * A, A)]
    assert a.untrimmed_bytes == 0
    a.end_trim([(0, 4 * A)])
    a.end_trim(got)
    with pytest.raises(ValueError, match="end_trim"):
        a.end_trim(got)


def test_trim_above_end_then_everything_freed():
    clock = FakeClock()
    a = ExtentAllocator(clock=clock)
    xs = [a.allocate(A) for _ in range(3)]
    for x in xs:
        a.free(*x)
    assert a.end == 0 and a.untrimmed_bytes == 3 * A
    got = a.begin_trim()
    assert got == [(0, 3 * A)] and a.end == 3 * A and a.used_bytes == 3 * A
    assert a.allocate(A) == (3 * A, A)  # grows past the reserved range
    with pytest.raises(ValueError):
        a.free(0, 3 * A)  # reserved ranges go back through end_trim only
    a.end_trim(got)
    a.free(3 * A, A)
    assert a.end == 0 and a.used_bytes == 0 and a.free_bytes == 0


def test_begin_trim_max_bytes():
    clock = FakeClock()
    a = ExtentAllocator(clock=clock)
    xs = [a.allocate(A) for _ in range(5)]
    a.free(*xs[0])
    a.free(*xs[2])
    a.free(*xs[4])
    assert a.begin_trim(max_bytes=A) == [(0, A)]
    assert a.untrimmed_bytes == 2 * A


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of which bytes are live."""

    extents = Bundle("extents")

    def __init__(self):
        super().__init__()
        self.align = A
        self.clock = FakeClock()
        self.a = ExtentAllocator(self.align, clock=self.clock)
        self.live: dict[int, int] = {}
        self.trimming: list[tuple[int, int]] = []

    @rule(target=extents, nbytes=st.integers(0, 64 * A))
    def allocate(self, nbytes):
        off, length = self.a.allocate(nbytes)
        assert length == -(-nbytes // self.align) * self.align
        assert off % self.align == 0
        if length:
            for o, n in [*self.live.items(), *self.trimming]:
                assert off + length <= o or o + n <= off, "overlap"
            self.live[off] = length
        return (off, length)

    @rule(dt=st.floats(0, 5), min_age=st.floats(0, 5), max_bytes=st.none() | st.integers(A, 32 * A))
    def begin_trim(self, dt, min_age, max_bytes):
        self.clock.t += dt
        got = self.a.begin_trim(min_age=min_age, max_bytes=max_bytes)
        for off, length in got:
            assert off % self.align == 0 and length % self.align == 0 and length > 0
            for o, n in [*self.live.items(), *self.trimming]:
                assert off + length <= o or o + n <= off, "trim range overlaps live data"
        self.trimming += got

    @rule()
    def end_trim(self):
        self.a.end_trim(self.trimming)
        self.trimming = []

    @rule(ext=consumes(extents))
    def free(self, ext):
        off, length = ext
        punched = self.a.free(off, length)
        if length:
            del self.live[off]
            assert punched == [(off, length)]
        else:
            assert punched == []

    @rule(nbytes=st.integers(1, 16 * A))
    def double_free_is_refused(self, nbytes):
        off, length = self.a.allocate(nbytes)
        self.a.free(off, length)
        with pytest.raises(ValueError):
            self.a.free(off, length)

    @rule(nbytes=st.integers(1, 16 * A))
    def freed_space_is_reused(self, nbytes):
        # Any request no larger than a free hole must not grow the end.
        length = -(-nbytes // self.align) * self.align
        fits = any(n >= length for _, n in self.a.free_ranges())
        end = self.a.end
        off, length = self.a.allocate(nbytes)
        if fits:
            assert self.a.end == end and off + length <= end
        self.a.free(off, length)

    @invariant()
    def accounting(self):
        a = self.a
        assert a.used_bytes == sum(self.live.values()) + sum(n for _, n in self.trimming)
        assert a.used_bytes + a.free_bytes == a.end
        ranges = a.free_ranges()
        for (o1, n1), (o2, _) in zip(ranges, ranges[1:]):
            assert o1 + n1 < o2, "free ranges must be coalesced"
        if ranges:
            assert ranges[-1][0] + ranges[-1][1] < a.end, "a free range touching the end must shrink it"
        top = max((o + n for o, n in [*self.live.items(), *self.trimming]), default=0)
        assert a.end == top
        # untrimmed bytes are free bytes (below end or above it), never live ones
        for o, n, _ in a._dirty.items():
            for lo, ln in self.live.items():
                assert o + n <= lo or lo + ln <= o, "live extent counted as untrimmed"

    def teardown(self):
        self.a.end_trim(self.trimming)
        for off, length in list(self.live.items()):
            self.a.free(off, length)
        assert self.a.end == 0 and self.a.used_bytes == 0 and self.a.free_bytes == 0


AllocatorMachine.TestCase.settings = settings(deadline=None, max_examples=40, stateful_step_count=40)
TestAllocatorMachine = AllocatorMachine.TestCase


# --- filesystem helpers ----------------------------------------------------------------------

def _blocks(path) -> int:
    return os.stat(path).st_blocks


def _cut_at(line: int, fn, *args):
    """Runs ``fn(*args)``, raising KeyboardInterrupt at its ``line``-th line inside allocator.py:
    what a Ctrl-C does on the training thread, at a reproducible moment."""
    seen = [0]

    def local(frame, event, arg):
        if event == "line":
            seen[0] += 1
            if seen[0] == line:
                raise KeyboardInterrupt
        return local

    sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename == allocator_module.__file__ else None)
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


@pytest.mark.parametrize("op", ["free", "allocate", "trim"])
def test_a_change_cut_at_every_line_is_healed(op):
    """The same, swept: the change cut at each of its lines in turn, with holes on both sides,
    then more allocations and frees (which must not raise) and every extent freed."""
    for cut in range(1, 200):
        a = ExtentAllocator(A, clock=lambda: 0.0)
        live = [a.allocate(n * A) for n in (1, 2, 3, 2, 1, 4)]
        a.free(*live.pop(1))
        a.free(*live.pop(2))
        try:
            if op == "free":
                _cut_at(cut, a.free, *live.pop(1))
            elif op == "allocate":
                live.append(_cut_at(cut, a.allocate, A))
            else:
                a.end_trim(_cut_at(cut, a.begin_trim, 0.0))
        except KeyboardInterrupt:
            pass
        else:
            if op != "free":
                break  # the whole change ran: every line has been cut at
        for n in (1, 2, 1, 5):
            got = a.allocate(n * A)
            assert all(got[0] + got[1] <= o or o + ln <= got[0] for o, ln in live), (cut, got, live)
            live.append(got)
        for victim in live:
            a.free(*victim)
        a.heal()
        assert a.consistent() and a.used_bytes <= 8 * A, (cut, a)  # what a cut allocation leaked, at most


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9 * A), st.integers(0, 60)), min_size=1, max_size=60))
def test_an_interrupted_change_leaks_but_never_hands_out_a_range_twice(ops):
    """Note [leaked, never doubly held]: allocations and frees, some cut short at an arbitrary
    line (0: not cut). Whatever was torn, no allocation ever overlaps a live extent (the next
    call heals what would raise), and heal() leaves the allocator consistent."""
    a = ExtentAllocator(A, clock=lambda: 0.0)
    live: list[tuple[int, int]] = []
    for alloc, size, cut in ops:
        try:
            if alloc or not live:
                got = _cut_at(cut, a.allocate, size) if cut else a.allocate(size)
                off, length = got
                assert all(off + length <= o or o + n <= off for o, n in live), (got, live)
                live.append(got)
            else:
                victim = live.pop(size % len(live))  # cut or not, it is not ours any more
                _cut_at(cut, a.free, *victim) if cut else a.free(*victim)
        except KeyboardInterrupt:
            pass
    a.heal()
    assert a.consistent()
    held = sorted(live)
    assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(held, held[1:]))
    for s, n in a.free_ranges():
        assert all(s + n <= o or o + ln <= s for o, ln in live)   # free space is not live space
    got = a.allocate(A)
    assert all(got[0] + got[1] <= o or o + n <= got[0] for o, n in live)
    for victim in live + [got]:
        a.free(*victim)                 # every live extent is still known as such
    assert a.consistent()


def test_punch_hole_frees_blocks(tmp_path):
    p = tmp_path / "arena"
    size = 64 * A
    with open(p, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    before = _blocks(p)
    fd = os.open(p, os.O_RDWR)
    try:
        ok = _fs.punch_hole(fd, 16 * A, 32 * A)
    finally:
        os.close(fd)
    if not ok:
        pytest.skip(f"{_fs.fs_type(tmp_path)} cannot punch holes")
    assert os.path.getsize(p) == size  # KEEP_SIZE
    assert _blocks(p) <= before - (32 * A) // 512
    data = p.read_bytes()
    assert data[16 * A:48 * A] == bytes(32 * A)


def test_punch_hole_zero_length_is_a_no_op(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert _fs.punch_hole(fd, 0, 0) is True
    finally:
        os.close(fd)


def test_punch_hole_bad_fd_raises():
    with pytest.raises(OSError):
        _fs.punch_hole(-1, 0, A)


def test_fs_type_longest_mount_point_wins(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "40 27 0:50 / /mnt/data rw - xfs /dev/nvme0n1 rw\n"
        "41 40 0:51 / /mnt/data/my\\040share rw - nfs4 srv:/x rw\n"
        "42 27 0:52 / /mnt/data2 rw - tmpfs tmpfs rw\n"
        "43 40 0:53 / /mnt/data rw - btrfs /dev/nvme1n1 rw\n"
    )
    lines = info.read_text().splitlines()
    assert _fs._match_mount("/mnt/data/x/y", lines)[1] == "btrfs"  # a later mount on top wins
    assert _fs._match_mount("/mnt/data/my share/z", lines)[1] == "nfs4"
    assert _fs._match_mount("/mnt/data2", lines)[1] == "tmpfs"
    assert _fs._match_mount("/mnt/data22", lines)[1] == "ext4"  # a name prefix is not a parent
    assert _fs._mount_of(tmp_path, str(tmp_path / "missing"))[1] == "unknown"


def test_fs_type_on_this_machine(tmp_path):
    assert _fs.fs_type(tmp_path) not in ("", None)
    assert _fs.fs_type(tmp_path / "not" / "yet") == _fs.fs_type(tmp_path)
    if os.path.isdir("/dev/shm") and _fs.fs_type("/dev/shm") == "tmpfs":
        assert _fs.is_ram_backed("/dev/shm")
        assert not _fs.is_network_fs("/dev/shm")


def test_direct_io_probe_leaves_nothing(tmp_path):
    result = _fs.direct_io_supported(tmp_path)
    assert isinstance(result, bool)
    assert list(tmp_path.iterdir()) == []


def test_direct_io_probe_missing_dir_raises(tmp_path):
    with pytest.raises(OSError):
        _fs.direct_io_supported(tmp_path / "missing")


def test_sizes(tmp_path):
    assert 0 <= _fs.free_bytes(tmp_path) <= _fs.total_bytes(tmp_path)
    assert _fs.total_bytes(tmp_path) > 0


def test_aligned_buffer_is_page_aligned():
    import ctypes
    import mmap

    buf = _fs.aligned_buffer(10)
    try:
        assert len(buf) == mmap.PAGESIZE
        c = ctypes.c_char.from_buffer(buf)
        addr = ctypes.addressof(c)
        del c
        assert addr % mmap.PAGESIZE == 0
    finally:
        buf.close()


def test_shrink_gives_back_the_tail_and_keeps_the_head():
    """Note [a group's parts are carved from one region]: a region's unused tail goes back to the
    allocator; the head stays allocated at its aligned length, and misuse raises."""
    a = ExtentAllocator(4096)
    off, length = a.allocate(16384)
    assert a.shrink(off, 5000, trimmed=True) == [(off + 8192, 8192)]
    assert a.used_bytes == 8192 and a.consistent()
    assert a.allocate(8192) == (off + 8192, 8192)  # the tail is reused
    assert a.shrink(off, 8192) == []  # already that long: nothing to give back
    for bad in (0, 8193):
        with pytest.raises(ValueError, match="cannot shrink"):
            a.shrink(off, bad)
    with pytest.raises(ValueError, match="cannot shrink"):
        a.shrink(off + 4096, 10)  # not an extent's start
    with pytest.raises(ValueError):
        a.free(off, length)  # its old length is not its length any more
    a.free(off, 8192)
    assert a.consistent() and a.used_bytes == 8192


def test_split_makes_two_live_extents_each_freed_on_its_own():
    """Note [a group's region passes on]: a split extent is two live extents, the use unchanged;
    each is freed (or split again) by itself, and misuse raises."""
    a = ExtentAllocator(4096)
    off, _ = a.allocate(16384)
    assert a.split(off, 5000) == (off + 8192, 8192)
    assert a.used_bytes == 16384 and a.consistent()
    assert a.split(off, 8192) is None  # nothing left beyond it
    assert a.split(off + 8192, 4096) == (off + 12288, 4096)
    for bad in (0, 8193):
        with pytest.raises(ValueError, match="split"):
            a.split(off, bad)
    a.free(off + 8192, 4096)
    assert a.used_bytes == 12288 and a.consistent()
    with pytest.raises(ValueError):
        a.free(off, 16384)  # its old length is not its length any more
    a.free(off, 8192)
    a.free(off + 12288, 4096)
    assert a.used_bytes == 0 and a.end == 0 and a.consistent()
