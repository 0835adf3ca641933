"""ssdtrain beside what users run to take activation checkpoints off the GPU, on a real Hugging Face model.

The model is ``transformers``' ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights
(nothing is downloaded): Llama-3.2-1B's shape by default (hidden 2048, 16 layers, 32 heads, 8 KV
heads, MLP 8192, vocab 128256, tied embeddings), ``--shape llama-3.1-8b`` with LoRA (peft, rank
``--lora``, every linear layer of the blocks) where the GPU holds it, ``--shape tiny`` for the CPU.
bf16 on a GPU, float32 on the CPU; one device. Every mode checkpoints each decoder layer (HF's
non-reentrant activation checkpointing) and differs in where the layer inputs go:

* ``hf-ckpt``: HF checkpointing alone: the inputs stay on the device (the reference);
* ``hf-ckpt-offload``: HF's own offload, ``activation_checkpointing_enable(..., offload=True)``
  (transformers 5.23; 5.17 has it as ``gradient_checkpointing_enable(..., offload=True)``; the
  ``Trainer`` takes ``gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True}`` and
  pops ``offload`` before calling it): ``save_on_cpu(pin_memory=True)`` around each layer's
  checkpoint, copies on the compute stream; "unsupported in transformers X.Y" where the argument
  is absent. It cannot run with a CPU-only torch (no pinned allocator): reported so;
* ``torchtune``: torchtune's ``OffloadActivations`` (``torchtune.training``, the real package)
  around forward: every save of 1 KiB or more to pinned memory on a side stream (CUDA only: its
  ``__init__`` takes ``torch.cuda.default_stream()``);
* ``deepspeed-offload``: DeepSpeed's ``cpu_checkpointing``: ``deepspeed.checkpointing.configure(
  None, checkpoint_in_cpu=True)`` and its reentrant ``deepspeed.checkpointing.checkpoint`` as HF's
  checkpoint function. No engine (``deepspeed.initialize``) is needed, but ``configure`` asks
  ``deepspeed.comm`` for the rank: a one-process gloo group is set up for it. On the CPU
  accelerator it breaks the recomputation (the layer input's ``.data`` is emptied): reported so;
* ``deepspeed-hf``: DeepSpeed's ``CheckpointHiddenStatesOffload`` (``deepspeed.runtime.
  activation_checkpointing.offload_activations``, from axolotl): a context around forward and
  backward that offloads only the inputs HF checkpoints, on a side stream, the last one kept
  (on the CPU it marks them and offloads nothing);
* ``unsloth``: Unsloth's offloaded checkpointing (``unsloth_zoo.gradient_checkpointing``) as HF's
  checkpoint function, if ``unsloth_zoo`` imports on its own (it refuses to unless ``import
  unsloth`` ran first, which patches transformers: then the mode says so and is skipped);
* ``ssdtrain``: recompute+offload: HF checkpointing and ``ssdtrain.Offloader(model, path=...,
  min_bytes=0)`` around forward (the host tier on a GPU; files under ``--path`` on the CPU);
* ``ssdtrain+tiled``: the same after ``ssdtrain.longctx.hf.long_context(model, tile_tokens=...)``
  (each MLP tiled along the sequence; the loss as ``--loss-chunk`` says), if that module exists.

A peer that is not installed, does not import, or cannot run on this device is reported with the
reason (in the table and the JSON), never dropped.

How it measures. Each mode runs in its own process (its own caching allocator, its own model
from the same seed, the same tokens), started together; the parent then alternates rounds: in
each round every mode runs ``--steps`` measured steps, in the order of the modes and reversed
every other round. A step is forward and backward (no optimizer: it would be the same for every
mode), timed to the device's synchronize (and ssdtrain's ``off.wait()``). Before its first round a
mode runs ``--warmup`` steps (ssdtrain: more while its host tier learns its copy budget, at most
5); on a GPU a mode empties its allocator's cache after each round (the idle processes share the
device) and runs one untimed step at the start of the next. ``--fresh`` starts a process per mode
and round instead (for shapes where the processes do not fit on the device together).

Per mode, the median over rounds of: the step time and tokens per second; the device peak
(GPU: ``torch.cuda.max_memory_allocated`` during the step; CPU: the process's resident-set growth
over the step, sampled every 2 ms with glibc's mmap threshold at 64 KiB so that freed memory
returns, plus nothing else: labelled as such); host memory (resident set after the step, the
pinned host allocator's peak where torch reports it, and ssdtrain's ``host_tier_pinned_bytes``);
the checkpoint bytes moved off the device in a step where the peer says (ssdtrain's stats,
DeepSpeed's engine stats, what torchtune's pack hook copied), else an estimate: layers x batch x
seq x hidden x element size (marked ``~``). Package versions are printed: torch, transformers,
each peer's own. Gradients (``--grads``; by default at ``--shape tiny`` and with LoRA, where they
are small): the first step's gradients of every mode against ``hf-ckpt``'s (``torch.equal`` and
the largest absolute difference), from the same weights and tokens; on a GPU with
``--deterministic`` (embedding backward's atomics differ from run to run otherwise). On the CPU
each worker runs torch with one thread (``--threads``): the workers share the cores.

``--max-seq``: the longest sequence per mode under ``--memory-budget`` GiB, found by doubling from
``--start-seq`` then bisecting (``ssdtrain.bench.maxseq.search``), a process per probe: on a GPU the
probe caps its allocator (``torch.cuda.set_per_process_memory_fraction``) and a real
out-of-memory is the failure; on the CPU the step's resident growth plus the weights must fit.

    python benchmarks/peers.py                                   # GPU, Llama-3.2-1B shape, seq 8192
    python benchmarks/peers.py --shape tiny --device cpu --rounds 2 --json peers.json
    python benchmarks/peers.py --max-seq --memory-budget 24 --loss-chunk 4096 --modes hf-ckpt,ssdtrain
    python benchmarks/peers.py --shape llama-3.1-8b --lora 16 --fresh
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIB = 1 << 20

MODES = ("hf-ckpt", "hf-ckpt-offload", "torchtune", "deepspeed-offload", "deepspeed-hf", "unsloth", "ssdtrain",
         "ssdtrain+tiled")
DEFAULT_MODES = MODES
REFERENCE = "hf-ckpt"

SHAPES: dict[str, dict[str, Any]] = {
    # A few blocks, small enough for a 2-core CPU in seconds (the test's shape).
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B's config.json (rope scaling left out: random weights, same shapes).
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    # meta-llama/Llama-3.1-8B's config.json.
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
}
# Per shape: (seq, batch) when not given.
SHAPE_DEFAULTS = {"tiny": (128, 2), "llama-3.2-1b": (8192, 1), "llama-3.1-8b": (8192, 1)}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# What each mode needs besides torch and transformers: (module to find, distribution for the version).
PEER_PACKAGES = {
    "torchtune": [("torchtune", "torchtune"), ("torchao", "torchao")],
    "deepspeed-offload": [("deepspeed", "deepspeed")],
    "deepspeed-hf": [("deepspeed", "deepspeed")],
    "unsloth": [("unsloth_zoo", "unsloth_zoo")],
    "ssdtrain": [("ssdtrain", "ssdtrain")],
    "ssdtrain+tiled": [("ssdtrain.longctx.hf", "ssdtrain")],
}
INSTALL_HINT = {
    "torchtune": "pip install torchtune==0.6.1 torchao==0.10.0 (its import also needs datasets, omegaconf, "
                 "sentencepiece, tiktoken); on a lent GPU carry their wheels (.ci/gpu-wheels)",
    "deepspeed-offload": "pip install deepspeed",
    "deepspeed-hf": "pip install deepspeed (0.19.8 has CheckpointHiddenStatesOffload)",
    "unsloth": "pip install unsloth-zoo unsloth",
    "ssdtrain+tiled": "ssdtrain.longctx.hf is not in this checkout",
}
WARMUP_MAX = 5  # as ssdtrain.bench._maxseq_child: steps while ssdtrain's host tier learns its copy budget


# ----------------------------------------------------------------------------------------------
# The worker: one mode, one model, in its own process.
# ----------------------------------------------------------------------------------------------


class Unavailable(Exception):
    """The mode cannot run here: the message says why."""


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        mod = sys.modules.get(dist)
        return getattr(mod, "__version__", None)


def _loss(model, ids, loss_chunk: int):
    """The causal-LM loss of ``ids`` (labels = the tokens): the model's own, or in chunks of
    ``loss_chunk`` tokens with ``ssdtrain.longctx.hf.chunked_lm_loss`` (the same for every mode)."""
    if not loss_chunk:
        return model(input_ids=ids, labels=ids).loss
    from ssdtrain.longctx.hf import chunked_lm_loss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "forward" in base.__dict__:  # long_context already computes its loss in chunks (ssdtrain+tiled)
        return model(input_ids=ids, labels=ids).loss
    hidden = base.model(input_ids=ids).last_hidden_state
    return chunked_lm_loss(base.lm_head, hidden, ids, chunk=loss_chunk)


def _enable_checkpointing(model, *, offload: bool = False) -> str:
    """HF's non-reentrant activation checkpointing per decoder layer; ``offload``: HF's own
    offload of the layer inputs. Returns the call made."""
    fn = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.23 (not 5.17)
    if fn is not None:
        kwargs = {"activation_checkpointing_kwargs": {"use_reentrant": False}}
        name = "activation_checkpointing_enable"
    else:
        fn = model.gradient_checkpointing_enable
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        name = "gradient_checkpointing_enable"
    if offload:
        if "offload" not in inspect.signature(fn).parameters:
            import transformers

            major_minor = ".".join(transformers.__version__.split(".")[:2])
            raise Unavailable(f"unsupported in transformers {major_minor} ({name} has no offload argument)")
        kwargs["offload"] = True
    fn(**kwargs)
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})"


def _set_checkpoint_function(model, function) -> None:
    """Makes ``function`` HF's checkpoint function for every layer (checkpointing already on)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=function)


