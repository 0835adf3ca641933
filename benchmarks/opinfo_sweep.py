"""A sweep of PyTorch's OpInfo database: which ops' gradients change when every tensor they save
for backward goes through ssdtrain?

For each OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` (which already
holds the lists of ``torch.testing._internal.opinfo.definitions``) that supports autograd, in
float64 and, where the op's backward supports it, complex128, it takes up to ``--max-samples``
of the op's own sample inputs (evenly spread over them) and for each:

* makes every input that requires grad an *activation*: inside the forward, a non-leaf copy with
  the same sizes and strides (ssdtrain keeps leaves that want gradients as they are, so a leaf
  input would never be offloaded), and takes the gradients with respect to the original inputs;
* runs forward and backward twice without ssdtrain, with ``torch.manual_seed`` before each
  forward (dropout, rrelu and the like draw the same numbers each time); if the two runs differ
  the op is non-deterministic on the CPU and the sample is skipped;
* runs it once per setting with an :class:`ssdtrain.Offloader` around the forward, the same
  seed, and backward (``torch.autograd.grad``) outside the ``with`` block:

  - ``offload``: ``Offloader(path=..., min_bytes=0)``, every save offloaded however small;
  - ``written``: ``Offloader(path=..., min_bytes=0, late_writes=True, when_full="wait")`` and
    ``off.wait()`` inside the block after the forward: every save is written to the file store
    and read back from it;

* compares the outputs and the gradients with those of the plain run, bit for bit (NaN equal to
  NaN wherever both are NaN; complex numbers by their real and imaginary parts). The outputs are
  reduced to one number with weights drawn once per sample from a fixed seed.

Races between a kernel and the offloader's copies show on large tensors, so two more kinds of
case run:

* ``tiled`` (on unless ``--no-tiled``): each op's largest sample again, its inputs repeated
  along their first dimension until the largest is at least ``--tiled-bytes`` (256 KiB); only
  the inputs with the same number of dimensions and the same first size as the largest are
  repeated; a sample whose ops do not accept that, or whose output grows faster than its
  inputs, is skipped (with its reason);
* ``large`` (``--large ROUNDS``): a few chosen ops (random ones first: rrelu, the dropouts) on one
  tensor of ``--large-numel`` elements (1 << 20), ``ROUNDS`` times with different seeds.

Samples that fail without ssdtrain, outputs that are not tensors, outputs none of which needs
a gradient and non-deterministic ops are skipped and counted by reason; an exception raised
only with ssdtrain is counted as ``error`` (with its message): a finding like a difference.

At the end it prints a summary: ops and cases run, per setting the counts (equal, differ,
error) and the skipped cases by reason, and the ops that differ or fail, with the number of
differing elements. ``--json FILE`` writes the same as JSON. Exit status 1 when anything
differs or fails with ssdtrain.

    python benchmarks/opinfo_sweep.py [--ops name1,name2] [--dtypes float64,complex128]
        [--max-samples 4] [--no-tiled] [--large ROUNDS] [--json out.json]

(``--ops`` takes OpInfo names, ``nn.functional.rrelu``, or names with their variant,
``nn.functional.feature_alpha_dropout.with_train``.) ``torch.testing._internal`` imports
``expecttest``; where it is not installed a stand-in is put in its place (it is only a base class
of torch's test cases, which this script does not use).
"""

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
import unittest
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import ssdtrain

SETTINGS: dict[str, tuple[dict[str, Any], bool]] = {
    # name: (Offloader keyword arguments, call off.wait() inside the block after the forward)
    "offload": ({"min_bytes": 0}, False),
    "written": ({"min_bytes": 0, "late_writes": True, "when_full": "wait"}, True),
}

DTYPES = {"float64": torch.float64, "complex128": torch.complex128}
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_TILED_OUTPUT_BYTES = 64 << 20


