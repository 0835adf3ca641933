"""Long context on a GPU: the Llama-shaped decoder with every layer tiled whole but for attention
(``ssdtrain.bench.tiled_models.tile_layers``), under an offloader with the host tier on: exact against
itself without one, close to the plain model per parameter class. Deterministic algorithms on: on
an H200 two runs of a GPT without ssdtrain differed otherwise (2026-11-28)."""

from __future__ import annotations

import copy

import pytest
import torch

import ssdtrain
from ssdtrain.bench.models import Llama, LlamaConfig
from ssdtrain.bench.tiled_models import tile_layers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def _step(model, tokens, off=None):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with off if off is not None else torch.enable_grad():
        loss = model(tokens, tokens)
    loss.backward()
    torch.cuda.synchronize()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("groups", [None, 8, 2], ids=["attention-whole", "a-head-a-time", "a-kv-head-a-time"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiled_layers_with_the_tier_are_exact(dtype, groups, tmp_path, deterministic):
    """``groups``: attention a group of query heads at a time (ssdtrain.longctx.head_groups; on CUDA
    its recompute path: each group's SDPA run again in backward)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab=1024, seq=2048, layers=4, hidden=256, heads=8, loss_chunk=512)
    plain = Llama(cfg, recompute=True).to(CUDA, dtype)
    model = copy.deepcopy(plain)
    tile_layers(model, 512, head_groups=groups)
    tokens = torch.randint(0, 1024, (2, 2048), device=CUDA)
    want = _step(model, tokens)
    assert all(torch.equal(a, b) for a, b in zip(want, _step(model, tokens))), "not deterministic without ssdtrain"
    off = ssdtrain.Offloader(model, path=str(tmp_path), min_bytes=0)
    try:
        for i in range(3):
            got = _step(model, tokens, off)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), f"step {i} differs"
        s = off.stats()
    finally:
        off.close()
    assert s.host_copied_bytes + s.written_bytes > 0
    base = _step(plain, tokens)
    worst = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                for a, b in zip(want[1:], base[1:]))
    print(f"{dtype}, groups {groups}: largest relative gradient difference against the untiled model {worst:.2e}")
    assert worst < (1e-5 if dtype == torch.float32 else 5e-2)
