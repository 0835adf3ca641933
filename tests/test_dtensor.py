"""DTensor saves (torch's tensor parallelism) go to storage by their parts and come back exact
(Note [a DTensor is saved by its parts], ``ssdtrain/engine/keep.py``).

One process, a 1-rank gloo group: DTensor's dispatch, flatten and unflatten are the same code as on
many ranks. Two and four ranks: ``tests/test_recipes.py::test_tensor_parallel``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import ssdtrain
from _recipes_worker import SEQ, VOCAB, TinyGPT, TPBlock, tensor_parallel
from ssdtrain import StorageError
from ssdtrain.engine import keep

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
dtensor = pytest.importorskip("torch.distributed.tensor")
pytest.importorskip("torch.distributed.tensor.parallel")
DTensor, Replicate, Shard = dtensor.DTensor, dtensor.Replicate, dtensor.Shard

# Dropout on a sequence-parallel DTensor: torch's CPU mesh draws from the default generator
# (the same masks in both runs, as the equality checks show), and warns so.
pytestmark = pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support:UserWarning")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _tp_model(mesh, sequence_parallel: bool = False, layers: int = 2) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(layers=layers, block=TPBlock)
    tensor_parallel(model, mesh, sequence_parallel)
    return model


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _step(model, x, off, autocast=False):
    """One forward and backward (dropout seeded); the loss and every gradient, as local tensors."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if off is None:
            loss = model(x, x.roll(-1, dims=1))
        else:
            with off:
                loss = model(x, x.roll(-1, dims=1))
                off.wait()  # every write lands before backward: it reads them all back
    loss.backward()
    return loss.detach(), [_local(p.grad).clone() for p in model.parameters()]


def _assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    differ = [i for i, (x, y) in enumerate(zip(a[1], b[1])) if not torch.equal(x, y)]
    assert not differ, f"gradients differ: {differ}"


def _saves(fn, autocast: bool = False) -> dict[str, int]:
    """What ``fn()`` saves for backward without offloading: bytes by type (a DTensor's by its
    local shard), under bf16 autocast if ``autocast``."""
    seen: dict[str, int] = {}

    def pack(t):
        local = t.to_local() if isinstance(t, DTensor) else t
        seen[type(t).__name__] = seen.get(type(t).__name__, 0) + local.numel() * local.element_size()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tensor_parallel_blocks_are_exact_with_their_dtensor_saves_written(mesh, tmp_path, monkeypatch,
                                                                         sequence_parallel):
    model = _tp_model(mesh, sequence_parallel)
    x = _tokens()
    assert _saves(lambda: model(x, x)).get("DTensor", 0) > 0, "no DTensor saved: the test proves nothing"
    want = _step(model, x, None)
    off = ssdtrain.Offloader(model, path=str(tmp_path / "a"), min_bytes=0)
    for _ in range(2):
        _assert_same(_step(model, x, off), want)
    got = off.stats()
    off.close()
    assert got.read_bytes > 0

    # The same run with DTensors kept as they are, as before the note: less is written.
    monkeypatch.setattr(keep, "_BY_PARTS", ())
    plain = ssdtrain.Offloader(model, path=str(tmp_path / "b"), min_bytes=0)
    for _ in range(2):
        _assert_same(_step(model, x, plain), want)
    without = plain.stats()
    plain.close()
    assert got.written_bytes > without.written_bytes > 0, (got.written_bytes, without.written_bytes)


def test_sequence_parallel_blocks_under_bf16_autocast_are_exact(mesh, tmp_path):
    """Mixed precision: the blocks' DTensor activations are bf16 and fp32 (norms); the weights'
    bf16 casts (DTensors too) are autocast's, kept as they are (keep._is_weight_cast)."""
    model = _tp_model(mesh, sequence_parallel=True)
    x = _tokens()
    want = _step(model, x, None, autocast=True)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0)
    _assert_same(_step(model, x, off, autocast=True), want)
    s = off.stats()
    off.close()
    assert s.written_bytes > 0 and s.read_bytes > 0
    # Not offered to storage: the linears' bf16 weight casts (and the parameters themselves).
    casts = sum(p.to_local().numel() * 2 for n, p in model.named_parameters()
                if n.startswith("blocks") and n.endswith("weight") and ".w" in n)
    every = sum(_saves(lambda: model(x, x.roll(-1, dims=1)), autocast=True).values())
    assert every - s.saved_bytes >= casts > 0, (every, s.saved_bytes, casts)


