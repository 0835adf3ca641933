"""DeepSpeed plugin: an ``"ssdtrain"`` section in the DeepSpeed config offloads activations.

Add the section to the config you already have and call this module's :func:`initialize` where
you called ``deepspeed.initialize``; everything else stays as it is::

    # ds_config.json: {..., "ssdtrain": {"enabled": true, "path": "/nvme/act", "min_bytes": "1MiB"}}
    from ssdtrain.integrations import deepspeed as ssd_deepspeed

    engine, optimizer, _, _ = ssd_deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")
    loss = engine(batch)            # or engine.train_batch(data_iter) for a PipelineModule
    engine.backward(loss)
    engine.step()
    print(ssd_deepspeed.get_offloader(engine).stats())
    engine.destroy()                # closes the offloader too

The section's keys are the fields of :class:`ssdtrain.OffloadConfig` plus ``"enabled"`` (default
``true`` when the section is present). DeepSpeed ignores top-level keys it does not know, so the
section is checked here: an unknown key or a bad value raises ``ValueError`` naming it before
DeepSpeed starts. Without the section, :func:`initialize` is exactly ``deepspeed.initialize``.

What runs under the offloader (wrapped per engine instance, never DeepSpeed's classes or files;
:func:`detach` restores the instance exactly):

* ``DeepSpeedEngine``: every ``engine(...)`` forward runs inside ``with offloader:``.
* ``PipelineEngine``: every forward instruction of the schedule runs in its own
  ``offloader.microbatch(i)`` scope, ``i`` counting the batch's micro-batches from 0, and
  ``offloader.prefetch(i)`` is called once per backward: as soon as the previous backward ends
  in DeepSpeed's 1F1B train schedule (so reads overlap the next forward), else right before
  micro-batch ``i``'s backward.

For engines built another way (e.g. by a trainer library), :func:`attach` an offloader yourself.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import inspect
import json
import logging
import os
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import ssdtrain
from ssdtrain.config import OffloadConfig, check_keys

__all__ = ["SECTION", "attach", "detach", "get_offloader", "initialize", "offload_config"]

logger = logging.getLogger(__name__)

SECTION = "ssdtrain"
"""Name of the top-level DeepSpeed config key this plugin reads."""

_ENABLED = "enabled"
_ATTACHMENT = "_ssdtrain_attachment"
_MISSING = object()


def _import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError("deepspeed is not installed; pip install 'ssdtrain[deepspeed]'") from exc
    return deepspeed


# --------------------------------------------------------------------------------------------
# The config section


def offload_config(ds_config: Mapping[str, Any]) -> OffloadConfig | None:
    """The :class:`~ssdtrain.OffloadConfig` that a DeepSpeed config's ``"ssdtrain"`` section asks for.

    Returns ``None`` when there is no section or it says ``"enabled": false``. A disabled section
    is validated all the same, so that a typo does not wait until someone switches it on.

    Raises:
        ValueError: naming the unknown key, or the key whose value is invalid.
    """
    if SECTION not in ds_config:
        return None
    section = ds_config[SECTION]
    if not isinstance(section, Mapping):
        raise ValueError(
            f'the DeepSpeed config\'s "{SECTION}" section must be an object of OffloadConfig fields '
            f'plus "{_ENABLED}", not {type(section).__name__} {section!r}'
        )
    enabled = section.get(_ENABLED, True)
    if not isinstance(enabled, bool):
        raise ValueError(f'"{SECTION}": {{"{_ENABLED}": {enabled!r}}} must be true or false')
    fields = {k: v for k, v in section.items() if k != _ENABLED}
    try:
        check_keys(fields, where=f'"{SECTION}" section')
    except ValueError as exc:
        raise ValueError(f'{exc}, {_ENABLED}; remove or fix the key in the DeepSpeed config') from None
    try:
        config = OffloadConfig(**fields)
    except ValueError as exc:
        raise ValueError(f'DeepSpeed config, "{SECTION}" section: {exc}') from None
    return config if enabled else None


def _read_config(config: Any) -> dict[str, Any] | None:
    """``config`` as DeepSpeed reads it (a mapping, a JSON/HJSON file, base64 of JSON), or ``None``
    when it cannot be read here (DeepSpeed then reports the problem in its own words)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        return None
    text = os.fspath(config)
    if os.path.exists(text):
        with open(text, encoding="utf-8") as f:
            return _loads(f.read())
    try:
        return _loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def _loads(text: str) -> dict[str, Any] | None:
    try:
        import hjson  # what DeepSpeed itself parses config files with (a superset of JSON)
    except ImportError:
        loads: Callable[[str], Any] = json.loads
    else:
        loads = hjson.loads
    try:
        data = loads(text)
    except ValueError:
        return None
    return dict(data) if isinstance(data, Mapping) else None


