"""kvikio (cuFile): GPUDirect Storage for CUDA tensors where it is really in use.

One arena file per path, opened as a ``kvikio.CuFile`` (which keeps a buffered and an O_DIRECT
descriptor). How a CUDA tensor moves depends on what this machine can do (:func:`gds_status`):

* **GDS** (the ``nvidia_fs`` driver is loaded, kvikio is not in compatibility mode, the file
  system is one GDS serves): the drive DMAs straight to and from device memory. With a cuFile
  configuration file present the requests go on this I/O thread's own stream through cuFile's
  stream API (Note [GDS without a default-stream barrier]); otherwise through ``pread``/``pwrite``.
* **compat** (no GDS): the tensor is staged through a pinned, page-aligned buffer of the I/O
  thread with copies on ssdtrain's own side stream, and kvikio moves host memory (Note [kvikio
  compat mode serialises with compute]).

Host tensors take whole-page windows (Note [zero-copy direct I/O] in ``_hostbuf.py``) so that
kvikio can use O_DIRECT without its bounce-buffer copy.

``backend="auto"`` picks this backend only for GDS (``ssdtrain/store/__init__.py``); asked for by
name it also runs in compat mode, and :meth:`KvikioBackend.describe` says which mode and why.

kvikio's settings are process-wide. The backend raises ``num_threads`` to at least
``io_threads x len(path)`` (never lowers it), passes ``chunk_bytes`` as each call's task size,
and sets ``auto_direct_io_read``/``auto_direct_io_write`` to follow ``direct_io`` (on unless
``direct_io=False``). kvikio needs the CUDA driver library (``libcuda.so.1``) for any I/O, even
on host memory; with a driver but no usable GPU it serves host memory through POSIX I/O.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import zlib
from collections.abc import Callable
from concurrent.futures import Future

import torch

MISSING = "kvikio is not installed; pip install 'ssdtrain[kvikio]'"

try:
    import kvikio
    import kvikio.defaults
except ModuleNotFoundError as e:
    if e.name in ("kvikio", "kvikio.defaults"):
        raise ImportError(MISSING) from None
    raise ImportError(f"kvikio is installed but cannot be imported ({e}); reinstall it for this machine's CUDA: "
                      "pip install 'ssdtrain[kvikio]' (CUDA 13) or 'ssdtrain[kvikio-cu12]'") from e
except (ImportError, OSError) as e:  # a library it links against is missing or does not match
    raise ImportError(f"kvikio is installed but cannot be imported ({e}); reinstall it for this machine's CUDA: "
                      "pip install 'ssdtrain[kvikio]' (CUDA 13) or 'ssdtrain[kvikio-cu12]'") from e

from ssdtrain.device import cuda as device
from ssdtrain.config import OffloadConfig
from ssdtrain.store import _fs
from ssdtrain.store._arena import Arena, ArenaBackend, open_unnamed
from ssdtrain.store._hostbuf import lead_of, raw_view, windows
from ssdtrain.store._pool import IOPool
from ssdtrain.store.base import ChecksumError, Extent, StorageError, align_up

__all__ = ["KvikioBackend", "gds_status", "MIN_VERSION"]

log = logging.getLogger(__name__)

MIN_VERSION = (25, 12)
"""``auto_direct_io_read``/``auto_direct_io_write`` and ``CuFile.is_direct_io_supported`` came in 25.12."""


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


if _version(getattr(kvikio, "__version__", "0.0")) < MIN_VERSION:
    raise ImportError(f"kvikio {getattr(kvikio, '__version__', '?')} is too old: ssdtrain needs kvikio 25.12 or newer "
                      "(auto_direct_io_read/write, CuFile.is_direct_io_supported); pip install -U 'ssdtrain[kvikio]'")

GDS_FILESYSTEMS = frozenset({"ext4", "xfs", "lustre", "wekafs", "gpfs", "beegfs", "nfs", "nfs4"})
"""File systems GPUDirect Storage serves (local NVMe: ext4 and xfs; the rest: distributed ones
with GDS support). On others cuFile either refuses or copies through its bounce buffers."""


# Note [kvikio compat mode serialises with compute]
# Without GDS (no nvidia_fs driver: most cloud GPUs), kvikio moves device memory through a pinned
# bounce buffer and copies it on a stream of its own per thread (``StreamCachePerThreadAndContext``
# in kvikio's detail/stream.cpp), created with ``CU_STREAM_DEFAULT`` -- a *blocking* stream -- and
# synchronised after each copy (detail/posix_io.cpp). A blocking stream and the legacy default
# stream, where torch computes unless told otherwise, wait for each other: every copy waits for
# all compute queued before it, and the kernels queued after it wait for the copy. cuFile's own
# compatibility mode (nvidia_fs missing, ``allow_compat_mode``) is no better. So ``auto`` picks
# kvikio only with GDS, and this backend in compat mode never hands kvikio device memory: it
# stages CUDA tensors itself, on a non-blocking stream of its own (``device.side_stream``).
def gds_status() -> tuple[bool, str]:
    """Whether CUDA tensors can move by GPUDirect Storage here, and why (or why not)."""
    try:
        if kvikio.defaults.is_compat_mode_preferred():
            if kvikio.defaults.get("compat_mode") == kvikio.CompatMode.ON:
                return False, "kvikio's compatibility mode is on (KVIKIO_COMPAT_MODE)"
            return False, ("kvikio found no usable cuFile (libcufile missing, /run/udev unreadable, or WSL): "
                           "compatibility mode")
        from kvikio import cufile_driver

        if not cufile_driver.get("is_gds_available"):
            return False, "the nvidia_fs driver is not loaded (cuFile would only copy through bounce buffers)"
        major, minor = cufile_driver.get("major_version"), cufile_driver.get("minor_version")
    except (RuntimeError, OSError, AttributeError, KeyError) as e:
        return False, f"the cuFile driver cannot be queried ({e})"
    return True, f"GPUDirect Storage (nvidia_fs {major}.{minor})"


def _cufile_config() -> str | None:
    """cuFile's configuration file, where kvikio looks for it (its stream API needs one)."""
    env = os.environ.get("CUFILE_ENV_PATH_JSON")
    if env and os.path.exists(env):
        return env
    return "/etc/cufile.json" if os.path.exists("/etc/cufile.json") else None


