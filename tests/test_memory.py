"""Offloading really frees memory: the offloader's count, and the process's RSS."""

import json
import os
import subprocess
import sys

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig

HERE = os.path.dirname(__file__)


def test_peak_resident_is_a_quarter_of_unique_bytes(off_dir):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=64, layers=8, hidden=128, heads=4, dropout=0.1)
    model = GPT(cfg)
    tok = torch.randint(0, cfg.vocab, (4, cfg.seq))
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, keep_last_layers=0,
                             max_inflight_bytes="2MiB", prefetch_bytes="2MiB", when_full="wait")
    for _ in range(2):
        before = off.stats()
        off.reset_peak()
        with off:
            loss = model(tok, tok)
        loss.backward()
        after = off.stats()
        unique = after.unique_bytes - before.unique_bytes
        assert after.written_bytes > before.written_bytes
        # Without offloading every unique byte is resident at the end of forward.
        assert after.peak_resident_bytes <= 0.25 * unique, (after.peak_resident_bytes, unique)
    off.close()


def _growth(mode):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, os.path.join(HERE, "_rss_worker.py"), mode], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_rss_growth_across_forward_shrinks():
    base = _growth("baseline")
    off = _growth("offload")
    unique = off["stats"]["unique_bytes"] / 2  # two steps were offloaded
    assert base["growth"] >= 0.8 * unique, (base["growth"], unique)  # baseline holds them all
    # Offloaded: what stays is what the offloader says it holds, plus allocator slack.
    assert off["growth"] <= 0.35 * base["growth"], (off["growth"], base["growth"])
