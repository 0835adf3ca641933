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

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

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
    if not torch.is_grad_enabled() or not (x.requires_grad or params):
        return _forward_tiles(fn, x, bounds)
    return _TiledFunction.apply(fn, bounds, preserve_rng_state, x, *params)


def _forward_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                   bounds: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The tiles' outputs written into one tensor (no concatenation: never two outputs at once)."""
    out = None
    with torch.no_grad():
        for a, b in bounds:
            y = fn(x.narrow(-2, a, b - a))
            if out is None:
                shape = (*y.shape[:-2], x.shape[-2], y.shape[-1])
                out = y.new_empty(shape)
            out.narrow(-2, a, b - a).copy_(y)
            del y
    return out


def _same(t: Any) -> Any:
    return t


# The recomputation's saves, as autograd keeps them without hooks (module docstring).
def _keep_saves() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


class _Replay:
    """The forward's RNG and autocast states, entered again in backward (as checkpoint does)."""

    def __init__(self, device: torch.device, preserve_rng_state: bool) -> None:
        self.device = device
        kinds = [device.type] if device.type == "cpu" else [device.type, "cpu"]
        self.autocast_state = [(k, torch.is_autocast_enabled(k), torch.get_autocast_dtype(k))
                               for k in kinds if torch.amp.is_autocast_available(k)]
        self.autocast_cache = torch.is_autocast_cache_enabled()
        self.cpu_rng = self.device_rng = None
        if preserve_rng_state:
            self.cpu_rng = torch.get_rng_state()
            mod = getattr(torch, device.type, None) if device.type != "cpu" else None
            if mod is not None and hasattr(mod, "get_rng_state") and getattr(mod, "is_initialized", lambda: True)():
                self.device_rng = mod.get_rng_state(device)

    @contextlib.contextmanager
    def rng(self) -> Iterator[None]:
        """The forward's RNG state, for the whole recomputation (the tiles draw in turn)."""
        if self.cpu_rng is None:
            yield
            return
        on_device = self.device_rng is not None
        with torch.random.fork_rng(devices=[self.device] if on_device else [],
                                   device_type=self.device.type if on_device else "cuda"):
            torch.set_rng_state(self.cpu_rng)
            if on_device:
                getattr(torch, self.device.type).set_rng_state(self.device_rng, self.device)
            yield

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward's autocast state, for a tile's forward only (its gradients are taken
        outside, as a backward outside autocast takes them)."""
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self.autocast_state:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


class GradSums:
    """Each wanted parameter's gradient summed over the tiles, as autograd would get it once."""

    def __init__(self, n: int) -> None:
        self.sums: list[torch.Tensor | None] = [None] * n
        self.fresh = [False] * n  # whether sums[i] is ours to add into

    def add(self, i: int, g: torch.Tensor | None) -> None:
        if g is None:
            return
        if self.sums[i] is None:  # 16-bit gradients are summed in float32 (one rounding at the end)
            up = g.float() if g.is_floating_point() and g.element_size() < 4 else g
            self.sums[i], self.fresh[i] = up, up is not g
        elif self.fresh[i]:
            self.sums[i].add_(g)
        else:  # the first tile's gradient may alias autograd's buffers: never written
            self.sums[i], self.fresh[i] = self.sums[i] + g, True

    def grads(self, params: tuple, wanted: list[int]) -> list[torch.Tensor | None]:
        """Every parameter's gradient, in its dtype (``None`` for those not wanted)."""
        out: list[torch.Tensor | None] = [None] * len(params)
        for i, s in zip(wanted, self.sums):
            out[i] = None if s is None else s.to(params[i].dtype)
        return out


class _TiledFunction(torch.autograd.Function):
    """Forward: the tiles without a graph, ``x`` saved. Backward: each tile again with a graph,
    its gradients taken at once; the weights' summed over tiles and returned once."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, bounds: tuple, preserve_rng_state: bool, x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.bounds = bounds
        ctx.params = params  # the module's own parameters: alive anyway, never activations
        ctx.replay = _Replay(x.device, preserve_rng_state)
        ctx.save_for_backward(x)
        return _forward_tiles(fn, x, bounds)

    @staticmethod
    @once_differentiable  # a double backward raises instead of differentiating the tiles' grad calls
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[3]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[4:]) if need]
        targets = [ctx.params[i] for i in wanted]
        grad_x = torch.empty_like(x) if want_x else None
        sums = GradSums(len(targets))
        replay = ctx.replay
        with replay.rng(), torch.enable_grad(), _keep_saves():
            for a, b in ctx.bounds:
                xt = x.narrow(-2, a, b - a).detach().requires_grad_(want_x)
                with replay.autocast():
                    # A view, not the leaf: autocast caches its casts of leaves that want
                    # gradients (made for weights), which would sum the input's gradients in
                    # the low precision where the forward summed them in float32.
                    y = ctx.fn(xt.view_as(xt) if want_x else xt)
                if not y.requires_grad:
                    grads: tuple = (None,) * (int(want_x) + len(targets))
                else:
                    inputs = ([xt] if want_x else []) + targets
                    grads = torch.autograd.grad(y, inputs, grad_out.narrow(-2, a, b - a), allow_unused=True)
                del y
                if want_x:
                    gx, grads = grads[0], grads[1:]
                    if gx is None:
                        grad_x.narrow(-2, a, b - a).zero_()
                    else:
                        grad_x.narrow(-2, a, b - a).copy_(gx)
                    del gx
                for i, g in enumerate(grads):
                    sums.add(i, g)
                del grads
        return (None, None, None, grad_x, *sums.grads(ctx.params, wanted))
