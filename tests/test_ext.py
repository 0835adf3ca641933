"""The optional CUDA extension: its best-effort loader (ssdtrain/_ext.py) and its build (cuda_ext/)."""

from __future__ import annotations

import importlib.util
import logging
import pathlib

import pytest

from ssdtrain import _ext

BUILD = pathlib.Path(__file__).resolve().parents[1] / "cuda_ext" / "build.py"


@pytest.fixture(autouse=True)
def fresh_loader(monkeypatch):
    monkeypatch.delenv("SSDTRAIN_NO_EXT", raising=False)
    monkeypatch.delenv("SSDTRAIN_EXT_PATH", raising=False)
    _ext._load.cache_clear()
    _ext._log_once.cache_clear()
    yield
    _ext._load.cache_clear()
    _ext._log_once.cache_clear()


def _build_module():
    spec = importlib.util.spec_from_file_location("_ssdtrain_cuda_ext_build", BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_env_var_turns_it_off(monkeypatch, caplog):
    monkeypatch.setenv("SSDTRAIN_NO_EXT", "1")
    with caplog.at_level(logging.INFO, logger="ssdtrain._ext"):
        assert _ext.is_available() is False
        assert _ext.is_available() is False
    assert "SSDTRAIN_NO_EXT" in _ext.unavailable_reason()
    assert [r.getMessage() for r in caplog.records].count(
        "ssdtrain: CUDA extension not used: SSDTRAIN_NO_EXT is set") == 1  # logged once
    with pytest.raises(RuntimeError, match="not available"):
        with _ext.register(object()):
            pass


def test_missing_library_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(tmp_path / "libssdtrain_cufile.so"))
    assert not _ext.is_available()
    assert "does not exist" in _ext.unavailable_reason() and "cuda_ext/build.py" in _ext.unavailable_reason()


def test_broken_library_falls_back(monkeypatch, tmp_path):
    junk = tmp_path / "libssdtrain_cufile.so"
    junk.write_bytes(b"\x7fELF not really")
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(junk))
    assert not _ext.is_available()
    assert "cannot load" in _ext.unavailable_reason()


def test_default_location_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _ext.library_path() == str(tmp_path / "ssdtrain" / "libssdtrain_cufile.so")


def test_build_reports_what_is_missing(monkeypatch, tmp_path):
    build = _build_module()
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.Unavailable, match="nvcc"):
        build.build(tmp_path)
    assert build.main(["--out", str(tmp_path)]) == 1


def test_compiles_and_loads_where_nvcc_exists(monkeypatch, tmp_path):
    build = _build_module()
    if build.find_nvcc() is None or build.find_cufile_include() is None:
        pytest.skip("needs nvcc and cufile.h (pip install nvidia-cufile-cu12)")
    lib = build.build(tmp_path)
    assert lib.name == "libssdtrain_cufile.so" and lib.is_file()
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(lib))
    # Loading needs no GPU: libcufile and the driver are opened on first use only.
    assert _ext.is_available(), _ext.unavailable_reason()
    assert _ext.unavailable_reason() is None
    assert isinstance(_ext.cufile_version(), int)
    path, alloc, free = _ext.allocator_spec(register_min_bytes=1 << 20)
    assert (path, alloc, free) == (str(lib), "ssdtrain_alloc", "ssdtrain_free")
    assert _ext._lib().ssdtrain_registered_bytes() == 0
