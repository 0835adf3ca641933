"""Megatron-Core: offload activations inside the pipeline schedules, switched on by ``--ssdtrain``.

All of Megatron-Core's schedules (no pipelining, 1F1B, interleaved 1F1B) run every micro-batch
through two module-level functions of ``megatron.core.pipeline_parallel.schedules``,
``forward_step`` and ``backward_step``, which they look up at call time. :func:`patch` replaces
those two with thin wrappers; the schedules themselves are not copied or changed:

* each micro-batch's forward runs in its own ``Offloader.microbatch(mb_id)`` scope, where
  ``mb_id`` is Megatron's micro-batch number, or ``(model_chunk, number)`` under the interleaved
  schedule (``vp_stage`` names the chunk);
* right before a backward, and right after the previous one, the offloader is told which
  micro-batch's backward comes next (``Offloader.prefetch``), so its last tensors are read first.

Usage with a Megatron-LM training script::

    from ssdtrain.integrations import megatron as ssdtrain_megatron

    pretrain(..., extra_args_provider=ssdtrain_megatron.add_arguments)
    # once the arguments are parsed (model_provider is a convenient place; repeated calls with
    # the same arguments return the same handle):
    ssdtrain_megatron.patch_from_args(get_args())

or directly: ``with ssdtrain_megatron.patch(path="/nvme/act") as h: ...``.

Importing this module imports neither Megatron nor CUDA; :func:`patch` imports Megatron-Core.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import logging
import sys
import weakref
from collections.abc import Mapping
from typing import Any

import torch

import ssdtrain
from ssdtrain import config as _config

__all__ = ["MegatronPatch", "add_arguments", "config_from_args", "patch", "patch_from_args"]

log = logging.getLogger(__name__)

_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_MARK = "__ssdtrain_patch__"  # attribute on our wrappers: the MegatronPatch that installed them


# -- command line ----------------------------------------------------------------------------------
def _size(text: str) -> int:
    try:
        return _config.parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _on_off_auto(text: str) -> bool | None:
    value = {"on": True, "off": False, "auto": None}.get(text.strip().lower(), "bad")
    if value == "bad":
        raise argparse.ArgumentTypeError(f"{text!r}: expected on, off or auto")
    return value


# (OffloadConfig field, argparse keyword arguments). Every field except ``create_path`` has a flag;
# tests/test_megatron.py checks that each name here is still a field of OffloadConfig.
_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("path", dict(nargs="+", metavar="DIR",
                  help="directory (several: striped over them) for the arena files; "
                       "default $SSDTRAIN_PATH, else the temporary directory")),
    ("backend", dict(choices=_config.BACKENDS, help="I/O backend (default auto)")),
    ("min_bytes", dict(type=_size, metavar="SIZE",
                       help="saved tensors smaller than this stay in memory (default 1MiB)")),
    ("keep_last_layers", dict(type=int, metavar="N",
                              help="keep the tensors of the last N transformer layers in memory "
                                   "(needs the model: patch_from_args(args, model=...))")),
    ("layers", dict(metavar="DOTTED", help="dotted name of the model's list of blocks "
                                           "(default: found; decoder.layers for GPTModel)")),
    ("keep_modules", dict(type=_names, metavar="NAME[,NAME...]",
                          help="dotted names of modules whose saves stay in memory (e.g. output_layer)")),
    ("prefetch_layers", dict(type=int, metavar="N", help="read ahead at most this many layers in backward")),
    ("prefetch_bytes", dict(type=_size, metavar="SIZE", help="... and at most this many bytes")),
    ("max_inflight_bytes", dict(type=_size, metavar="SIZE", help="cap on bytes waiting to be written")),
    ("when_full", dict(choices=_config.WHEN_FULL, help="at the cap: wait for the drive, or keep in memory")),
    ("late_writes", dict(action="store_true", default=None,
                         help="also write saves whose write ends after the step's peak (the end of forward)")),
    ("on_error", dict(choices=_config.ON_ERROR, help="a failed write: raise, or keep the tensor in memory")),
    ("verify", dict(action="store_true", default=None, help="checksum every extent written and read")),
    ("io_threads", dict(type=int, metavar="N", help="I/O threads per path")),
    ("direct_io", dict(type=_on_off_auto, metavar="on|off|auto", help="O_DIRECT for the posix backend")),
    ("chunk_bytes", dict(type=_size, metavar="SIZE", help="size of one I/O request")),
    ("host_bytes", dict(metavar="SIZE|auto", help="pinned host memory in front of the drives for GPU saves "
                                                   "(0: none; default auto, a share of the RAM available)")),
    ("rated_tbw", dict(type=float, metavar="TB", help="the drive's rated endurance, for the wear warning")),
    ("endurance_horizon_days", dict(type=float, metavar="DAYS",
                                    help="warn if the rated endurance would be used up sooner")),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--ssdtrain`` and its settings to ``parser``; usable as Megatron-LM's ``extra_args_provider``.

    Each setting is ``--ssdtrain-<field>`` for a field of :class:`ssdtrain.OffloadConfig`
    (``--ssdtrain-path``, ``--ssdtrain-min-bytes``, ``--ssdtrain-keep-last-layers``, ...). A
    setting left out keeps the OffloadConfig default (and its ``SSDTRAIN_*`` environment override).

    Returns:
        ``parser``, as ``extra_args_provider`` must.
    """
    group = parser.add_argument_group("ssdtrain", "offload saved activations to NVMe (ssdtrain)")
    group.add_argument("--ssdtrain", action="store_true",
                       help="offload the activations saved for backward to storage")
    for name, kwargs in _FLAGS:
        kwargs = {"default": None, **kwargs}
        group.add_argument("--ssdtrain-" + name.replace("_", "-"), dest="ssdtrain_" + name, **kwargs)
    return parser


