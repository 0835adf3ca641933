"""The recipes of docs/recipes.md, run as written on the CPU: each compares the final parameters
with ``torch.equal`` against the same training without offloading, and checks bytes were written.

DDP and FSDP2 run 2 ranks under torchrun with gloo (``tests/_recipes_worker.py``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib
import re

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import ssdtrain
from _recipes_worker import SEQ, STEPS, VOCAB, TinyGPT
from _torchrun import gloo_or_skip, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_recipes_worker.py")


@pytest.fixture(autouse=True)
def _restore_environ():
    """transformers, accelerate and Lightning set environment variables as they go: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(STEPS)]


def _train(model, step):
    """``step(model, tokens) -> loss``, then backward and an AdamW step; returns the parameters."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)  # dropout draws the same masks in every run
    for tokens in _batches():
        loss = step(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, f"parameters differ: {differ}"


def _offloaded(off):
    def step(model, tokens):
        with off:
            return model(tokens, tokens.roll(-1, dims=1))
    return step


# -- DDP, FSDP2, tensor parallelism: 2 or 4 ranks, gloo --------------------------------------------------
def _ranks(tmp_path, *modes: str, nproc: int = 2) -> list[dict]:
    """Runs ``_recipes_worker.py`` for ``modes`` on ``nproc`` ranks; each rank's report."""
    storage, out = tmp_path / "storage", tmp_path / "out"
    storage.mkdir()
    out.mkdir()
    torchrun(WORKER, "--modes", *modes, "--storage", str(storage), "--out", str(out), "--timeout", "120", nproc=nproc)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def _assert_exact(r: dict, where: tuple) -> None:
    """One rank's run of one mode: trained, ``torch.equal`` to the run without offloading, bytes
    written, no file left; for the tensor-parallel modes, more written than with DTensors kept."""
    assert r["names"] and r["trained"], (where, r)
    assert r["differ"] == [], f"{where}: parameters differ: {r['differ']}"
    assert r["written_bytes"] > 0, (where, r)
    if "written_bytes_dtensors_kept" in r:
        assert r["differ_dtensors_kept"] == [], (where, r)
        assert r["written_bytes"] > r["written_bytes_dtensors_kept"] > 0, (where, r)
    assert r["left_behind"] == [], where


@pytest.mark.slow
def test_ddp_and_fsdp2_two_ranks(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    gloo_or_skip()
    for rank, rep in enumerate(_ranks(tmp_path, "ddp", "fsdp2")):
        for mode in ("ddp", "fsdp2"):
            _assert_exact(rep[mode], (rank, mode))


@pytest.mark.slow
@pytest.mark.parametrize("modes, nproc", [(("tp", "tp_sp"), 2), (("fsdp2_tp_sp",), 4)],
                         ids=["two_ranks", "fsdp2_2x2"])
def test_tensor_parallel(tmp_path, modes, nproc):
    """torch's tensor parallelism (``parallelize_module``), with and without sequence
    parallelism, and inside FSDP2 on a 2 x 2 mesh (torchtitan's 2-D layout): exact, and the
    DTensor saves are written too (the run that keeps them in memory writes less)."""
    pytest.importorskip("torch.distributed.tensor.parallel")
    pytest.importorskip("torch.distributed.fsdp")
    gloo_or_skip()
    for rank, rep in enumerate(_ranks(tmp_path, *modes, nproc=nproc)):
        for mode in modes:
            _assert_exact(rep[mode], (rank, mode))


# -- one process --------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing(gpt, tmp_path, use_reentrant):
    """torch's ``checkpoint`` around each block: what reaches the offloader is each block's
    input (saved by checkpoint itself, either way) and the layers outside the blocks."""
    def step(model, tokens):
        x = model.embed(tokens)
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=use_reentrant)
        return model.loss(x, tokens.roll(-1, dims=1))

    want = _train(copy.deepcopy(gpt), step)
    model = copy.deepcopy(gpt)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0)

    def offloaded(model, tokens):
        with off:
            return step(model, tokens)

    got = _train(model, offloaded)
    s = off.stats()
    off.close()
    _assert_equal(got, want)
    full = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)
    _train(copy.deepcopy(gpt), _offloaded(full))
    assert 0 < s.written_bytes and s.saved_bytes < full.stats().saved_bytes / 2
    full.close()


