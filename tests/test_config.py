"""Bad input is refused at construction, with a message that names the field and what to do."""

import os

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
])
def test_invalid_field_is_named(field, value, words):
    with pytest.raises(ValueError) as info:
        OffloadConfig(**{field: value})
    assert words in str(info.value)


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
