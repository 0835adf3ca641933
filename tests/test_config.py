"""Bad input is refused at construction, with a message that names the field and what to do."""

import os
import stat

import pytest
import torch

import ssdtrain
from ssdtrain import OffloadConfig
from ssdtrain.config import parse_bytes


@pytest.mark.parametrize("field, value, words", [
    ("backend", "nvme", "backend='nvme'"),
    ("min_bytes", -1, "min_bytes=-1"),
    ("max_inflight_bytes", -5, "max_inflight_bytes"),
    ("max_inflight_bytes", 0, "max_inflight_bytes=0"),
    ("prefetch_bytes", "lots", "prefetch_bytes='lots'"),
    ("keep_last_layers", -2, "keep_last_layers=-2"),
    ("prefetch_layers", 1.5, "prefetch_layers=1.5"),
    ("io_threads", 0, "io_threads=0"),
    ("chunk_bytes", 1000, "chunk_bytes=1000"),
    ("on_error", "ignore", "on_error='ignore'"),
    ("when_full", "drop", "when_full='drop'"),
    ("verify", "yes", "verify='yes'"),
    ("direct_io", "auto", "direct_io='auto'"),
    ("path", [], "path=[]"),
    ("path", ["/a", "/a"], "same directory twice"),
    ("layers", "", "layers=''"),
    ("rated_tbw", -1, "rated_tbw=-1"),
    ("endurance_horizon_days", 0, "endurance_horizon_days=0"),
    # Past the upper bounds, or not numbers at all: refused by name, never an OverflowError.
    ("min_bytes", 10**30, "min_bytes=1000000000000000000000000000000 is more than 1 PiB"),
    ("max_inflight_bytes", "1" * 400, "max_inflight_bytes='1111"),
    ("prefetch_bytes", "1e400", "prefetch_bytes='1e400' is not a size"),
    ("min_bytes", "2PiB", "min_bytes='2PiB' is not a size"),
    ("prefetch_bytes", "1025TiB", "prefetch_bytes='1025TiB' is more than 1 PiB"),
    ("chunk_bytes", "2GiB", "chunk_bytes='2GiB' is more than 1 GiB"),
    ("io_threads", 10**6, "io_threads=1000000 must be an integer from 1 to 64"),
    ("io_threads", 65, "io_threads=65"),
    ("prefetch_layers", 1025, "prefetch_layers=1025 must be an integer from 0 to 1024"),
    ("keep_last_layers", 2**21, "keep_last_layers=2097152"),
    ("rated_tbw", float("inf"), "rated_tbw=inf must be a finite number"),
    ("rated_tbw", float("nan"), "rated_tbw=nan"),
    ("rated_tbw", 2e6, "rated_tbw=2000000.0"),
    ("endurance_horizon_days", float("inf"), "endurance_horizon_days=inf"),
    ("endurance_horizon_days", 36501, "endurance_horizon_days=36501"),
    ("direct_io", 0, "direct_io=0 must be True, False or None"),
    ("direct_io", 0.0, "direct_io=0.0"),
    ("direct_io", 1, "direct_io=1"),
    ("direct_io", "yes", "direct_io='yes'"),
    ("create_path", 1, "create_path=1"),
    ("backend", ["posix"], "backend=['posix']"),
    ("path", "/tmp/a\0b", "contains a NUL byte"),
    ("path", ["/tmp/ok", "/tmp/a\0b"], "path=['/tmp/ok', '/tmp/a\\x00b']"),
    ("path", "/tmp/" + "x" * 256, "is 256 bytes long; the limit is 255"),
    ("path", "/tmp/" + "/".join(["d" * 200] * 21), "bytes long; the limit is 4095"),
    ("path", "/tmp/\ud800", "cannot be encoded"),
    ("path", b"/tmp", "path=b'/tmp' must be a directory"),
    ("path", [b"/tmp"], "is not a directory name"),
])
def test_invalid_field_is_named(field, value, words):
    with pytest.raises(ValueError) as info:
        OffloadConfig(**{field: value})
    assert words in str(info.value)
    assert f"{field}=" in str(info.value)


def test_a_huge_integer_is_refused_without_printing_it():
    with pytest.raises(ValueError, match=r"prefetch_bytes=<an integer of 16610 bits> is more than 1 PiB"):
        OffloadConfig(prefetch_bytes=10**5000)


