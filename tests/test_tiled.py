"""ssdtrain.longctx.tiled: an MLP computed a tile of the sequence at a time.

What is equal and what is bounded (float32, this CPU's MKL): the output and the input's gradient
are ``torch.equal`` to the untiled MLP's when every tile has 4, 8 or at least 12 rows (each tile
is a slice of rows of the same products; MKL's kernels for 1-3, 5-7 and 9-11 rows round
otherwise: ``ROW_REL``); a weight's gradient is a sum over tokens split into one partial sum per
tile, within ``WEIGHT_REL`` of the untiled one (measured: under 5e-7 of the gradient's largest
entry). With an offloader every gradient is ``torch.equal`` to the same tiled model's without one.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import ssdtrain
from ssdtrain.longctx.tiled import TiledMLP, tile_bounds, tile_in_place, tiled_mlp

H, I = 64, 224  # a Llama MLP's shape: intermediate = 3.5 x hidden
WEIGHT_REL = 2e-6  # weights' gradients, tiled vs untiled: max |diff| / max |grad| (measured < 5e-7)
ROW_REL = 1e-6  # output and input gradient where a tile has a row count MKL rounds otherwise


class SwiGLU(nn.Module):
    """The shape of Hugging Face's ``LlamaMLP``."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.gate_proj(x)) * self.up_proj(x)
        if self.dropout:
            y = F.dropout(y, self.dropout, training=self.training)
        return self.down_proj(y)


class Block(nn.Module):
    def __init__(self, tile_tokens: int | None) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.mlp = SwiGLU() if tile_tokens is None else TiledMLP(SwiGLU(), tile_tokens=tile_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    """An input projection, then blocks (in ``blocks``, as the offloader finds them)."""

    def __init__(self, tile_tokens: int | None = None, recompute: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.blocks = nn.ModuleList(Block(tile_tokens) for _ in range(2))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return x.square().mean()


def _net(tile_tokens=None, recompute=False) -> Net:
    torch.manual_seed(0)  # the same weights whatever the wrapping (the same draws, in order)
    return Net(tile_tokens, recompute)


def _step(net: Net, x0: torch.Tensor, off=None, backward_inside=False):
    """Loss, input gradient and parameters' gradients (by their untiled names)."""
    net.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    with off if off is not None else contextlib.nullcontext():
        loss = net(x)
        if off is not None:
            off.wait()  # every write lands before backward: backward reads every save back
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = {n.replace("mlp.mlp.", "mlp."): p.grad.clone() for n, p in net.named_parameters()}
    return loss.detach(), x.grad.clone(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def x0():
    return torch.randn(2, 256, H, generator=torch.Generator().manual_seed(1))


def test_tile_bounds():
    assert tile_bounds(10, tile_tokens=4) == ((0, 4), (4, 8), (8, 10))
    assert tile_bounds(10, tiles=3) == ((0, 4), (4, 8), (8, 10))
    assert tile_bounds(10, tiles=20) == tuple((i, i + 1) for i in range(10))
    assert tile_bounds(10) == ((0, 10),)
    assert tile_bounds(10, default_tokens=6) == ((0, 6), (6, 10))
    for bad in ({"tiles": 0}, {"tile_tokens": -1}, {"tile_tokens": 2.5}, {"tiles": 2, "tile_tokens": 3}):
        with pytest.raises(ValueError):
            tile_bounds(10, **bad)


@pytest.mark.parametrize("tile_tokens", [37, 100, 85])
def test_tiled_matches_untiled(x0, tile_tokens):
    """Output and input gradient equal (within ROW_REL where the last tile has 2 rows: 256 mod
    85 = 1 position x 2 sequences); the weights' gradients within WEIGHT_REL; one tile: all equal."""
    torch.manual_seed(0)
    mlp = SwiGLU()
    x = x0.clone().requires_grad_()
    y = mlp(x)
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, *mlp.parameters()], g)
    xt = x0.clone().requires_grad_()
    yt = tiled_mlp(mlp, xt, tile_tokens=tile_tokens)
    got = torch.autograd.grad(yt, [xt, *mlp.parameters()], g)
    if (x0.shape[0] * (x0.shape[1] % tile_tokens)) in (1, 2, 3, 5, 6, 7, 9, 10, 11):
        assert not torch.equal(yt, y)  # so that the rule above stays measured
        assert _rel(yt, y) < ROW_REL and _rel(got[0], want[0]) < ROW_REL
    else:
        assert torch.equal(yt, y)
        assert torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert _rel(a, b) < WEIGHT_REL
    # A single tile is the module itself.
    one = tiled_mlp(mlp, xt, tiles=1)
    assert torch.equal(torch.autograd.grad(one, [xt, *mlp.parameters()], g)[1], want[1])
    # Without a graph: the same output.
    with torch.no_grad():
        assert torch.equal(tiled_mlp(mlp, x0, tile_tokens=tile_tokens), yt)


def test_weight_gradients_reach_autograd_once(x0):
    """The weights' gradients come back through autograd: ``autograd.grad`` returns them, and a
    post-accumulate-grad hook (DDP's, FSDP2's reduction) fires once per backward, not per tile
    (DeepSpeed's TiledMLP adds each tile's into ``.grad`` inside its backward)."""
    torch.manual_seed(0)
    mlp = SwiGLU()
    calls = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: calls.append(p)) for p in mlp.parameters()]
    tiled_mlp(mlp, x0.clone().requires_grad_(), tiles=4).sum().backward()
    for h in handles:
        h.remove()
    assert len(calls) == 3
    by_backward = [p.grad for p in mlp.parameters()]
    x = x0.clone().requires_grad_()
    by_grad = torch.autograd.grad(tiled_mlp(mlp, x, tiles=4).sum(), [x, *mlp.parameters()])
    for a, b in zip(by_grad[1:], by_backward):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "checkpointed"])