def test_a_dtensor_save_is_written_once_and_rebuilt_with_its_placement_views_and_dtype(mesh, tmp_path):
    """Only DTensors are saved here: every byte written is a DTensor's local part, each storage
    once (``a`` and its transpose), in fp32 and bf16; the gradients are the same DTensors."""
    from torch.distributed.tensor import distribute_tensor

    torch.manual_seed(0)
    a0 = distribute_tensor(torch.randn(64, 128), mesh, [Shard(0)])
    b0 = distribute_tensor(torch.randn(128, 32, dtype=torch.bfloat16), mesh, [Replicate()])

    def run(off):
        a, b = a0.detach().requires_grad_(), b0.detach().requires_grad_()

        def fwd():
            h = torch.tanh(a)                     # saves its output (fp32)
            m = h.t() @ h                         # h again, and its transpose: one storage
            y = (m.to(torch.bfloat16) @ b).float()  # a bf16 DTensor activation
            return y.square().sum()

        if off is None:
            loss = fwd()
        else:
            with off:
                loss = fwd()
                off.wait()
        loss.backward()
        return loss.detach(), a.grad, b.grad

    want = run(None)
    off = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)
    got = run(off)
    s = off.stats()
    off.close()
    assert torch.equal(got[0].to_local(), want[0].to_local())
    for g, w in zip(got[1:], want[1:]):
        assert isinstance(g, DTensor) and g.placements == w.placements, (type(g), getattr(g, "placements", None))
        assert g.dtype == w.dtype and torch.equal(g.to_local(), w.to_local())
    # tanh's output h (fp32; saved by tanh, and as h and h.t() by the first matmul: one entry),
    # the bf16 m (the second matmul; b is a leaf) and y (square): all DTensors, each once.
    assert s.written_bytes == 64 * 128 * 4 + 128 * 128 * 2 + 128 * 32 * 4, s.written_bytes
    assert s.read_bytes > 0


def test_a_dtensor_parameter_is_never_written_even_through_a_detached_alias(mesh, tmp_path):
    """``w.detach()`` is no view of ``w`` for autograd, but its local part is the parameter's
    shard: pack finds it among the parameters' storages (keep.storage_keys) and keeps it."""
    from torch.distributed.tensor import distribute_tensor

    lin = nn.Linear(256, 256, bias=False)
    lin.weight = nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    h = distribute_tensor(torch.randn(256, 256), mesh, [Replicate()]).requires_grad_()
    off = ssdtrain.Offloader(lin, path=str(tmp_path), min_bytes=0)
    with off:
        loss = (lin.weight.detach() * h).sum()  # saves the detached weight (for h's gradient)
        off.wait()
    loss.backward()
    s = off.stats()
    off.close()
    assert torch.equal(h.grad.to_local(), lin.weight.detach().to_local())
    assert s.written_bytes == 0 and s.saved_bytes == 0, (s.written_bytes, s.saved_bytes)


def test_a_dtensor_in_a_kept_module_stays_in_memory(mesh, tmp_path):
    from torch.distributed.tensor import distribute_tensor

    class Tanh(nn.Module):
        def forward(self, x):
            return torch.tanh(x)

    a = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)]).requires_grad_()
    saved = {}
    for kept in (False, True):
        m = Tanh()
        off = ssdtrain.Offloader(m, path=str(tmp_path), min_bytes=0, keep_modules=[m] if kept else [])
        with off:
            loss = m(a).sum()  # tanh saves its output; sum saves nothing
            off.wait()
        loss.backward()
        saved[kept] = off.stats().saved_bytes, off.stats().written_bytes
        off.close()
    assert saved == {False: (64 * 128 * 4,) * 2, True: (0, 0)}, saved