def config_from_args(args: argparse.Namespace) -> ssdtrain.OffloadConfig:
    """The :class:`ssdtrain.OffloadConfig` that parsed ``--ssdtrain-*`` flags describe."""
    values = {}
    for name, _ in _FLAGS:
        value = getattr(args, "ssdtrain_" + name, None)
        if value is not None:
            values[name] = tuple(value) if name == "path" else value
    return ssdtrain.OffloadConfig.from_dict(values)


def patch_from_args(args: argparse.Namespace, *, model: Any = None) -> MegatronPatch | None:
    """:func:`patch` with the settings of parsed arguments; ``None`` (and nothing done) without ``--ssdtrain``.

    Calling it again with the same settings while the patch is active returns the active handle,
    so it may sit in a ``model_provider`` that Megatron-LM calls once per model chunk.
    """
    if not getattr(args, "ssdtrain", False):
        return None
    cfg = config_from_args(args)
    active = _active_patch()
    if active is not None and active._from_args and active.offloader.config == cfg:
        return active
    handle = patch(cfg, model=model)
    handle._from_args = True
    return handle


# -- the patch --------------------------------------------------------------------------------------
def patch(config: ssdtrain.OffloadConfig | Mapping | None = None, *, model: Any = None,
          **overrides: Any) -> MegatronPatch:
    """Enables offloading inside Megatron-Core's pipeline schedules.

    Args:
        config: an :class:`ssdtrain.OffloadConfig` (or a mapping of its fields).
        model: optional; the model (or a one-element list of it). Needed for
            ``keep_last_layers``, which counts the last blocks of this model.
        **overrides: OffloadConfig fields replacing those of ``config``.

    Returns:
        A :class:`MegatronPatch`: ``.offloader`` is the :class:`ssdtrain.Offloader` in use;
        ``.unpatch()`` (or leaving its ``with`` block) restores Megatron exactly.

    Raises:
        ImportError: Megatron-Core is not installed.
        RuntimeError: ssdtrain is already patched into Megatron in this process.
        ValueError: invalid settings.
    """
    schedules = _import_schedules()
    active = _active_patch(schedules)
    if active is not None:
        raise RuntimeError(
            "ssdtrain is already patched into Megatron-Core's schedules in this process; call "
            "unpatch() on the handle patch() returned (it is also at "
            f"{_SCHEDULES}.forward_step.{_MARK}) before patching again")
    cfg = _resolve(config, overrides)
    if isinstance(model, (list, tuple)):
        # Model chunks of an interleaved schedule, in layer order: the Offloader counts their
        # blocks as one sequence, so keep_last_layers keeps the last blocks of the last chunk.
        model = model[0] if len(model) == 1 else list(model)
    if cfg.keep_last_layers and model is None:
        raise ValueError(
            f"keep_last_layers={cfg.keep_last_layers} counts the model's last blocks: pass the model "
            "chunk, patch(..., model=model) or patch_from_args(args, model=model), or set it to 0")
    return MegatronPatch(schedules, ssdtrain.Offloader(model, cfg))