def load_op_db() -> list:
    """torch's OpInfo list (the ``expecttest`` stand-in put in place first where needed).

    Importing torch's test helpers freezes ``torch.backends``' flags (they may then be set only
    in ``with torch.backends.<x>.flags(...)``) and wraps TorchScript's calls: undone here, so
    that a process (a test session) that imports this goes on as before."""
    stand_in = None
    try:
        import expecttest  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("expecttest")
        stand_in.TestCase = unittest.TestCase
        stand_in.ACCEPT = False
        sys.modules["expecttest"] = stand_in
    flag = "__allow_nonbracketed_mutation_flag"  # a global of torch/backends/__init__.py
    backends = getattr(torch.backends.flags_frozen, "__globals__", {})
    was_flag = backends.get(flag)
    was_calls = torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db
    finally:
        if was_flag is not None:
            backends[flag] = was_flag
        torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__ = was_calls
        if stand_in is not None and sys.modules.get("expecttest") is stand_in:
            del sys.modules["expecttest"]  # torch's modules hold it; nothing else should see it
    return list(op_db)


def op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


# -- one case: a forward that builds its activations from its inputs ---------------------------
@dataclass
class Case:
    op: str
    kind: str  # "sample", "tiled" or "large"
    dtype: str
    index: int  # sample index (round for "large")
    describe: str
    inputs: list[torch.Tensor]  # what the gradients are taken with respect to
    forward: Callable[[], Any]  # the op's output, processed for gradients


def _activation(t: torch.Tensor) -> torch.Tensor:
    """A non-leaf copy of ``t`` laid out as ``t`` is: a view with its sizes, strides and storage
    offset into a storage of its storage's size (a plain clone where its elements overlap)."""
    if t.layout is torch.strided and type(t) is torch.Tensor and not t.is_conj() and not t.is_neg():
        try:
            n = t.untyped_storage().nbytes() // t.element_size()
            view = torch.zeros(n, dtype=t.dtype, device=t.device).as_strided(t.size(), t.stride(), t.storage_offset())
            return view.copy_(t)
        except RuntimeError:
            pass  # overlapping elements (an expanded input): no tensor can be written so
    return t.clone()


def _as_activations(tree: Any) -> Any:
    return tree_map(lambda x: _activation(x) if isinstance(x, torch.Tensor) and x.requires_grad else x, tree)


def _grad_inputs(tree: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for x in tree_flatten(tree)[0]:
        if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _short(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided:
            return f"T{list(x.shape)}{str(x.layout).replace('torch.', ':')}"
        return f"T{list(x.shape)}" + ("" if x.is_contiguous() else "nc")
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_short(v) for v in x[:6]) + (", ..." if len(x) > 6 else "")
        return f"[{inner}]" if isinstance(x, list) else f"({inner})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}={_short(v)}" for k, v in x.items()) + "}"
    r = repr(x)
    return r if len(r) <= 40 else r[:37] + "..."


def sample_case(op, sample, dtype: str, index: int, kind: str = "sample", tree: Any = None) -> Case:
    """The case of one SampleInput (``tree``: its (input, args, kwargs) replaced, for ``tiled``)."""
    if tree is None:
        tree = (sample.input, sample.args, sample.kwargs)
    process = sample.output_process_fn_grad

    def forward():
        inp, args, kwargs = _as_activations(tree)
        return process(op(inp, *args, **kwargs))

    return Case(op_id(op), kind, dtype, index, _short(tree[0]) + " " + _short(list(tree[1])) + " " + _short(tree[2]),
                _grad_inputs(tree), forward)


