"""Best-effort loader of the optional native helper (``cuda_ext/``): cuFile buffer registration.

Pure Python is the complete default; the helper only lets GPUDirect Storage skip its bounce
buffers for registered GPU memory (kvikio's ``memory_register`` does the same for kvikio's own
requests). Nothing happens at import: the library is looked for on the first call of
:func:`is_available` (or any function below), and the reason it could not be used is logged once
at INFO and kept in :func:`unavailable_reason`.

Environment:
    SSDTRAIN_NO_EXT=1       never load native code of ssdtrain (``1/true/yes/on``; ``0/false/no/off``
                            or empty: load it; anything else is an error); nor call the CUDA
                            runtime directly (the host tier's copies then go through torch:
                            Note [the copy thread issues copies without the GIL]).
    SSDTRAIN_EXT_PATH=FILE  load this library instead of ``~/.cache/ssdtrain/libssdtrain_cufile.so``
                            (where ``python cuda_ext/build.py`` puts it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import logging
import os
import stat
from collections.abc import Iterator

__all__ = ["is_available", "unavailable_reason", "library_path", "register", "cufile_version", "native_code_disabled",
           "NATIVE_ABI", "compiled"]

log = logging.getLogger(__name__)

LIB_NAME = "libssdtrain_cufile.so"
ABI_VERSION = 2

NATIVE_ABI = 4
"""The number a build of ``ssdtrain._cpack`` (``cuda_ext/_cpack.c``'s ``NATIVE_ABI``) must answer
for this source to use it: a build from another source is not used."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})

# Where the cuFile wheels put libcufile.so.0, under site-packages/nvidia: CUDA 13's
# ``nvidia-cufile`` (one ``cu13`` tree for all CUDA 13 wheels), CUDA 12's ``nvidia-cufile-cu12``.
CUFILE_WHEEL_LIBS = ("cu13/lib/libcufile.so.0", "cufile/lib/libcufile.so.0")


def cache_dir() -> str:
    """Where ssdtrain's native libraries are built and looked for: ``$XDG_CACHE_HOME/ssdtrain``,
    else ``~/.cache/ssdtrain``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ssdtrain")


def native_code_disabled() -> bool:
    """Whether ``SSDTRAIN_NO_EXT`` asks for no native code of ssdtrain to be loaded.

    Raises:
        ValueError: the variable holds something other than 1/true/yes/on or 0/false/no/off/empty.
    """
    raw = os.environ.get("SSDTRAIN_NO_EXT", "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"SSDTRAIN_NO_EXT={raw!r} is not understood: use 1, true, yes or on to disable ssdtrain's "
                     "native code, or 0, false, no, off or nothing to allow it")


def compiled(abi: int = NATIVE_ABI) -> tuple[object | None, str | None]:
    """``(module, None)``: ``ssdtrain._cpack``, built at install where a C compiler is (``setup.py``)
    and answering ``abi``; else ``(None, why not)``. ``SSDTRAIN_NATIVE=0`` turns it off for a
    process: the compiled pack (``engine/native.py``) and the host tier's batched copies
    (``device/copies.py``) then run their pure-Python twins."""
    if os.environ.get("SSDTRAIN_NATIVE", "1") == "0":
        return None, "off (SSDTRAIN_NATIVE=0)"
    try:
        import ssdtrain._cpack as module
    except ImportError as e:
        return None, f"not built ({e})"
    if module.abi() != abi:
        return None, f"stale build (ABI {module.abi()}, this source {abi}): reinstall ssdtrain to rebuild it"
    return module, None


def library_path() -> str:
    """Where the extension is looked for."""
    explicit = os.environ.get("SSDTRAIN_EXT_PATH")
    if explicit:
        return explicit
    return os.path.join(cache_dir(), LIB_NAME)


# Note [load only what no one else can write]
# A shared library runs with all of this process's rights. Under a permissive umask (000) the
# cache directory and the library could be writable by every local user, who could then replace
# the library and run code as the trainer. So a library is loaded only if the file (symlinks
# resolved) is a regular file owned by this user (or root) and writable by no group or other, and
# every directory from it up to ``/`` is owned by this user or root and writable by no group or
# other -- or sticky (as ``/tmp`` is: others cannot rename or replace what they do not own).
def _trusted(path: str) -> str | None:
    """``None`` when ``path`` may be loaded (Note [load only what no one else can write]), else why not."""
    me = os.geteuid()
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        return f"{real} is not a regular file"
    if st.st_uid not in (me, 0):
        return f"{real} belongs to user {st.st_uid}, not to this user ({me}) or root"
    if st.st_mode & 0o022:
        return f"{real} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
    d = os.path.dirname(real)
    while True:
        st = os.stat(d)
        if st.st_uid not in (me, 0):
            return f"directory {d} belongs to user {st.st_uid}, not to this user ({me}) or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"directory {d} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod go-w it"
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _preload_cufile() -> None:
    """Makes ``dlopen("libcufile.so.0")`` find the cuFile wheel's copy, if one is installed."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for rel in CUFILE_WHEEL_LIBS:
            lib = os.path.join(root, rel)
            if not os.path.isfile(lib):
                continue
            why = _trusted(lib)
            if why is not None:
                log.info("ssdtrain: not loading %s: %s", lib, why)
                return
            try:
                ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
            except OSError as e:
                log.debug("ssdtrain: cannot preload %s: %s", lib, e)
            return


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """``(library, None)`` or ``(None, why not)``; cached for the process (``_load.cache_clear()``
    in tests)."""
    if native_code_disabled():
        return None, "SSDTRAIN_NO_EXT is set"
    path = library_path()
    if not os.path.isfile(path):
        return None, f"{path} does not exist (build it with: python cuda_ext/build.py)"
    try:
        why = _trusted(path)
    except OSError as e:
        why = f"cannot check {path}: {e}"
    if why is not None:
        return None, f"refusing to load {path}: {why}"
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    try:
        version = lib.ssdtrain_ext_abi_version()
    except AttributeError:
        return None, f"{path} is not ssdtrain's CUDA extension"
    if version != ABI_VERSION:
        return None, f"{path} has ABI version {version}, this ssdtrain needs {ABI_VERSION}; rebuild it"
    _preload_cufile()
    lib.ssdtrain_buf_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ssdtrain_buf_deregister.argtypes = [ctypes.c_void_p]
    lib.ssdtrain_registered_bytes.restype = ctypes.c_size_t
    return lib, None


def _lib() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"ssdtrain's CUDA extension is not available: {why}")
    return lib


