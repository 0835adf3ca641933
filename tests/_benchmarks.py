"""A benchmark script loaded as a module, for the tests that run its parts."""

import importlib.util
import sys
from pathlib import Path


def load_benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (``name`` may name a subfolder: ``investigations/save_cost``)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name.replace('/', '_')}_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up while it is made
    spec.loader.exec_module(module)
    return module