def test_keep_takes_apart_only_the_subclasses_it_lists(mesh):
    from torch.distributed.tensor import distribute_tensor

    d = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    assert keep.by_parts(d)
    assert not keep.by_parts(torch.randn(4)) and not keep.by_parts(nn.Parameter(torch.randn(4)))

    class Other(torch.Tensor):
        pass

    assert not keep.by_parts(torch.randn(4).as_subclass(Other))
    assert keep.as_is(torch.randn(4).as_subclass(Other), frozenset(), False)



def test_checkpointed_sequence_parallel_blocks_offload_their_dtensor_inputs(mesh, tmp_path, monkeypatch):
    """The recommended GPU setup under sequence parallelism: with activation checkpointing a
    block saves only its input, a DTensor sharded by sequence; those inputs go to storage."""
    model = _tp_model(mesh, sequence_parallel=True)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = _Checkpointed(block)
    x = _tokens()
    want = _step(model, x, None)
    written = []
    for by_parts in (keep._BY_PARTS, ()):  # then DTensors kept as they are, as before the note
        monkeypatch.setattr(keep, "_BY_PARTS", by_parts)
        off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0)
        for _ in range(2):
            _assert_same(_step(model, x, off), want)
        written.append(off.stats().written_bytes)
        assert off.stats().read_bytes > 0
        off.close()
    inputs = 2 * 2 * SEQ * 64 * 4  # per step: two blocks' (2, SEQ, 64) fp32 inputs
    assert written[0] - written[1] >= 2 * inputs, written


class _Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("wait", [False, True], ids=["in_memory", "read_back"])
@pytest.mark.parametrize("through_alias", [False, True], ids=["itself", "an_alias_after_it_died"])
def test_an_in_place_change_of_a_saved_dtensor_fails_backward_as_without_offloading(mesh, tmp_path, wait,
                                                                                      through_alias):
    """The change bumps the DTensor's version, not its shard's (Parts' guard sees it): without
    offloading PyTorch raises, and so must backward with offloading, whether the shard comes
    from memory or from the drive, and also when the saved DTensor itself died and a detached
    alias of it (which shares its version counter, and does not keep it alive) was changed."""
    from torch.distributed.tensor import distribute_tensor

    a = distribute_tensor(torch.randn(64, 128), mesh, [Shard(0)]).requires_grad_()

    def forward():
        h = torch.tanh(a)  # saves its output
        loss = (h * 3).sum()
        if through_alias:
            d = h.detach()
            del h
            d.mul_(2)
        else:
            h.mul_(2)
        return loss

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        forward().backward()
    off = ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)
    with off:
        loss = forward()
        if wait:
            off.wait()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[DTensor of shape \(64, 128\)\]"):
        loss.backward()
    s = off.stats()
    off.close()
    assert s.saved_bytes == 64 * 128 * 4 and (s.written_bytes > 0) == wait, (s.saved_bytes, s.written_bytes)


def test_a_dtensor_save_is_unpacked_again_in_a_second_backward(mesh, tmp_path):
    """retain_graph: the same Parts are rebuilt twice, from what was read back."""
    from torch.distributed.tensor import distribute_tensor

    a0 = distribute_tensor(torch.randn(64, 128), mesh, [Shard(1)])
    grads = []
    for off in (None, ssdtrain.Offloader(path=str(tmp_path), min_bytes=0)):
        a = a0.detach().requires_grad_()
        with off if off is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = (torch.tanh(a) * torch.sigmoid(a)).sum()
            if off is not None:
                off.wait()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(a.grad.to_local())
        if off is not None:
            assert off.stats().read_bytes > 0
            off.close()
    assert torch.equal(grads[0], grads[1])