class _Counted:
    """Wraps a ``saved_tensors_hooks`` object's pack hook to count what it takes off the device
    (``rule(tensor)``: whether this save is copied off), without changing what it does."""

    def __init__(self, hooks, rule) -> None:
        self.bytes = 0
        pack = hooks.pack_hook

        def counting_pack(t):
            if rule(t):
                self.bytes += t.numel() * t.element_size()
            return pack(t)

        hooks.pack_hook = counting_pack


class Worker:
    """One mode's model and step, driven by the parent over a pipe (:func:`worker_main`)."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.mode = mode = spec["mode"]
        for module, _ in PEER_PACKAGES.get(mode, []):
            if importlib.util.find_spec(module.split(".")[0]) is None or (
                    "." in module and importlib.util.find_spec(module) is None):
                raise Unavailable(f"{module} is not installed: {INSTALL_HINT.get(mode, '')}".rstrip(": "))
        import torch
        import transformers

        self.torch = torch
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        if spec.get("deterministic"):
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                         "transformers": transformers.__version__}
        dev = torch.device(spec["device"])
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise Unavailable("no CUDA device")
            dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        self.dev = dev
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
        self.ctx_factory = contextlib.nullcontext  # what each forward runs inside
        self.around_backward = False  # the context spans backward too (deepspeed-hf)
        self.off = None  # an ssdtrain.Offloader
        self.counter: _Counted | None = None
        self.ds_engine = None  # DeepSpeed's offload engine (its stats)
        self.setup_notes: list[str] = []
        self.prepare_peer()  # imports and checks before the model is built (fast refusals)
        if dev.type == "cuda" and spec.get("budget_bytes"):
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget_bytes"] / total), dev)
        self.model = self.build_model(transformers)
        self.install_mode()
        g = torch.Generator().manual_seed(spec["seed"] + 1)
        self.ids = torch.randint(0, self.config.vocab_size, (spec["batch"], spec["seq"]), generator=g).to(dev)
        self.steps_run = 0
        self.turns = 0
        from ssdtrain.bench._measure import RssSampler

        self.sampler = RssSampler()
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    # --- setup ------------------------------------------------------------------------------

    def prepare_peer(self) -> None:
        """Imports the peer and checks it can run here; records its versions."""
        mode, torch = self.mode, self.torch
        if mode == "torchtune":
            try:
                from torchtune.training import OffloadActivations
            except Exception as exc:  # an import error of torchtune or of what it imports
                raise Unavailable(f"torchtune does not import: {type(exc).__name__}: {exc}") from exc
            self.versions.update(torchtune=_version("torchtune"), torchao=_version("torchao"))
            if self.dev.type != "cuda":
                raise Unavailable(f"torchtune {self.versions['torchtune']} imports, but OffloadActivations needs "
                                  "CUDA (its __init__ takes torch.cuda.default_stream(); unpack copies to 'cuda')")
            self._torchtune = OffloadActivations
        elif mode in ("deepspeed-offload", "deepspeed-hf"):
            if self.dev.type == "cpu":
                os.environ.setdefault("DS_ACCELERATOR", "cpu")
            try:
                import deepspeed  # noqa: F401
            except Exception as exc:
                raise Unavailable(f"deepspeed does not import: {type(exc).__name__}: {exc}") from exc
            self.versions["deepspeed"] = _version("deepspeed")
            if mode == "deepspeed-hf":
                try:
                    from deepspeed.runtime.activation_checkpointing import offload_activations  # noqa: F401
                except ImportError as exc:
                    raise Unavailable(f"deepspeed {self.versions['deepspeed']} has no CheckpointHiddenStatesOffload "
                                      f"({exc})") from exc
        elif mode == "unsloth":
            try:
                import unsloth_zoo.gradient_checkpointing  # noqa: F401
            except Exception as exc:
                why = (" (it needs `import unsloth` first, which patches transformers' models at import)"
                       if "install Unsloth" in str(exc) else "")
                raise Unavailable(f"unsloth_zoo {_version('unsloth_zoo')} does not import on its own: "
                                  f"{type(exc).__name__}: {str(exc).strip()[:300]}{why}") from exc
            self.versions["unsloth_zoo"] = _version("unsloth_zoo")
        elif mode in ("ssdtrain", "ssdtrain+tiled"):
            import ssdtrain

            self.versions["ssdtrain"] = ssdtrain.__version__
            if mode == "ssdtrain+tiled":
                try:
                    importlib.import_module("ssdtrain.longctx.hf")
                except ImportError as exc:
                    raise Unavailable(f"ssdtrain.longctx.hf does not import: {exc}") from exc
        if self.spec.get("lora"):
            try:
                import peft
            except ImportError as exc:
                raise Unavailable(f"--lora needs peft: {exc}") from exc
            self.versions["peft"] = peft.__version__
        del torch

    def build_model(self, transformers):
        torch, spec = self.torch, self.spec
        cfg = transformers.LlamaConfig(**spec["shape"], max_position_embeddings=max(spec["seq"], 8192),
                                       use_cache=False, attention_dropout=0.0)
        self.config = cfg
        torch.manual_seed(spec["seed"])
        with torch.device(self.dev):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
        model.train()
        self.checkpointing = None
        if self.mode != "ssdtrain+tiled":  # long_context turns it on itself
            self.checkpointing = _enable_checkpointing(model, offload=self.mode == "hf-ckpt-offload")
        if spec.get("lora"):
            import peft

            lcfg = peft.LoraConfig(r=spec["lora"], lora_alpha=2 * spec["lora"], lora_dropout=0.0,
                                   target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
            torch.manual_seed(spec["seed"] + 2)
            model = peft.get_peft_model(model, lcfg)
            model.train()
        return model

    def install_mode(self) -> None:
        mode, torch, model = self.mode, self.torch, self.model
        if mode == "torchtune":
            hooks = self._torchtune()  # defaults: pinned memory, a side stream, saves of 1 KiB or more
            self.counter = _Counted(hooks, lambda t: t.numel() * t.element_size() >= hooks.min_tensor_size_bytes
                                    and not isinstance(t, (torch.nn.Parameter, getattr(torch.nn, "Buffer", ()))))
            self.ctx_factory = lambda: hooks
        elif mode == "deepspeed-offload":
            self._setup_deepspeed_comm()
            from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

            ds_ckpt.configure(None, checkpoint_in_cpu=True)
            _set_checkpoint_function(model, ds_ckpt.checkpoint)
            self.ds_ckpt = ds_ckpt
            self.setup_notes.append("deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True); its reentrant "
                                    "checkpoint as HF's checkpoint function; deepspeed.comm: one gloo rank")
        elif mode == "deepspeed-hf":
            from deepspeed.runtime.activation_checkpointing.offload_activations import (
                get_checkpoint_hidden_states_offloading_ctx_manager,
            )

            hooks = get_checkpoint_hidden_states_offloading_ctx_manager()
            self.ds_engine = hooks
            self.ctx_factory = lambda: hooks
            self.around_backward = True  # its __exit__ drops what it offloaded: backward runs inside
        elif mode == "unsloth":
            from unsloth_zoo.gradient_checkpointing import unsloth_offloaded_gradient_checkpoint

            _set_checkpoint_function(model, unsloth_offloaded_gradient_checkpoint)
        elif mode in ("ssdtrain", "ssdtrain+tiled"):
            import ssdtrain

            if mode == "ssdtrain+tiled":
                from ssdtrain.longctx.hf import long_context

                self.long_context = long_context(model, tile_tokens=self.spec.get("tile_tokens") or None,
                                                 loss_chunk=self.spec.get("loss_chunk") or 0)
                self.checkpointing = f"long_context: {self.long_context!r}"
            path = self.spec.get("path")
            self.off = ssdtrain.Offloader(model, min_bytes=0, **({"path": path} if path else {}))
            self.ctx_factory = lambda: self.off

    def _setup_deepspeed_comm(self) -> None:
        """``deepspeed.checkpointing.configure`` asks ``deepspeed.comm`` for the rank: one gloo rank."""
        import socket

        import deepspeed

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                         LOCAL_RANK="0").items():
            os.environ.setdefault(k, v)
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)

    # --- steps ------------------------------------------------------------------------------

    def _learning(self) -> bool:
        if self.off is None:
            return False
        from ssdtrain.bench._maxseq_child import _learning

        class _Mode:  # what _maxseq_child._learning reads
            off = self.off

        return _learning(_Mode)

    def step(self) -> dict:
        """One forward and backward; its record (an out-of-memory is recorded, not raised)."""
        torch, dev = self.torch, self.dev
        from ssdtrain.bench import _device

        self.model.zero_grad(set_to_none=True)
        rec: dict[str, Any] = {}
        rec["start_bytes"] = _device.reset_memory_peaks(dev)
        before = self.off.stats() if self.off is not None else None
        counted = self.counter.bytes if self.counter is not None else 0
        eng = getattr(getattr(self, "ds_ckpt", None), "_cpu_offload_engine", None)
        ds_before = eng.stats.offloaded_bytes if eng is not None else 0
        on_cpu = dev.type == "cpu"
        if on_cpu:
            self.sampler.start()
        loss = None
        try:
            t0 = time.perf_counter()
            ctx = self.ctx_factory()
            with ctx:
                loss = _loss(self.model, self.ids, self.spec.get("loss_chunk") or 0)
                if self.around_backward:
                    loss.backward()
            if not self.around_backward:
                loss.backward()
            if self.off is not None:
                self.off.wait()
            _device.synchronize(dev)
            rec["step_s"] = time.perf_counter() - t0
            rec["loss"] = float(loss.detach().float())
        except torch.OutOfMemoryError as exc:
            rec["oom"] = True
            rec["error"] = str(exc).splitlines()[0][:300]
        finally:
            growth = self.sampler.stop() if on_cpu else None
            del loss
        self.steps_run += 1
        peaks = _device.memory_peaks(dev)
        if on_cpu:
            rec["peak_bytes"] = growth
        else:
            rec["peak_bytes"] = peaks["max_memory_allocated_bytes"]
            rec["pinned_peak_bytes"] = peaks["pinned_host_peak_bytes"]
        rec["rss_bytes"] = self.sampler.rss() if self.sampler.available else None
        if self.off is not None:
            s = self.off.stats()
            rec.update(moved_bytes=s.written_bytes - before.written_bytes,
                       host_copied_bytes=s.host_copied_bytes - before.host_copied_bytes,
                       drive_bytes=(s.written_bytes - before.written_bytes) - (s.host_copied_bytes
                                                                              - before.host_copied_bytes),
                       kept_bytes=s.kept_bytes - before.kept_bytes,
                       host_tier_pinned_bytes=s.host_tier_pinned_bytes, moved_how="ssdtrain stats")
        elif self.counter is not None:
            rec.update(moved_bytes=self.counter.bytes - counted, moved_how="its pack hook, counted")
        elif self.ds_engine is not None:
            import dataclasses

            rec.update(moved_bytes=self.ds_engine.stats.offloaded_bytes, moved_how="DeepSpeed engine stats",
                       peer_stats=dataclasses.asdict(self.ds_engine.stats))
        elif self.mode == "deepspeed-offload" and getattr(self.ds_ckpt, "_cpu_offload_engine", None) is not None:
            eng = self.ds_ckpt._cpu_offload_engine
            rec.update(moved_bytes=eng.stats.offloaded_bytes - ds_before, moved_how="DeepSpeed engine stats")
        return rec

    def save_grads(self, path: str) -> None:
        grads = {n: p.grad.detach().float().cpu() for n, p in self.model.named_parameters() if p.grad is not None}
        self.torch.save(grads, path)

    def turn(self, cmd: dict) -> dict:
        """One round of this mode: warm-up steps, then ``steps`` measured ones."""
        torch = self.torch
        first = self.turns == 0
        self.turns += 1
        warm = cmd.get("warmup", 1) if first else cmd.get("rewarm", 0)
        out: dict[str, Any] = {"warmup": [], "steps": []}
        while len(out["warmup"]) < warm or (first and len(out["warmup"]) < warm + WARMUP_MAX and self._learning()):
            rec = self.step()
            if self.steps_run == 1 and cmd.get("grads_file") and "step_s" in rec:
                self.save_grads(cmd["grads_file"])
            out["warmup"].append(rec)
            if rec.get("oom"):
                return out
        for _ in range(cmd.get("steps", 1)):
            rec = self.step()
            if self.steps_run == 1 and cmd.get("grads_file") and "step_s" in rec:
                self.save_grads(cmd["grads_file"])
            out["steps"].append(rec)
            if rec.get("oom"):
                break
        if self.dev.type == "cuda" and cmd.get("release"):
            self.model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        return out

    def close(self) -> None:
        if self.off is not None:
            self.off.close()
        self.sampler.close()

    def info(self) -> dict:
        return {"versions": self.versions, "checkpointing": self.checkpointing, "notes": self.setup_notes,
                "param_bytes": self.param_bytes,
                "trainable_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()
                                       if p.requires_grad),
                "device_name": (self.torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu")}


def _hint(spec: dict, exc: Exception) -> str:
    """What is known of a peer's failure here (checked by reading the peer's code)."""
    mode, cpu = spec["mode"], spec["device"] == "cpu"
    if mode == "hf-ckpt-offload" and cpu and "pin_memory" in str(exc):
        return (" [transformers' offload runs save_on_cpu(pin_memory=True) also where no accelerator exists: "
                "it cannot run with a CPU-only torch]")
    if mode == "deepspeed-offload" and cpu and isinstance(exc, (IndexError, RuntimeError)):
        return (" [DeepSpeed's cpu_checkpointing on its CPU accelerator: copy_to_device(args, 'cpu') returns the "
                "layer input itself, whose .data get_cpu_activations_for_backward then empties, so the "
                "recomputation gets a 0-d tensor; on a GPU its asynchronous offload engine runs instead]")
    return ""


def worker_main() -> int:
    """The worker's loop: a spec line in, ``ready`` (or why not) out; then a JSON command per line
    (``{"cmd": "round", ...}`` or ``{"cmd": "quit"}``), a JSON reply per line. The replies go to
    the original stdout; everything printed by libraries goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    spec = json.loads(sys.stdin.readline())
    try:
        w = Worker(spec)
    except Unavailable as exc:
        reply({"status": "unavailable", "reason": str(exc)})
        return 0
    except Exception as exc:  # a failure to set up: said, with where
        reply({"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:600],
               "traceback": traceback.format_exc()[-3000:]})
        return 0
    reply({"status": "ready", **w.info()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            reply({"status": "ok", **w.turn(cmd)})
        except Exception as exc:
            reply({"status": "failed", "reason": (f"{type(exc).__name__}: {exc}"[:600] + _hint(spec, exc)),
                   "traceback": traceback.format_exc()[-3000:]})
            break
    try:
        w.close()
    except Exception:
        pass
    # Leave without the interpreter's teardown (torch's and transformers' take seconds on a loaded
    # machine): everything worth keeping was sent or closed above.
    sys.stderr.flush()
    proto.close()
    os._exit(0)


# ----------------------------------------------------------------------------------------------
# The parent.
# ----------------------------------------------------------------------------------------------


def _env(device: str, probe: bool = False, deterministic: bool = False) -> dict:
    env = dict(os.environ)
    if deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        env["MALLOC_MMAP_THRESHOLD_"] = str(64 << 10)  # freed memory returns: the RSS growth is the step's
        env.setdefault("DS_ACCELERATOR", "cpu")
    elif probe:
        from ssdtrain.bench.maxseq import ALLOC_CONF

        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    return env


class Proc:
    """A worker process seen from the parent."""

    def __init__(self, spec: dict, log_dir: str, tag: str, probe: bool = False) -> None:
        self.mode = spec["mode"]
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{tag}.log")
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env=_env(spec["device"], probe, spec.get("deterministic", False)),
                                  cwd=str(ROOT))
        self.p.stdin.write(json.dumps(spec) + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.p.stdout], [], [], timeout)
        line = self.p.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        if not ready:
            self.kill()
            return {"status": "failed", "reason": f"no answer in {timeout:.0f} s", "log_tail": self.tail()}
        rc = self.p.wait()
        # A process killed by a signal (the kernel's OOM killer) or dead without a word.
        return {"status": "failed", "reason": f"the worker died (exit status {rc})", "oom": rc < 0,
                "log_tail": self.tail()}

    def send(self, cmd: dict) -> bool:
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def ask_quit(self) -> None:
        if self.p.poll() is None and not self.p.stdin.closed:
            self.send({"cmd": "quit"})
            try:
                self.p.stdin.close()
            except OSError:
                pass

    def quit(self, timeout: float = 60) -> None:
        if self.p.poll() is None:
            self.ask_quit()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.p.stdin, self.p.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.log.close()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def precheck(mode: str) -> str | None:
    """Why ``mode`` cannot run, if its package is missing (no process needed); else None."""
    for module, _ in PEER_PACKAGES.get(mode, []):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return f"{module} is not installed: {INSTALL_HINT.get(mode, '')}".rstrip(": ")
    return None


