"""The optional native helper: its best-effort loader (ssdtrain/_ext.py) and its build (cuda_ext/)."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import pathlib
import shutil
import types

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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The helper compiled once for this module (skips where no compiler or headers exist)."""
    build = _build_module()
    if build.find_compiler() is None or build.find_header("cufile.h") is None or build.find_header("cuda.h") is None:
        pytest.skip("needs a C++ compiler, cufile.h (pip install nvidia-cufile) and cuda.h (a CUDA toolkit)")
    return build.build(tmp_path_factory.mktemp("ext") / "out")


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


@pytest.mark.parametrize("raw, off", [("1", True), ("TRUE", True), (" yes ", True), ("on", True), ("", False),
                                      ("0", False), ("False", False), ("no", False), (" off", False)])
def test_env_var_is_parsed_strictly(monkeypatch, raw, off):
    monkeypatch.setenv("SSDTRAIN_NO_EXT", raw)
    assert _ext.native_code_disabled() is off


@pytest.mark.parametrize("raw", ["2", "disable", "y", "nope"])
def test_env_var_nonsense_is_an_error(monkeypatch, raw):
    monkeypatch.setenv("SSDTRAIN_NO_EXT", raw)
    with pytest.raises(ValueError, match="SSDTRAIN_NO_EXT"):
        _ext.native_code_disabled()
    with pytest.raises(ValueError, match="SSDTRAIN_NO_EXT"):
        _ext.is_available()


def test_missing_library_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(tmp_path / "libssdtrain_cufile.so"))
    assert not _ext.is_available()
    assert "does not exist" in _ext.unavailable_reason() and "cuda_ext/build.py" in _ext.unavailable_reason()


def test_broken_library_falls_back(monkeypatch, tmp_path):
    junk = tmp_path / "libssdtrain_cufile.so"
    junk.write_bytes(b"\x7fELF not really")
    junk.chmod(0o644)
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(junk))
    assert not _ext.is_available()
    assert "cannot load" in _ext.unavailable_reason()


def test_default_location_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _ext.library_path() == str(tmp_path / "ssdtrain" / "libssdtrain_cufile.so")


# Note [load only what no one else can write] (in _ext.py)
@pytest.mark.parametrize("where, mode", [("file", 0o666), ("file", 0o646), ("dir", 0o777), ("dir", 0o775)])
def test_refuses_a_library_others_can_write(monkeypatch, tmp_path, where, mode):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    lib = d / "libssdtrain_cufile.so"
    lib.write_bytes(b"\x7fELF not really")
    lib.chmod(0o755)
    (lib if where == "file" else d).chmod(mode)
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(lib))
    assert not _ext.is_available()
    why = _ext.unavailable_reason()
    assert why.startswith("refusing to load") and "writable by other users" in why, why


def test_a_sticky_directory_is_fine_but_not_a_foreign_file(monkeypatch, tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)  # like /tmp: others cannot replace what they do not own
    lib = d / "libssdtrain_cufile.so"
    lib.write_bytes(b"junk")
    lib.chmod(0o755)
    assert _ext._trusted(str(lib)) is None
    link = tmp_path / "link.so"
    link.symlink_to(lib)
    assert _ext._trusted(str(link)) is None  # judged by what it points to
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(lib, 65534, 65534)
    assert "belongs to user 65534" in _ext._trusted(str(lib))


def test_register_covers_the_view_not_the_storage(monkeypatch):
    calls = []
    fake = types.SimpleNamespace(ssdtrain_buf_register=lambda p, n: calls.append(("reg", p, n)) or 0,
                                 ssdtrain_buf_deregister=lambda p: calls.append(("dereg", p)) or 0)
    monkeypatch.setattr(_ext, "_load", functools.cache(lambda: (fake, None)))

    class View:  # a CUDA view 256 elements into a larger storage (no GPU needed to check the range)
        device = types.SimpleNamespace(type="cuda")

        def data_ptr(self):
            return 0x7000_0000 + 256 * 4

        def numel(self):
            return 100

        def element_size(self):
            return 4

        def is_contiguous(self):
            return True

    with _ext.register(View()):
        pass
    assert calls == [("reg", 0x7000_0400, 400), ("dereg", 0x7000_0400)]
    with pytest.raises(ValueError, match="CUDA"):
        _ext.byte_range(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))


