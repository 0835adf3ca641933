"""How the posix backend shapes its I/O: reload buffers on huge pages (Note [huge pages make
large requests]) and one thread-pool task per direct request (Note [one task per direct
request])."""

import os
import re

import pytest
import torch

from ssdtrain.config import OffloadConfig
from ssdtrain.store._hostbuf import HUGE, HostBufferPool
from ssdtrain.store.posix import PosixBackend

MiB = 1 << 20


def _vma(addr: int) -> tuple[str, set[str]]:
    """The permissions and VmFlags of this process's mapping that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+)", line)
        if m and int(m.group(1), 16) <= addr < int(m.group(2), 16):
            for rest in lines[i + 1:]:
                if rest.startswith("VmFlags:"):
                    return m.group(3), set(rest.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _thp_possible() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_large_reload_buffers_ask_for_huge_pages_over_their_whole_huge_pages_only():
    pool = HostBufferPool(64 * MiB)
    lead = 64
    buf = pool.take(5 * MiB, lead)  # payload + lead spans two whole huge pages and a partial third
    start = buf.data_ptr() - lead
    assert start % HUGE == 0, "a buffer of a huge page or more starts on a huge-page boundary"
    perms, flags = _vma(start)
    assert perms.endswith("p"), f"reload buffers are private memory (THP skips shared), got {perms}"
    if _thp_possible():
        assert "hg" in flags, "the whole huge pages of the payload are advised MADV_HUGEPAGE"
        _, tail = _vma(start + 4 * MiB + 4096)
        assert "hg" not in tail, "the partial huge page at the end keeps small pages"
    small = pool.take(64 << 10, 0)
    assert "hg" not in _vma(small.data_ptr())[1]
    # The buffer still works as memory: writes land where the tensor says.
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()
    del buf, small
    pool.close()


def _counting(monkeypatch, backend):
    counts = {"write": 0, "read": 0}
    arena = backend._arenas[0]
    for name, pool in (("write", arena.pool), ("read", arena.read_pool)):
        real = pool.submit

        def submit(*a, _real=real, _name=name, **k):
            counts[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(pool, "submit", submit)
    return counts


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("verify", [False, True])
def test_a_direct_request_is_one_task_and_buffered_ones_a_task_per_chunk(off_dir, monkeypatch, direct, verify):
    cfg = OffloadConfig(path=str(off_dir), chunk_bytes="1MiB", io_threads=2, direct_io=direct)
    backend = PosixBackend(cfg)
    if direct and not backend.direct:
        backend.close()
        pytest.skip(f"{off_dir} does not take O_DIRECT")
    counts = _counting(monkeypatch, backend)
    src = torch.randn(7 * MiB // 8 // 2 + 3, dtype=torch.float64)  # 3.5 MiB and change
    raw = src.view(torch.uint8).reshape(-1)
    extent = backend.allocate(raw.numel())
    crcs = backend.submit_write(extent, raw, checksum=verify).result()
    chunks = -(-((raw.data_ptr() % 4096 if direct else 0) + raw.numel()) // MiB)
    assert len(crcs) == chunks  # one entry per window, whatever the task split
    assert counts["write"] == (1 if direct else chunks)
    dst = backend.alloc_buffer(raw.numel(), raw.device, extent=extent)
    backend.submit_read(extent, dst, checksum=crcs if verify else None).result()
    assert counts["read"] == (1 if direct else chunks)
    assert torch.equal(dst, raw)
    backend.free(extent)
    backend.close()


@pytest.mark.parametrize("verify", [False, True])
def test_a_read_into_foreign_memory_goes_through_staging(off_dir, verify):
    # A destination that is not a reload buffer of this extent (another offset within its page,
    # no room for whole pages) cannot take a direct read in place: the I/O thread reads into its
    # own page-aligned staging buffer, on huge pages once it is large, and copies the payload.
    backend = PosixBackend(OffloadConfig(path=str(off_dir), chunk_bytes="1MiB", io_threads=2))
    src = torch.randint(0, 256, (3 * MiB + 1234,), dtype=torch.uint8)
    extent = backend.allocate(src.numel())
    crcs = backend.submit_write(extent, src, checksum=verify).result()
    room = torch.zeros(src.numel() + 64, dtype=torch.uint8)
    dst = room[7:7 + src.numel()]
    backend.submit_read(extent, dst, checksum=crcs if verify else None).result()
    assert torch.equal(dst, src)
    assert int(room[:7].sum()) == 0 and int(room[7 + src.numel():].sum()) == 0  # nothing around it touched
    backend.free(extent)
    backend.close()


def test_cuda_tensors_stage_in_page_aligned_pinned_memory(monkeypatch):
    # Note [pinned staging for CUDA tensors]: the CUDA branch itself needs a GPU; here a stand-in
    # for torch's pinned allocator hands out memory 64 bytes past a page, as it is allowed to.
    import threading

    import ssdtrain.store.posix as posix

    asked = []

    def pinned_empty(n):
        asked.append(n)
        block = torch.zeros(n + 8192, dtype=torch.uint8)
        start = -block.data_ptr() % 4096 + 64
        return block[start:start + n]

    monkeypatch.setattr(posix.device, "pinned_empty", pinned_empty)
    out = {}

    def on_an_io_thread():
        out["pinned"] = posix._staging(10_000, pinned=True)
        out["again"] = posix._staging(5_000, pinned=True)
        out["pageable"] = posix._staging(10_000)

    t = threading.Thread(target=on_an_io_thread)
    t.start()
    t.join()
    mv, staged = out["pinned"]
    assert asked == [12288 + 4096]  # a page of slack to find the boundary in
    assert staged.data_ptr() % 4096 == 0 and staged.numel() == len(mv) == 12288
    assert out["again"][1] is staged  # one per thread, reused
    assert out["pageable"][1].data_ptr() != staged.data_ptr()  # host tensors keep their own
    mv[:4] = b"abcd"  # the memoryview is the tensor's memory
    assert bytes(staged[:4].tolist()) == b"abcd"