def _shape(args) -> dict:
    return dict(SHAPES[args.shape])


def make_spec(args, mode: str, seq: int | None = None, budget: int | None = None) -> dict:
    return {"mode": mode, "shape": _shape(args), "seq": seq or args.seq, "batch": args.batch,
            "device": args.device, "dtype": args.dtype, "seed": args.seed, "lora": args.lora,
            "loss_chunk": args.loss_chunk, "tile_tokens": args.tile_tokens, "path": args.path,
            "budget_bytes": budget, "threads": args.threads, "deterministic": args.deterministic}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def estimate_moved(args, spec_shape: dict) -> int:
    """What offloading every checkpointed layer input moves: layers x batch x seq x hidden x bytes."""
    elem = 2 if args.dtype == "bfloat16" else 4
    return spec_shape["num_hidden_layers"] * args.batch * args.seq * spec_shape["hidden_size"] * elem


def run_rounds(args, modes: list[str], say) -> dict:
    results: dict[str, dict] = {}
    runnable = []
    for m in modes:
        why = precheck(m)
        if why:
            results[m] = {"status": "unavailable", "reason": why}
            say(f"{m}: unavailable: {why}")
        else:
            runnable.append(m)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="peers-logs-")
    grads_dir = tempfile.mkdtemp(prefix="peers-grads-") if args.grads else None
    procs: dict[str, Proc] = {}
    rounds: dict[str, list[dict]] = {m: [] for m in runnable}
    on_gpu = args.device.startswith("cuda")

    def start(m: str, r: int) -> dict:
        procs[m] = Proc(make_spec(args, m), log_dir, f"{m}-r{r}" if args.fresh else m)
        return procs[m]

    def ready(m: str) -> bool:
        msg = procs[m].recv(args.timeout)
        if msg["status"] != "ready":
            results[m] = msg
            say(f"{m}: {msg['status']}: {msg.get('reason')}")
            procs.pop(m).quit()
            return False
        results.setdefault(m, {"status": "ran", **{k: v for k, v in msg.items() if k != "status"}})
        return True

    live = list(runnable)
    if not args.fresh:  # every mode's process at once: imports and model builds overlap
        for m in live:
            start(m, 0)
        live = [m for m in live if ready(m)]
    for r in range(args.rounds):
        order = live if r % 2 == 0 else live[::-1]
        for m in list(order):
            if m not in live:
                continue
            if args.fresh:
                start(m, r)
                if not ready(m):
                    live.remove(m)
                    continue
            cmd = {"cmd": "round", "steps": args.steps, "warmup": args.warmup, "rewarm": 1 if on_gpu else 0,
                   "release": on_gpu and not args.fresh,
                   "grads_file": os.path.join(grads_dir, f"{m}.pt") if grads_dir and r == 0 else None}
            procs[m].send(cmd)
            msg = procs[m].recv(args.timeout)
            if msg["status"] != "ok":
                results[m].update(status="failed", reason=msg.get("reason"), traceback=msg.get("traceback"),
                                  log_tail=msg.get("log_tail"))
                say(f"{m}: round {r + 1} failed: {msg.get('reason')}")
                procs.pop(m).quit()
                live.remove(m)
                continue
            steps = msg["steps"]
            oom = any(s.get("oom") for s in msg["warmup"] + steps)
            if oom:
                results[m].update(status="failed", reason="out of memory: " + next(
                    s.get("error", "") for s in msg["warmup"] + steps if s.get("oom")))
                say(f"{m}: round {r + 1}: out of memory")
                procs.pop(m).quit()
                live.remove(m)
                continue
            rounds[m].append({"step_s": _median(s["step_s"] for s in steps), "steps": steps,
                              "warmup_steps": len(msg["warmup"])})
            say(f"{m}: round {r + 1}: step {rounds[m][-1]['step_s'] * 1e3:.1f} ms")
            if args.fresh:
                procs.pop(m).quit()
    for p in procs.values():  # all at once: their closing overlaps
        p.ask_quit()
    for p in procs.values():
        p.quit()
    shape = _shape(args)
    tokens = args.batch * args.seq
    for m in runnable:
        res = results[m]
        if not rounds.get(m) or res.get("status") != "ran":
            continue
        steps = [s for rd in rounds[m] for s in rd["steps"]]
        step_s = _median(rd["step_s"] for rd in rounds[m])
        res.update(step_s=step_s, tokens_per_s=tokens / step_s if step_s else None,
                   step_s_rounds=[rd["step_s"] for rd in rounds[m]],
                   peak_bytes=_median(s.get("peak_bytes") for s in steps),
                   start_bytes=_median(s.get("start_bytes") for s in steps),
                   rss_bytes=_median(s.get("rss_bytes") for s in steps),
                   pinned_peak_bytes=_median(s.get("pinned_peak_bytes") for s in steps),
                   host_tier_pinned_bytes=_median(s.get("host_tier_pinned_bytes") for s in steps),
                   loss=steps[0].get("loss") if steps else None, rounds=rounds[m])
        if any("moved_bytes" in s for s in steps):
            res["moved_bytes"] = _median(s.get("moved_bytes") for s in steps)
            res["moved_how"] = next(s["moved_how"] for s in steps if "moved_how" in s)
            for k in ("host_copied_bytes", "drive_bytes", "kept_bytes"):
                if any(k in s for s in steps):
                    res[k] = _median(s.get(k) for s in steps)
        elif m == REFERENCE:
            res.update(moved_bytes=0, moved_how="none (the reference keeps the inputs on the device)")
        else:
            res.update(moved_bytes=estimate_moved(args, shape),
                       moved_how="estimate: layers x batch x seq x hidden x element size")
    out = {"modes": {m: results[m] for m in modes}, "log_dir": log_dir}
    if grads_dir:
        out["grads"] = compare_grads(grads_dir, runnable, results)
        shutil.rmtree(grads_dir, ignore_errors=True)
    return out