def test_bounds_are_inclusive():
    cfg = OffloadConfig(min_bytes="1024TiB", chunk_bytes="1GiB", io_threads=64, prefetch_layers=1024,
                        keep_last_layers=2**20, rated_tbw=1e6, endurance_horizon_days=36500, direct_io=False,
                        path="/tmp/" + "x" * 255)
    assert cfg.min_bytes == 1 << 50 and cfg.chunk_bytes == 1 << 30 and cfg.direct_io is False
    assert parse_bytes("1" * 16) == 1111111111111111
    assert parse_bytes("0.5KiB") == 512


@pytest.mark.parametrize("var, value", [
    ("SSDTRAIN_IO_THREADS", "lots"),
    ("SSDTRAIN_IO_THREADS", "4.0"),
    ("SSDTRAIN_IO_THREADS", "0"),
    ("SSDTRAIN_IO_THREADS", "1000000"),
    ("SSDTRAIN_IO_THREADS", "9" * 400),
    ("SSDTRAIN_CHUNK_BYTES", "garbage"),
    ("SSDTRAIN_CHUNK_BYTES", "1000"),
    ("SSDTRAIN_CHUNK_BYTES", "2GiB"),
    ("SSDTRAIN_CHUNK_BYTES", "9" * 400),
    ("SSDTRAIN_BACKEND", "nvme"),
    ("SSDTRAIN_PATH", os.pathsep),
    ("SSDTRAIN_PATH", "/tmp/" + "x" * 300),
    ("SSDTRAIN_DIRECT_IO", "maybe"),
])
def test_invalid_environment_variable_is_named(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as info:
        OffloadConfig()
    assert f"environment variable {var}=" in str(info.value)


def test_environment_values_within_bounds(monkeypatch):
    monkeypatch.setenv("SSDTRAIN_IO_THREADS", " 64 ")
    monkeypatch.setenv("SSDTRAIN_CHUNK_BYTES", "1GiB")
    monkeypatch.setenv("SSDTRAIN_BACKEND", "memory")
    cfg = OffloadConfig()
    assert cfg.io_threads == 64 and cfg.chunk_bytes == 1 << 30 and cfg.backend == "memory"
    monkeypatch.setenv("SSDTRAIN_IO_THREADS", "")  # empty: the default, as if unset
    assert OffloadConfig().io_threads == min(4, max(2, os.cpu_count() or 2))


def test_env_flag(monkeypatch):
    from ssdtrain.config import env_flag

    monkeypatch.delenv("SSDTRAIN_TEST_FLAG", raising=False)
    assert env_flag("SSDTRAIN_TEST_FLAG") is False
    for raw, want in [("1", True), ("ON", True), (" yes ", True), ("0", False), ("off", False), ("", False)]:
        monkeypatch.setenv("SSDTRAIN_TEST_FLAG", raw)
        assert env_flag("SSDTRAIN_TEST_FLAG") is want
    monkeypatch.setenv("SSDTRAIN_TEST_FLAG", "garbage")
    with pytest.raises(ValueError, match="environment variable SSDTRAIN_TEST_FLAG='garbage'"):
        env_flag("SSDTRAIN_TEST_FLAG")


def test_sizes_and_lists():
    cfg = OffloadConfig(path=["/tmp/a", "/tmp/b"], min_bytes="1MiB", prefetch_bytes="64 MB", max_inflight_bytes=4096)
    assert cfg.paths == ("/tmp/a", "/tmp/b")
    assert cfg.min_bytes == 1 << 20 and cfg.prefetch_bytes == 64_000_000 and cfg.max_inflight_bytes == 4096
    assert parse_bytes("2GiB") == 2 << 30
    with pytest.raises(ValueError, match="unknown OffloadConfig key"):
        OffloadConfig.from_dict({"min_bytes": 1, "min_byte": 2})
    with pytest.raises(dataclasses_frozen_error()):
        cfg.min_bytes = 3


def dataclasses_frozen_error():
    import dataclasses
    return dataclasses.FrozenInstanceError


def test_environment_defaults_and_explicit_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("SSDTRAIN_IO_THREADS", "3")
    monkeypatch.setenv("SSDTRAIN_PATH", f"{tmp_path}/x{os.pathsep}{tmp_path}/y")
    monkeypatch.setenv("SSDTRAIN_DIRECT_IO", "off")
    cfg = OffloadConfig()
    assert cfg.io_threads == 3 and cfg.paths == (f"{tmp_path}/x", f"{tmp_path}/y") and cfg.direct_io is False
    assert OffloadConfig(io_threads=5).io_threads == 5
    monkeypatch.setenv("SSDTRAIN_DIRECT_IO", "maybe")
    with pytest.raises(ValueError, match="SSDTRAIN_DIRECT_IO"):
        OffloadConfig()


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        ssdtrain.Offloader(path=str(f))


def _read_only_dir():
    for d in ("/proc/sys", "/sys/fs"):
        if os.path.isdir(d) and not os.access(d, os.W_OK):
            return d
    pytest.fail("no read-only directory found on this machine to test an unwritable path")


def test_path_unwritable():
    with pytest.raises(ValueError, match="not writable"):
        ssdtrain.Offloader(path=_read_only_dir())


def test_path_missing_and_cannot_be_created():
    with pytest.raises(ValueError, match="cannot be created"):
        ssdtrain.Offloader(path=os.path.join(_read_only_dir(), "ssdtrain-nope", "deeper"))


def test_path_missing(tmp_path):
    missing = tmp_path / "new" / "dir"
    with pytest.raises(ValueError, match="does not exist"):
        ssdtrain.Offloader(path=str(missing), create_path=False)
    assert not missing.exists()
    off = ssdtrain.Offloader(path=str(missing))  # created by default, 0700
    assert missing.is_dir()
    off.close()
    assert list(missing.iterdir()) == []


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("tail", [
    os.path.join("a", "b", "x" * 256),  # a component over NAME_MAX
    os.path.join(*["d" * 200] * 21),  # over PATH_MAX
    os.path.join("a", "b\0c"),
])
def test_refused_path_is_refused_before_creating_anything(tmp_path, tail):
    with pytest.raises(ValueError, match="path="):
        ssdtrain.Offloader(path=str(tmp_path / "root" / tail))
    assert _tree(tmp_path) == []


def test_refused_path_leaves_no_directory_it_created(tmp_path):
    # The first path is created, the second cannot be: the first goes again.
    new = tmp_path / "new" / "dir"
    with pytest.raises(ValueError, match="cannot be created"):
        ssdtrain.Offloader(path=[str(new), os.path.join(_read_only_dir(), "ssdtrain-nope", "deeper")])
    assert _tree(tmp_path) == []


def test_created_directories_are_private_whatever_the_umask(tmp_path):
    path = tmp_path / "p1" / "p2" / "p3"
    old = os.umask(0)
    try:
        ssdtrain.Offloader(path=str(path)).close()
    finally:
        os.umask(old)
    for d in (tmp_path / "p1", tmp_path / "p1" / "p2", path):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_direct_io_required_where_unsupported(off_dir, monkeypatch):
    import errno

    import ssdtrain.store.posix as posix

    real = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(posix.os, "open", no_direct)
    with pytest.raises(ValueError, match="does not support O_DIRECT"):
        ssdtrain.Offloader(path=str(off_dir), direct_io=True)
    assert list(off_dir.iterdir()) == []
    off = ssdtrain.Offloader(path=str(off_dir))  # auto: falls back to buffered I/O
    assert "buffered" in off.stats().backend
    off.close()


def test_keep_last_layers_needs_blocks(off_dir):
    with pytest.raises(ValueError, match="keep_last_layers=2 needs blocks"):
        ssdtrain.Offloader(path=str(off_dir), keep_last_layers=2)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        ssdtrain.Offloader(torch.nn.Linear(2, 2), path=str(off_dir), layers="nope")
    with pytest.raises(TypeError, match="nn.Module"):
        ssdtrain.Offloader(model="gpt", path=str(off_dir))


def test_overrides_and_mapping(off_dir):
    off = ssdtrain.Offloader(config={"path": str(off_dir), "min_bytes": 0}, verify=True)
    assert off.config.verify and off.config.min_bytes == 0
    assert off.backend == "posix" and "posix" in off.stats().backend
    off.close()
    with pytest.raises(RuntimeError, match="closed"):
        with off:
            pass
    with pytest.raises(ValueError, match="unknown OffloadConfig key"):
        ssdtrain.offload(path=str(off_dir), min_bites=3)