# Inductor's CPU code generation still imports a torch.jit helper.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_torch_compile(tmp_path, deterministic):
    """``with off:`` around the compiled model's call (inductor). Two compiled runs are bit-equal
    only in deterministic mode, with or without offloading. (A small MLP: inductor compiles a GPT
    for 20 to 50 s on 2 cores.)"""
    torch.manual_seed(0)
    mlp = _MLP()
    x = torch.randn(16, 64)

    def run(off):
        model = copy.deepcopy(mlp)
        compiled = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(STEPS):
            if off is None:
                loss = compiled(x)
            else:
                with off:
                    loss = compiled(x)
                    # The compiled graph is one autograd op: its saves are written once it returned,
                    # at the next op's save or here (Note [a save is copied only after its op returned]).
                    off.wait()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    want = run(None)
    off = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)
    got = run(off)
    assert off.stats().written_bytes > 0
    off.close()
    _assert_equal(got, want)


def test_the_hooks_are_never_traced_by_dynamo(tmp_path):
    """Note [our hooks are never traced]: once dynamo is loaded, the pack and unpack hooks pushed
    are ``torch.compiler.disable``d (torch 2.11 traced them around a graph break, and warned on
    os.getpid at every save); close() still knows them as the offloader's and pops a step left open."""
    import torch._dynamo  # noqa: F401  (what torch.compile loads)

    off = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)
        assert getattr(pack, "_torchdynamo_disable", False) and getattr(unpack, "_torchdynamo_disable", False)
        assert pack.__self__ is off and pack.__wrapped__ is ssdtrain.Offloader._pack
        y = (x * 2).tanh().sum()
        off.wait()  # written (through the hooks pushed), then read back
    y.backward()
    want = x.grad
    x.grad = None
    (x * 2).tanh().sum().backward()
    assert torch.equal(want, x.grad) and off.stats().written_bytes > 0
    off.__enter__()  # a step whose __exit__ never ran (a Ctrl-C) is left at close()
    off.close()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 64)) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_accelerate(gpt, tmp_path):
    """As in the recipe: the unwrapped model as ``model=``, ``with off:`` inside
    ``accelerator.accumulate`` (2 micro-batches per optimizer step)."""
    accelerate = pytest.importorskip("accelerate")

    def run(offload):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model = copy.deepcopy(gpt)
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        off = ssdtrain.Offloader(accelerator.unwrap_model(model), path=str(tmp_path), min_bytes=0) if offload else None
        torch.manual_seed(5)
        for tokens in _batches() * 2:
            with accelerator.accumulate(model):
                with off if off is not None else contextlib.nullcontext():
                    loss = model(tokens, tokens.roll(-1, dims=1))
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
        written = 0
        if off is not None:
            written = off.stats().written_bytes
            off.close()
        return {n: p.detach().clone() for n, p in accelerator.unwrap_model(model).named_parameters()}, written

    want, _ = run(False)
    got, written = run(True)
    _assert_equal(got, want)
    assert written > 0
    assert not all(torch.equal(want[n], p) for n, p in gpt.named_parameters())


def test_every_row_of_the_composition_table_names_tests_that_exist():
    """docs/recipes.md's composition table: each row names at least one test, and each test it
    names (``tests/test_x.py::name``, or a bare ``name`` after it in the same row) is defined."""
    root = pathlib.Path(__file__).resolve().parent.parent
    table = (root / "docs" / "recipes.md").read_text().split("## Composition table", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| stack", "| ---"))]
    stacks = ["checkpointing", "selective", "FSDP2", "DDP", "tensor parallelism", "torch.compile", "PEFT",
              "DeepSpeed", "Megatron", "Trainer", "Lightning"]
    assert all(any(stack in row.split("|")[1] for row in rows) for stack in stacks)
    for row in rows:
        tests_cell = row.split("|")[3]
        named = 0
        path = None
        for token in re.findall(r"`([^`]+)`", tests_cell):
            if token.startswith("tests/"):
                path, _, name = token.partition("::")
                source = (root / path).read_text()
            else:
                name = token
            if name.startswith("test_") and path is not None:
                assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} (in: {row[:60]})"
                named += 1
            elif token.startswith("tests/test_"):
                named += 1  # a whole file
        assert named, f"no test named in: {row[:60]}"
