"""Builds the optional native helper (``libssdtrain_cufile.so``): cuFile buffer registration.

    python cuda_ext/build.py [--out DIR]     # default DIR: ~/.cache/ssdtrain (what the loader searches)

The library is host C++ (no device code): it needs a C++17 compiler (``$CXX``, else ``c++``,
``g++`` or ``clang++``), ``cufile.h`` and the ``cuda.h`` that cufile.h includes -- no nvcc.
``cufile.h`` comes from the cuFile wheel (``nvidia-cufile``: ``nvidia/cu13/include``; CUDA 12's
``nvidia-cufile-cu12``: ``nvidia/cufile/include``) or a CUDA toolkit with GDS; ``cuda.h`` from a
CUDA toolkit (``$CUDA_HOME``) or the CUDA runtime wheel. Nothing is linked but libdl: libcufile
is opened at run time, so the library also loads on machines without a GPU. ``ssdtrain/_ext.py``
loads it best-effort, and only from a file and directories that no other user can write (the
build makes them so); pure Python remains the complete default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import platform
import shutil
import subprocess
import sys

SOURCE = pathlib.Path(__file__).resolve().parent / "ssdtrain_cufile.cpp"
LIB_NAME = "libssdtrain_cufile.so"

# Where the NVIDIA wheels put headers, under site-packages/nvidia: CUDA 13 wheels share one
# ``cu13`` tree; CUDA 12 wheels have a directory per component.
WHEEL_INCLUDE_DIRS = ("cu13/include", "cufile/include", "cuda_runtime/include", "cu12/include")


class Unavailable(RuntimeError):
    """The extension cannot be built here; the message says what is missing."""


def default_out_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ssdtrain"


def find_compiler() -> str | None:
    """A host C++ compiler: ``$CXX``, else the first of c++, g++, clang++ on PATH."""
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit) or (explicit if os.access(explicit, os.X_OK) else None)
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _toolkit_include_dirs() -> list[str]:
    arch = {"x86_64": "x86_64-linux", "aarch64": "sbsa-linux"}.get(platform.machine(), "x86_64-linux")
    dirs = []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs += [os.path.join(home, "include"), os.path.join(home, "targets", arch, "include")]
    return dirs


def _wheel_include_dirs() -> list[str]:
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [os.path.join(root, sub) for root in roots for sub in WHEEL_INCLUDE_DIRS]


def find_header(name: str) -> str | None:
    """The directory holding ``name`` (``cufile.h`` or ``cuda.h``): NVIDIA wheels first (CUDA 13
    layout, then CUDA 12), then the CUDA toolkit."""
    return next((d for d in _wheel_include_dirs() + _toolkit_include_dirs()
                 if os.path.isfile(os.path.join(d, name))), None)


def find_cufile_include() -> str | None:
    return find_header("cufile.h")


def _private_dir(path: pathlib.Path) -> None:
    """Creates ``path`` and its missing parents with mode 0700, whatever the umask (the loader
    refuses directories that others can write)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        os.chmod(d, 0o700)


def build(out_dir: str | os.PathLike | None = None, *, compiler: str | None = None, quiet: bool = True) -> pathlib.Path:
    """Compiles the extension into ``out_dir``; returns the library's path.

    Raises:
        Unavailable: no C++ compiler, no cufile.h or no cuda.h.
        subprocess.CalledProcessError: the compiler failed.
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        raise Unavailable("no C++ compiler found (install g++ or set CXX)")
    cufile = find_header("cufile.h")
    if cufile is None:
        raise Unavailable("cufile.h not found (pip install nvidia-cufile for CUDA 13, nvidia-cufile-cu12 for "
                          "CUDA 12, or install a CUDA toolkit with GDS)")
    cuda = find_header("cuda.h")
    if cuda is None:
        raise Unavailable("cuda.h not found (install the CUDA toolkit and set CUDA_HOME)")
    out = pathlib.Path(out_dir) if out_dir is not None else default_out_dir()
    _private_dir(out)
    lib = out / LIB_NAME
    tmp = out / f".{LIB_NAME}.{os.getpid()}"
    includes = [f"-I{d}" for d in dict.fromkeys((cufile, cuda))]
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-std=c++17", *includes, "-o", str(tmp), str(SOURCE), "-ldl"]
    try:
        subprocess.run(cmd, check=True, capture_output=quiet)
        os.chmod(tmp, 0o755)  # never group- or world-writable, whatever the umask
        os.replace(tmp, lib)  # atomic: a process loading the old library never sees half a file
    finally:
        if tmp.exists():
            tmp.unlink()
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build ssdtrain's optional native helper (cuFile buffer registration).")
    p.add_argument("--out", default=None, help=f"output directory (default: {default_out_dir()})")
    args = p.parse_args(argv)
    try:
        lib = build(args.out, quiet=False)
    except Unavailable as e:
        print(f"cuda_ext: not built: {e}", file=sys.stderr)
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