def compare_grads(grads_dir: str, modes: list[str], results: dict) -> dict:
    """Each mode's first-step gradients against the reference's: ``torch.equal`` over every
    parameter, and the largest absolute difference."""
    import torch

    ref_path = os.path.join(grads_dir, f"{REFERENCE}.pt")
    if not os.path.exists(ref_path):
        return {"error": f"no gradients of {REFERENCE} (it did not run)"}
    ref = torch.load(ref_path)
    out = {}
    for m in modes:
        path = os.path.join(grads_dir, f"{m}.pt")
        if m == REFERENCE or not os.path.exists(path):
            continue
        got = torch.load(path)
        if got.keys() != ref.keys():
            out[m] = {"equal": False, "max_abs_diff": None,
                      "error": f"different parameters with gradients ({len(got)} vs {len(ref)})"}
            continue
        diff = max(((got[k] - ref[k]).abs().max().item() for k in ref), default=0.0)
        scale = max((ref[k].abs().max().item() for k in ref), default=0.0)
        out[m] = {"equal": all(torch.equal(got[k], ref[k]) for k in ref), "max_abs_diff": diff,
                  "max_rel_diff": diff / scale if scale else None}
    return out


def parse_bytes(text: str) -> int:
    t = text.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", GIB), ("gb", 10**9), ("mib", MIB), ("mb", 10**6), ("g", GIB), ("m", MIB)):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * mult)
    return int(float(t) * GIB)  # a bare number: GiB