@functools.cache
def _log_once(why: str) -> None:
    log.info("ssdtrain: CUDA extension not used: %s", why)


def is_available() -> bool:
    """Whether the extension is loaded (it still needs a GPU and cuFile to do anything)."""
    lib, why = _load()
    if lib is None:
        _log_once(why)
    return lib is not None


def unavailable_reason() -> str | None:
    """Why :func:`is_available` is ``False`` (``None`` when it is ``True``)."""
    return _load()[1]


def cufile_version() -> int:
    """cuFile's version number (e.g. 1140), or a negative code when libcufile cannot be used."""
    return int(_lib().ssdtrain_cufile_version())


def byte_range(tensor) -> tuple[int, int]:
    """``(address, nbytes)`` of a contiguous CUDA tensor's own bytes: from ``data_ptr()`` (which
    includes the view's storage offset) for ``numel * element_size`` bytes -- never the whole
    storage, which would run past its end for a view that does not start at offset 0.

    Raises:
        ValueError: the tensor is not on a CUDA device, or not contiguous.
    """
    if getattr(tensor, "device", None) is None or tensor.device.type != "cuda":
        raise ValueError("only CUDA tensors can be registered with cuFile")
    if not tensor.is_contiguous():
        raise ValueError("only a contiguous tensor covers one byte range; register a contiguous one")
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def register(tensor) -> Iterator[None]:
    """Registers a contiguous CUDA tensor's bytes with cuFile for the ``with`` block (GDS without
    bounce buffers). The tensor must stay alive and in place meanwhile.

    Raises:
        RuntimeError: the extension is not available, or cuFile refused (the code is cuFile's
            ``CUfileOpError``, or -1: no libcufile).
        ValueError: not a contiguous CUDA tensor.
    """
    lib = _lib()
    ptr, nbytes = byte_range(tensor)
    rc = lib.ssdtrain_buf_register(ptr, nbytes)
    if rc != 0:
        raise RuntimeError(f"cuFileBufRegister of {nbytes} bytes failed with code {rc}")
    try:
        yield
    finally:
        lib.ssdtrain_buf_deregister(ptr)
