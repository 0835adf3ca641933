"""Huge pages for the activations ssdtrain writes from host memory (``host_allocator``).

Note [written tensors on huge pages]
A tensor written from host memory with O_DIRECT goes to the drive straight from its own pages
(Note [zero-copy direct I/O] in ``store/_hostbuf.py``). torch's CPU allocator hands out memory on
4 KiB pages, and a direct request over scattered 4 KiB pages carries one segment per page: a
1 MiB write is 256 segments. Where the disk takes few segments per request (a virtio disk
without indirect descriptors, measured on the machine this was built on: one request of 254
pages fills its whole queue) every write waits for the one before it, and each one wakes the
kernel's block worker on a core that is computing. Measured there on the bench model, per
step: 700 to 780 write requests and 540 to 630 worker wake-ups from 4 KiB pages, against 211 and
58 when the same tensors sit on 2 MiB pages (``THP_MEM_ALLOC_ENABLE=1``).

``THP_MEM_ALLOC_ENABLE`` is read once, when torch starts, and applies to the whole program.
So while an Offloader is active (the forward passes it wraps: where the tensors it writes are
allocated) ssdtrain puts its own CPU allocator in front of torch's, through torch's
``c10::SetCPUAllocator``: allocations of at least one huge page get the memory torch's own
option would give them (aligned to 2 MiB, ``MADV_HUGEPAGE``, reported to torch's memory
profiler), and smaller ones go to torch's allocator unchanged. Memory the C library hands out
again may sit on 4 KiB pages already, which ``MADV_HUGEPAGE`` does not change; ``MADV_COLLAPSE``
(Linux 6.1) moves such a range onto a huge page once. When the Offloader deactivates, torch's
allocator is back; tensors keep the memory they have. A freed block (whatever allocator is in
place when it is freed) is kept, up to ``IDLE_LIMIT`` bytes in all, and handed out again for an
allocation of its length, so that forward does not fault in and zero fresh pages for what was
freed a layer or a backward pass before (Note [reuse freed blocks] in the C++ source).
``trim()`` gives the kept blocks back and stops keeping more until the next forward; the
Offloader calls it when it closes.

The allocator is native code (``cuda_ext/ssdtrain_hostalloc.cpp``, about 250 lines),
compiled on first use against the installed torch with the system's C++ compiler (about a
second) and cached in ``~/.cache/ssdtrain`` under a key of the source, torch and compiler.
Without a compiler, on a kernel without transparent huge pages, or off Linux, ``"auto"``
leaves torch's allocator alone and says why in :func:`unavailable_reason`.

Environment:
    SSDTRAIN_HOST_ALLOCATOR   default of ``OffloadConfig.host_allocator``
    SSDTRAIN_NO_EXT=1         no native code: the allocator is neither built nor loaded
    CXX                       the compiler (default: ``g++``, else ``c++``)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from ssdtrain import _ext

__all__ = ["HUGE", "available", "unavailable_reason", "source_path", "library_path", "build", "use",
           "release", "installed", "counters", "trim"]

log = logging.getLogger(__name__)

HUGE = 2 << 20
ABI_VERSION = 2
# Note [reuse freed blocks] (in the C++ source): freed blocks kept for reuse, at most this many bytes.
IDLE_LIMIT = 256 << 20
SOURCE_NAME = "ssdtrain_hostalloc.cpp"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


class Unavailable(RuntimeError):
    """The allocator cannot be used here; the message says why and what would fix it."""


def source_path() -> Path:
    """The C++ source: in the installed package (``ssdtrain/_native``) or the checkout's ``cuda_ext``."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_native" / SOURCE_NAME, here.parent / "cuda_ext" / SOURCE_NAME):
        if candidate.is_file():
            return candidate
    raise Unavailable(f"{SOURCE_NAME} is not shipped with this installation of ssdtrain "
                      f"(looked in {here / '_native'} and {here.parent / 'cuda_ext'})")


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise Unavailable("no C++ compiler found (install g++, or set CXX)")
    return cxx


def _torch_dirs() -> tuple[str, str]:
    root = os.path.dirname(torch.__file__)
    include, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if not os.path.isfile(os.path.join(include, "c10", "core", "CPUAllocator.h")):
        raise Unavailable(f"torch's C++ headers are not installed ({include}/c10/core/CPUAllocator.h is missing)")
    return include, lib


def _check_platform() -> None:
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"transparent huge pages are a Linux feature (this is {sys.platform})")
    try:
        with open(THP_SETTING) as f:
            setting = f.read()
    except OSError:
        raise Unavailable(f"this kernel has no transparent huge pages ({THP_SETTING} is missing)") from None
    if "[never]" in setting:
        raise Unavailable(f"transparent huge pages are switched off ({THP_SETTING}: never); "
                          "'madvise' or 'always' lets ssdtrain use them")


