"""ssdtrain probe (ssdtrain/tools/probe.py): results, JSON, warnings, bad paths, nothing left behind."""

from __future__ import annotations

import json
import os

import pytest
from _benchmarks import load_benchmark

from ssdtrain.tools import probe
from ssdtrain.store import _fs

SMALL = dict(size_bytes=4 << 20, block_bytes=1 << 20, threads=2)


def test_probe_measures_and_leaves_nothing(tmp_path):
    seen = []
    r = probe.probe_path(tmp_path, progress=lambda phase, done, total: seen.append((phase, done, total)), **SMALL)
    assert r.path == str(tmp_path)
    assert r.fs_type == _fs.fs_type(tmp_path)
    assert r.write_gbps > 0 and r.read_gbps > 0
    assert r.size_bytes == 4 << 20 and r.block_bytes == 1 << 20 and r.threads == 2
    assert 0 < r.free_bytes <= r.total_bytes
    assert r.drive_writes_per_day is None
    assert list(tmp_path.iterdir()) == []
    assert {p for p, _, _ in seen} == {"alloc", "write", "read"}
    assert r.first_write_gbps > 0
    assert ("write", 4 << 20, 4 << 20) in seen and ("read", 4 << 20, 4 << 20) in seen


def test_probe_direct_io_matches_the_filesystem(tmp_path):
    r = probe.probe_path(tmp_path, **SMALL)
    assert r.direct_io == _fs.direct_io_supported(tmp_path)
    if not r.direct_io:
        assert any("O_DIRECT" in w for w in r.warnings)


def test_probe_drive_writes_per_day(tmp_path):
    r = probe.probe_path(tmp_path, write_rate=1e9, **SMALL)
    assert r.drive_writes_per_day == pytest.approx(1e9 * 86400 / r.total_bytes)


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or _fs.fs_type("/dev/shm") != "tmpfs", reason="no tmpfs /dev/shm")
def test_probe_warns_on_tmpfs(tmp_path):
    d = os.path.join("/dev/shm", f"ssdtrain-test-{os.getpid()}")
    os.mkdir(d, 0o700)
    try:
        r = probe.probe_path(d, **SMALL)
        assert os.listdir(d) == []
    finally:
        os.rmdir(d)
    assert r.fs_type == "tmpfs"
    assert any("RAM" in w for w in r.warnings)


def test_probe_warns_on_network_fs(tmp_path, monkeypatch):
    monkeypatch.setattr(_fs, "fs_type", lambda path: "nfs4")
    r = probe.probe_path(tmp_path, **SMALL)
    assert any("network filesystem" in w for w in r.warnings)


def test_probe_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        probe.probe_path(tmp_path / "missing", **SMALL)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        probe.probe_path(f, **SMALL)
    with pytest.raises(ValueError, match="block_bytes"):
        probe.probe_path(tmp_path, size_bytes=1 << 20, block_bytes=1000)
    with pytest.raises(ValueError, match="size_bytes"):
        probe.probe_path(tmp_path, size_bytes=1 << 10, block_bytes=4096)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_probe_unwritable(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            probe.probe_path(d, **SMALL)
    finally:
        d.chmod(0o700)


def test_cli_json_and_table(tmp_path, capsys):
    out = tmp_path / "probe.json"
    store = tmp_path / "store"
    store.mkdir()
    rc = probe.main([str(store), "--size", "2MiB", "--block", "1MiB", "--threads", "2",
                     "--write-rate", "full", "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    (r,) = doc["results"]
    assert set(r) >= {"path", "fs_type", "direct_io", "write_gbps", "read_gbps", "free_bytes",
                      "total_bytes", "warnings", "drive_writes_per_day"}
    assert r["path"] == str(store) and r["size_bytes"] == 2 << 20
    assert r["drive_writes_per_day"] == pytest.approx(r["write_gbps"] * 1e9 * 86400 / r["total_bytes"])
    printed = capsys.readouterr().out
    assert "write GB/s" in printed and str(store) in printed
    # No CUDA device here: the host tier's copy rates are said to be not measured (tests/gpu measures them).
    assert doc["host"] == {"device": None, "why": "no CUDA device"}
    assert "host tier: copy rates not measured (no CUDA device)" in printed
    rc = probe.main([str(store), "--size", "2MiB", "--block", "1MiB", "--no-host", "--json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["host"]["why"] == "--no-host"
    assert list(store.iterdir()) == []


def test_cli_json_to_stdout_and_bad_path(tmp_path, capsys):
    rc = probe.main([str(tmp_path), str(tmp_path / "missing"), "--size", "1MiB", "--block", "1MiB",
                     "--json", "-", "--quiet"])
    assert rc == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert [r["path"] for r in doc["results"]] == [str(tmp_path)]
    assert "missing" in captured.err and "no such directory" in captured.err


def test_cli_bad_size(capsys):
    with pytest.raises(SystemExit) as e:
        probe.main(["--size", "lots"])
    assert e.value.code == 2


def test_progress_bar_draws_on_a_terminal():
    import io

    s = io.StringIO()
    bar = probe._Bar(s, "x", enabled=True)
    bar("write", 1, 2)
    bar("write", 2, 2)
    bar.finish()
    assert "50%" in s.getvalue() and "100%" in s.getvalue()


def test_io_throughput_benchmark_smoke(tmp_path, capsys):
    """benchmarks/io_throughput.py at a tiny size, so that it cannot rot."""
    mod = load_benchmark("io_throughput")
    out = tmp_path / "bench.json"
    rc = mod.main(["--path", str(tmp_path), "--size", "2MiB", "--tensor", "1MiB", "--rounds", "1",
                   "--chunk", "1MiB", "--io-threads", "2", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["median_gbps"]) == {"raw", "backend", "offloader"}
    assert set(res["ratio_to_raw"]) == {"backend", "offloader"}
    assert all(w > 0 and r > 0 for w, r in res["median_gbps"].values())
    assert "write/raw" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [out]
