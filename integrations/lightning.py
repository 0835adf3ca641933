"""PyTorch Lightning callback: every ``training_step`` runs under an :class:`~ssdtrain.Offloader`.

Add the callback to the trainer; the LightningModule stays as it is::

    import lightning as L
    from ssdtrain.integrations.lightning import OffloadCallback

    offload = OffloadCallback(path="/nvme/ssdtrain", min_bytes="1MiB")
    trainer = L.Trainer(max_steps=1000, callbacks=[offload])
    trainer.fit(module, datamodule)
    print(offload.stats())          # the run's OffloadStats, also after fit()

The keyword arguments are the fields of :class:`ssdtrain.OffloadConfig`; they are validated when
the callback is made, so a bad setting fails before training starts.

How: Lightning's ``on_train_batch_start``/``on_train_batch_end`` enclose backward too, and the
offloader must be left when forward ends (backward starts reading then). What a training step
computes is the loss, so from ``on_train_start`` to the end of ``fit()`` the callback puts a
wrapper in front of this module's ``training_step`` (an instance attribute; the class is
untouched) that runs it inside ``with offloader:``. Lightning calls backward after
``training_step`` returns, so each call is one offloaded forward: one per micro-batch under
``accumulate_grad_batches``; ``validation_step``, ``test_step`` and ``predict_step`` run
untouched. This covers forwards that do not go through ``module(...)`` as well.

With manual optimization (``self.automatic_optimization = False``) backward runs inside
``training_step``: the callback also wraps ``manual_backward``, which leaves the offloader before
backward, and the next module called with gradients enabled in the same step (a second model's
forward, as in a GAN) enters it again.

Importing this module does not import Lightning: ``OffloadCallback`` (a real
``lightning.pytorch.Callback``) is defined on first access.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

import ssdtrain
from ssdtrain.integrations._run import OffloadRun

__all__ = ["OffloadCallback"]

logger = logging.getLogger(__name__)

_MISSING = object()

if TYPE_CHECKING:
    from lightning.pytorch import Callback


def _import_lightning() -> Any:
    try:
        import lightning.pytorch
    except ImportError as exc:
        raise ImportError("lightning is not installed; pip install 'ssdtrain[lightning]'") from exc
    return lightning.pytorch


class _StepOffload:
    """Runs ``module.training_step`` inside ``with offloader:`` (and, with manual optimization,
    leaves it for each ``manual_backward``). :meth:`remove` restores the module's attributes."""

    def __init__(self, module: torch.nn.Module, offloader: ssdtrain.Offloader) -> None:
        self.module = module
        self.offloader = offloader
        self._active = False
        self._rearm: Any = None  # global forward pre-hook, armed after a manual backward
        self._replaced: dict[str, Any] = {}
        self._wrap("training_step", self._training_step)
        if not getattr(module, "automatic_optimization", True):
            self._wrap("manual_backward", self._manual_backward)

    def _wrap(self, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(self.module, name)
        self._replaced[name] = vars(self.module).get(name, _MISSING)
        # An instance attribute, looked up when Lightning calls it (also through DDP's forward).
        object.__setattr__(self.module, name, functools.wraps(original)(make(original)))

    def _training_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def training_step(*args: Any, **kwargs: Any) -> Any:
            self._enter()
            try:
                out = original(*args, **kwargs)
            except BaseException as exc:
                self._disarm()
                self._leave(exc)
                raise
            self._disarm()
            self._leave(None)
            return out

        return training_step

    def _manual_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def manual_backward(*args: Any, **kwargs: Any) -> Any:
            self._leave(None)  # forward is over: backward reads what it saved
            out = original(*args, **kwargs)
            if self._rearm is None:
                self._rearm = torch.nn.modules.module.register_module_forward_pre_hook(self._reenter)
            return out

        return manual_backward

    def _reenter(self, module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._disarm()
            self._enter()
        return None  # a pre-hook's return value would replace the forward's arguments

    def _enter(self) -> None:
        if not self._active:
            self.offloader.__enter__()
            self._active = True

    def _leave(self, exc: BaseException | None) -> None:
        if self._active:
            self._active = False
            if exc is None:
                self.offloader.__exit__(None, None, None)
            else:
                self.offloader.__exit__(type(exc), exc, exc.__traceback__)

    def _disarm(self) -> None:
        if self._rearm is not None:
            self._rearm.remove()
            self._rearm = None

    def remove(self) -> None:
        self._disarm()
        self._leave(sys.exc_info()[1])
        for name, old in self._replaced.items():
            if old is _MISSING:
                vars(self.module).pop(name, None)
            else:
                object.__setattr__(self.module, name, old)
        self._replaced = {}


def _define_callback() -> type[Callback]:
    pl = _import_lightning()

    class OffloadCallback(OffloadRun, pl.Callback):
        """Offloads the activations of every ``training_step`` of a ``lightning.Trainer``.

        Args:
            **fields: fields of :class:`ssdtrain.OffloadConfig` (``path``, ``min_bytes``, ...).

        Raises:
            ValueError: an unknown field or a bad value (here, before training).
        """

        def __init__(self, **fields: Any) -> None:
            super().__init__()
            self._setup(fields)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._finish()
            # The LightningModule holds the model: its parameters are never written, and its
            # repeated blocks order the reads in backward.
            self._start(pl_module, _StepOffload)
            logger.info("ssdtrain: training steps of %s offload activations to %s",
                        type(pl_module).__name__, ", ".join(self.config.paths))

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._finish()

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            self._finish()

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
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
