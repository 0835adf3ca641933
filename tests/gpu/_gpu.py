"""Helpers of the GPU tests (a module of its own: ``conftest`` is a name two directories use)."""

from __future__ import annotations

import pytest


def kvikio_missing() -> str | None:
    """``None`` when the kvikio backend can be made here, else why not."""
    try:
        import ssdtrain.store.kvikio_backend  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def kvikio_compat():
    """kvikio's compatibility mode, on while a backend is made (it then stages CUDA tensors
    through pinned memory even where GDS works)."""
    import kvikio
    import kvikio.defaults

    return kvikio.defaults.set("compat_mode", kvikio.CompatMode.ON)


BACKENDS = [
    pytest.param(("posix", None), id="posix"),
    pytest.param(("memory", None), id="memory"),
    pytest.param(("kvikio", None), id="kvikio"),
    pytest.param(("kvikio", kvikio_compat), id="kvikio-compat"),
]
"""(backend, setup) pairs: ``setup`` is entered while the Offloader or backend is made."""
