"""host_allocator: forward's large CPU allocations on huge pages while an Offloader is active
(Note [written tensors on huge pages] in ssdtrain/_hostalloc.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ssdtrain
from ssdtrain import _hostalloc
from ssdtrain.models import GPT, GPTConfig

from _equiv import assert_same, step

HUGE = _hostalloc.HUGE

# The allocator needs a C++ compiler and transparent huge pages; CI has both, so there these
# tests run. Elsewhere they skip with the reason, and "auto" falls back (tested below by faking it).
pytestmark = pytest.mark.skipif(not _hostalloc.available(), reason=f"{_hostalloc.unavailable_reason()}")


def _huge_bytes_at(addr: int) -> int:
    """AnonHugePages of the mapping holding ``addr`` (from /proc/self/smaps), in bytes."""
    span = None
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                span = (int(m.group(1), 16), int(m.group(2), 16))
            elif line.startswith("AnonHugePages:") and span and span[0] <= addr < span[1]:
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_forward_allocations_go_on_huge_pages_and_torch_gets_its_allocator_back(off_dir):
    model = torch.nn.Linear(8, 8)
    off = ssdtrain.Offloader(model, path=str(off_dir))
    assert off.host_allocator == "hugepage", off.host_allocator_reason
    before = _hostalloc.counters()
    assert not _hostalloc.installed()
    with off:
        assert _hostalloc.installed()
        big = torch.ones(3 * HUGE // 4)  # 6 MiB: three whole huge pages
        torch.ones(1000).sum()  # under a huge page: torch's allocator
    assert not _hostalloc.installed()
    after = _hostalloc.counters()
    assert after["allocations"] == before["allocations"] + 1  # the small one went to torch's allocator
    assert after["bytes"] == before["bytes"] + 3 * HUGE
    assert big.data_ptr() % HUGE == 0
    outside = torch.ones(3 * HUGE // 4)
    assert _hostalloc.counters() == after  # torch's allocator again
    assert float(big.sum()) == 3 * HUGE // 4 and float(outside.sum()) == 3 * HUGE // 4
    del big  # freed while torch's allocator is in place: kept for reuse all the same
    off.close()


def test_tensors_made_in_forward_sit_on_huge_pages(tmp_path):
    """In a fresh process (so that no earlier test's use of the C library's memory decides which
    pages a range already has): a 6 MiB tensor made in ``with off:`` is on three huge pages
    (``/proc/self/smaps``); one made outside is not 2 MiB aligned, as torch's allocator leaves it."""
    code = textwrap.dedent(f"""
        import sys, torch, ssdtrain
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_hostalloc import _huge_bytes_at, HUGE
        off = ssdtrain.Offloader(torch.nn.Linear(4, 4), path={str(tmp_path)!r})
        with off:
            big = torch.ones(3 * HUGE // 4)
        plain = torch.ones(3 * HUGE // 4)
        assert big.data_ptr() % HUGE == 0 and plain.data_ptr() % HUGE != 0
        print(_huge_bytes_at(big.data_ptr()) // HUGE)
        off.close()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) >= 3


def test_allocator_stays_while_any_scope_is_active(off_dir):
    """Two Offloaders, nested, and micro-batch scopes: in place until the last one ends."""
    a = ssdtrain.Offloader(torch.nn.Linear(4, 4), path=str(off_dir))
    b = ssdtrain.Offloader(torch.nn.Linear(4, 4), path=str(off_dir))
    with a:
        with b:
            assert _hostalloc.installed()
        assert _hostalloc.installed()
        with a.microbatch(0):
            with a.microbatch(1):
                assert _hostalloc.installed()
            assert _hostalloc.installed()
        assert _hostalloc.installed()
    assert not _hostalloc.installed()
    with pytest.raises(ZeroDivisionError):
        with b:
            1 / 0
    assert not _hostalloc.installed()
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_exact_with_huge_pages(off_dir, dtype):
    """A GPT with s x s attention scores of 2 MiB and more, dropout, layer norm, views of one QKV
    storage; in bfloat16 the loss is taken in float32 (mixed dtypes). Offloaded with the
    allocator in place, gradients equal those of a step without offloading, bit for bit, also in
    the second step, whose forward runs on blocks the first one freed (stale bytes in them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=256, seq=128, layers=3, hidden=128, heads=4, dropout=0.1, flash=False)).to(dtype)
    tok = torch.randint(0, 256, (16, 128))
    base = step(model, lambda: model(tok, tok), None)
    off = ssdtrain.Offloader(model, path=str(off_dir), host_allocator="hugepage")
    before = _hostalloc.counters()
    for i in range(2):
        assert_same(base, step(model, lambda: model(tok, tok), off, wait=i == 1))
    s = off.stats()
    assert _hostalloc.counters()["bytes"] - before["bytes"] >= s.written_bytes // 2
    assert _hostalloc.counters()["reused"] > before["reused"]
    assert s.written_bytes > 0 and s.read_bytes > 0
    off.close()