def library_path() -> Path:
    """Where the built library for this source, torch and compiler is (or will be) cached."""
    source = source_path().read_bytes()
    key = hashlib.sha256(b"\0".join([
        source, torch.__version__.encode(), os.path.dirname(torch.__file__).encode(),
        str(int(torch._C._GLIBCXX_USE_CXX11_ABI)).encode(), _compiler().encode(), platform.machine().encode(),
    ])).hexdigest()[:16]
    return Path(_ext.cache_dir()) / f"libssdtrain_hostalloc-{key}.so"


def build(out: Path | None = None) -> Path:
    """Compiles the allocator (unless already cached) and returns the library's path.

    Raises:
        Unavailable: no compiler, no torch headers, no source, or the compiler failed.
    """
    lib = out or library_path()
    if lib.is_file():
        return lib
    start = time.perf_counter()
    include, libdir = _torch_dirs()
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f".{lib.name}.{os.getpid()}.{threading.get_ident()}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [_compiler(), "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           f"-I{include}", "-o", str(tmp), str(source_path()), f"-L{libdir}", "-lc10", f"-Wl,-rpath,{libdir}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Unavailable(f"compiling {SOURCE_NAME} failed: {e}") from None
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-6:])
        raise Unavailable(f"compiling {SOURCE_NAME} failed ({' '.join(cmd)}):\n{tail}")
    os.replace(tmp, lib)  # atomic: another process loading it never sees half a file
    log.info("ssdtrain: built the huge-page allocator in %.1f s: %s", time.perf_counter() - start, lib)
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` or ``(None, why not)``; built on the first call, cached for the
    process (``_load.cache_clear()`` in tests)."""
    if _ext.native_code_disabled():
        return None, "SSDTRAIN_NO_EXT is set (no native code is built or loaded)"
    try:
        _check_platform()
        path = build()
        lib = ctypes.CDLL(str(path))
        if lib.ssdtrain_hostalloc_abi_version() != ABI_VERSION:
            return None, f"{path} has another ABI version than this ssdtrain; delete it to rebuild"
    except Unavailable as e:
        return None, str(e)
    except OSError as e:
        return None, f"cannot load the huge-page allocator: {e}"
    for name in ("allocations", "bytes", "reused", "idle_bytes", "trim"):
        getattr(lib, f"ssdtrain_hostalloc_{name}").restype = ctypes.c_uint64
    lib.ssdtrain_hostalloc_set_idle_limit.argtypes = [ctypes.c_uint64]
    lib.ssdtrain_hostalloc_set_idle_limit(IDLE_LIMIT)
    return lib, None


def available() -> bool:
    """Whether the allocator can be used here (builds it on the first call)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why the allocator cannot be used here, or None."""
    return _load()[1]


# Note [one allocator, many users]
# Several Offloaders (or micro-batch scopes of one) may be active at once, on one thread or
# several; the allocator is in place while any of them is, so users are counted.
_lock = threading.Lock()
_users = 0


def use() -> None:
    """One more active user: puts the allocator in place if it is the first.

    Raises:
        Unavailable: it cannot be built or loaded here, or another CPU allocator of higher
            priority is in place.
    """
    global _users
    lib, why = _load()
    if lib is None:
        raise Unavailable(why)
    with _lock:
        if _users == 0 and lib.ssdtrain_hostalloc_install() != 0:
            raise Unavailable("torch's CPU allocator is not its default one (another was put in place with "
                              "c10::SetCPUAllocator); set host_allocator='torch' to keep it")
        _users += 1


def release() -> None:
    """One user fewer: torch's allocator is back when it was the last."""
    global _users
    lib = _load()[0]
    assert lib is not None, "release() without use()"
    with _lock:
        assert _users > 0, "release() without use()"
        _users -= 1
        if _users == 0 and lib.ssdtrain_hostalloc_uninstall() == 2:
            log.warning("ssdtrain: another CPU allocator replaced ssdtrain's huge-page allocator while it "
                        "was in place; that one is left in place")


def installed() -> bool:
    """Whether torch's CPU allocator is ssdtrain's now."""
    lib = _load()[0] if _load.cache_info().currsize else None
    return bool(lib is not None and lib.ssdtrain_hostalloc_installed())


def counters() -> dict[str, int]:
    """Allocations the allocator served on huge pages since the process started and their bytes;
    how many of them reused a freed block; the bytes of freed blocks kept for reuse now."""
    lib = _load()[0] if _load.cache_info().currsize else None
    if lib is None:
        return {"allocations": 0, "bytes": 0, "reused": 0, "idle_bytes": 0}
    return {"allocations": lib.ssdtrain_hostalloc_allocations(), "bytes": lib.ssdtrain_hostalloc_bytes(),
            "reused": lib.ssdtrain_hostalloc_reused(), "idle_bytes": lib.ssdtrain_hostalloc_idle_bytes()}


def trim() -> int:
    """Gives the freed blocks kept for reuse back to the C library, unless a user is active, and
    keeps none until the allocator is in place again; returns their bytes. The Offloader calls
    it when it closes."""
    lib = _load()[0] if _load.cache_info().currsize else None
    if lib is None:
        return 0
    with _lock:
        return 0 if _users else lib.ssdtrain_hostalloc_trim()
