"""Note [nothing left on disk]: private, unlinked arenas; close(), GC and SIGKILL leave nothing."""

import errno
import gc
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import textwrap

import pytest
import torch

import ssdtrain
from ssdtrain.store import _arena


def _arena_fds(directory):
    """Our descriptors whose (deleted) file lived under ``directory``."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith("(deleted)"):
            out.append(int(name))
    return out


def test_arena_is_private_and_unlinked(off_dir):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    x = torch.randn(256, 256, requires_grad=True)
    with off.microbatch(0):  # writes its last save too (Note [the last save waits])
        loss = (x * 2).sigmoid().sum()
    off.wait()
    assert off.stats().written_bytes > 0
    assert list(off_dir.iterdir()) == []  # nothing visible while running
    fds = _arena_fds(off_dir)
    assert fds, "the arena file should be open (and deleted)"
    for fd in fds:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    loss.backward()
    off.close()
    off.close()  # idempotent
    assert _arena_fds(off_dir) == []
    assert list(off_dir.iterdir()) == []


@pytest.fixture
def no_tmpfile(monkeypatch):
    """A filesystem without O_TMPFILE: the arena falls back to a private directory."""
    real = os.open

    def fake(path, flags, *args, **kwargs):
        if hasattr(os, "O_TMPFILE") and flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(_arena.os, "open", fake)


def test_arena_file_never_has_a_name(off_dir, monkeypatch):
    if not hasattr(os, "O_TMPFILE"):
        pytest.skip("no O_TMPFILE on this platform")
    made = []
    real = os.mkdir
    monkeypatch.setattr(_arena.os, "mkdir", lambda p, mode=0o777: (made.append(p), real(p, mode))[1])
    ssdtrain.Offloader(path=str(off_dir)).close()
    assert made == []  # no private directory, no file name: O_TMPFILE


def test_private_dir_is_created_0700(off_dir, monkeypatch, no_tmpfile):
    modes = []
    real = os.mkdir
    monkeypatch.setattr(_arena.os, "mkdir", lambda p, mode=0o777: (modes.append(mode), real(p, mode))[1])
    ssdtrain.Offloader(path=str(off_dir)).close()
    assert modes == [0o700]


@pytest.mark.parametrize("tmpfile", [True, False])
def test_nothing_is_named_during_the_direct_io_test_write(off_dir, monkeypatch, request, tmpfile):
    # The O_DIRECT test write is the slow step of construction (it reaches the drive): a
    # SIGKILL there must find nothing to leave behind, with or without O_TMPFILE.
    if not tmpfile:
        request.getfixturevalue("no_tmpfile")
    import ssdtrain.store.posix as posix

    seen = []
    real = os.pwrite
    monkeypatch.setattr(posix.os, "pwrite", lambda *a: (seen.append(os.listdir(off_dir)), real(*a))[1])
    ssdtrain.Offloader(path=str(off_dir), backend="posix").close()
    assert seen and seen == [[]] * len(seen)
    assert list(off_dir.iterdir()) == []


@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_existing_name_is_refused_not_followed(off_dir, tmp_path, monkeypatch, no_tmpfile, kind):
    monkeypatch.setattr(_arena.secrets, "token_hex", lambda n: "fixed")
    name = off_dir / f"ssdtrain-{os.getpid()}-fixed"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "symlink":
        name.symlink_to(elsewhere)
    else:
        name.write_text("x")
    with pytest.raises(ValueError, match="already exists"):
        ssdtrain.Offloader(path=str(off_dir))
    assert list(elsewhere.iterdir()) == []


def test_two_offloaders_never_share_a_file(off_dir):
    a = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    b = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    inodes = {os.fstat(fd).st_ino for fd in _arena_fds(off_dir)}
    assert len(inodes) == 2
    x = torch.randn(128, 128, requires_grad=True)
    with a:
        la = (x * 1).exp().sum()
    with b:
        lb = (x * 2).exp().sum()
    a.wait()
    b.wait()
    (ga,) = torch.autograd.grad(la, x)
    (gb,) = torch.autograd.grad(lb, x)
    assert torch.equal(ga, (x * 1).exp().detach()) and torch.equal(gb, 2 * (x * 2).exp().detach())
    a.close()
    b.close()


def test_garbage_collection_closes(off_dir):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        (x * 2).exp().sum().backward()
    del off
    # A write still in flight holds the offloader until it completes; then it is collectable.
    for _ in range(100):
        gc.collect()
        if not _arena_fds(off_dir):
            break
        time.sleep(0.05)
    assert _arena_fds(off_dir) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("ssdtrain-io")]


_KILLED = textwrap.dedent("""
    import sys, time, torch, ssdtrain
    off = ssdtrain.Offloader(path=sys.argv[1], min_bytes=0)
    x = torch.randn(512, 512, requires_grad=True)
    with off:
        h = x
        for i in range(20):
            h = (h * 1.01).tanh()
        off.wait()
        if sys.argv[2] == "forward":
            print("ready", off.stats().written_bytes, flush=True)
            time.sleep(60)
        loss = h.sum()
    def hook(g):
        print("ready", off.stats().written_bytes, flush=True)
        time.sleep(60)
        return g
    h.register_hook(hook)
    loss.backward()
""")


@pytest.mark.parametrize("when", ["forward", "backward"])
def test_sigkill_leaves_nothing(off_dir, when):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(off_dir), when], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("ready") and int(line.split()[1]) > 0, line
        assert list(off_dir.iterdir()) == []
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert list(off_dir.iterdir()) == []  # no directory, no file, no bytes


_CONSTRUCTING = textwrap.dedent("""
    import json, os, random, shutil, signal, sys, time
    import ssdtrain
    d, trials = sys.argv[1], int(sys.argv[2])
    ssdtrain.Offloader(path=d, backend="posix").close()  # imports done before the first fork
    rng = random.Random(int(sys.argv[3]))
    left = []
    for trial in range(trials):
        pid = os.fork()
        if pid == 0:  # constructs and closes offloaders until it is killed
            try:
                while True:
                    ssdtrain.Offloader(path=d, backend="posix").close()
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.002, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        names = os.listdir(d)
        if names:
            left.append(names)
            for n in names:
                shutil.rmtree(os.path.join(d, n), ignore_errors=True)
    print(json.dumps(left), flush=True)
""")


def test_sigkill_while_constructing_leaves_nothing(off_dir):
    # Killed at a random moment of constructing or closing an Offloader (direct_io auto: the
    # O_DIRECT test write included), 50 times: nothing may stay under the path.
    out = subprocess.run([sys.executable, "-c", _CONSTRUCTING, str(off_dir), "50", str(os.getpid())],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    assert list(off_dir.iterdir()) == []


def test_the_model_does_not_keep_the_offloader_alive(off_dir):
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)]))
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0)
    assert len(off._blocks) == 3
    del off
    gc.collect()
    assert _arena_fds(off_dir) == []  # closed by its finalizer
    assert not model[0][0]._forward_pre_hooks and not model[0][0]._forward_hooks  # hooks removed
