"""``ssdtrain probe``: the raw sequential bandwidth of a storage path, the yardstick for offloading.

Writes ``size_bytes`` to a private temporary file in large aligned blocks with several requests in
flight, writes it again (the figure reported: offloading overwrites the same arena space step
after step, while a first write also pays for block allocation, reported apart), then reads it
back, with the page cache out of the way (``O_DIRECT``; when the filesystem
refuses it, buffered I/O with ``fsync`` and the cache dropped, and a warning). Also reports the
filesystem type, free space and capacity, and warns when a path is RAM-backed or on the network.
Where a CUDA device is present it also measures the host tier's yardstick: copies between the
device and pinned host memory, each way and both at once (``host_rates``; ``--no-host`` skips it).

The file lives in a fresh ``0700`` directory, is created ``O_EXCL`` with mode ``0600`` and is
unlinked (and the directory removed) right after it is opened: nothing is left behind, even if
the probe is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence

from ssdtrain.store import _fs, endurance

__all__ = ["ProbeResult", "probe_path", "main"]

Progress = Callable[[str, int, int], None]
"""``progress(phase, done_bytes, total_bytes)``; phase is ``"alloc"`` (first write), ``"write"``
or ``"read"``."""

GB = 1e9


@dataclasses.dataclass
class ProbeResult:
    """What :func:`probe_path` measured on one path. Bandwidths are in GB/s (10^9 bytes/s)."""

    path: str
    fs_type: str
    direct_io: bool
    """Whether the figures are O_DIRECT ones (False: buffered I/O with fsync, cache dropped)."""
    write_gbps: float
    """Overwriting the file: the steady state of an offload arena."""
    read_gbps: float
    free_bytes: int
    total_bytes: int
    warnings: list[str] = dataclasses.field(default_factory=list)
    drive_writes_per_day: float | None = None
    """Drive writes per day (of ``total_bytes``) at the write rate given to the probe."""
    size_bytes: int = 0
    block_bytes: int = 0
    threads: int = 0
    write_seconds: float = 0.0
    read_seconds: float = 0.0
    first_write_gbps: float = 0.0
    """Writing the file the first time, blocks being allocated (fresh arena space)."""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def probe_path(
    path: str | os.PathLike,
    *,
    size_bytes: int = 256 << 20,
    block_bytes: int = 8 << 20,
    threads: int = 4,
    write_rate: float | None = None,
    progress: Progress | None = None,
) -> ProbeResult:
    """Measures raw sequential write and read bandwidth of the directory ``path``.

    Args:
        path: an existing, writable directory on the drive to measure.
        size_bytes: bytes written then read (rounded down to whole blocks; reduced to half the
            free space, with a warning, when the drive is nearly full).
        block_bytes: size of one request (a multiple of 4096).
        threads: requests in flight.
        write_rate: bytes per second a training run would write; fills in
            ``drive_writes_per_day``.
        progress: called from this thread as the measurement advances.

    Raises:
        FileNotFoundError, NotADirectoryError, PermissionError: ``path`` is not a writable
            directory.
        ValueError: a size or count is out of range.
        OSError: not enough free space, or an I/O error.
    """
    if block_bytes < 4096 or block_bytes % 4096:
        raise ValueError(f"block_bytes={block_bytes} must be a positive multiple of 4096 (e.g. 8MiB)")
    if size_bytes < block_bytes:
        raise ValueError(f"size_bytes={size_bytes} must be at least one block ({block_bytes} bytes)")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    directory = os.path.abspath(os.fspath(path))
    if not os.path.exists(directory):
        raise FileNotFoundError(f"{directory}: no such directory; create it or give another path")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory}: not a directory; give the directory to store activations in")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f"{directory}: not writable by this user; give a writable directory")

    warnings: list[str] = []
    fs = _fs.fs_type(directory)
    if fs in _fs.RAM_FS:
        warnings.append(
            f"{directory} is on {fs}, which lives in RAM: offloading there frees no memory, "
            "and these figures are memory speed, not a drive's"
        )
    elif _fs.is_network_fs(directory):
        warnings.append(
            f"{directory} is on {fs}, a network filesystem: bandwidth and latency are the "
            "network's; prefer a local NVMe drive"
        )
    free, total = _fs.free_bytes(directory), _fs.total_bytes(directory)
    size = size_bytes // block_bytes * block_bytes
    if size > free // 2:
        size = (free // 2) // block_bytes * block_bytes
        if size < block_bytes:
            raise OSError(f"{directory}: only {free} bytes free; the probe needs at least {2 * block_bytes}")
        warnings.append(f"{directory} is nearly full: measured {size} bytes instead of {size_bytes}")

    fd, direct = _open_private(directory)
    try:
        if not direct:
            warnings.append(
                f"{directory} ({fs}) refuses O_DIRECT: measured buffered I/O with fsync and the "
                "page cache dropped; the offloader will also run buffered there"
            )
        nblocks = size // block_bytes
        first_s = _run(fd, nblocks, block_bytes, threads, write=True, direct=direct, progress=progress,
                       phase="alloc")
        write_s = _run(fd, nblocks, block_bytes, threads, write=True, direct=direct, progress=progress)
        read_s = _run(fd, nblocks, block_bytes, threads, write=False, direct=direct, progress=progress)
    finally:
        os.close(fd)

    return ProbeResult(
        path=directory,
        fs_type=fs,
        direct_io=direct,
        write_gbps=size / write_s / GB,
        read_gbps=size / read_s / GB,
        free_bytes=free,
        total_bytes=total,
        warnings=warnings,
        drive_writes_per_day=(endurance.drive_writes_per_day(write_rate, total) if write_rate else None),
        size_bytes=size,
        block_bytes=block_bytes,
        threads=threads,
        write_seconds=write_s,
        read_seconds=read_s,
        first_write_gbps=size / first_s / GB,
    )


def _open_private(directory: str) -> tuple[int, bool]:
    """An anonymous read-write file on ``directory``'s filesystem, and whether it is O_DIRECT."""
    private = tempfile.mkdtemp(prefix=".ssdtrain-probe-", dir=directory)  # mode 0700
    name = os.path.join(private, "probe")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        direct = _fs.direct_io_supported(private)
        fd = os.open(name, flags | (os.O_DIRECT if direct else 0), 0o600)
    finally:
        # The open descriptor keeps the file alive; the name and the directory go at once.
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
        os.rmdir(private)
    return fd, direct