def _resolve(config: Any, overrides: dict[str, Any]) -> ssdtrain.OffloadConfig:
    if config is None:
        return ssdtrain.OffloadConfig.from_dict(overrides)
    if isinstance(config, Mapping):
        config = ssdtrain.OffloadConfig.from_dict(config)
    elif not isinstance(config, ssdtrain.OffloadConfig):
        raise TypeError(f"config must be an OffloadConfig or a mapping, not {type(config).__name__}")
    return config.replace(**overrides) if overrides else config


def _import_schedules():
    try:
        return importlib.import_module(_SCHEDULES)
    except ImportError as err:
        raise ImportError(
            f"Megatron-Core is not installed ({err}); pip install 'ssdtrain[megatron]' "
            "(megatron-core==0.16.1)") from err


def _active_patch(schedules: Any = None) -> MegatronPatch | None:
    if schedules is None:
        schedules = sys.modules.get(_SCHEDULES)
        if schedules is None:
            return None
    return getattr(schedules.forward_step, _MARK, None)


class _Pending:
    """A micro-batch whose forward ran and whose backward has not: its id, and its output tensor
    (weakly: a forward-only pass drops the output without a backward, and the entry with it)."""

    __slots__ = ("mb_id", "output")

    def __init__(self, mb_id: Any, output: Any) -> None:
        self.mb_id = mb_id
        self.output = weakref.ref(output) if output is not None else None

    def alive(self) -> bool:
        return self.output is None or self.output() is not None


def _anchor(output: Any) -> Any:
    """The tensor that identifies a micro-batch: the forward's output, or its first element."""
    while isinstance(output, (list, tuple)) and output:
        output = output[0]
    return output if hasattr(output, "grad_fn") else None


