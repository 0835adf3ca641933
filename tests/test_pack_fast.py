"""Note [pack's common case in one function] (``ssdtrain/engine/hooks.py``): pack screens a plain
tensor by its properties and settles parameters, small saves and saves kept at once in one
function; everything else takes the general path, which asks ``keep.as_is`` every question. The
two must reach the same state for the same saves: the same counters, the same gradients, the
same kinds of handles, on every path (kept at once, small, the host tier, the drive)."""

import dataclasses
import itertools
import types

import pytest
import torch
import torch.nn.functional as F

import ssdtrain
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.engine.cache import Ref, Small
from ssdtrain.bench.models import GPT, GPTConfig

from _equiv import assert_same, step

# Counters that depend on timing (copy clocks, I/O threads), not on the pack path's decisions.
_TIMED = {"backend", "stall_seconds", "backpressure_stall_seconds", "drive_write_bps", "peak_bound_bytes",
          "prefetch_hits", "prefetch_misses", "read_stall_seconds", "microbatches", "endurance",
          "written_bytes_by_path"}

_IO_TIMED = ("peak_fall_bytes", "forwarded_bytes", "reads", "read_bytes", "host_read_bytes", "written_bytes",
             "writes", "host_copied_bytes", "adaptive_keep_bytes", "cancelled_writes", "peak_resident_bytes",
             "resident_bytes", "live_entries", "live_disk_bytes", "prefetch_window_bytes", "write_budget_bytes")


class _Mixed(torch.nn.Module):
    """Views, transposes, a frozen weight, a buffer, a bf16 cast of a weight, a complex conjugate
    view, dropout, attention, norms: the saves pack screens."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.frozen = torch.nn.Linear(32, 32).requires_grad_(False)
        self.norm = torch.nn.LayerNorm(32)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))

    def forward(self, x):
        h = self.norm(self.a(x)) * self.scale
        h = self.frozen(h).relu()
        w16 = self.a.weight.to(torch.bfloat16)  # a weight cast: kept as the weight is
        h = h + (h.to(torch.bfloat16) @ w16.t()).float()
        q = h.view(2, 8, 4, 8).transpose(1, 2)  # views of one storage
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).transpose(1, 2).reshape(2, 8, 32)
        z = torch.complex(h[..., :16], h[..., 16:])
        zc = z.conj() * z  # a conjugate view saved
        return (zc.real.sum() + F.dropout(h, 0.2).square().sum()) / 100


def _stats(off):
    return {k: v for k, v in dataclasses.asdict(off.stats()).items() if k not in _TIMED}


def _handles(off, model, x):
    """The kinds of handle pack returns for one forward."""
    kinds = []
    pack = off._pack

    def spy(_self, t):
        out = pack(t)
        kinds.append(type(out).__name__ if isinstance(out, (Ref, Small)) else "tensor")
        return out
    off._pack = types.MethodType(spy, off)  # bound, as keep.untraced wants once torch._dynamo is imported
    try:
        step(model, lambda: model(x), off)
    finally:
        del off._pack
    return kinds


@pytest.mark.parametrize("path", ["kept", "small", "tier", "drive"])
def test_the_fast_path_and_the_general_path_agree(path, tmp_path, monkeypatch):
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = _Mixed()
    x = torch.randn(2, 8, 32)
    base = step(model, lambda: model(x), None)
    kw = {"backend": "memory", "min_bytes": 1 << 20 if path == "small" else 0}
    if path != "tier":
        kw["host_bytes"] = 0
    results = []
    for general in (False, True):
        off = ssdtrain.Offloader(model, path=str(tmp_path / str(general)), **kw)
        if path == "kept":
            off._kept_at_once = lambda t, nbytes: "budget_kept_bytes"
        if general:
            off._pack = off._pack_general  # every save asked every question
        try:
            for _ in range(3):
                assert_same(base, step(model, lambda: model(x), off))
                off.wait()
            kinds = _handles(off, model, x)
            off.wait()
            results.append((_stats(off), kinds))
        finally:
            off.close()
    (fast_stats, fast_kinds), (general_stats, general_kinds) = results
    wrote = fast_stats["written_bytes"] > 0 and general_stats["written_bytes"] > 0
    if path in ("tier", "drive"):
        # What the copies and reads did depends on how far the I/O threads got before backward
        # (forwarded or read back, when a copy fell due): the pack path's own decisions do not.
        for k in _IO_TIMED:
            fast_stats.pop(k), general_stats.pop(k)
    assert fast_kinds == general_kinds
    assert fast_stats == general_stats
    assert fast_stats["saved_bytes"] > 0
    if path in ("tier", "drive"):
        assert "Ref" in fast_kinds and wrote
    else:
        assert "Ref" not in fast_kinds and "Small" in fast_kinds


def test_the_gpt_bench_model_agrees_on_both_paths(tmp_path, monkeypatch):
    """The bench's GPT through the tier on CPU tensors: the same counters either way."""
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, seq=32, layers=2, hidden=32, heads=4))
    tokens = torch.randint(0, 128, (2, 32))
    base = step(model, lambda: model(tokens, tokens), None)
    seen = []
    for general in (False, True):
        off = ssdtrain.Offloader(model, path=str(tmp_path / str(general)), backend="memory", min_bytes=4096)
        if general:
            off._pack = off._pack_general
        try:
            for _ in range(3):
                assert_same(base, step(model, lambda: model(tokens, tokens), off))
                off.wait()
            got = _stats(off)
            for k in _IO_TIMED:
                got.pop(k)
            seen.append(got)
        finally:
            off.close()
    assert seen[0] == seen[1] and seen[0]["saved_bytes"] > 0


def test_autograd_refuses_an_inference_tensor_before_any_pack_hook():
    """The fast path does not ask ``is_inference()``: autograd refuses to save such a tensor
    before it calls a pack hook (a torch where it no longer does fails here)."""
    with torch.inference_mode():
        x = torch.randn(3)
    w = torch.randn(3, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
            x * w
    assert packed == []


def test_a_models_storages_are_found_in_one_walk():
    """Note [a model's storages are found in one walk] (``keep.py``): the keys pack screens by are
    those of ``parameters()`` and ``buffers()``, with tied weights, parametrized weights, absent
    biases and buffers, buffers of their own, and parameters with no storage (meta)."""
    from torch.nn.utils import parametrizations

    from ssdtrain.engine import keep

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab=64, seq=16, layers=2, hidden=16, heads=2))
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    tied[1].weight = tied[0].weight
    normed = parametrizations.weight_norm(torch.nn.Linear(4, 4))
    odd = torch.nn.Module()
    odd.register_buffer("absent", None)
    odd.register_buffer("scale", torch.ones(3))
    odd.register_parameter("none", None)
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 4)
    for models in ([gpt], [tied], [normed], [odd], [meta], [gpt, tied, gpt]):
        want = keep.storage_keys(t for m in models for t in itertools.chain(m.parameters(), m.buffers()))
        assert keep.model_storage_keys(models) == want
    assert len(keep.model_storage_keys([tied])) == 1 and len(keep.model_storage_keys([normed])) == 3