def run_max_seq(args, modes: list[str], say, partial=None) -> dict:
    from ssdtrain.bench.maxseq import search

    budget = args.memory_budget
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="peers-maxseq-")
    rows, probes, skipped = [], [], {}
    versions: dict[str, Any] = {}
    device_name = [args.device]

    def probe(mode: str, seq: int) -> dict:
        p = Proc(make_spec(args, mode, seq=seq, budget=budget), log_dir, f"{mode}-{seq}", probe=True)
        msg = p.recv(args.timeout)
        r: dict[str, Any] = {"mode": mode, "seq": seq, "fits": False, "step_s": None, "peak_bytes": None}
        if msg["status"] == "ready":
            param_bytes = msg["param_bytes"]
            for k, v in msg.get("versions", {}).items():
                versions.setdefault(k, v)
            device_name[0] = msg.get("device_name", device_name[0])
            p.send({"cmd": "round", "steps": 1, "warmup": args.warmup, "release": False})
            msg = p.recv(args.timeout)
            if msg["status"] == "ok":
                steps = msg["warmup"] + msg["steps"]
                oom = next((s for s in steps if s.get("oom")), None)
                last = msg["steps"][-1] if msg["steps"] else None
                if oom is not None:
                    r.update(oom=True, error=oom.get("error"))
                elif last is not None:
                    r.update(step_s=last["step_s"], peak_bytes=last["peak_bytes"])
                    if args.device == "cpu":  # the step's resident growth, plus the weights resident before it
                        r["peak_bytes"] = (last["peak_bytes"] or 0) + param_bytes
                        r["fits"] = r["peak_bytes"] <= budget
                    else:
                        r["fits"] = True
            elif msg.get("oom"):  # killed for memory: a failure to fit
                r.update(oom=True, error=msg.get("reason"))
            else:  # the mode failed, not for memory
                r.update(error=msg.get("reason"), broken=True)
        elif msg.get("oom"):
            r.update(oom=True, error=msg.get("reason"))
        else:
            r.update(error=msg.get("reason"), broken=True)
        p.quit()
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:.0f} MiB"
        step = "-" if r["step_s"] is None else f"{r['step_s']:.2f}s"
        say(f"max-seq {mode} seq {seq}: {'fits' if r['fits'] else 'does not fit'} (peak {peak}, step {step})"
            + (f": {r['error']}" if r.get("error") and not r.get("oom") else ""))
        probes.append(r)
        if partial is not None:  # a search cut off keeps its probes
            partial({"budget_bytes": budget, "partial": True, "max_seq": rows, "probes": probes})
        return r

    for m in modes:
        why = precheck(m)
        first = None
        if why is None:  # the first probe also says whether the mode runs here at all
            first = probe(m, args.start_seq)
            if first.get("broken"):
                why = first["error"]
        if why:
            skipped[m] = why
            rows.append({"mode": m, "max_seq": None, "unavailable": why})
            continue
        cache = {args.start_seq: first}

        def cached(mode, seq, _cache=cache):
            return _cache.pop(seq) if seq in _cache else probe(mode, seq)

        longest, tried = search(m, cached, args.start_seq, args.max_seq_limit)
        at = [p for p in tried if p["fits"] and p["seq"] == longest]
        rows.append({"mode": m, "max_seq": longest, "step_s": at[0]["step_s"] if at else None,
                     "peak_bytes": at[0]["peak_bytes"] if at else None, "hit_limit": longest == args.max_seq_limit})
    kind = ("a real out-of-memory with the allocator capped at the budget" if args.device != "cpu" else
            "the step's resident growth plus the weights within the budget (on the CPU memory is not the limit: "
            "this stands for it)")
    return {"budget_bytes": budget, "start_seq": args.start_seq, "limit": args.max_seq_limit, "max_seq": rows,
            "probes": probes, "versions": versions, "device_name": device_name[0], "limit_kind": kind}


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    return f"{b / GIB:.2f} GiB" if abs(b) >= GIB else f"{b / MIB:.1f} MiB"