RING_BLOCKS = 32
"""Distinct memory blocks the requests cycle through (see Note [probe memory])."""


# Note [probe memory]
# Requests move data from and to a ring of distinct, pre-faulted blocks (up to RING_BLOCKS),
# not one buffer per thread: on virtual machines, DMA into memory that the previous request
# just used measured up to a third slower, while the offloader always moves distinct tensors.
# The ring is faulted in before the clock starts: the yardstick is the drive, not page faults.
def _run(fd: int, nblocks: int, block: int, threads: int, *, write: bool, direct: bool,
         progress: Progress | None, phase: str | None = None) -> float:
    """One sequential pass over ``nblocks`` blocks; returns the seconds it took."""
    lock = threading.Lock()
    state = {"next": 0, "done": 0, "error": None}
    phase = phase or ("write" if write else "read")
    total = nblocks * block
    ring = max(min(nblocks, RING_BLOCKS), min(threads, nblocks))
    mem = _fs.aligned_buffer(ring * block)
    view = memoryview(mem)
    if write:
        view[:block] = os.urandom(block)
        for k in range(1, ring):
            view[k * block:(k + 1) * block] = view[:block]
    else:
        head = ctypes.c_char.from_buffer(mem)
        ctypes.memset(ctypes.addressof(head), 0, len(mem))  # fault the ring in
        del head

    def worker() -> None:
        try:
            while True:
                with lock:
                    i = state["next"]
                    if i >= nblocks or state["error"] is not None:
                        return
                    state["next"] = i + 1
                slot = view[(i % ring) * block:(i % ring + 1) * block]
                if write:
                    # A distinct first word per block: no drive can deduplicate the pass away.
                    slot[:8] = i.to_bytes(8, "little")
                    _pwrite_all(fd, slot, i * block)
                else:
                    _pread_all(fd, slot, i * block)
                slot.release()
                with lock:
                    state["done"] += block
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            with lock:
                state["error"] = e

    pool = [threading.Thread(target=worker, name=f"ssdtrain-probe-{i}", daemon=True)
            for i in range(min(threads, nblocks))]
    if progress:
        progress(phase, 0, total)
    start = time.perf_counter()
    for t in pool:
        t.start()
    try:
        while alive := [t for t in pool if t.is_alive()]:
            alive[0].join(0.1)
            if progress:
                progress(phase, state["done"], total)
        if state["error"] is None and write:
            os.fsync(fd)  # O_DIRECT writes are on the drive; this also covers the metadata
        elapsed = time.perf_counter() - start
    finally:
        for t in pool:
            t.join()
        view.release()
        mem.close()
    if state["error"] is not None:
        raise state["error"]
    if write and not direct and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read pass must hit the drive
    if progress:
        progress(phase, total, total)
    return max(elapsed, 1e-9)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"short write at offset {offset + done}")
        done += n


def _pread_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"unexpected end of file at offset {offset + done}")
        done += n


# --- command line ----------------------------------------------------------------------------

