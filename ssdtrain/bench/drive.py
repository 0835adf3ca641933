"""The bench's drive: its raw bandwidth (the probe), and a speed limit set with ``--drive-gbps``.

Two ways to limit the drive, chosen by ``--throttle``:

* ``cgroup`` - a blkio cgroup (v1) capping ``read_bps_device`` and ``write_bps_device`` of the
  block device under each offload path; the bench process moves into it for the run and back
  to its own group after, and the group is removed. Needs root and a writable
  ``/sys/fs/cgroup/blkio``. The cap applies to the drive itself, but only to I/O the kernel
  charges to the process: O_DIRECT requests (what the posix backend sends), not buffered
  writeback. Baseline does no I/O, so the whole process can go in.
* ``backend`` - :class:`ssdtrain.store.throttle.ThrottledBackend` around the offloader's
  backend: each direction is a virtual drive of that speed, on any machine.

``auto`` takes the cgroup where it can, else the backend. With several offload paths the limit
is their total (each of k devices gets 1/k of it under the cgroup).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from typing import Any

from ssdtrain.bench._progress import Progress

__all__ = ["BLKIO", "THROTTLES", "BlkioGroup", "DriveLimit", "blkio_device", "choose_limit", "drive_rates", "limited",
           "make_store", "probe"]

BLKIO = "/sys/fs/cgroup/blkio"
GB = 1e9
THROTTLES = ("auto", "cgroup", "backend")


def probe(paths: list[str], size: int, progress: bool | None) -> dict:
    """Raw drive bandwidth of the offload paths (summed over paths), or why not."""
    drive: dict[str, Any] = {"paths": paths, "write_gbps": None, "read_gbps": None}
    try:
        from ssdtrain.tools.probe import probe_path
    except ImportError as exc:
        drive["error"] = f"probe unavailable: {exc}"
        return drive
    results = []
    for path in paths:
        os.makedirs(path, exist_ok=True)
        bar = Progress(total=size, label=f"probe {path}", enabled=progress)

        def show(phase: str, done: int, total: int, bar: Progress = bar) -> None:
            bar.total = total  # one bar per phase (the probe's phases have their own totals)
            bar.set(done, phase)

        try:
            results.append(probe_path(path, size_bytes=size, progress=show))
        except (OSError, ValueError) as exc:
            drive["error"] = f"probe of {path} failed: {exc}"
            return drive
        finally:
            bar.close()
    drive["write_gbps"] = sum(r.write_gbps for r in results)
    drive["read_gbps"] = sum(r.read_gbps for r in results)
    drive["probe"] = [r.as_dict() for r in results]
    drive["warnings"] = [w for r in results for w in r.warnings]
    return drive


@dataclass(frozen=True)
class DriveLimit:
    """The speed the offload modes' drive is limited to, and how."""

    gbps: float
    """Each way (write and read), in GB/s (10^9 bytes/s), over all offload paths."""
    method: str
    """``"cgroup"`` or ``"backend"``."""
    devices: tuple[str, ...] = ()
    """``major:minor`` of the block devices the cgroup caps."""
    why: str = ""
    """Why ``auto`` did not take the cgroup (empty when it did, or was not asked)."""

    def describe(self) -> str:
        if self.method == "cgroup":
            return (f"{self.gbps:g} GB/s each way, by a blkio cgroup (read_bps and write_bps of "
                    f"{', '.join(self.devices)}; O_DIRECT I/O only)")
        return f"{self.gbps:g} GB/s each way, in the backend (ssdtrain.store.throttle)" + (
            f"; no cgroup: {self.why}" if self.why else "")

    def as_dict(self) -> dict:
        return {"gbps": self.gbps, "method": self.method, "devices": list(self.devices), "why": self.why}