def _rounds_table(result: dict) -> list[str]:
    setup = result["setup"]
    on_gpu = setup["device"] != "cpu"
    lines: list[str] = []
    peak_label = "device peak" if on_gpu else "RSS growth"
    head = ("mode", "step", "x ref", "tokens/s", peak_label, "host RSS", "pinned", "moved off device", "grads vs ref")
    rows = [head]
    modes = result["modes"]
    ref = modes.get(REFERENCE, {})
    grads = result.get("grads", {}) or {}
    for m, r in modes.items():
        if r.get("status") != "ran":
            continue
        g = grads.get(m)
        gtxt = "ref" if m == REFERENCE else ("-" if not g else ("equal" if g.get("equal") else
                                                               f"max |d| {g['max_abs_diff']:.1e}"
                                                               if g.get("max_abs_diff") is not None else "differ"))
        pinned = r.get("host_tier_pinned_bytes") if r.get("host_tier_pinned_bytes") else r.get("pinned_peak_bytes")
        moved = _fmt_bytes(r.get("moved_bytes"))
        if r.get("moved_how", "").startswith("estimate"):
            moved = "~" + moved
        ratio = (f"x{r['step_s'] / ref['step_s']:.2f}" if ref.get("step_s") and r.get("step_s") else "-")
        rows.append((m, f"{r['step_s'] * 1e3:.1f} ms", ratio, f"{r['tokens_per_s']:.0f}",
                     _fmt_bytes(r.get("peak_bytes")),
                     _fmt_bytes(r.get("rss_bytes")), _fmt_bytes(pinned), moved, gtxt))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines.append("")
    if len(rows) == 1:
        lines.append("no mode ran")
        rows = []
    for i, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    skipped = [(m, r) for m, r in modes.items() if r.get("status") != "ran"]
    if skipped:
        lines.append("")
        for m, r in skipped:
            lines.append(f"{m}: {r.get('status')}: {r.get('reason')}")
    lines.append("")
    lines.append(("device peak: torch.cuda.max_memory_allocated during the step (weights included)" if on_gpu else
                  "RSS growth: the worker's resident-set growth over the step (sampled every 2 ms; glibc mmap "
                  "threshold 64 KiB), not a device peak: on the CPU nothing leaves the device")
                 + "; pinned: ssdtrain's host_tier_pinned_bytes, else the pinned host allocator's peak in the step; "
                   "moved: per step, ~ = estimated (layers x batch x seq x hidden x element size)")
    return lines