def test_freed_blocks_are_reused_within_a_limit_and_given_back_at_close(off_dir):
    """Note [reuse freed blocks]: a freed block comes back for an allocation of its length (its
    old bytes are not seen through torch.zeros), not for another length; one freed outside any
    scope (in backward) is kept too; no more than the limit is kept; trim() keeps them while a
    scope is active, and close() gives them back and keeps no more."""
    lib = _hostalloc._load()[0]
    off = ssdtrain.Offloader(torch.nn.Linear(8, 8), path=str(off_dir))
    n = 3 * HUGE // 4  # 6 MiB of float32
    _hostalloc.trim()
    try:
        with off:
            a = torch.full((n,), 7.0)
            where = a.data_ptr()
            del a
            assert _hostalloc.counters()["idle_bytes"] == 3 * HUGE
            before = _hostalloc.counters()
            b = torch.zeros(n)
            assert b.data_ptr() == where and not b.any()
            assert _hostalloc.counters()["reused"] == before["reused"] + 1
            c = torch.ones(n + HUGE // 4)  # another length: a new block
            assert c.data_ptr() != where
            assert _hostalloc.counters()["reused"] == before["reused"] + 1
            del c
            assert _hostalloc.counters()["idle_bytes"] == 4 * HUGE
            assert _hostalloc.trim() == 0  # a scope is active: kept
        assert _hostalloc.counters()["idle_bytes"] == 4 * HUGE
        del b  # freed outside any scope: kept for the next forward
        assert _hostalloc.counters()["idle_bytes"] == 7 * HUGE
        assert _hostalloc.trim() == 7 * HUGE

        lib.ssdtrain_hostalloc_set_idle_limit(4 * HUGE)
        with off:
            blocks = [torch.ones(n) for _ in range(3)]
            survivor = torch.ones(n)
            del blocks
            assert _hostalloc.counters()["idle_bytes"] == 3 * HUGE  # a second 6 MiB block would pass 8 MiB
        blocks = [torch.ones(n) for _ in range(2)]  # outside: torch's allocator (the kept block stays)
        assert _hostalloc.counters()["idle_bytes"] == 3 * HUGE
    finally:
        lib.ssdtrain_hostalloc_set_idle_limit(_hostalloc.IDLE_LIMIT)
    off.close()
    assert _hostalloc.counters()["idle_bytes"] == 0
    del survivor  # freed after close(): not kept (until an offloader is active again)
    assert _hostalloc.counters()["idle_bytes"] == 0


def test_torch_and_auto_choices(off_dir):
    m = torch.nn.Linear(4, 4)
    off = ssdtrain.Offloader(m, path=str(off_dir), host_allocator="torch")
    with off:
        assert not _hostalloc.installed()
    assert off.host_allocator == "torch"
    off.close()
    mem = ssdtrain.Offloader(m, backend="memory")
    assert mem.host_allocator == "torch" and "memory" in mem.host_allocator_reason
    mem.close()
    meta = ssdtrain.Offloader(torch.nn.Linear(4, 4, device="meta"), path=str(off_dir))
    assert meta.host_allocator == "torch" and "not on the CPU" in meta.host_allocator_reason
    meta.close()
    with pytest.raises(ValueError, match="host_allocator='bogus' is not one of"):
        ssdtrain.OffloadConfig(host_allocator="bogus")


def test_unavailable_allocator(off_dir, monkeypatch):
    """'auto' falls back to torch's allocator and says why; 'hugepage' is refused before any
    file is created."""
    monkeypatch.setattr(_hostalloc, "_load", lambda: (None, "no C++ compiler found (install g++, or set CXX)"))
    off = ssdtrain.Offloader(torch.nn.Linear(4, 4), path=str(off_dir))
    assert off.host_allocator == "torch" and "compiler" in off.host_allocator_reason
    with off:
        pass
    off.close()
    with pytest.raises(ValueError, match="host_allocator='hugepage' cannot be used here: no C.. compiler"):
        ssdtrain.Offloader(torch.nn.Linear(4, 4), path=str(off_dir / "new"), host_allocator="hugepage")
    assert not (off_dir / "new").exists()


def test_no_native_code_when_asked(off_dir, monkeypatch):
    monkeypatch.setenv("SSDTRAIN_NO_EXT", "1")
    _hostalloc._load.cache_clear()
    try:
        off = ssdtrain.Offloader(torch.nn.Linear(4, 4), path=str(off_dir))
        assert off.host_allocator == "torch" and "SSDTRAIN_NO_EXT" in off.host_allocator_reason
        off.close()
    finally:
        monkeypatch.delenv("SSDTRAIN_NO_EXT")
        _hostalloc._load.cache_clear()
    assert _hostalloc.available()


def test_compiler_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    with pytest.raises(_hostalloc.Unavailable, match="compiling ssdtrain_hostalloc.cpp failed"):
        _hostalloc.build(tmp_path / "lib.so")
    assert list(tmp_path.iterdir()) == []


def test_someone_elses_allocator_is_left_in_place(tmp_path):
    """torch's mobile allocator (priority 100) in place: 'auto' keeps it, 'hugepage' says so.
    In a subprocess: that allocator's priority stays for the life of the process."""
    code = textwrap.dedent(f"""
        import torch, ssdtrain
        from ssdtrain import _hostalloc
        torch._C._set_default_mobile_cpu_allocator()
        off = ssdtrain.Offloader(torch.nn.Linear(4, 4), path={str(tmp_path)!r})
        with off:
            assert not _hostalloc.installed()
        assert off.host_allocator == "torch", off.host_allocator
        assert "not its default one" in off.host_allocator_reason, off.host_allocator_reason
        strict = ssdtrain.Offloader(torch.nn.Linear(4, 4), path={str(tmp_path)!r}, host_allocator="hugepage")
        try:
            with strict:
                pass
        except RuntimeError as e:
            assert "host_allocator='hugepage'" in str(e) and "set host_allocator='torch'" in str(e), e
        else:
            raise AssertionError("no error")
        assert not _hostalloc.installed()
        x = torch.ones(1 << 20) * 2  # torch still allocates
        assert float(x.sum()) == 2 << 20
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_fork_while_another_thread_frees_blocks_does_not_hang_the_child():
    """A fork (a DataLoader worker) copies the block lock as it is; fork handlers make sure no
    other thread holds it then, so the child can free its copy of a tensor and allocate.
    In a subprocess: forks while a thread allocates and frees blocks in a loop."""
    code = textwrap.dedent("""
        import os, threading, time, torch
        from ssdtrain import _hostalloc
        torch.set_num_threads(1)
        _hostalloc.use()
        n = 3 * _hostalloc.HUGE // 4
        stop = False
        def churn():
            while not stop:
                t = torch.empty(n)
                del t
        worker = threading.Thread(target=churn)
        worker.start()
        kept = torch.empty(n)
        hung = 0
        for _ in range(200):  # without the handlers, about one child in 200 hung here
            pid = os.fork()
            if pid == 0:
                del kept  # the child's copy of a block: freed through the block lock
                x = torch.empty(n)
                del x
                os._exit(0)
            deadline = time.monotonic() + 10
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    hung += 1
                    break
                time.sleep(0.001)
        stop = True
        worker.join()
        _hostalloc.release()
        print("hung", hung)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hung 0", done.stdout