def blkio_device(path: str) -> str | None:
    """``major:minor`` of the whole block device holding ``path``; None when it is on none
    (tmpfs, overlay, a network filesystem). A ``path`` not made yet (the Offloader makes it) is
    on the device of its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    dev = os.stat(path).st_dev
    node = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if os.major(dev) == 0 or not os.path.exists(node):
        return None
    if os.path.exists(os.path.join(node, "partition")):  # blkio caps whole disks, not partitions
        node = os.path.dirname(os.path.realpath(node))
    with open(os.path.join(node, "dev")) as f:
        return f.read().strip()


def _cgroup_unavailable(paths: list[str]) -> tuple[str | None, tuple[str, ...]]:
    """(why the cgroup cannot be used or None, the devices it would cap)."""
    if os.geteuid() != 0:
        return "not root", ()
    if not os.path.exists(os.path.join(BLKIO, "blkio.throttle.write_bps_device")):
        return f"no cgroup v1 blkio controller at {BLKIO}", ()
    if not os.access(BLKIO, os.W_OK):
        return f"{BLKIO} is not writable", ()
    devices = []
    for path in paths:
        dev = blkio_device(path)
        if dev is None:
            return f"{path} is not on a block device", ()
        devices.append(dev)
    return None, tuple(sorted(set(devices)))


def choose_limit(paths: list[str], gbps: float, throttle: str = "auto") -> DriveLimit:
    """The limit for ``--drive-gbps gbps --throttle throttle``; raises ValueError when
    ``throttle="cgroup"`` cannot be had, saying why."""
    if throttle not in THROTTLES:
        raise ValueError(f"--throttle must be one of {', '.join(THROTTLES)}, got {throttle!r}")
    if not gbps > 0:
        raise ValueError(f"--drive-gbps must be a positive number of GB/s, got {gbps!r}")
    if throttle == "backend":
        return DriveLimit(gbps, "backend")
    why, devices = _cgroup_unavailable(paths)
    if why is None:
        return DriveLimit(gbps, "cgroup", devices)
    if throttle == "cgroup":
        raise ValueError(f"--throttle cgroup: {why}; use --throttle backend")
    return DriveLimit(gbps, "backend", why=why)


def drive_rates(drive: dict, limit: DriveLimit | None) -> tuple[float | None, float | None]:
    """The write and read GB/s the offload modes' drive has: the raw probe's figures, or the
    limit (the slower of the two where both are known)."""
    w, r = drive.get("write_gbps"), drive.get("read_gbps")
    if limit is None:
        return w, r
    return (limit.gbps if w is None else min(w, limit.gbps), limit.gbps if r is None else min(r, limit.gbps))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _own_group() -> str:
    """This process's blkio cgroup, relative to the hierarchy's root ("/" for the root)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, group = line.rstrip("\n").split(":", 2)
            if "blkio" in controllers.split(","):
                return group
    return "/"


class BlkioGroup:
    """Runs the process in a blkio cgroup whose devices read and write at most ``bps`` each
    (``with BlkioGroup(devices, bps):``); on exit the process goes back to its own group and
    the new one is removed."""

    def __init__(self, devices: tuple[str, ...], bps: int, *, root: str = BLKIO) -> None:
        self.devices, self.bps, self.root = devices, int(bps), root
        self.dir = os.path.join(root, f"ssdtrain-bench-{os.getpid()}")
        self._origin = "/"

    def __enter__(self) -> BlkioGroup:
        _remove_stale_groups(self.root)
        self._origin = _own_group()
        os.mkdir(self.dir)
        try:
            for dev in self.devices:
                for kind in ("read", "write"):
                    _write(os.path.join(self.dir, f"blkio.throttle.{kind}_bps_device"), f"{dev} {self.bps}")
            _write(os.path.join(self.dir, "cgroup.procs"), str(os.getpid()))  # every thread moves
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            _write(os.path.join(self.root, self._origin.lstrip("/"), "cgroup.procs"), str(os.getpid()))
        finally:
            self._remove()

    def _remove(self) -> None:
        for _ in range(50):  # a thread still on its way out keeps the group busy for a moment
            try:
                os.rmdir(self.dir)
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.02)


def _remove_stale_groups(root: str) -> None:
    """Groups left by bench runs that were killed: empty ones whose process is gone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if not name.startswith("ssdtrain-bench-"):
                continue
            pid = name.rsplit("-", 1)[-1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(root, name))


def limited(limit: DriveLimit | None):
    """A context in which the drive is limited as ``limit`` says (the cgroup's part; the
    backend's is built into each offloader by :func:`make_store`)."""
    if limit is None or limit.method != "cgroup":
        return contextlib.nullcontext()
    return BlkioGroup(limit.devices, limit.gbps * GB / len(limit.devices))


def make_store(config, limit: DriveLimit | None):
    """The backend an offloader of ``config`` should use under ``limit``: a throttled one for
    the backend method, else None (the offloader makes its own)."""
    if limit is None or limit.method != "backend":
        return None
    from ssdtrain.store import make_backend
    from ssdtrain.store.throttle import ThrottledBackend

    bps = limit.gbps * GB
    return ThrottledBackend(make_backend(config), write_bps=bps, read_bps=bps)
