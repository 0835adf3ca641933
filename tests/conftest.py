import os
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


@pytest.fixture
def off_dir(tmp_path):
    """A fresh directory for arena files; the test checks it is left as found."""
    d = tmp_path / "offload"
    d.mkdir()
    return d