def format_table(result: dict) -> str:
    setup = result["setup"]
    lines = [f"peers: {setup['shape']} ({setup['layers']} layers, hidden {setup['hidden']}), batch {setup['batch']}"
             + ("" if setup.get("only_max_seq") else f" x seq {setup['seq']}")
             + f", {setup['dtype']}, {setup['device_name']}"
             + (f", LoRA rank {setup['lora']}" if setup.get("lora") else "")
             + (f", loss in chunks of {setup['loss_chunk']}" if setup.get("loss_chunk") else ", the model's own loss")
             + ("" if setup.get("only_max_seq") else
                f"; {setup['rounds']} rounds x {setup['steps']} steps, alternated; a step is forward + backward")]
    vers = result.get("versions", {})
    if vers:
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in vers.items() if v))
    if not setup.get("only_max_seq"):
        lines += _rounds_table(result)
    ms = result.get("max_seq")
    if ms:
        within = _fmt_bytes(ms["budget_bytes"]) if ms["budget_bytes"] else "the device's memory"
        lines += ["", f"longest sequence per mode within {within} ({ms['limit_kind']}):"]
        for row in ms["max_seq"]:
            if row.get("unavailable"):
                lines.append(f"  {row['mode']}: -  ({row['unavailable'][:200]})")
            else:
                lines.append(f"  {row['mode']}: {row['max_seq'] if row['max_seq'] is not None else '-'}"
                             + ("+" if row.get("hit_limit") else "")
                             + (f" tokens, step {row['step_s']:.2f} s, peak {_fmt_bytes(row['peak_bytes'])}"
                                if row.get("step_s") is not None else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return worker_main()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: per shape)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--lora", type=int, default=None,
                    help="LoRA rank (peft) on every linear layer of the blocks; default: 16 for llama-3.1-8b, "
                         "else none (0: none)")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per mode per round")
    ap.add_argument("--warmup", type=int, default=2, help="steps before a mode's first measured round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-chunk", type=int, default=0,
                    help="the loss in chunks of this many tokens (ssdtrain.longctx.hf.chunked_lm_loss) for every "
                         "mode; 0: the model's own loss (the full logits)")
    ap.add_argument("--tile-tokens", type=int, default=0, help="ssdtrain+tiled's MLP tile (0: the hidden size)")
    ap.add_argument("--path", default=None, help="ssdtrain's offload directory (default: $SSDTRAIN_PATH or a temp dir)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's CPU threads in each worker (default: 1 on the CPU, where the workers share the "
                         "cores; torch's own on a GPU)")
    ap.add_argument("--fresh", action="store_true", help="a process per mode and round (not one per mode)")
    ap.add_argument("--grads", choices=("auto", "on", "off"), default="auto",
                    help="compare the first step's gradients with hf-ckpt's (auto: for --shape tiny or LoRA, where "
                         "they are small; each mode writes its gradients to a temp file in float32)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True, warn_only=True) and CUBLAS_WORKSPACE_CONFIG in "
                         "the workers (for the gradient comparison on a GPU: embedding backward's atomics differ "
                         "between runs otherwise; it slows the host, so not for timings)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a worker may take to answer")
    ap.add_argument("--max-seq", action="store_true", help="also search each mode's longest sequence")
    ap.add_argument("--only-max-seq", action="store_true", help="the search alone, no rounds")
    ap.add_argument("--memory-budget", default=None, help="GiB (or '6GiB', '512MiB') for --max-seq")
    ap.add_argument("--start-seq", type=int, default=None)
    ap.add_argument("--max-seq-limit", type=int, default=None)
    ap.add_argument("--log-dir", default=None, help="the workers' stderr logs (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    on_gpu = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    if args.threads is None and not on_gpu:
        args.threads = 1
    seq, batch = SHAPE_DEFAULTS[args.shape]
    args.seq = args.seq or seq
    args.batch = args.batch or batch
    if args.lora is None:
        args.lora = 16 if args.shape == "llama-3.1-8b" else 0
    args.grads = args.grads == "on" or (args.grads == "auto" and (args.shape == "tiny" or bool(args.lora)))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}; known: {', '.join(MODES)}")
    if args.only_max_seq:
        args.max_seq = True
    if args.max_seq:
        if args.memory_budget is None and not on_gpu:
            ap.error("--max-seq on the CPU needs --memory-budget (memory is not the limit there)")
        args.memory_budget = parse_bytes(args.memory_budget) if args.memory_budget else None
        args.start_seq = args.start_seq or (8192 if on_gpu else 128)
        args.max_seq_limit = args.max_seq_limit or (1 << 20 if on_gpu else 1 << 14)
    if args.path is None and not on_gpu:
        args.path = os.environ.get("SSDTRAIN_PATH") or None
    say = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    shape = SHAPES[args.shape]
    result: dict[str, Any] = {
        "setup": {"shape": args.shape, "layers": shape["num_hidden_layers"], "hidden": shape["hidden_size"],
                  "config": shape, "seq": args.seq, "batch": args.batch, "device": args.device, "dtype": args.dtype,
                  "lora": args.lora, "loss_chunk": args.loss_chunk, "rounds": args.rounds, "steps": args.steps,
                  "warmup": args.warmup, "fresh": args.fresh, "threads": args.threads, "grads": args.grads,
                  "deterministic": args.deterministic, "only_max_seq": args.only_max_seq, "modes": modes,
                  "device_name": args.device,
                  "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
    }
    if not args.only_max_seq:
        result.update(run_rounds(args, modes, say))
        versions: dict[str, Any] = {}
        for r in result["modes"].values():
            for k, v in (r.get("versions") or {}).items():
                versions.setdefault(k, v)
            if r.get("device_name"):
                result["setup"]["device_name"] = r["device_name"]
        result["versions"] = versions
    def save(res: dict) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    if args.max_seq:
        result["max_seq"] = run_max_seq(args, modes, say, partial=lambda ms: save({**result, "max_seq": ms}))
        for k, v in result["max_seq"]["versions"].items():
            result.setdefault("versions", {}).setdefault(k, v)
        if result["setup"]["device_name"] == args.device:
            result["setup"]["device_name"] = result["max_seq"]["device_name"]
    text = format_table(result)
    print(text, flush=True)
    save(result)
    ran = any(r.get("status") == "ran" for r in result.get("modes", {}).values()) or any(
        row.get("max_seq") for row in (result.get("max_seq") or {}).get("max_seq", []))
    return 0 if ran else 1  # every mode unavailable or failed: something is wrong with the setup


if __name__ == "__main__":
    sys.exit(main())