def tiled_tree(sample, target_bytes: int, factor: int | None = None) -> tuple[Any, int] | str:
    """``(input, args, kwargs)`` with the inputs shaped as the largest tensor repeated along
    their first dimension (the largest to at least ``target_bytes``) and the factor; or why not."""
    flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.layout is torch.strided]
    if not tensors:
        return "no strided tensor input"
    big = max(tensors, key=lambda x: x.nbytes)
    if big.ndim == 0 or big.numel() == 0:
        return "largest input is 0-dim or empty"
    if factor is None:
        if big.nbytes >= target_bytes:
            return "already large"
        factor = math.ceil(target_bytes / big.nbytes)

    def grow(x):
        if not (isinstance(x, torch.Tensor) and x.layout is torch.strided and x.ndim == big.ndim
                and x.shape[0] == big.shape[0]):
            return x
        r = x.detach().repeat(factor, *([1] * (x.ndim - 1)))
        return r.requires_grad_() if x.requires_grad else r

    return tree_unflatten([grow(x) for x in flat], spec), factor


# -- running and comparing ---------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float):
    """Raises _Timeout in the main thread after ``seconds`` (no limit elsewhere, or if 0)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _Timeout(f"took more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _dense(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.layout is not torch.strided:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg()


def _diff_mask(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where ``a`` and ``b`` differ bit for bit (NaN equal to NaN; complex by parts)."""
    if a.is_complex():
        return _diff_mask(torch.view_as_real(a), torch.view_as_real(b)).any(-1)
    a, b = a.contiguous(), b.contiguous()
    if a.is_floating_point():
        both_nan = a.isnan() & b.isnan()
        bits = _BITS[a.element_size()]
        return (a.view(bits) != b.view(bits)) & ~both_nan
    return a != b


