"""Builds the optional CUDA extension (``libssdtrain_cufile.so``) when CUDA and cuFile headers exist.

    python cuda_ext/build.py [--out DIR]     # default DIR: ~/.cache/ssdtrain (what the loader searches)

Needs ``nvcc`` (``$CUDA_HOME/bin`` or ``PATH``), ``cuda.h`` (the CUDA toolkit) and ``cufile.h``
(the ``nvidia-cufile-cu12`` wheel ships it, as do CUDA toolkits with GDS). Nothing is linked but
libdl: libcufile and the CUDA driver are opened at run time, so the library also loads on machines
without a GPU. ``ssdtrain/_ext.py`` loads it best-effort; pure Python remains the complete default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

SOURCE = pathlib.Path(__file__).resolve().parent / "ssdtrain_cufile.cpp"
LIB_NAME = "libssdtrain_cufile.so"


class Unavailable(RuntimeError):
    """The extension cannot be built here; the message says what is missing."""


def default_out_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ssdtrain"


def find_nvcc() -> str | None:
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def find_cufile_include() -> str | None:
    """The directory holding ``cufile.h``: the nvidia-cufile wheel's, else the CUDA toolkit's."""
    candidates = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(root, "cufile", "include"))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates += [os.path.join(home, "include"), os.path.join(home, "targets", "x86_64-linux", "include")]
    return next((c for c in candidates if os.path.isfile(os.path.join(c, "cufile.h"))), None)


def build(out_dir: str | os.PathLike | None = None, *, nvcc: str | None = None, quiet: bool = True) -> pathlib.Path:
    """Compiles the extension into ``out_dir``; returns the library's path.

    Raises:
        Unavailable: no nvcc or no cufile.h.
        subprocess.CalledProcessError: the compiler failed.
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise Unavailable("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    include = find_cufile_include()
    if include is None:
        raise Unavailable("cufile.h not found (pip install nvidia-cufile-cu12, or a CUDA toolkit with GDS)")
    out = pathlib.Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / LIB_NAME
    tmp = out / f".{LIB_NAME}.{os.getpid()}"
    cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O2", "-std=c++17", f"-I{include}", "-o", str(tmp),
           str(SOURCE), "-ldl"]
    subprocess.run(cmd, check=True, capture_output=quiet)
    os.replace(tmp, lib)  # atomic: a process loading the old library never sees half a file
    return lib


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build ssdtrain's optional CUDA extension (cuFile buffer registration).")
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