def _settings(cfg: OffloadConfig) -> dict:
    want = {"auto_direct_io_read": cfg.direct_io is not False, "auto_direct_io_write": cfg.direct_io is not False}
    threads = cfg.io_threads * len(cfg.paths)
    if kvikio.defaults.get("num_threads") < threads:
        want["num_threads"] = threads
    return want


class _Arena(Arena):
    """An arena file opened by kvikio (cuFile)."""

    def __init__(self, index: int, path: str, cfg: OffloadConfig, gds: bool) -> None:
        from ssdtrain.store.posix import prepare_dir

        super().__init__(index, path)
        self.created = prepare_dir(path, create=cfg.create_path)
        try:
            fd = open_unnamed(path)  # Note [nothing left on disk] (in _arena.py)
        except OSError as e:
            _fs.remove_dirs(self.created)
            raise ValueError(f"cannot create a file in path={path!r} ({e.strerror}); "
                             "choose a directory you can write to") from e
        self.gds, self.why = gds, ""
        try:
            # kvikio opens by name: the unnamed file's /proc link (it opens it twice, with and
            # without O_DIRECT).
            name = f"/proc/self/fd/{fd}"
            if gds:
                fs = _fs.fs_type(path)
                if fs not in GDS_FILESYSTEMS:
                    self.gds, self.why = False, f"{path} is on {fs}, which GPUDirect Storage does not serve"
            if self.gds:
                self.file = self._open_gds(name)
            if not self.gds:
                self.file = kvikio.CuFile(name, "r+")
        except (RuntimeError, OSError) as e:
            _fs.remove_dirs(self.created)
            raise ValueError(f"kvikio cannot open a file in path={path!r}: {e}") from e
        finally:
            os.close(fd)
        self.direct = cfg.direct_io is not False and self.file.is_direct_io_supported()
        self.pool = IOPool(cfg.io_threads, f"ssdtrain-kvikio{index}")
        # Reads have their own threads: backward waits on them, so they never queue behind writes.
        self.read_pool = IOPool(cfg.io_threads, f"ssdtrain-kvikio{index}r")

    def _open_gds(self, name: str):
        """Opens with compatibility mode OFF, so that a file cuFile cannot register fails here
        instead of silently taking kvikio's POSIX path; such a file is opened in compat mode."""
        try:
            with kvikio.defaults.set("compat_mode", kvikio.CompatMode.OFF):
                return kvikio.CuFile(name, "r+")
        except RuntimeError as e:
            self.gds, self.why = False, f"cuFile cannot register the arena file on {self.path}: {e}"
            return None

    def error(self, what: str, nbytes: int, offset: int, e: BaseException) -> StorageError:
        text = str(e)
        code = errno.ENOSPC if "No space left" in text else getattr(e, "errno", None) or errno.EIO
        hint = ("free space on the drive, add another path, or set on_error='keep'" if code == errno.ENOSPC
                else "check the drive (dmesg, smartctl) and the GDS setup (gdscheck)")
        return StorageError(code, f"kvikio {what} of {nbytes} bytes at offset {offset} in the ssdtrain arena on "
                            f"{self.path!r} failed: {text}; {hint}")

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.read_pool.shutdown(wait=True)
        self.file.close()


