"""Importing ssdtrain has no side effects: no CUDA initialisation, no logging setup, no patching."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import logging, sys
    import torch
    calls = []
    torch.cuda._lazy_init = lambda: calls.append("lazy_init")
    torch.cuda.is_available = lambda: calls.append("is_available") or False
    handlers, level = list(logging.root.handlers), logging.root.level
    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)
    import ssdtrain, ssdtrain.engine.offloader, ssdtrain.engine.cache, ssdtrain.store.posix, ssdtrain.store.memory
    import ssdtrain.engine.schedule, ssdtrain.engine.stats, ssdtrain.device.cuda, ssdtrain.cli, ssdtrain.integrations
    assert logging.root.handlers == handlers and logging.root.level == level, "logging was configured"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before, "hooks installed"
    for heavy in ("deepspeed", "megatron", "kvikio", "nvidia.dali", "matplotlib"):
        assert heavy not in sys.modules, heavy + " imported"
    # A CPU step with the default backend choice does not touch CUDA either.
    import tempfile
    off = ssdtrain.Offloader(path=tempfile.mkdtemp(), min_bytes=0, backend="posix")
    x = torch.randn(64, 64, requires_grad=True)
    with off:
        loss = (x * 2).exp().sum()
    off.wait(); loss.backward(); off.close()
    assert calls == [], calls
    print("clean")
""")


def test_import_is_side_effect_free():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_public_surface():
    import ssdtrain

    assert set(ssdtrain.__all__) >= {"OffloadConfig", "Offloader", "offload", "no_offload", "OffloadStats"}
    for name in ssdtrain.__all__:
        assert hasattr(ssdtrain, name)
