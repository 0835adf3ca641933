"""``ssdtrain bench``: train a GPT-style decoder with and without offloading, side by side.

The tooling around the engine, kept apart from it: the model (:mod:`.models`), the input
pipeline (:mod:`.data`), the modes (:mod:`.modes`), the drive and its speed limit
(:mod:`.drive`), the run (:mod:`.runner`), the table (:mod:`.report`) and the command line
(:mod:`.command`). Use it from Python as::

    from ssdtrain.bench import BenchArgs, format_table, run
    from ssdtrain.bench.models import preset
    print(format_table(run(BenchArgs(model=preset("quick"), batch=8, steps=3))))

``BenchArgs(device="auto")`` (the CLI's default) trains on the GPU where there is one (in
bfloat16 unless ``dtype`` says otherwise); the library's default device is ``"cpu"``.
Names load on first use, so ``from ssdtrain.bench.models import GPT`` imports only the model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["MODES", "BenchArgs", "format_table", "main", "run"]

_WHERE = {
    "MODES": "ssdtrain.bench.modes",
    "BenchArgs": "ssdtrain.bench.runner",
    "run": "ssdtrain.bench.runner",
    "format_table": "ssdtrain.bench.report",
    "main": "ssdtrain.bench.command",
}

if TYPE_CHECKING:
    from ssdtrain.bench.command import main
    from ssdtrain.bench.modes import MODES
    from ssdtrain.bench.report import format_table
    from ssdtrain.bench.runner import BenchArgs, run


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ssdtrain.bench' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