class KvikioBackend(ArenaBackend):
    """Files read and written by kvikio; CUDA tensors with GPUDirect Storage where it works."""

    name = "kvikio"

    def __init__(self, cfg: OffloadConfig) -> None:
        super().__init__(2 * cfg.prefetch_bytes)
        self.cfg = cfg
        self.task_size = cfg.chunk_bytes
        kvikio.defaults.set(_settings(cfg))
        gds, self.why = gds_status()
        self._open_arenas(cfg.paths, lambda i, p: _Arena(i, p, cfg, gds))
        refused = [a.why for a in self._arenas if not a.gds and a.why]
        if gds and refused:
            self.why = "; ".join(refused)
        self.stream_io = self.gds and _cufile_config() is not None

    @property
    def gds(self) -> bool:
        """Whether CUDA tensors move by GPUDirect Storage (``False``: staged through pinned memory)."""
        return bool(self._arenas) and all(a.gds for a in self._arenas)

    def _window(self, arena: _Arena, extent: Extent, t: torch.Tensor, lead: int) -> tuple[object, int]:
        """The host buffer kvikio moves and its size: whole pages (direct), else the payload."""
        if arena.direct:
            return raw_view(t, -lead, align_up(lead + extent.nbytes)), align_up(lead + extent.nbytes)
        return raw_view(t, 0, extent.nbytes), extent.nbytes

    # -- writes ---------------------------------------------------------------------------------
    def submit_write(self, extent: Extent, src: torch.Tensor, *, checksum: bool = False,
                     ready: Callable[[], None] | None = None) -> Future:
        self._check_process()
        arena = self._arenas[extent.path_index]
        on_gpu = device.is_cuda(src)
        lead = lead_of(src) if arena.direct and not on_gpu else 0  # device payloads start on a page
        with arena.lock:
            arena.queued += extent.nbytes
            arena.leads[extent.offset] = lead
        if not on_gpu:
            work = self._write_host
        elif arena.gds:
            work = self._write_gds
        else:
            work = self._write_staged
        fut = arena.pool.submit(work, arena, extent, src, lead, checksum, ready)
        fut.add_done_callback(lambda f: self._settle(arena, extent.nbytes, written=f.exception() is None))
        return fut

    def _write_host(self, arena: _Arena, extent: Extent, src: torch.Tensor, lead: int, checksum: bool,
                    ready: Callable[[], None] | None) -> int | None:
        if ready is not None:
            ready()
        buf, size = self._window(arena, extent, src, lead)
        self._move(arena, "write", buf, size, extent.offset, extent.nbytes)
        return zlib.crc32(raw_view(src, 0, extent.nbytes)) if checksum else None

    def _move(self, arena: _Arena, what: str, buf, size: int, offset: int, nbytes: int) -> None:
        """One kvikio pwrite/pread of ``size`` bytes, all of them or a StorageError."""
        call = arena.file.pwrite if what == "write" else arena.file.pread
        try:
            done = call(buf, size, offset, self.task_size).get()
        except (RuntimeError, OSError) as e:
            raise arena.error(what, nbytes, offset, e) from e
        if done != size:
            raise arena.error(what, nbytes, offset, OSError(errno.EIO, f"short {what}: {done} of {size} bytes"))

    # Note [GDS without a default-stream barrier]
    # kvikio's ``pread``/``pwrite`` on device memory synchronise the CUDA default stream before
    # every request (``sync_default_stream``, on by default and not exposed in Python;
    # FileHandle::pread in file_handle.cpp): a read-ahead issued while backward's kernels are queued
    # starts only once all of them ran. cuFile's stream API (``CuFile.raw_read_async``/
    # ``raw_write_async``) is ordered on a stream we choose instead: the request goes on this I/O
    # thread's side stream after the fence (``device.order``: the side stream waits for the
    # producer, or for the reload buffer's allocation point, on the device), and the thread then
    # waits for that stream alone. kvikio serves the stream API only when cuFile has a
    # configuration file (otherwise it falls back to a synchronous read with the barrier), so
    # without one the backend uses pread/pwrite and says so in describe().
    def _write_gds(self, arena: _Arena, extent: Extent, src: torch.Tensor, lead: int, checksum: bool,
                   ready: Callable[[], None] | None) -> int | None:
        n = extent.nbytes
        with device.on_device(src.device):
            if self.stream_io:
                self._stream_io(arena, "write", src, extent, ready)
            else:
                if ready is not None:
                    ready()
                self._move(arena, "write", src, n, extent.offset, n)
            return _device_crc(src, n) if checksum else None

    def _stream_io(self, arena: _Arena, what: str, t: torch.Tensor, extent: Extent,
                   ready: Callable[[], None] | None) -> None:
        stream = device.side_stream(t.device)
        device.order(ready, stream)
        call = arena.file.raw_write_async if what == "write" else arena.file.raw_read_async
        futures = []
        try:
            for _, _, p0, p1 in windows(extent.nbytes, 0, self.task_size, direct=False):
                futures.append((p1 - p0, call(t, stream.cuda_stream, p1 - p0, extent.offset + p0, p0)))
            device.synchronize(stream)
            for size, f in futures:
                done = f.check_bytes_done()
                if done != size:
                    raise OSError(errno.EIO, f"short {what}: {done} of {size} bytes")
        except (RuntimeError, OSError) as e:
            raise arena.error(what, extent.nbytes, extent.offset, e) from e

    def _write_staged(self, arena: _Arena, extent: Extent, src: torch.Tensor, lead: int, checksum: bool,
                      ready: Callable[[], None] | None) -> int | None:
        """Note [kvikio compat mode serialises with compute]: device to pinned host memory on our
        own stream, then kvikio writes host memory (whole pages: O_DIRECT)."""
        n, crc, after = extent.nbytes, 0, ready
        wins = list(windows(n, 0, self.task_size, direct=arena.direct))
        staged = device.staging(max(wn for _, wn, _, _ in wins))
        for w0, wn, p0, p1 in wins:
            device.copy_on_side_stream(staged[:p1 - p0], src[p0:p1], after=after)
            after = None
            if checksum:
                crc = zlib.crc32(raw_view(staged, 0, p1 - p0), crc)
            # Past the payload, the last window's pages carry stale staging bytes: never read as data.
            self._move(arena, "write", raw_view(staged, 0, wn), wn, extent.offset + w0, n)
        return crc if checksum else None

    # -- reads ----------------------------------------------------------------------------------
    def submit_read(self, extent: Extent, dst: torch.Tensor, *, checksum: object = None,
                    ready: Callable[[], None] | None = None) -> Future:
        self._check_process()
        arena = self._arenas[extent.path_index]
        if not device.is_cuda(dst):
            work = self._read_host
        elif arena.gds:
            work = self._read_gds
        else:
            work = self._read_staged
        fut = arena.read_pool.submit(work, arena, extent, dst, self._lead(extent), checksum, ready)
        self._count_read(arena, fut, extent.nbytes)
        return fut

    def _read_host(self, arena: _Arena, extent: Extent, dst: torch.Tensor, lead: int, crc: object,
                   ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        n = extent.nbytes
        in_place = not arena.direct or (
            lead_of(dst) == lead and _room_before(dst) >= lead and _room_after(dst) >= align_up(lead + n) - lead)
        if in_place:
            buf, size = self._window(arena, extent, dst, lead)
            offset = extent.offset
        else:
            # A buffer not from alloc_buffer: read the payload only (kvikio splits off what is
            # not page-aligned and moves it through its own bounce buffer).
            buf, size, offset = raw_view(dst, 0, n), n, extent.offset + lead
        self._move(arena, "read", buf, size, offset, n)
        if crc is not None and zlib.crc32(raw_view(dst, 0, n)) != crc:
            raise _mismatch(arena, extent)

    def _read_gds(self, arena: _Arena, extent: Extent, dst: torch.Tensor, lead: int, crc: object,
                  ready: Callable[[], None] | None) -> None:
        n = extent.nbytes
        with device.on_device(dst.device):
            if self.stream_io:
                self._stream_io(arena, "read", dst, extent, ready)
            else:
                if ready is not None:
                    ready()  # pread writes device memory off our streams: wait on the host
                self._move(arena, "read", dst, n, extent.offset, n)
            if crc is not None and _device_crc(dst, n) != crc:
                raise _mismatch(arena, extent)

    def _read_staged(self, arena: _Arena, extent: Extent, dst: torch.Tensor, lead: int, crc: object,
                     ready: Callable[[], None] | None) -> None:
        """Reads into two halves of the pinned staging buffer in turn; each half's copy to the
        device is queued on the side stream behind the fence (Note [reload waits for the
        allocation point] in device/cuda.py), so the drive keeps reading while the copies wait."""
        n, got = extent.nbytes, 0
        wins = list(windows(n, lead, self.task_size, direct=arena.direct))
        half = max(wn for _, wn, _, _ in wins)
        staged = device.staging(2 * half)
        with device.on_device(dst.device):
            stream = device.side_stream(dst.device)
            device.order(ready, stream)
            copied = [None, None]  # per half: the event after its last copy
            for k, (w0, wn, p0, p1) in enumerate(wins):
                buf = staged[(k % 2) * half:][:wn]
                if copied[k % 2] is not None:
                    copied[k % 2].synchronize()  # the copy out of this half is done
                self._move(arena, "read", raw_view(buf, 0, wn), wn, extent.offset + w0, n)
                s0 = p0 + lead - w0
                if crc is not None:
                    got = zlib.crc32(raw_view(buf, s0, p1 - p0), got)
                copied[k % 2] = device.queue_copy(dst[p0:p1], buf[s0:s0 + p1 - p0], stream, copied[k % 2])
            device.synchronize(stream)
        if crc is not None and got != crc:
            raise _mismatch(arena, extent)

    # -- bookkeeping --------------------------------------------------------------------------------
    def describe(self) -> str:
        if self.gds:
            how = ("stream-ordered cuFile I/O" if self.stream_io
                   else "pread/pwrite: each request first synchronises the default stream (no cuFile config file)")
            mode = f"GDS, {how}; {self.why}"
        else:
            mode = f"compat: {self.why}; CUDA tensors staged through pinned memory on ssdtrain's streams"
        return f"kvikio ({mode}): " + ", ".join(
            f"{a.path} ({'O_DIRECT' if a.direct else 'buffered'})" for a in self._arenas)


def _mismatch(arena: _Arena, extent: Extent) -> ChecksumError:
    return ChecksumError(errno.EIO, f"checksum mismatch reading {extent.nbytes} bytes at offset {extent.offset} of "
                         f"the arena on {arena.path!r}: the drive returned different bytes than were written")


def _room_before(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def _room_after(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() - _room_before(t)


def _device_crc(t: torch.Tensor, n: int) -> int:
    """CRC32 of the first ``n`` bytes of a CUDA tensor, through the thread's pinned staging
    buffer on its side stream: never ``.cpu()``, which would run on the default stream and wait
    for all compute queued there (and not be ordered after our side stream's work)."""
    crc, step = 0, 16 << 20
    staged = device.staging(min(step, n))
    for start in range(0, n, step):
        m = min(step, n - start)
        device.copy_on_side_stream(staged[:m], t[start:start + m])
        crc = zlib.crc32(raw_view(staged, 0, m), crc)
    return crc
