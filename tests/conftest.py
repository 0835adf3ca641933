import os
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Hypothesis: bounded and deadline-free in CI (2 shared cores make timings meaningless).
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# cuFile (behind kvikio) logs to ./cufile.log unless told where: keep the checkout clean.
os.environ.setdefault("CUFILE_LOGFILE_PATH", os.path.join(tempfile.gettempdir(), "ssdtrain-tests-cufile.log"))


@pytest.fixture(autouse=True)
def _no_hooks_left_behind():
    """A test that leaves saved-tensor hooks pushed on this thread fails itself, and they are
    popped: else every later test's saves go to them (a closed offloader's raise in each)."""
    yield
    torch = sys.modules.get("torch")
    if torch is None:
        return
    left = 0
    while torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        torch._C._autograd._pop_saved_tensors_default_hooks()
        left += 1
    if left:
        pytest.fail(f"the test left {left} saved-tensor hook pair(s) pushed on the main thread (popped now)")


@pytest.fixture
def off_dir(tmp_path):
    """A fresh directory for arena files; the test checks it is left as found."""
    d = tmp_path / "offload"
    d.mkdir()
    return d


@pytest.fixture
def deterministic():
    """torch's deterministic mode, for this test only (inductor then emits no racing reductions,
    e.g. the embedding's scatter-add in backward)."""
    import torch
    import torch._dynamo

    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    torch._dynamo.reset()
    yield
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    torch._dynamo.reset()
