"""Best-effort loader of the optional CUDA extension (``cuda_ext/``): cuFile buffer registration.

Pure Python is the complete default; the extension only lets GPUDirect Storage skip its bounce
buffers for registered GPU memory. Nothing happens at import: the library is looked for on the
first call of :func:`is_available` (or any function below), and the reason it could not be used
is logged once at INFO and kept in :func:`unavailable_reason`.

Environment:
    SSDTRAIN_NO_EXT=1       never load the extension.
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
from collections.abc import Iterator

__all__ = ["is_available", "unavailable_reason", "library_path", "register", "allocator_spec", "cufile_version"]

log = logging.getLogger(__name__)

LIB_NAME = "libssdtrain_cufile.so"
ABI_VERSION = 1


def cache_dir() -> str:
    """Where ssdtrain's native libraries are built and looked for: ``$XDG_CACHE_HOME/ssdtrain``,
    else ``~/.cache/ssdtrain``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ssdtrain")


def native_code_disabled() -> bool:
    """``SSDTRAIN_NO_EXT`` is set: no native code of ssdtrain is built or loaded."""
    return os.environ.get("SSDTRAIN_NO_EXT", "").strip().lower() not in ("", "0", "false", "no", "off")


def library_path() -> str:
    """Where the extension is looked for."""
    explicit = os.environ.get("SSDTRAIN_EXT_PATH")
    if explicit:
        return explicit
    return os.path.join(cache_dir(), LIB_NAME)


def _preload_cufile() -> None:
    """Makes ``dlopen("libcufile.so.0")`` find the nvidia-cufile wheel's copy, if installed."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        lib = os.path.join(root, "cufile", "lib", "libcufile.so.0")
        if os.path.isfile(lib):
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
    lib.ssdtrain_set_register_min_bytes.argtypes = [ctypes.c_size_t]
    lib.ssdtrain_set_register_min_bytes.restype = None
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


@contextlib.contextmanager
def register(tensor) -> Iterator[None]:
    """Registers a CUDA tensor's memory with cuFile for the ``with`` block (GDS without bounce
    buffers). The tensor must stay alive and in place meanwhile.

    Raises:
        RuntimeError: the extension is not available, or cuFile refused (the code is cuFile's
            ``CUfileOpError``, or -1 no libcufile, -2 no CUDA driver).
    """
    lib = _lib()
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    rc = lib.ssdtrain_buf_register(ptr, nbytes)
    if rc != 0:
        raise RuntimeError(f"cuFileBufRegister of {nbytes} bytes failed with code {rc}")
    try:
        yield
    finally:
        lib.ssdtrain_buf_deregister(ptr)


def allocator_spec(register_min_bytes: int = 4 << 20) -> tuple[str, str, str]:
    """``(library path, alloc name, free name)`` for ``torch.cuda.memory.CUDAPluggableAllocator``:
    allocations of at least ``register_min_bytes`` are registered with cuFile while they live.

    Example::

        path, alloc, free = ssdtrain._ext.allocator_spec()
        torch.cuda.memory.change_current_allocator(
            torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free))
    """
    _lib().ssdtrain_set_register_min_bytes(register_min_bytes)
    return library_path(), "ssdtrain_alloc", "ssdtrain_free"
