"""Token batches for ``ssdtrain bench``: a synthetic corpus on disk, read by NVIDIA DALI.

The corpus is generated locally from a seed (no download): a sparse random Markov chain over
the vocabulary, so a model can learn something from it. It is cached as ``.npy`` shards, one
sequence of ``seq + 1`` int32 tokens per file, under ``cache_dir``; a second run with the same
shape and seed reuses them.

Batches come from a DALI pipeline (``fn.readers.numpy``) through DALI's PyTorch iterator when
``nvidia-dali`` is installed; without it, from a plain torch ``DataLoader`` over the same files,
and one log line says so. Either way the loader yields ``(tokens, targets)`` int64 tensors of
shape ``(batch, seq)`` forever (epochs wrap)::

    loader = TokenLoader(cache_dir, batch_size=8, seq=128, vocab=512)
    for step, (tokens, targets) in zip(range(10), loader):
        loss = model(tokens, targets)
    loader.close()

On a machine with CUDA, ``device="cuda"`` builds the GPU pipeline: the numpy reader's ``gpu``
backend reads the shards with GPUDirect Storage (cuFile) straight into GPU memory.
"""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["TokenLoader", "dali_available", "load_npy", "make_corpus", "save_npy"]

logger = logging.getLogger(__name__)

_DONE = "COMPLETE"
_BRANCHING = 4  # likely successors per token in the synthetic Markov chain
_NPY_MAGIC = b"\x93NUMPY\x01\x00"


def save_npy(path: str | os.PathLike, tokens: torch.Tensor) -> None:
    """Write a 1-D int32 tensor as a version 1.0 ``.npy`` file (numpy itself is not needed)."""
    if tokens.dtype != torch.int32 or tokens.dim() != 1:
        raise ValueError(f"save_npy takes a 1-D int32 tensor, got {tokens.dtype} {tuple(tokens.shape)}")
    header = f"{{'descr': '<i4', 'fortran_order': False, 'shape': ({tokens.numel()},), }}"
    # The format pads the header with spaces and a newline so the data starts 64-byte aligned.
    pad = -(len(_NPY_MAGIC) + 2 + len(header) + 1) % 64
    header = (header + " " * pad + "\n").encode("latin1")
    with open(path, "wb") as f:
        f.write(_NPY_MAGIC + struct.pack("<H", len(header)) + header)
        # Native byte order is written as '<i4': ssdtrain runs on little-endian hosts only.
        tokens = tokens.contiguous()
        f.write(ctypes.string_at(tokens.data_ptr(), tokens.numel() * tokens.element_size()))


def load_npy(path: str | os.PathLike) -> torch.Tensor:
    """Read a 1-D little-endian int32 ``.npy`` file written by :func:`save_npy`."""
    data = Path(path).read_bytes()
    if data[:6] != _NPY_MAGIC[:6]:
        raise ValueError(f"{path}: not a .npy file")
    major = data[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", data[8:10]), 10
    else:
        (hlen,), start = struct.unpack("<I", data[8:12]), 12
    header = ast.literal_eval(data[start:start + hlen].decode("latin1"))
    if header.get("descr") != "<i4" or header.get("fortran_order") or len(header.get("shape", ())) != 1:
        raise ValueError(f"{path}: expected a 1-D little-endian int32 array, got header {header}")
    return torch.frombuffer(bytearray(data[start + hlen:]), dtype=torch.int32)


def dali_available() -> bool:
    """True if NVIDIA DALI and its PyTorch plugin import."""
    try:
        import nvidia.dali  # noqa: F401
        import nvidia.dali.plugin.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def make_corpus(cache_dir: str | os.PathLike, *, vocab: int, seq: int, num_samples: int = 256,
                seed: int = 0) -> list[str]:
    """Create (or reuse) the synthetic corpus and return its shard paths, sorted.

    Deterministic in ``(vocab, seq, num_samples, seed)``: each combination has its own
    subdirectory, completed by a marker file written last, so an interrupted run is redone.
    """
    if vocab < 2 or seq < 1 or num_samples < 1:
        raise ValueError(f"corpus needs vocab >= 2, seq >= 1, num_samples >= 1; got {vocab}, {seq}, {num_samples}")
    root = Path(cache_dir) / f"tokens-v{vocab}-s{seq}-n{num_samples}-seed{seed}"
    names = [f"{i:06d}.npy" for i in range(num_samples)]
    if (root / _DONE).exists():
        return [str(root / n) for n in names]
    root.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, _BRANCHING), generator=g, dtype=torch.int32)
    tokens = torch.empty(num_samples, seq + 1, dtype=torch.int32)
    tokens[:, 0] = torch.randint(0, vocab, (num_samples,), generator=g, dtype=torch.int32)
    choices = torch.randint(0, _BRANCHING, (num_samples, seq), generator=g)
    for t in range(seq):
        tokens[:, t + 1] = successors[tokens[:, t].long(), choices[:, t]]
    # Build in a sibling temp dir and rename, so readers never see half a corpus.
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    for name, row in zip(names, tokens):
        save_npy(tmp / name, row)
    (tmp / _DONE).write_text("ok\n")
    try:
        os.rename(tmp, root)
    except OSError:  # another process finished first
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()
    return [str(root / n) for n in names]