class _Bar:
    """A one-line progress bar on a terminal; silent when the stream is not one."""

    def __init__(self, stream, label: str, enabled: bool | None = None) -> None:
        self.stream = stream
        self.label = label
        self.enabled = stream.isatty() if enabled is None else enabled
        self._last = ""

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total if total else 1.0
        width = 30
        filled = int(frac * width)
        line = f"\r{self.label} {phase:<5} [{'#' * filled}{'.' * (width - filled)}] {frac:4.0%}"
        if line != self._last:
            self.stream.write(line)
            self.stream.flush()
            self._last = line

    def finish(self) -> None:
        if self.enabled and self._last:
            self.stream.write("\r" + " " * (len(self._last) - 1) + "\r")
            self.stream.flush()


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def format_table(results: Sequence[ProbeResult]) -> str:
    """The human-readable table ``ssdtrain probe`` prints."""
    head = ("path", "fs", "O_DIRECT", "write GB/s", "read GB/s", "first write", "free", "capacity", "DWPD")
    rows = [head]
    for r in results:
        rows.append((
            r.path, r.fs_type, "yes" if r.direct_io else "no", f"{r.write_gbps:.2f}", f"{r.read_gbps:.2f}",
            f"{r.first_write_gbps:.2f}", _gib(r.free_bytes), _gib(r.total_bytes),
            "-" if r.drive_writes_per_day is None else f"{r.drive_writes_per_day:.2f}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    for r in results:
        lines += [f"warning: {w}" for w in r.warnings]
    return "\n".join(lines)


def host_rates(size_bytes: int = 256 << 20, repeats: int = 3) -> dict:
    """Copy rates between the current CUDA device and pinned host memory, GB/s: device to host,
    host to device, and each way while both run (two side streams); the best of ``repeats``,
    timed with events. ``{"device": None, "why": ...}`` where there is no CUDA device."""
    import torch

    from ssdtrain.device.measure import timed_copies

    if not torch.cuda.is_available():
        return {"device": None, "why": "no CUDA device"}
    dev = torch.device("cuda", torch.cuda.current_device())
    host = torch.empty(2 * size_bytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(2 * size_bytes, dtype=torch.uint8, device=dev)
    streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
    lo, hi = slice(0, size_bytes), slice(size_bytes, 2 * size_bytes)
    d2h = timed_copies([(streams[0], host[lo], gpu[lo])], repeats)
    h2d = timed_copies([(streams[0], gpu[lo], host[lo])], repeats)
    both = timed_copies([(streams[0], host[lo], gpu[lo]), (streams[1], gpu[hi], host[hi])], repeats)
    return {"device": torch.cuda.get_device_name(dev), "size_bytes": size_bytes, "repeats": repeats,
            "d2h_gbps": size_bytes / d2h / GB, "h2d_gbps": size_bytes / h2d / GB,
            "both_ways_gbps_each": size_bytes / both / GB}


def format_host(host: dict) -> str:
    if host.get("device") is None:
        return f"host tier: copy rates not measured ({host.get('why', 'skipped')})"
    return (f"host tier: {host['device']}: device to host {host['d2h_gbps']:.1f} GB/s, host to device "
            f"{host['h2d_gbps']:.1f} GB/s, {host['both_ways_gbps_each']:.1f} GB/s each way at once (pinned, "
            f"{host['size_bytes'] >> 20} MiB copies, best of {host['repeats']}); `ssdtrain plan --host-gbps` takes the lower")


def _parser() -> argparse.ArgumentParser:
    from ssdtrain.config import parse_bytes

    def size(text: str) -> int:
        try:
            return parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    def rate(text: str) -> float | str:
        return "full" if text == "full" else float(size(text))

    p = argparse.ArgumentParser(
        prog="ssdtrain probe",
        description="Measure the raw sequential O_DIRECT write and read bandwidth of storage paths "
        "(the yardstick for offloading), their filesystem and free space.",
    )
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help="directories to measure (default: $SSDTRAIN_PATH, else the temporary directory)")
    p.add_argument("--size", type=size, default=256 << 20, help="bytes written then read per path (default 256MiB)")
    p.add_argument("--block", type=size, default=8 << 20, help="bytes per request (default 8MiB)")
    p.add_argument("--threads", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--write-rate", type=rate, default=None, metavar="RATE",
                   help="bytes per second a run writes (e.g. 2GB), or 'full' for the measured write "
                   "bandwidth: adds drive writes per day")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")
    p.add_argument("--no-host", action="store_true",
                   help="do not measure the copy rates between a CUDA device and pinned host memory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.paths:
        paths = args.paths
    else:
        from ssdtrain.config import _default_paths

        paths = list(_default_paths())
    results: list[ProbeResult] = []
    failed = False
    for path in paths:
        bar = _Bar(sys.stderr, os.path.basename(os.path.abspath(path)) or path, enabled=None if not args.quiet else False)
        try:
            r = probe_path(path, size_bytes=args.size, block_bytes=args.block, threads=args.threads,
                           write_rate=None if args.write_rate == "full" else args.write_rate, progress=bar)
        except (OSError, ValueError) as e:
            bar.finish()
            print(f"ssdtrain probe: {path}: {e}", file=sys.stderr)
            failed = True
            continue
        bar.finish()
        if args.write_rate == "full":
            r.drive_writes_per_day = endurance.drive_writes_per_day(r.write_gbps * GB, r.total_bytes)
        results.append(r)
    host = {"device": None, "why": "--no-host"} if args.no_host else host_rates()
    if results and not args.quiet and args.json != "-":
        print(format_table(results))
    if not args.quiet and args.json != "-":
        print(format_host(host))
    if args.json:
        doc = json.dumps({"results": [r.as_dict() for r in results], "host": host}, indent=2)
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(doc + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