def test_no_pluggable_allocator_any_more():
    assert not hasattr(_ext, "allocator_spec")
    source = (BUILD.parent / "ssdtrain_cufile.cpp").read_text()
    assert "void* ssdtrain_alloc(" not in source and "void ssdtrain_free(" not in source


def test_cufile_is_found_in_the_cuda13_wheel_layout(monkeypatch, tmp_path):
    root = tmp_path / "nvidia"
    (root / "cu13" / "include").mkdir(parents=True)
    (root / "cu13" / "include" / "cufile.h").write_text("/* stand-in */")
    (root / "cu13" / "lib").mkdir()
    (root / "cu13" / "lib" / "libcufile.so.0").write_bytes(b"junk")
    (root / "cu13" / "lib" / "libcufile.so.0").chmod(0o755)
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    build = _build_module()
    monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: spec if name == "nvidia" else None)
    monkeypatch.setattr(build, "_toolkit_include_dirs", lambda: [])
    assert build.find_header("cufile.h") == str(root / "cu13" / "include")
    loaded = []
    monkeypatch.setattr(_ext.importlib.util, "find_spec", lambda name: spec if name == "nvidia" else None)
    monkeypatch.setattr(_ext.ctypes, "CDLL", lambda path, mode=0: loaded.append(path))
    _ext._preload_cufile()
    assert loaded == [str(root / "cu13" / "lib" / "libcufile.so.0")]


def test_build_reports_what_is_missing(monkeypatch, tmp_path):
    build = _build_module()
    monkeypatch.setattr(build, "find_compiler", lambda: None)
    with pytest.raises(build.Unavailable, match="compiler"):
        build.build(tmp_path)
    assert build.main(["--out", str(tmp_path)]) == 1
    monkeypatch.setattr(build, "find_compiler", lambda: "/bin/true")
    monkeypatch.setattr(build, "find_header", lambda name: None)
    with pytest.raises(build.Unavailable, match="cufile.h"):
        build.build(tmp_path)


def test_build_needs_no_nvcc(monkeypatch, tmp_path):
    build = _build_module()
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc, no compiler either
    monkeypatch.setenv("CXX", "/bin/true")
    assert build.find_compiler() == "/bin/true"


def test_compiles_and_loads_where_headers_exist(monkeypatch, built):
    # Loading needs no GPU: libcufile is opened on first use only.
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(built))
    assert _ext.is_available(), _ext.unavailable_reason()
    assert _ext.unavailable_reason() is None
    assert isinstance(_ext.cufile_version(), int)
    assert _ext._lib().ssdtrain_registered_bytes() == 0
    assert _ext._lib().ssdtrain_ext_abi_version() == _ext.ABI_VERSION == 2


def test_build_under_a_permissive_umask_makes_a_loadable_private_library(monkeypatch, tmp_path, built):
    build = _build_module()
    old = os.umask(0)
    try:
        out = tmp_path / "fresh" / "cache" / "ssdtrain"
        lib = build.build(out)
    finally:
        os.umask(old)
    for d in (out, out.parent, out.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700, oct(d.stat().st_mode)
    assert lib.stat().st_mode & 0o777 == 0o755
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(lib))
    assert _ext.is_available(), _ext.unavailable_reason()
    # Copied by hand into a world-writable directory, the same library is refused.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    shutil.copy(lib, open_dir / lib.name)
    monkeypatch.setenv("SSDTRAIN_EXT_PATH", str(open_dir / lib.name))
    _ext._load.cache_clear()
    assert not _ext.is_available() and "writable by other users" in _ext.unavailable_reason()