class TokenLoader:
    """Endless ``(tokens, targets)`` batches over the cached corpus.

    Args:
        cache_dir: where the corpus shards live (created if missing).
        batch_size: sequences per batch.
        seq: tokens per sequence (targets are the same tokens shifted by one).
        vocab: vocabulary size of the synthetic corpus.
        num_samples: sequences in the corpus (at least ``batch_size``).
        seed: corpus and shuffling seed.
        backend: ``"auto"`` (DALI if installed, else torch), ``"dali"`` or ``"torch"``.
        device: ``"cpu"``; ``"cuda"`` builds the GPU pipeline (GPUDirect Storage reads).
        num_threads: DALI CPU threads.
    """

    def __init__(self, cache_dir: str | os.PathLike, *, batch_size: int, seq: int, vocab: int,
                 num_samples: int = 256, seed: int = 0, backend: str = "auto",
                 device: str = "cpu", num_threads: int = 1) -> None:
        if backend not in ("auto", "dali", "torch"):
            raise ValueError(f"backend must be 'auto', 'dali' or 'torch', got {backend!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_samples = max(num_samples, batch_size)
        self.files = make_corpus(cache_dir, vocab=vocab, seq=seq, num_samples=num_samples, seed=seed)
        self.batch_size = batch_size
        self.device = device
        self._seed = seed
        if backend == "auto":
            backend = "dali" if dali_available() else "torch"
            if backend == "torch":
                logger.warning("NVIDIA DALI is not installed; reading tokens with a torch DataLoader "
                               "(pip install 'ssdtrain[dali]' for the DALI pipeline)")
        elif backend == "dali" and not dali_available():
            raise ImportError("NVIDIA DALI is not installed; pip install 'ssdtrain[dali]'")
        self.backend = backend
        self._iter: Iterator | None = None
        self._dali = None
        if backend == "dali":
            self._dali = self._build_dali(num_threads)
        else:
            self._loader = self._build_torch()

    # -- DALI -------------------------------------------------------------------------------
    def _build_dali(self, num_threads: int):
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        gpu = self.device == "cuda"
        if gpu:
            # GPU pipeline: the numpy reader's gpu backend reads through GPUDirect Storage
            # (cuFile) into device memory; needs CUDA, which this import path alone never touches.
            device_id = torch.cuda.current_device()
        else:
            device_id = None  # CPU-only pipeline: no GPU needed at all

        @pipeline_def(batch_size=self.batch_size, num_threads=num_threads, device_id=device_id,
                      seed=self._seed)
        def pipeline(files):
            return fn.readers.numpy(device="gpu" if gpu else "cpu", files=files, name="Reader",
                                    random_shuffle=True, seed=self._seed)

        pipe = pipeline(files=self.files)
        return DALIGenericIterator([pipe], ["tokens"], reader_name="Reader", auto_reset=True,
                                   last_batch_policy=LastBatchPolicy.DROP)

    def _dali_batches(self) -> Iterator[torch.Tensor]:
        while True:
            for batch in self._dali:  # auto_reset: the next `for` starts a new epoch
                yield batch[0]["tokens"]

    # -- torch fallback --------------------------------------------------------------------
    def _build_torch(self):
        return torch.utils.data.DataLoader(
            _ShardDataset(self.files), batch_size=self.batch_size, shuffle=True, drop_last=True,
            generator=torch.Generator().manual_seed(self._seed), num_workers=0,
        )

    def _torch_batches(self) -> Iterator[torch.Tensor]:
        while True:
            yield from self._loader

    # -- public ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        source = self._dali_batches() if self.backend == "dali" else self._torch_batches()
        for raw in source:
            # int32 -> int64 is a copy: nothing aliases the reader's buffers afterwards.
            raw = raw.to(torch.int64)
            if self.device == "cuda" and not raw.is_cuda:
                raw = raw.cuda(non_blocking=True)
            yield raw[:, :-1].contiguous(), raw[:, 1:].contiguous()

    def close(self) -> None:
        """Release the DALI pipeline (idempotent)."""
        self._dali = None


class _ShardDataset(torch.utils.data.Dataset):
    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        return load_npy(self.files[i])
