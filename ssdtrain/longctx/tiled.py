"""A position-wise module (a transformer's MLP) computed a tile of the sequence at a time.

Per-block checkpointing keeps one input per block, and ssdtrain takes those off the device. What
is left is one recomputed block, and in a Llama block its widest tensors are the SwiGLU MLP's
gate, up and their product: 3.5 times the hidden size each, 10.5 times together, against the
block input's 1. Tiled, the MLP runs ``tile_tokens`` positions of the sequence at a time: in
forward without a graph, in backward again with one, a tile at a time. Its intermediates then
exist for one tile at a time, and forward saves only the MLP's input (which an offloader takes
like any save)::

    from ssdtrain.longctx.tiled import TiledMLP, tiled_mlp, tile_in_place

    y = tiled_mlp(block.mlp, x, tile_tokens=4096)       # one call
    block.mlp = TiledMLP(block.mlp, tile_tokens=4096)   # a module, for models you write
    undo = tile_in_place(block.mlp, tile_tokens=4096)   # the same module, its forward tiled

The module must be position-wise along dim ``-2`` (each position's output depends on that
position's input only: an MLP, not attention) and its only differentiable inputs must be ``x`` and
its own parameters. Each tile holds ``batch x tile_tokens`` positions.

Exactness. Each tile is the module applied to a slice of rows, so the output and the input's
gradient are the untiled module's wherever the matrix product of a slice of rows gives exactly
those rows of the whole product. That is the BLAS's choice, not ours: on an AVX2 CPU (MKL,
float32 and bfloat16) it held for every slice of 4, 8 or at least 12 rows, and a slice of 1-3,
5-7 or 9-11 rows (a short last tile: ``batch x (seq mod tile_tokens)`` rows) differs by rounding
(measured in tests/test_tiled.py); on an AVX-512 CPU (2026-11-28) a 224 -> 64 product of 32, 56,
80 or 104 rows also differs from its 24-row slices'; float64 differs at more sizes, and cuBLAS
may choose another kernel for another row count. A parameter's gradient is a sum over tokens that tiling splits
into one partial sum per tile, added in tile order (in float32 for 16-bit parameters): equal to
the untiled one up to the order of the additions, under 5e-7 of its largest entry in float32
here. Offloading changes nothing: a tiled model with an offloader gives gradients equal
(``torch.equal``) to the same tiled model without one.

Why not DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``, which
Liger-Kernel's ``LigerTiledMLPFunction`` copies): its backward runs an inner
``torch.autograd.backward`` per tile, which adds each tile's weight gradient into ``param.grad``
as a side effect. ``torch.autograd.grad`` then returns no gradient for the weights, and a
parameter's post-accumulate-grad hooks (DDP's and FSDP2's reductions, optimizers in backward) fire
once per tile. Here the parameters are inputs of the autograd Function: each tile's weight
gradient comes from ``torch.autograd.grad``, they are summed, and the sum returns to autograd once,
as an untiled module's would. It also replays the forward's RNG state and autocast state in
backward (dropout inside the module, mixed precision), as ``torch.utils.checkpoint`` does.

Saved-tensor hooks. Forward saves ``x`` through whatever hooks are active (an offloader's, a
checkpoint's). The backward's recomputation of each tile runs under hooks that keep its saves as
they are: they live only until that tile's gradients are taken, so an offloader active during
backward (``loss.backward()`` inside ``with off:``) never sees them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ssdtrain.longctx._tiles import tiled_parts

__all__ = ["TiledMLP", "tile_bounds", "tile_in_place", "tiled_mlp"]


def tile_bounds(n: int, *, tiles: int | None = None, tile_tokens: int | None = None,
                default_tokens: int | None = None) -> tuple[tuple[int, int], ...]:
    """The ``(start, end)`` of each tile of ``n`` positions.

    ``tile_tokens``: positions per tile (the last tile may be shorter); ``tiles``: that many tiles
    of ``ceil(n / tiles)`` positions (fewer when they do not divide evenly, as ``torch.chunk``);
    neither: tiles of ``default_tokens`` positions (one tile if that is ``None``).
    """
    if tiles is not None and tile_tokens is not None:
        raise ValueError("give tiles or tile_tokens, not both")
    for name, value in (("tiles", tiles), ("tile_tokens", tile_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n <= 0:
        return ((0, n),)
    if tiles is not None:
        size = math.ceil(n / tiles)
    else:
        size = tile_tokens if tile_tokens is not None else (default_tokens or n)
    return tuple((a, min(a + size, n)) for a in range(0, n, size))


def tiled_mlp(module: nn.Module, x: torch.Tensor, *, tiles: int | None = None, tile_tokens: int | None = None,
              preserve_rng_state: bool = True) -> torch.Tensor:
    """``module(x)`` computed over the sequence (dim ``-2``) a tile at a time, forward and backward.

    Args:
        module: a position-wise module, ``(..., seq, hidden) -> (..., seq, out)``; called once
            per tile in forward and once per tile in backward (its hooks run each time).
        x: its input, at least 2-D.
        tiles, tile_tokens: how the sequence is cut (:func:`tile_bounds`); neither: tiles of
            ``x.shape[-1]`` positions (as many positions as the hidden size, DeepSpeed ALST's
            default: a tile's intermediates are then about 10.5 h^2 elements for a Llama MLP).
        preserve_rng_state: replay the forward's RNG state in backward (dropout in the module).

    One tile (a sequence no longer than a tile): exactly ``module(x)``.
    """
    return _tiled(module, module, x, tiles, tile_tokens, preserve_rng_state)


class TiledMLP(nn.Module):
    """A module that runs ``mlp`` through :func:`tiled_mlp`; for models you write.

    ``block.mlp = TiledMLP(block.mlp, tile_tokens=4096)``. The wrapped module is a child named
    ``mlp``, so its parameters' names gain ``.mlp`` (``block.mlp.mlp.fc.weight``): to keep a
    model's names (Hugging Face checkpoints, PEFT target names) use :func:`tile_in_place`.
    """

    def __init__(self, mlp: nn.Module, *, tiles: int | None = None, tile_tokens: int | None = None,
                 preserve_rng_state: bool = True) -> None:
        super().__init__()
        tile_bounds(1, tiles=tiles, tile_tokens=tile_tokens)  # checks the settings now
        self.mlp = mlp
        self.tiles = tiles
        self.tile_tokens = tile_tokens
        self.preserve_rng_state = preserve_rng_state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _tiled(self.mlp, self.mlp, x, self.tiles, self.tile_tokens, self.preserve_rng_state)

    def extra_repr(self) -> str:
        return f"tiles={self.tiles}, tile_tokens={self.tile_tokens}"


def tile_in_place(module: nn.Module, *, tiles: int | None = None, tile_tokens: int | None = None,
                  preserve_rng_state: bool = True) -> Callable[[], None]:
    """Tiles ``module``'s forward where it is; returns a function that undoes it.

    The module stays the same object at the same place (parameter names, state dict, PEFT and
    FSDP wrapping unchanged): its ``forward`` becomes an instance attribute that runs the
    forward it had through :func:`tiled_mlp`. Its hooks run once per call, around all tiles;
    its children's once per tile.
    """
    tile_bounds(1, tiles=tiles, tile_tokens=tile_tokens)  # checks the settings now
    if getattr(module.forward, "_ssdtrain_tiled", False):
        raise ValueError(f"{type(module).__name__} is already tiled")
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        return _tiled(inner, module, x, tiles, tile_tokens, preserve_rng_state)

    forward._ssdtrain_tiled = True  # type: ignore[attr-defined]
    return replace_forward(module, forward)


def replace_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """Sets ``forward`` as ``module``'s instance attribute; returns a function that restores the
    forward it had (its own instance attribute, or its class's), unless another replaced it since."""
    had_own = "forward" in module.__dict__
    previous = module.forward
    module.forward = forward

    def undo() -> None:
        if module.__dict__.get("forward") is forward:
            if had_own:
                module.forward = previous
            else:
                del module.forward

    return undo


def _tiled(fn: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, tiles: int | None,
           tile_tokens: int | None, preserve_rng_state: bool) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"a tiled module's input must have a sequence dimension (-2); got shape {tuple(x.shape)}")
    bounds = tile_bounds(x.shape[-2], tiles=tiles, tile_tokens=tile_tokens, default_tokens=x.shape[-1])
    if len(bounds) <= 1:
        return fn(x)
    params = tuple(p for p in module.parameters() if p.requires_grad)
    (y,) = tiled_parts(lambda a, b, xt: (fn(xt),), (x,), params, bounds, preserve_rng_state=preserve_rng_state)
    return y