def compare(expected: list, got: list, names: list[str]) -> tuple[int, int, str]:
    """(differing elements, elements compared, where) over paired tensors (or Nones)."""
    diff = total = 0
    where = []
    for name, a, b in zip(names, expected, got):
        if a is None or b is None:
            if (a is None) != (b is None):
                diff += 1
                where.append(f"{name}: None vs tensor")
            continue
        a, b = _dense(a), _dense(b)
        total += a.numel()
        if a.shape != b.shape or a.dtype != b.dtype:
            diff += max(a.numel(), 1)
            where.append(f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            continue
        n = int(_diff_mask(a, b).sum())
        if n:
            diff += n
            where.append(f"{name}: {n}/{a.numel()}")
    if len(expected) != len(got):
        diff += 1
        where.append(f"{len(expected)} vs {len(got)} tensors")
    return diff, total, "; ".join(where)


@dataclass
class Run:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    stats: Any = None


def _tensors(out: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]


def make_weights(outputs: list[torch.Tensor], seed: int) -> list[torch.Tensor | None]:
    """A weight per output that needs a gradient, float64 or complex128 (the loss's precision)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, dtype=torch.complex128 if o.is_complex() else torch.float64, generator=g)
            if o.requires_grad else None for o in outputs]


def run_case(case: Case, seed: int, weights: list | None, off=None, wait: bool = False) -> Run:
    """Forward (inside ``with off:`` when given), the weighted sum, and the gradients."""
    torch.manual_seed(seed)
    with off if off is not None else contextlib.nullcontext():
        outputs = _tensors(case.forward())
        if wait:
            off.wait()
    if weights is None:
        raise ValueError("no weights")
    if len(weights) != len(outputs):
        raise RuntimeError(f"{len(outputs)} output tensors, {len(weights)} expected")
    terms = [(o.to(w.dtype) * w).sum() for o, w in zip(outputs, weights) if w is not None and o.requires_grad]
    if not terms:
        raise RuntimeError("no output needs a gradient here")
    loss = torch.stack([t.real if t.is_complex() else t for t in terms]).sum()
    grads = list(torch.autograd.grad(loss, case.inputs, allow_unused=True))
    stats = off.stats() if off is not None else None
    return Run([o.detach() for o in outputs], grads, stats)


def _plain_outputs(case: Case, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    return _tensors(case.forward())


def _err(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def _where(e: BaseException) -> str:
    """Where ``e`` was raised (file:line function)."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"[{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} {tb[-1].name}]" if tb else ""


def _where_in_ssdtrain(e: BaseException) -> str:
    """The innermost frames of ``e`` in ssdtrain (file:line function), for the report."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}ssdtrain{os.sep}" in f.filename]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))


@dataclass
class Result:
    case: Case
    skipped: str | None = None  # reason
    detail: str = ""
    by_setting: dict[str, dict] = field(default_factory=dict)  # setting -> {"result": ..., ...}


def check_case(case: Case, path: str, settings: Iterable[str], seed: int, timeout: float) -> Result:
    """Plain twice (skip unless equal), then once per setting; compared bit for bit."""
    res = Result(case)
    weight_seed = 1000003 * seed + 7
    try:
        with _time_limit(timeout):
            outputs = _plain_outputs(case, seed)
            if not outputs:
                res.skipped = "output not a tensor"
                return res
            if not any(o.requires_grad for o in outputs):
                res.skipped = "no differentiable output"
                return res
            weights = make_weights(outputs, weight_seed)
            del outputs
            first = run_case(case, seed, weights)
            second = run_case(case, seed, weights)
    except _Timeout as e:
        res.skipped, res.detail = "timeout without ssdtrain", _err(e)
        return res
    except Exception as e:  # noqa: BLE001 - any failure of the op itself
        res.skipped, res.detail = "fails without ssdtrain", _err(e)
        return res
    names = [f"output[{i}]" for i in range(len(first.outputs))] + [f"grad[{i}]" for i in range(len(first.grads))]
    expected = first.outputs + first.grads
    n, _, where = compare(expected, second.outputs + second.grads, names)
    if n:
        res.skipped, res.detail = "nondeterministic", where
        return res
    for name in settings:
        kwargs, wait = SETTINGS[name]
        off = None
        entry: dict[str, Any]
        try:
            with _time_limit(timeout):
                off = ssdtrain.Offloader(path=path, **kwargs)
                got = run_case(case, seed, weights, off, wait)
                off.close()
                off = None
        except BaseException as e:  # noqa: BLE001 - a finding
            if isinstance(e, KeyboardInterrupt):
                raise
            entry = {"result": "error", "message": _err(e), "where": _where_in_ssdtrain(e)}
        else:
            n, total, where = compare(expected, got.outputs + got.grads, names)
            entry = {"result": "differ" if n else "equal", "n_diff": n, "numel": total, "where": where}
            s = got.stats
            entry["bytes"] = {"saved": s.saved_bytes, "written": s.written_bytes, "read": s.read_bytes,
                              "kept": s.kept_bytes}
        finally:
            if off is not None:
                try:
                    off.close()
                except Exception as e:  # noqa: BLE001
                    entry.setdefault("close", _err(e))
        res.by_setting[name] = entry
    return res


# -- the cases of the sweep ------------------------------------------------------------------
def _spread(n: int, k: int) -> list[int]:
    """``k`` indices evenly spread over ``range(n)``, the first and the last included."""
    if n <= k:
        return list(range(n))
    if k <= 1:
        return [0][:k]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _input_bytes(sample) -> int:
    return sum(x.nbytes for x in tree_flatten((sample.input, sample.args, sample.kwargs))[0]
               if isinstance(x, torch.Tensor) and x.layout is torch.strided)


def _output_bytes(case: Case, seed: int) -> int:
    return sum(o.nbytes for o in _plain_outputs(case, seed))


def tiled_case(op, samples: list, dtype: str, target_bytes: int, seed: int, timeout: float = 0) -> Case | str:
    """The case of the op's largest sample, tiled; or why not."""
    if not samples:
        return "no samples"
    index = max(range(len(samples)), key=lambda i: _input_bytes(samples[i]))
    sample = samples[index]
    made = tiled_tree(sample, target_bytes)
    if isinstance(made, str):
        return made
    tree, factor = made
    try:  # how the output grows: four times the inputs must give about four times the output
        with _time_limit(timeout):
            base = _output_bytes(sample_case(op, sample, dtype, index), seed)
            four = _output_bytes(sample_case(op, sample, dtype, index, tree=tiled_tree(sample, 0, 4)[0]), seed)
    except Exception as e:  # noqa: BLE001
        return f"not tileable ({type(e).__name__})"
    if base == 0:
        return "empty output"
    if four > 5 * base + 64:
        return "output grows faster than inputs"
    if base * factor > _MAX_TILED_OUTPUT_BYTES:
        return "output too large"
    case = sample_case(op, sample, dtype, index, kind="tiled", tree=tree)
    case.describe = f"x{factor} along dim 0: " + case.describe
    return case


def large_cases(names: Iterable[str] | None, rounds: int, numel: int) -> list[Case]:
    """Chosen ops on one input of ``numel`` float64 elements, ``rounds`` times (random ops first)."""
    F = torch.nn.functional
    numel = max(4096, -(-numel // 4096) * 4096)
    chosen: dict[str, Callable[[torch.Tensor], Any]] = {
        "nn.functional.rrelu": lambda x: F.rrelu(x, 0.1, 0.3, training=True),
        "nn.functional.dropout": lambda x: F.dropout(x, 0.5, training=True),
        "nn.functional.alpha_dropout": lambda x: F.alpha_dropout(x, 0.5, training=True),
        "nn.functional.feature_alpha_dropout": lambda x: F.feature_alpha_dropout(x.view(16, 64, -1), 0.5, True),
        "nn.functional.dropout2d": lambda x: F.dropout2d(x.view(16, 64, 4, -1), 0.5, training=True),
        "nn.functional.layer_norm": lambda x: F.layer_norm(x.view(-1, 256), (256,)),
        "softmax": lambda x: torch.softmax(x.view(-1, 256), -1),
        "nn.functional.gelu": lambda x: F.gelu(x),
        "mul": lambda x: x * x.flip(0),
    }
    wanted = set(names) if names else None
    cases = []
    for name, fn in chosen.items():
        if wanted is not None and name not in wanted:
            continue
        for r in range(rounds):
            x = torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(r)).requires_grad_()

            def forward(fn=fn, x=x):
                return fn(_activation(x))

            cases.append(Case(name, "large", "float64", r, f"T[{numel}]", [x], forward))
    return cases


def _matches(op, wanted: set[str] | None) -> bool:
    return wanted is None or op.name in wanted or op_id(op) in wanted


def sweep(ops: Iterable[str] | None = None, dtypes: Iterable[str] = ("float64", "complex128"), max_samples: int = 4,
          tiled: bool = True, tiled_bytes: int = 256 << 10, large_rounds: int = 0, large_numel: int = 1 << 20,
          settings: Iterable[str] = tuple(SETTINGS), path: str | None = None, seed: int = 0,
          timeout: float = 120.0, progress: Callable[[str], None] | None = None) -> dict:
    """Runs the sweep and returns its summary (see :func:`summarize`); every case, with what
    each setting gave, is under ``"details"``. ``ops``: OpInfo names or ``name.variant``s (all
    when None; names matching no OpInfo that supports autograd nor a large case are listed under
    ``"unknown_ops"``)."""
    settings = list(settings)
    wanted = set(ops) if ops else None
    own_dir = path is None
    path = tempfile.mkdtemp(prefix="opinfo-sweep-") if own_dir else path
    results: list[Result] = []
    ops_run: set[str] = set()
    start = time.perf_counter()
    timing: dict[str, float] = defaultdict(float)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            op_db = [op for op in load_op_db() if op.supports_autograd and _matches(op, wanted)]
            for i, op in enumerate(op_db):
                t0 = time.perf_counter()
                for dname in dtypes:
                    dtype = DTYPES[dname]
                    try:
                        if dtype not in op.supported_backward_dtypes("cpu"):
                            continue
                        torch.manual_seed(seed)
                        samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
                    except Exception as e:  # noqa: BLE001
                        stub = Case(op_id(op), "sample", dname, -1, "", [], lambda: None)
                        results.append(Result(stub, "sample_inputs fails", _err(e)))
                        continue
                    ops_run.add(op_id(op))
                    for j in _spread(len(samples), max_samples):
                        try:
                            results.append(check_case(sample_case(op, samples[j], dname, j), path, settings, seed,
                                                      timeout))
                        except Exception as e:  # noqa: BLE001 - this script's own failure: counted, shown
                            stub = Case(op_id(op), "sample", dname, j, "", [], lambda: None)
                            results.append(Result(stub, "harness error", _err(e) + " " + _where(e)))
                    if tiled:
                        try:
                            made = tiled_case(op, samples, dname, tiled_bytes, seed, timeout)
                            if isinstance(made, str):
                                stub = Case(op_id(op), "tiled", dname, -1, "", [], lambda: None)
                                results.append(Result(stub, "tiled: " + made))
                            else:
                                results.append(check_case(made, path, settings, seed, timeout))
                        except Exception as e:  # noqa: BLE001
                            stub = Case(op_id(op), "tiled", dname, -1, "", [], lambda: None)
                            results.append(Result(stub, "harness error", _err(e) + " " + _where(e)))
                    del samples
                timing[op_id(op)] += time.perf_counter() - t0
                if progress is not None:
                    progress(f"[{i + 1}/{len(op_db)}] {op_id(op)} {timing[op_id(op)]:.2f} s "
                             f"(total {time.perf_counter() - start:.0f} s)")
            if large_rounds:
                for case in large_cases(wanted, large_rounds, large_numel):
                    t0 = time.perf_counter()
                    results.append(check_case(case, path, settings, seed + case.index, timeout))
                    timing["large:" + case.op] += time.perf_counter() - t0
                    if progress is not None:
                        progress(f"[large] {case.op} round {case.index} {time.perf_counter() - t0:.2f} s")
                    ops_run.add(case.op)
    finally:
        if own_dir:
            shutil.rmtree(path, ignore_errors=True)
    summary = summarize(results, settings, sorted(ops_run), time.perf_counter() - start)
    summary["slowest_ops"] = [[k, round(v, 2)] for k, v in sorted(timing.items(), key=lambda kv: -kv[1])[:10]]
    known = {n for op in op_db for n in (op.name, op_id(op))} | {c.op for c in large_cases(None, 1, 4096)}
    summary["unknown_ops"] = sorted(wanted - known) if wanted else []
    return summary


def summarize(results: list[Result], settings: list[str], ops_run: list[str], seconds: float) -> dict:
    skipped: Counter = Counter()
    skipped_why: dict[str, Counter] = defaultdict(Counter)
    counts = {s: {"equal": 0, "differ": 0, "error": 0} for s in settings}
    by_kind = {s: defaultdict(lambda: {"equal": 0, "differ": 0, "error": 0}) for s in settings}
    findings: dict[str, list[dict]] = {s: [] for s in settings}
    cases = []
    bytes_moved = {s: Counter() for s in settings}
    for r in results:
        c = r.case
        row = {"op": c.op, "kind": c.kind, "dtype": c.dtype, "index": c.index, "sample": c.describe}
        if r.skipped:
            skipped[r.skipped] += 1
            if r.detail:
                skipped_why[r.skipped][r.detail.split(":")[0]] += 1
            row.update(skipped=r.skipped, detail=r.detail)
        for s, entry in r.by_setting.items():
            counts[s][entry["result"]] += 1
            by_kind[s][c.kind][entry["result"]] += 1
            bytes_moved[s].update(entry.get("bytes", {}))
            if entry["result"] != "equal":
                findings[s].append({**row, **{k: v for k, v in entry.items() if k != "bytes"}})
        row["settings"] = r.by_setting
        cases.append(row)
    run = [r for r in results if not r.skipped]
    return {
        "torch": torch.__version__,
        "seconds": round(seconds, 1),
        "ops_run": len(ops_run),
        "cases": len(results),
        "cases_run": len(run),
        "cases_by_kind": dict(Counter(r.case.kind for r in results)),
        "skipped": dict(skipped.most_common()),
        "skipped_detail": {k: dict(v.most_common()) for k, v in skipped_why.items()},
        "counts": counts,
        "counts_by_kind": {s: {k: dict(v) for k, v in by_kind[s].items()} for s in settings},
        "bytes": {s: dict(v) for s, v in bytes_moved.items()},
        "findings": findings,
        "ops_with_findings": {s: sorted({f["op"] for f in findings[s]}) for s in settings},
        "details": cases,
    }


def report(summary: dict, out=sys.stdout) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    p(f"opinfo sweep (torch {summary['torch']}): {summary['ops_run']} ops, {summary['cases']} cases "
      f"({', '.join(f'{k} {v}' for k, v in summary['cases_by_kind'].items())}), "
      f"{summary['cases_run']} run, in {summary['seconds']:.1f} s")
    if summary.get("unknown_ops"):
        p("no such op (or without autograd): " + ", ".join(summary["unknown_ops"]))
    if summary["skipped"]:
        p("skipped: " + ", ".join(f"{k} {v}" for k, v in summary["skipped"].items()))
    for s, c in summary["counts"].items():
        kinds = "; ".join(f"{k}: {v['equal']}/{v['differ']}/{v['error']}"
                          for k, v in summary["counts_by_kind"][s].items())
        b = summary["bytes"].get(s, {})
        p(f"setting {s}: equal {c['equal']}, differ {c['differ']}, error with ssdtrain {c['error']}"
          f"  (equal/differ/error by kind: {kinds}; bytes saved {b.get('saved', 0)}, "
          f"written {b.get('written', 0)}, read {b.get('read', 0)})")
    for s, found in summary["findings"].items():
        if not found:
            p(f"{s}: no op differs or fails")
            continue
        p(f"{s}: {len(summary['ops_with_findings'][s])} ops differ or fail:")
        for f in found:
            head = f"  {f['op']} [{f['dtype']}, {f['kind']} {f['index']}] {f['sample']}"
            if f["result"] == "differ":
                p(f"{head}: differ, {f['n_diff']} of {f['numel']} elements ({f['where']})")
            else:
                p(f"{head}: error with ssdtrain: {f['message']}" + (f"  [{f['where']}]" if f["where"] else ""))
    if summary.get("slowest_ops"):
        p("slowest: " + ", ".join(f"{k} {v:.1f} s" for k, v in summary["slowest_ops"][:5]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ops", help="comma-separated OpInfo names (or name.variant); all by default")
    ap.add_argument("--dtypes", default="float64,complex128", help="of " + ",".join(DTYPES))
    ap.add_argument("--max-samples", type=int, default=4, help="samples per op and dtype (spread over them)")
    ap.add_argument("--no-tiled", action="store_true", help="do not run the tiled copy of each op's largest sample")
    ap.add_argument("--tiled-bytes", type=int, default=256 << 10)
    ap.add_argument("--large", type=int, default=0, metavar="ROUNDS", help="rounds of the chosen ops on a large input")
    ap.add_argument("--large-numel", type=int, default=1 << 20)
    ap.add_argument("--settings", default=",".join(SETTINGS), help="of " + ",".join(SETTINGS))
    ap.add_argument("--path", help="directory for the offloader's files (a fresh temporary one by default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case and run")
    ap.add_argument("--json", help="write the summary (and every case) here")
    ap.add_argument("-v", "--verbose", action="store_true", help="a line per op")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}")
    for s in settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}")
    last = [time.perf_counter()]

    def progress(line: str) -> None:
        if args.verbose or time.perf_counter() - last[0] > 30:
            last[0] = time.perf_counter()
            print(line, file=sys.stderr, flush=True)

    summary = sweep(ops, dtypes, args.max_samples, not args.no_tiled, args.tiled_bytes, args.large, args.large_numel,
                    settings, args.path, args.seed, args.timeout, progress)
    report(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return 1 if any(summary["findings"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