def test_dtensor_micro_batches_backward_in_either_order_are_exact(mesh, tmp_path, monkeypatch):
    """Two micro-batches' forwards in their own scopes, backwards in reverse order, each after
    ``prefetch``: exact, with the DTensor shards written (more than with DTensors kept)."""
    model = _tp_model(mesh, sequence_parallel=True)
    xs = [_tokens(), _tokens().roll(3, dims=1)]

    def run(off):
        model.zero_grad(set_to_none=True)
        losses = []
        for i, x in enumerate(xs):
            torch.manual_seed(7 + i)
            with off.microbatch(i) if off is not None else contextlib.nullcontext():
                losses.append(model(x, x.roll(-1, dims=1)))
        if off is not None:
            off.wait()
        for i in (1, 0):
            if off is not None:
                off.prefetch(i)
            losses[i].backward()
        return [_local(p.grad).clone() for p in model.parameters()]

    want = run(None)
    written = []
    for by_parts in (keep._BY_PARTS, ()):
        monkeypatch.setattr(keep, "_BY_PARTS", by_parts)
        off = ssdtrain.Offloader(model, path=str(tmp_path / f"{len(written)}"), min_bytes=0)
        got = run(off)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        written.append(off.stats().written_bytes)
        assert off.stats().read_bytes > 0
        off.close()
    assert written[0] > written[1], written


def _dtensor_forward(a):
    """Saves DTensors only: tanh's output (fp32) and the bf16 product's two inputs (one through views)."""
    h = torch.tanh(a)
    return (h.to(torch.bfloat16) * h.to(torch.bfloat16).t().t()).float().sum()


def test_a_failing_drive_under_dtensor_saves_keeps_them_or_raises(mesh, tmp_path, monkeypatch):
    """Note [a failing drive does not corrupt training], for saves taken apart: with every third
    write failing, ``on_error="keep"`` keeps those shards and backward is exact; a failed read
    raises and never hands back garbage. Only DTensors are saved, so every write and read here
    is of a shard."""
    from torch.distributed.tensor import distribute_tensor

    from test_hardening import _inject_io

    a0 = distribute_tensor(torch.randn(256, 256), mesh, [Shard(0)])

    def grad(off):
        a = a0.detach().requires_grad_()
        if off is None:
            loss = _dtensor_forward(a)
        else:
            with off:
                loss = _dtensor_forward(a)
                off.wait()
        loss.backward()
        return a.grad.to_local()

    want = grad(None)
    with monkeypatch.context() as m:
        _inject_io(m, "write", lambda n: n % 3 == 0, "eio")
        off = ssdtrain.Offloader(path=str(tmp_path / "w"), min_bytes=0, on_error="keep")
        with pytest.warns(RuntimeWarning, match="a write failed"):
            assert torch.equal(grad(off), want)
        assert off.stats().failed_writes > 0 and off.stats().written_bytes > 0
        off.close()
    with monkeypatch.context() as m:
        _inject_io(m, "read", lambda n: n == 1, "eio")
        off = ssdtrain.Offloader(path=str(tmp_path / "r"), min_bytes=0)
        with pytest.raises(StorageError, match="could not read a saved activation back"):
            grad(off)
        assert off.stats().failed_reads >= 1
        off.close()


# Inductor's CPU code generation still imports a torch.jit helper.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_compiled_tensor_parallel_blocks_offload_exactly(mesh, tmp_path, deterministic, sequence_parallel):
    # torch.compile (as torchtitan runs TP): AOTAutograd takes the DTensors apart itself, so the
    # compiled graph saves their local tensors, plain ones, which are offloaded as any save.
    model = _tp_model(mesh, sequence_parallel)
    compiled = torch.compile(model)
    x = _tokens()
    want = _step(compiled, x, None)
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0)
    for _ in range(2):
        _assert_same(want, _step(compiled, x, off))
    s = off.stats()
    assert s.written_bytes > 0 and s.read_bytes == s.written_bytes, s
    off.close()