class MegatronPatch:
    """Handle of an active patch: ``.offloader``, ``.unpatch()``; a context manager that unpatches."""

    def __init__(self, schedules: Any, offloader: ssdtrain.Offloader) -> None:
        self.offloader = offloader
        self._from_args = False
        self._schedules = schedules
        self._forward_step = schedules.forward_step
        self._backward_step = schedules.backward_step
        # Where forward_step takes these by position (the schedules pass them by keyword).
        params = list(inspect.signature(self._forward_step).parameters.values())
        self._positions = {p.name: i for i, p in enumerate(params)
                           if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}
        # Backward order per schedule mirrors forward order per model chunk: one FIFO per chunk,
        # exactly like the schedules' own input_tensors/output_tensors lists.
        self._fifo: dict[int, collections.deque[_Pending]] = collections.defaultdict(collections.deque)
        # Which backward followed which in the last step: schedules repeat every step, so this
        # predicts the next backward (for prefetch) without knowing the schedule.
        self._next_backward: dict[Any, Any] = {}
        self._last_backward: Any = None
        self._hinted: set[Any] = set()  # told to prefetch already, backward not begun yet
        self._active = True

        @functools.wraps(self._forward_step)
        def forward_step(*args: Any, **kwargs: Any) -> Any:
            return self._forward(args, kwargs)

        @functools.wraps(self._backward_step)
        def backward_step(*args: Any, **kwargs: Any) -> Any:
            return self._backward(args, kwargs)

        setattr(forward_step, _MARK, self)
        setattr(backward_step, _MARK, self)
        self._wrappers = (forward_step, backward_step)
        schedules.forward_step = forward_step
        schedules.backward_step = backward_step
        log.info("ssdtrain patched into %s (%s)", _SCHEDULES, offloader.backend)

    # -- public ---------------------------------------------------------------------------------
    def unpatch(self, *, close: bool = True) -> None:
        """Puts Megatron's own ``forward_step``/``backward_step`` back (the same objects) and,
        with ``close``, closes the offloader. Call it between steps. Idempotent."""
        if not self._active:
            return
        s = self._schedules
        if (s.forward_step, s.backward_step) != self._wrappers:
            raise RuntimeError(
                f"{_SCHEDULES}.forward_step/backward_step were replaced after ssdtrain patched them; "
                "undo that patch first (patches must be undone in reverse order)")
        s.forward_step, s.backward_step = self._forward_step, self._backward_step
        self._active = False
        self._fifo.clear()
        self._hinted.clear()
        if close:
            self.offloader.close()
        log.info("ssdtrain unpatched from %s", _SCHEDULES)

    @property
    def active(self) -> bool:
        return self._active

    def pending(self) -> dict[int, list[Any]]:
        """Micro-batch ids whose forward ran and whose backward has not yet, per model chunk."""
        self._purge()
        return {chunk: [p.mb_id for p in q] for chunk, q in self._fifo.items() if q}

    def __enter__(self) -> MegatronPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.unpatch()

    def __repr__(self) -> str:
        state = "active" if self._active else "unpatched"
        return f"MegatronPatch({state}, backend={self.offloader.backend!r})"

    # -- wrappers -------------------------------------------------------------------------------
    # Note [hollowed-out outputs]: once a stage's output is sent, the schedules call
    # deallocate_output_tensor, which sets ``out.data`` to a 1-element tensor while ``out``'s graph
    # lives on. If an op saved ``out`` itself (tanh, sigmoid, exp save their result), the pack hook
    # was handed that very tensor object; a saved reference that held the object rather than its
    # storage would find one element in backward, and broadcasting would make the gradients
    # silently wrong. The offloader's entries hold the storage (and rebuild views on it), so this
    # wrapper needs to do nothing about it. Caught by test_deallocated_output_keeps_exact_gradients
    # and by the pipeline runs of tests/_megatron_worker.py, whose every sent output is a tanh.
    def _forward(self, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward
            return self._forward_step(*args, **kwargs)
        vp_stage = self._arg(args, kwargs, "vp_stage")
        chunk = 0 if vp_stage is None else int(vp_stage)
        self._purge()
        index = self._arg(args, kwargs, "current_microbatch")
        if index is None:
            # A schedule that does not number its micro-batches: the lowest number not pending
            # in this chunk (ids stay few, however many steps run).
            taken = {p.mb_id if vp_stage is None else p.mb_id[1] for p in self._fifo[chunk]}
            index = next(i for i in range(len(taken) + 1) if i not in taken)
        mb_id = index if vp_stage is None else (chunk, index)
        self._hinted.discard(mb_id)  # a hint for an earlier micro-batch of this id is void
        with self.offloader.microbatch(mb_id):
            result = self._forward_step(*args, **kwargs)
        output = result[0] if isinstance(result, tuple) else result
        self._fifo[chunk].append(_Pending(mb_id, _anchor(output)))
        return result

    def _arg(self, args: tuple, kwargs: dict, name: str) -> Any:
        if name in kwargs:
            return kwargs[name]
        i = self._positions.get(name)
        return args[i] if i is not None and i < len(args) else None

    def _backward(self, args: tuple, kwargs: dict) -> Any:
        output = args[1] if len(args) > 1 else kwargs.get("output_tensor")
        mb_id = self._pop(_anchor(output))
        if mb_id is not None:
            # Once per backward: prefetch() restarts the micro-batch's read-ahead window.
            if mb_id in self._hinted:
                self._hinted.discard(mb_id)
            else:
                self.offloader.prefetch(mb_id)
            if self._last_backward is not None:
                self._next_backward[self._last_backward] = mb_id
            self._last_backward = mb_id
        result = self._backward_step(*args, **kwargs)
        if mb_id is not None:
            upcoming = self._predict_next(mb_id)
            if upcoming is not None and upcoming not in self._hinted:
                self._hinted.add(upcoming)
                self.offloader.prefetch(upcoming)
        return result

    # -- bookkeeping ----------------------------------------------------------------------------
    def _purge(self) -> None:
        for q in self._fifo.values():
            if any(not p.alive() for p in q):
                live = [p for p in q if p.alive()]
                q.clear()
                q.extend(live)

    def _pop(self, anchor: Any) -> Any:
        """The id of the micro-batch whose backward is starting: the chunk whose oldest pending
        forward produced ``anchor``; with one chunk, simply the oldest."""
        self._purge()
        heads = [q for q in self._fifo.values() if q]
        for q in heads:
            if anchor is not None and q[0].output is not None and q[0].output() is anchor:
                return q.popleft().mb_id
        if len(heads) == 1:
            return heads[0].popleft().mb_id
        if heads:
            log.debug("ssdtrain: could not tell which micro-batch's backward starts; no prefetch hint")
        return None

    def _predict_next(self, mb_id: Any) -> Any:
        pending = {p.mb_id for q in self._fifo.values() for p in q}
        guess = self._next_backward.get(mb_id)
        if guess is not None:
            return guess if guess in pending else None
        chunk = mb_id[0] if isinstance(mb_id, tuple) else 0
        q = self._fifo.get(chunk)
        return q[0].mb_id if q else None
