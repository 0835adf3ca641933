"""The training thread's Python calls per save in pack (issue 64, item 3): a count, not a time, so
that a pack path growing back fails here whatever the machine's noise.

Counted by ``benchmarks/pack_cost.py``'s own measure (cProfile over one forward's pack calls,
the hook itself not counted) on the bench's GPT, the tier's logic on CPU tensors as in
``tests/test_tier.py``. The ceilings are today's counts with a margin for what the I/O threads'
progress changes (2026-11-28: kept 37.2, tier 78.4, drive 87.5 calls a save); issue 64 asks for
at most 15 on the kept and tier paths: lower them as the path gets there."""

import pytest
import torch
from _benchmarks import load_benchmark

from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.engine import offloader as offloader_mod

pack_cost = load_benchmark("pack_cost")
CEILING = {"kept": 40, "tier": 85, "drive": 95}


@pytest.mark.parametrize("mode", list(CEILING))
def test_pack_calls_per_save_do_not_grow(mode, tmp_path, monkeypatch):
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=64, layers=4, hidden=64, heads=4))
    tokens = torch.randint(0, 512, (2, 64))
    r = pack_cost.measure(mode, model, tokens, 1, str(tmp_path))
    assert r["saves"] > 100  # every save of the forward went through pack
    assert 5 < r["pack_calls"] <= CEILING[mode], r["pack_calls"]