def test_tiled_net_vs_untiled_and_offloaded(tmp_path, x0, recompute):
    """Blocks with a tiled MLP, with and without ``checkpoint(block, x, use_reentrant=False)``:
    against the untiled net, everything but the MLP weights' gradients is equal; with an
    offloader (every save written and read back), every gradient equals the tiled net's without
    one, whether ``loss.backward()`` runs outside ``with off:`` or inside it; inside, the tiles'
    recomputation in backward is not offloaded (the same bytes are written)."""
    loss0, gx0, grads0 = _step(_net(), x0)
    net = _net(tile_tokens=37, recompute=recompute)
    loss, gx, grads = _step(net, x0)
    assert torch.equal(loss, loss0) and torch.equal(gx, gx0)
    for name, g in grads.items():
        if ".mlp." in name:
            assert _rel(g, grads0[name]) < WEIGHT_REL, name
        else:
            assert torch.equal(g, grads0[name]), name
    written = []
    for inside in (False, True):
        path = tmp_path / f"act{int(inside)}"
        path.mkdir()
        off = ssdtrain.Offloader(net, path=str(path), min_bytes=0, late_writes=True)
        try:
            lo, gxo, gro = _step(net, x0, off, backward_inside=inside)
            off.wait()
            s = off.stats()
        finally:
            off.close()
        assert list(path.iterdir()) == []
        assert torch.equal(lo, loss) and torch.equal(gxo, gx)
        assert all(torch.equal(gro[n], grads[n]) for n in grads)
        assert s.written_bytes > 0 and s.read_bytes > 0
        written.append(s.written_bytes)
    assert written[0] == written[1]


def test_dropout_is_replayed_and_autocast_too(x0):
    """Backward recomputes each tile with the forward's RNG state (the same dropout masks) and
    autocast state (bfloat16 matmuls on the CPU): the gradients are those of the tiles computed
    with a graph in one go."""
    torch.manual_seed(0)
    mlp = SwiGLU(dropout=0.3)

    def ref_and_tiled(ctx):
        grads = []
        for tiled in (False, True):
            x = x0.clone().requires_grad_()
            torch.manual_seed(5)
            with ctx():
                if tiled:
                    y = tiled_mlp(mlp, x, tile_tokens=100)
                else:
                    y = torch.cat([mlp(x[:, a:b]) for a, b in tile_bounds(x.shape[1], tile_tokens=100)], dim=1)
            grads.append((y.detach(), *torch.autograd.grad(y.float().square().sum(), [x, *mlp.parameters()])))
        return grads

    # The weights' gradients are summed across tiles in another order; under autocast the
    # reference sums its tiles' in bfloat16 (into the cached cast of each weight), the tiled
    # MLP in float32 (measured 3.6e-3 apart, bfloat16's rounding).
    for ctx, bound in ((contextlib.nullcontext, WEIGHT_REL),
                       (lambda: torch.autocast("cpu", dtype=torch.bfloat16), 1e-2)):
        (y0, gx0, *gw0), (y1, gx1, *gw1) = ref_and_tiled(ctx)
        assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
        for a, b in zip(gw1, gw0):
            assert _rel(a, b) < bound


def test_tile_in_place_keeps_the_module_and_undoes():
    torch.manual_seed(0)
    mlp = SwiGLU()
    names = list(mlp.state_dict())
    x = torch.randn(1, 56, H, requires_grad=True)
    want = mlp(x)
    undo = tile_in_place(mlp, tile_tokens=24)
    assert list(mlp.state_dict()) == names and "forward" in mlp.__dict__
    seen = []
    mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
    got = mlp(x)
    assert seen == [24, 24, 8]
    # The module applied tile by tile, exactly; the whole product's rows within ROW_REL (on an
    # AVX-512 CPU, 2026-11-28, a 56-row product's rows differ from 24-row tiles' in the 224 -> 64
    # down projection: the module docstring's rule is MKL's per machine).
    with torch.no_grad():
        by_tile = torch.cat([SwiGLU.forward(mlp, x[:, a:b]) for a, b in ((0, 24), (24, 48), (48, 56))], dim=1)
    assert torch.equal(got, by_tile) and _rel(got, want) < ROW_REL
    with pytest.raises(ValueError, match="already tiled"):
        tile_in_place(mlp, tiles=2)
    undo()
    assert "forward" not in mlp.__dict__
    undo()  # twice is harmless
    assert torch.equal(mlp(x), want)
    # The wrapper, by contrast, names its child: the names gain "mlp.".
    assert list(TiledMLP(SwiGLU(), tiles=2).state_dict()) == ["mlp." + n for n in names]
