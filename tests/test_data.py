"""Tests for ssdtrain/bench/data.py: synthetic corpus, DALI pipeline and the torch fallback."""

import logging
from pathlib import Path

import pytest
import torch

from ssdtrain.bench import data

SHAPE = dict(vocab=97, seq=16)


def _take(loader, n):
    return [batch for _, batch in zip(range(n), loader)]


def test_corpus_is_deterministic_and_cached(tmp_path):
    a = data.make_corpus(tmp_path / "a", num_samples=8, seed=1, **SHAPE)
    b = data.make_corpus(tmp_path / "b", num_samples=8, seed=1, **SHAPE)
    c = data.make_corpus(tmp_path / "a", num_samples=8, seed=2, **SHAPE)
    assert len(a) == 8
    for fa, fb in zip(a, b):
        assert torch.equal(data.load_npy(fa), data.load_npy(fb))
    assert not torch.equal(data.load_npy(a[0]), data.load_npy(c[0]))
    mtime = [p.stat().st_mtime_ns for p in map(Path, a)]
    again = data.make_corpus(tmp_path / "a", num_samples=8, seed=1, **SHAPE)
    assert again == a
    assert mtime == [p.stat().st_mtime_ns for p in map(Path, a)]
    tokens = data.load_npy(a[0])
    assert tokens.dtype == torch.int32 and tokens.shape == (SHAPE["seq"] + 1,)
    assert 0 <= int(tokens.min()) and int(tokens.max()) < SHAPE["vocab"]


def test_npy_files_are_real_npy(tmp_path):
    np = pytest.importorskip("numpy")
    t = torch.arange(100, dtype=torch.int32)[7:77]
    data.save_npy(tmp_path / "x.npy", t)
    assert np.load(tmp_path / "x.npy").tolist() == t.tolist()
    np.save(tmp_path / "y.npy", np.arange(5, dtype=np.int32))
    assert data.load_npy(tmp_path / "y.npy").tolist() == [0, 1, 2, 3, 4]
    np.save(tmp_path / "z.npy", np.arange(5, dtype=np.float64))
    with pytest.raises(ValueError, match="int32"):
        data.load_npy(tmp_path / "z.npy")


def _check_batches(loader, batches, num_samples):
    for tokens, targets in batches:
        assert tokens.shape == targets.shape == (loader.batch_size, SHAPE["seq"])
        assert tokens.dtype == targets.dtype == torch.int64
        assert torch.equal(tokens[:, 1:], targets[:, :-1])
    # One epoch (drop_last) covers distinct corpus rows; later epochs wrap around.
    corpus = {tuple(data.load_npy(f)[:-1].tolist()) for f in loader.files}
    seen = [tuple(row.tolist()) for tokens, _ in batches for row in tokens]
    assert set(seen) <= corpus
    per_epoch = num_samples // loader.batch_size * loader.batch_size
    assert len(set(seen[:per_epoch])) == per_epoch


def test_torch_loader(tmp_path):
    loader = data.TokenLoader(tmp_path, batch_size=4, num_samples=10, backend="torch", **SHAPE)
    assert loader.backend == "torch"
    _check_batches(loader, _take(loader, 7), 10)  # 2 batches per epoch: wraps 3 times
    loader.close()


def test_dali_loader(tmp_path):
    pytest.importorskip("nvidia.dali")
    loader = data.TokenLoader(tmp_path, batch_size=4, num_samples=10, backend="dali", **SHAPE)
    assert loader.backend == "dali"
    _check_batches(loader, _take(loader, 7), 10)
    loader.close()


def test_auto_without_dali_says_so_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(data, "dali_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="ssdtrain.bench.data"):
        loader = data.TokenLoader(tmp_path, batch_size=2, num_samples=4, **SHAPE)
        _take(loader, 3)
    assert loader.backend == "torch"
    lines = [r for r in caplog.records if "DALI" in r.getMessage()]
    assert len(lines) == 1 and "DataLoader" in lines[0].getMessage()


def test_explicit_dali_missing_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "dali_available", lambda: False)
    with pytest.raises(ImportError, match="pip install 'ssdtrain\\[dali\\]'"):
        data.TokenLoader(tmp_path, batch_size=2, backend="dali", **SHAPE)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="backend"):
        data.TokenLoader(tmp_path, batch_size=2, backend="tf", **SHAPE)
    with pytest.raises(ValueError, match="device"):
        data.TokenLoader(tmp_path, batch_size=2, device="tpu", **SHAPE)