@contextlib.contextmanager
def _attr_set_to(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``deepspeed.initialize`` that also honours an ``"ssdtrain"`` config section.

    Takes exactly the arguments of the installed ``deepspeed.initialize`` and returns its tuple
    ``(engine, optimizer, training_dataloader, lr_scheduler)``. The config is found where
    DeepSpeed looks for it (``config``, ``config_params``, ``args.deepspeed_config``) as a dict,
    a JSON file or base64. If it has an enabled ``"ssdtrain"`` section, the section is removed
    before DeepSpeed sees the config and an :class:`~ssdtrain.Offloader` is attached to the
    engine (see :func:`get_offloader`); otherwise nothing differs from ``deepspeed.initialize``.

    Raises:
        ValueError: the section has an unknown key or an invalid value (before DeepSpeed starts).
        ImportError: DeepSpeed is not installed.
    """
    deepspeed = _import_deepspeed()
    bound = inspect.signature(deepspeed.initialize).bind(*args, **kwargs)
    given = bound.arguments
    ds_args = given.get("args")

    source = None  # (where the config came from, the raw value)
    for name in ("config", "config_params"):
        if given.get(name) is not None:
            source = (name, given[name])
            break
    else:
        for name in ("deepspeed_config", "deepscale_config"):
            if getattr(ds_args, name, None) is not None:
                source = ("args." + name, getattr(ds_args, name))
                break
    data = _read_config(source[1]) if source is not None else None
    if data is None or SECTION not in data:
        return deepspeed.initialize(*args, **kwargs)

    config = offload_config(data)
    stripped = {k: v for k, v in data.items() if k != SECTION}
    where = source[0]
    # Created before DeepSpeed starts, so that an unusable path fails fast too.
    offloader = ssdtrain.Offloader(model=given.get("model"), config=config) if config is not None else None
    try:
        with contextlib.ExitStack() as stack:
            if where.startswith("args."):
                # DeepSpeed refuses `config` next to args.deepspeed_config; hide the file for the
                # call (args stays the caller's object: DeepSpeed writes args.local_rank into it).
                stack.enter_context(_attr_set_to(ds_args, where[len("args."):], None))
                given["config"] = stripped
            else:
                given[where] = stripped
            result = deepspeed.initialize(*bound.args, **bound.kwargs)
        if offloader is None:
            return result
        engine = result[0]
        attach(engine, offloader)
    except BaseException:
        if offloader is not None:
            offloader.close()
        raise
    logger.info("ssdtrain: %s offloads activations to %s", type(engine).__name__, ", ".join(config.paths))
    return result


# --------------------------------------------------------------------------------------------
# Wrapping an engine


def get_offloader(engine: Any) -> ssdtrain.Offloader | None:
    """The :class:`~ssdtrain.Offloader` attached to ``engine``, or ``None`` if there is none.

    Use it for ``stats()``; ``close()`` it (or ``engine.destroy()``) when training is over.
    """
    attachment = vars(engine).get(_ATTACHMENT)
    return attachment.offloader if attachment is not None else None


def attach(engine: Any, offloader: ssdtrain.Offloader) -> ssdtrain.Offloader:
    """Runs ``engine``'s forwards under ``offloader`` (see the module docstring for how).

    Only this engine instance changes; :func:`detach` undoes it. ``engine.destroy()`` closes the
    offloader. Returns ``offloader``.

    Raises:
        ValueError: the engine already has an offloader attached.
    """
    if _ATTACHMENT in vars(engine):
        raise ValueError("this engine already has an ssdtrain offloader; detach(engine) it first")
    _import_deepspeed()
    from deepspeed.runtime.pipe.engine import PipelineEngine

    attachment = _Attachment(offloader)
    try:
        if isinstance(engine, PipelineEngine):
            attachment.wrap_pipeline(engine, PipelineEngine)
        else:
            attachment.wrap_forward(engine)
        attachment.wrap_destroy(engine)
    except BaseException:
        attachment.restore(engine)
        raise
    vars(engine)[_ATTACHMENT] = attachment
    return offloader


def detach(engine: Any) -> ssdtrain.Offloader | None:
    """Removes what :func:`attach` added to ``engine``; returns the offloader (still open), or ``None``."""
    attachment = vars(engine).pop(_ATTACHMENT, None)
    if attachment is None:
        return None
    attachment.restore(engine)
    return attachment.offloader


class _Attachment:
    """What attach() did to one engine, and the pipeline bookkeeping of that engine."""

    def __init__(self, offloader: ssdtrain.Offloader) -> None:
        self.offloader = offloader
        self.saved: dict[str, Any] = {}   # instance attribute -> its value before (or _MISSING)
        # Micro-batches whose forward ran and whose backward has not, oldest first:
        # {key of the forward instruction (its buffer slot, ...): micro-batch id}.
        self.in_flight: dict[Any, int] = {}
        self.prefetched: set[int] = set()  # told to the offloader already (ahead of the backward)
        self.next_id = 0
        self.prefetch_ahead = False

    def _set(self, engine: Any, name: str, value: Any) -> None:
        self.saved.setdefault(name, vars(engine).get(name, _MISSING))
        vars(engine)[name] = value

    def restore(self, engine: Any) -> None:
        for name, old in reversed(self.saved.items()):
            if old is _MISSING:
                vars(engine).pop(name, None)
            else:
                vars(engine)[name] = old
        self.saved.clear()

    @staticmethod
    def _current(engine: Any, name: str) -> Callable[..., Any]:
        """``engine.name`` as a callable that does not keep the engine alive (no reference cycle
        through the engine's own ``__dict__``)."""
        own = vars(engine).get(name)
        if own is not None:
            return own
        function = getattr(type(engine), name)
        ref = weakref.ref(engine)
        return lambda *args, **kwargs: function(ref(), *args, **kwargs)

    # -- DeepSpeedEngine ------------------------------------------------------------------

    def wrap_forward(self, engine: Any) -> None:
        # nn.Module.__call__ looks `forward` up on the instance first, so an instance attribute
        # wraps this engine's forward and no other.
        forward = self._current(engine, "forward")
        offloader = self.offloader

        def offloaded_forward(*inputs: Any, **kwargs: Any) -> Any:
            with offloader:
                return forward(*inputs, **kwargs)

        self._set(engine, "forward", offloaded_forward)

    def wrap_destroy(self, engine: Any) -> None:
        if not hasattr(type(engine), "destroy") and "destroy" not in vars(engine):
            return
        # Note [destroy holds the engine]: DeepSpeedEngine.__del__ calls self.destroy() after the
        # garbage collector has cleared weak references, so this wrapper must hold the engine
        # strongly to run DeepSpeed's own destroy. The cycle it makes is collected like any other.
        destroy = vars(engine).get("destroy") or types.MethodType(type(engine).destroy, engine)
        offloader = self.offloader

        def destroy_and_close(*args: Any, **kwargs: Any) -> Any:
            try:
                return destroy(*args, **kwargs)
            finally:
                offloader.close()

        self._set(engine, "destroy", destroy_and_close)

    # -- PipelineEngine ---------------------------------------------------------------------

    def wrap_pipeline(self, engine: Any, pipeline_engine: type) -> None:
        from deepspeed.runtime.pipe import schedule

        # _exec_schedule dispatches through self._INSTRUCTION_MAP, a class attribute holding the
        # plain functions; an instance attribute with two entries replaced shadows it for this
        # engine only.
        instructions = dict(engine._INSTRUCTION_MAP)
        forward = instructions[schedule.ForwardPass]
        backward = instructions[schedule.BackwardPass]
        instructions[schedule.ForwardPass] = self._forward_instruction(forward)
        instructions[schedule.BackwardPass] = self._backward_instruction(backward)
        # 1F1B runs backwards in the order of their forwards, so once a backward ends the next
        # one is the oldest forward in flight; other schedules only get the prefetch right before.
        self.prefetch_ahead = type(engine)._train_schedule is pipeline_engine._train_schedule

        exec_schedule = self._current(engine, "_exec_schedule")

        def exec_schedule_counted(*args: Any, **kwargs: Any) -> Any:
            self.reset()
            try:
                return exec_schedule(*args, **kwargs)
            finally:
                self.reset()

        self._set(engine, "_INSTRUCTION_MAP", instructions)
        self._set(engine, "_exec_schedule", exec_schedule_counted)

    def reset(self) -> None:
        """A schedule (one batch) starts or ends: micro-batch ids count from 0 again."""
        self.in_flight.clear()
        self.prefetched.clear()
        self.next_id = 0

    def prefetch_once(self, microbatch: int) -> None:
        # Once per backward: a second prefetch of the same micro-batch would restart its
        # read-ahead window while the first reads are still counted in it.
        if microbatch not in self.prefetched:
            self.prefetched.add(microbatch)
            self.offloader.prefetch(microbatch)

    def _forward_instruction(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        def forward_pass(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # eval_batch: nothing is saved for a backward
                return forward(engine, *args, **kwargs)
            # Note [buffer slots are not micro-batches]: ForwardPass(buffer_id) names a slot that
            # the schedule reuses (micro-batch % number of buffers). The slot stays taken until
            # that micro-batch's backward, so the forward's key finds its micro-batch again.
            microbatch = self.next_id
            self.next_id += 1
            self.in_flight[_instruction_key(args, kwargs)] = microbatch
            with self.offloader.microbatch(microbatch):
                return forward(engine, *args, **kwargs)

        return forward_pass

    def _backward_instruction(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        def backward_pass(engine: Any, *args: Any, **kwargs: Any) -> Any:
            microbatch = self.in_flight.pop(_instruction_key(args, kwargs), None)
            if microbatch is not None:
                self.prefetch_once(microbatch)
                self.prefetched.discard(microbatch)  # the id comes back in the next batch
            result = backward(engine, *args, **kwargs)
            if self.prefetch_ahead and self.in_flight:
                # Read the next backward's first tensors while this stage runs its next forward.
                self.prefetch_once(next(iter(self.in_flight.values())))
            return result

        return backward_pass


def _instruction_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args, tuple(sorted(kwargs.items()))
