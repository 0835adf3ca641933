"""Note [an offloader does not cross a fork]: a forked child holds none of the arena's files and
gets a clear error, not a hang, when it uses the offloader."""

import json
import os
import signal
import time
import warnings

import pytest
import torch

import ssdtrain

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"),
                                reason="needs fork and /proc")


def _arena_links(pid, directory):
    """The descriptors of process ``pid`` on a file that lived under ``directory``."""
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            out.append(target)
    return out


def _fork(child):
    """Forks; the child runs ``child(write_end)`` and always exits. Returns (pid, read_end)."""
    r, w = os.pipe()
    with warnings.catch_warnings():  # Python >= 3.12 warns about forking with threads alive
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover (runs in the child)
        code = 1
        try:
            os.close(r)
            child(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _read_line(fd, timeout):
    """A line from the pipe, or None if none came within ``timeout`` seconds."""
    os.set_blocking(fd, False)
    data, deadline = b"", time.monotonic() + timeout
    while b"\n" not in data and time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        if not chunk:
            break
        data += chunk
    return data.decode().partition("\n")[0] if b"\n" in data else None


def _reap(pid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _with_data_on_disk(off_dir, **kw):
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0, when_full="wait", **kw)
    x = torch.randn(256, 256, requires_grad=True)
    with off.microbatch(0):
        loss = (x * 2).sigmoid().sum()
    off.wait()
    return off, loss


def test_a_forked_child_holds_no_arena_file(off_dir):
    off, loss = _with_data_on_disk(off_dir)
    assert off.stats().written_bytes > 0 and _arena_links(os.getpid(), off_dir)
    go_r, go_w = os.pipe()

    def child(w):
        os.close(go_w)
        os.write(w, b"forked\n")
        os.read(go_r, 1)  # holds on until the parent has closed

    pid, r = _fork(child)
    os.close(go_r)
    try:
        assert _read_line(r, 10) == "forked"
        assert _arena_links(pid, off_dir) == []  # closed in the child at the fork
        loss.backward()
        off.close()
        assert _arena_links(os.getpid(), off_dir) == []  # the last descriptor: the blocks are free
    finally:
        os.write(go_w, b"x")
        os.close(go_w)
        os.close(r)
        assert _reap(pid) == 0


@pytest.mark.parametrize("backend", ["posix", "memory"])
def test_using_it_in_a_forked_child_fails_clearly(off_dir, backend):
    off, loss = _with_data_on_disk(off_dir, backend=backend)
    store = off._backend
    extent = store.allocate(4096)
    store.submit_write(extent, torch.zeros(4096, dtype=torch.uint8)).result()
    parent = os.getpid()

    def child(w):
        src = torch.zeros(4096, dtype=torch.uint8)
        calls = {
            "allocate": lambda: store.allocate(4096),
            "submit_write": lambda: store.submit_write(extent, src).result(),
            "submit_read": lambda: store.submit_read(extent, src).result(),
            "free": lambda: store.free(extent),
        }
        errors = {}
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except RuntimeError as e:
                errors[name] = str(e)
        store.close()  # returns at once: nothing to wait for here
        os.write(w, (json.dumps(errors) + "\n").encode())

    pid, r = _fork(child)
    try:
        line = _read_line(r, 10)
    finally:
        os.close(r)
        code = _reap(pid)
    assert line is not None, "the child hung using an offloader made before the fork"
    assert code == 0
    for name, message in json.loads(line).items():
        assert message is not None, f"{name} worked in a forked child"
        assert f"created in process {parent}" in message and "forked child" in message
        assert "Create a new Offloader in the child" in message
    store.free(extent)  # the parent's offloader is untouched
    loss.backward()
    off.close()
    assert list(off_dir.iterdir()) == []


class _Probe(torch.utils.data.Dataset):
    def __init__(self, off, directory):
        self.off, self.directory = off, directory

    def __len__(self):
        return 1

    def __getitem__(self, i):
        try:
            self.off._backend.allocate(4096)
            error = ""
        except RuntimeError as e:
            error = str(e)
        return json.dumps({"links": _arena_links(os.getpid(), self.directory), "error": error})


def test_dataloader_worker_started_while_offloading(off_dir):
    off, loss = _with_data_on_disk(off_dir)
    loader = torch.utils.data.DataLoader(_Probe(off, str(off_dir)), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork", timeout=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        (item,) = list(loader)
    seen = json.loads(item)
    assert seen["links"] == []
    assert "forked child" in seen["error"]
    loss.backward()
    off.close()
