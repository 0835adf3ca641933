"""Test-only stand-in for the CUDA driver (``libcuda.c``) and the helper that builds it.

Never shipped in the package. See ``libcuda.c`` for what it answers.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess

import pytest

SOURCE = pathlib.Path(__file__).parent / "libcuda.c"


def build_stand_in(out_dir: pathlib.Path) -> pathlib.Path:
    """Compiles the stand-in driver into ``out_dir``; returns the library's path (skips the test
    when there is no C compiler)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in CUDA driver")
    lib = out_dir / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(SOURCE)],
                   check=True, capture_output=True)
    return lib


def load_driver(out_dir: pathlib.Path) -> str:
    """Makes ``dlopen("libcuda.so.1")`` succeed: ``"real"`` where the CUDA driver is installed,
    else ``"stand-in"`` (built into ``out_dir`` and loaded globally under the driver's soname)."""
    try:
        ctypes.CDLL("libcuda.so.1")
        return "real"
    except OSError:
        pass
    ctypes.CDLL(str(build_stand_in(out_dir)), mode=os.RTLD_GLOBAL)
    return "stand-in"
