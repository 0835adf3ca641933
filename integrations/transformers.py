"""Hugging Face ``Trainer`` callback: every training forward runs under an :class:`~ssdtrain.Offloader`.

Add the callback to the trainer you already have; nothing else changes::

    from ssdtrain.integrations.transformers import OffloadCallback

    offload = OffloadCallback(path="/nvme/ssdtrain", min_bytes="1MiB")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[offload])
    trainer.train()
    print(offload.stats())          # the run's OffloadStats, also after training

The keyword arguments are the fields of :class:`ssdtrain.OffloadConfig`; they are validated when
the callback is made, so a bad setting fails before training starts.

How: a ``TrainerCallback`` has no event around the forward pass, so at ``on_train_begin`` the
callback makes an offloader for the trainer's model and registers a forward pre-hook and a
forward hook (``always_call=True``) on it: the outermost call of the model enters
``with offloader:`` and its end leaves it, whatever wraps the model (DDP, ``torch.compile``,
Accelerate). Only forwards in training mode with gradients enabled are offloaded, so each
micro-batch of gradient accumulation is one offloaded step, and evaluation and prediction run
untouched. With ``activation_checkpointing=True`` (``gradient_checkpointing=True`` in older
releases) what reaches the offloader is what checkpointing keeps: each checkpointed layer's input
and the layers outside them (recomputation in backward stays in memory). At
``on_train_end`` the hooks are removed and the offloader is closed.

Importing this module does not import ``transformers``: ``OffloadCallback`` (a real
``transformers.TrainerCallback`` subclass) is defined on first access.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch

import ssdtrain
from ssdtrain.integrations._run import OffloadRun

__all__ = ["OffloadCallback"]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import TrainerCallback


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("transformers is not installed; pip install 'ssdtrain[transformers]'") from exc
    return transformers


class _ForwardOffload:
    """Runs each training forward of ``module`` inside ``with offloader:`` (forward hooks).

    Only the outermost call enters: a model that calls itself, or is called from inside its own
    forward, is one step. A forward that raises leaves the offloader as ``with`` would (its error
    passed on, nothing started for backward).
    """

    def __init__(self, module: torch.nn.Module, offloader: ssdtrain.Offloader) -> None:
        self.offloader = offloader
        # One entry per call of the module in progress: (entered?, exception being handled then).
        self._calls: list[tuple[bool, BaseException | None]] = []
        self._active = False
        self.entered = 0  # forwards run under the offloader
        # The hooks run eagerly under torch.compile (a graph break at the model's boundary):
        # entering saved_tensors_hooks is no op a graph can hold.
        self._handles = [
            module.register_forward_pre_hook(torch.compiler.disable(self._pre)),
            module.register_forward_hook(torch.compiler.disable(self._post), always_call=True),
        ]

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        enter = not self._active and module.training and torch.is_grad_enabled()
        self._calls.append((enter, sys.exc_info()[1]))
        if enter:
            self.offloader.__enter__()
            self._active = True
            self.entered += 1
        return None  # a pre-hook's return value would replace the forward's arguments

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self._calls:
            return None  # hooks registered while a forward was running
        entered, handled_before = self._calls.pop()
        if entered:
            self._active = False
            # always_call hooks run from torch's `except Exception:` when forward raised; an
            # exception that was already being handled at the pre-hook is the caller's, not ours.
            exc = sys.exc_info()[1]
            if exc is not None and exc is not handled_before:
                self.offloader.__exit__(type(exc), exc, exc.__traceback__)
            else:
                self.offloader.__exit__(None, None, None)
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._active:  # a forward interrupted by BaseException (e.g. KeyboardInterrupt)
            self._active = False
            self._calls.clear()
            self.offloader.__exit__(None, None, None)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module the trainer calls, below wrappers that forward to ``.module`` (DDP, DataParallel)."""
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def _define_callback() -> type[TrainerCallback]:
    transformers = _import_transformers()

    class OffloadCallback(OffloadRun, transformers.TrainerCallback):
        """Offloads the activations of every training forward of a ``transformers.Trainer``.

        Args:
            **fields: fields of :class:`ssdtrain.OffloadConfig` (``path``, ``min_bytes``, ...).

        Raises:
            ValueError: an unknown field or a bad value (here, before training).
        """

        def __init__(self, **fields: Any) -> None:
            self._setup(fields)
            self._warned = False

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            self._finish()  # a previous train() that raised never reached on_train_end
            self._warned = False
            if model is None:
                raise RuntimeError("OffloadCallback: the trainer passed no model to on_train_begin")
            module = _unwrap(model)
            # The trainer's own model (a PeftModel for PEFT): its parameters, frozen ones too,
            # are never written, and its repeated blocks order the reads in backward.
            self._start(module, _ForwardOffload)
            logger.info("ssdtrain: training forwards of %s offload activations to %s",
                        type(module).__name__, ", ".join(self.config.paths))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            forward = self._hooks
            if forward is not None and forward.entered == 0 and not self._warned:
                self._warned = True
                warnings.warn(
                    "ssdtrain OffloadCallback: an optimizer step ended and no training forward ran "
                    "under the offloader, so nothing is offloaded: the model's forward hooks did not run. "
                    "Either its __call__ skips nn.Module hooks, or it was compiled with torch.compile and "
                    "ran in training mode before train() began (compiled code ignores hooks added "
                    "later); let the Trainer compile it (torch_compile=True) instead.",
                    RuntimeWarning, stacklevel=2)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._finish()


    OffloadCallback.__module__ = __name__
    OffloadCallback.__qualname__ = "OffloadCallback"
    return OffloadCallback


def __getattr__(name: str) -> Any:
    if name == "OffloadCallback":
        cls = _define_callback()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
