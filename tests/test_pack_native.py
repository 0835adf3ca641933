"""Note [a compiled pack for the common save] (``ssdtrain/engine/native.py``): the compiled pack
(``cuda_ext/_cpack.c``) and pure Python reach the same state for the same saves, object by object:
every save's handle, the group part it made (its place, bytes, version, guard, host extent), the
group's counts, the copy clock's and the peak's positions, the counters; and the same gradients.
Pure Python is the reference; the compiled path is built at install where a C compiler is, and
the suite's other tests run on it."""

import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.engine import hooks, native
from ssdtrain.engine import offloader as offloader_mod
from ssdtrain.engine.ref import Ref
from ssdtrain.host import tier

from _equiv import assert_same, step

COMPILED = hooks._native_pack
needs_build = pytest.mark.skipif(COMPILED is None, reason=f"the compiled pack: {native.native_pack_status()}")


def test_the_compiled_pack_is_built_where_a_compiler_is():
    """Where a C compiler is (CI's machines), the install built it and hooks.py uses it: a build
    broken by a change fails here, not silently as pure Python."""
    if os.environ.get("SSDTRAIN_NATIVE") == "0" or not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here, or the compiled pack turned off")
    assert native.native_pack_status() == "compiled"
    assert COMPILED is not None


class _Views(torch.nn.Module):
    """Saves the join path meets: views of one storage (a transpose, a slice), a complex
    conjugate view, a negative view, dropout, attention, norms, a bf16 matmul."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 32)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        h = self.norm(self.a(x)).relu()
        q = h.view(2, 8, 4, 8).transpose(1, 2)  # non-contiguous views of one storage
        h = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).transpose(1, 2).reshape(2, 8, 32)
        h = h + (h.to(torch.bfloat16) @ h.to(torch.bfloat16).transpose(1, 2)).float() @ h / 100
        z = torch.complex(h[..., :16], h[..., 16:])
        zc = z.conj() * z  # a conjugate view saved
        n = torch._neg_view(h[:, 1:]) * h[:, 1:]  # a negative view of a slice
        return (zc.real.sum() + n.sum() + F.dropout(h, 0.2).square().sum()) / 100


def _record(off, t, out):
    """What one pack left, timing aside: the handle's fields, its part's and group's, the clocks'."""
    if not isinstance(out, Ref):
        return ("kept", type(out).__name__, out is t)
    e, p = out.entry, out.part
    rec = [e.id, type(e).__name__, out.size, out.stride, out.offset, out.dtype, out.conj, out.neg, out.whole,
           out.gen, out.weak.filed, out.weak() is out, out.graveyard is off._graveyard, e.refs, len(e.ref_weaks),
           e.ref_weaks[-1] is out.weak, e.nbytes]
    if e.grouped:
        ext = p.extent
        rec += [p.index, p.entry is e, p.lo, p.nbytes, p.version, p.refs, p.whole, p.tainted, p.unpacked,
                p.key == t.untyped_storage()._cdata, not p.storage_ref.expired(), p.data is not None,
                p.guard is not None and p.guard._version == t._version, p.guard_weak() is t,
                type(ext).__name__, ext.offset - e.parts[0].extent.offset, ext.slab == e.parts[0].extent.slab,
                ext.reserved, ext.nbytes, ext.length, ext.path_index, ext.landed, ext.due, ext.back, ext.ordered,
                len(e.parts), e.extent.parts[p.index] is ext, e.extent.used, e.op is None,
                any(x is p for x in off._cache.index.keys.get(p.key, ()))]
    clock, peak, total = off._tier.clock, off._peak, off._counters.total
    rec += [clock.pos, clock.saves, clock._positions[-1:], clock.sent, clock.pending, peak.pos, len(peak._positions),
            total.saved_bytes, total.unique_bytes]
    return tuple(rec)


def _in_program_order(monkeypatch):
    """The tier's copy threads finish each batch before its hand-over returns, as on the modelled
    GPU (Note [the modelled tier runs in a fixed order] in ``host/tier.py``): whether a save finds
    its storage's entry still queued (a hit) or handed over (a new entry) is then the program's,
    not the scheduler's, and the two paths' records compare save by save."""
    submit = tier._Batches.submit

    def waited(self, requests):
        fut = submit(self, requests)
        fut.exception()
        return fut

    monkeypatch.setattr(tier._Batches, "submit", waited)


def _run(model, loss_fn, tmp_path, compiled, monkeypatch):
    """Three steps with the compiled pack or pure Python; each save's record in the last; the
    gradients of each step; how many saves pack's Python decided (``_pack_plain``)."""
    monkeypatch.setattr(hooks, "_native_pack", COMPILED if compiled else None)
    _in_program_order(monkeypatch)
    off = ssdtrain.Offloader(model, path=str(tmp_path / str(compiled)), backend="memory", min_bytes=0)
    records, grads = [], []
    plain = off._pack_plain
    plain_calls = [0]

    def counted_plain(*args):
        plain_calls[0] += 1
        return plain(*args)

    off._pack_plain = counted_plain
    pack = off._pack

    def spy(_self, t):
        out = pack(t)
        records.append(_record(off, t, out))
        return out

    try:
        for i in range(3):
            records.clear()
            plain_calls[0] = 0
            off._pack = types.MethodType(spy, off)  # bound, as keep.untraced wants once torch._dynamo is imported
            grads.append(step(model, loss_fn, off))
            off.wait()
        stats = off.stats()
    finally:
        off.close()
    return records, grads, plain_calls[0], stats


@needs_build
@pytest.mark.parametrize("which", ["views", "gpt"])
def test_the_compiled_pack_and_pure_python_agree_object_by_object(which, tmp_path, monkeypatch):
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    if which == "views":
        model = _Views()
        x = torch.randn(2, 8, 32)

        def loss_fn():
            return model(x)
    else:
        model = GPT(GPTConfig(vocab=128, seq=32, layers=3, hidden=32, heads=4))
        tokens = torch.randint(0, 128, (2, 32))

        def loss_fn():
            return model(tokens, tokens)
    base = step(model, loss_fn, None)
    pure, pure_grads, pure_plain, pure_stats = _run(model, loss_fn, tmp_path, False, monkeypatch)
    fast, fast_grads, fast_plain, fast_stats = _run(model, loss_fn, tmp_path, True, monkeypatch)
    for g in pure_grads + fast_grads:
        assert_same(base, g)
    assert len(pure) == len(fast)
    for i, (a, b) in enumerate(zip(pure, fast)):
        assert a == b, f"save {i}: pure {a} vs compiled {b}"
    joins = sum(1 for r in pure if r[0] != "kept" and r[1] == "Group" and r[17] > 0)
    assert joins > len(pure) // 4  # the path under test: saves that joined an open group
    # the compiled pack decided most of them itself: pack's Python saw fewer saves
    assert fast_plain <= pure_plain - joins // 2, (fast_plain, pure_plain, joins)
    assert pure_stats.saved_bytes == fast_stats.saved_bytes and pure_stats.unique_bytes == fast_stats.unique_bytes


@needs_build
def test_a_join_the_copy_budget_refuses_goes_to_pure_python(tmp_path, monkeypatch):
    """The copy clock's refusal is Python's to make (the compiled pack asks first, changes nothing):
    with a forward's copy limit reached, the same saves are kept either way, counted once."""
    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, seq=32, layers=2, hidden=32, heads=4))
    tokens = torch.randint(0, 128, (2, 32))
    seen = []
    _in_program_order(monkeypatch)
    for compiled in (False, True):
        monkeypatch.setattr(hooks, "_native_pack", COMPILED if compiled else None)
        off = ssdtrain.Offloader(model, path=str(tmp_path / str(compiled)), backend="memory", min_bytes=0)
        try:
            clock = off._tier.clock
            step(model, lambda: model(tokens, tokens), off)
            off.wait()
            limit = clock.sent // 3
            begin = clock.begin
            clock.begin = lambda room=True: (begin(room), setattr(clock, "limit", limit))
            step(model, lambda: model(tokens, tokens), off)
            off.wait()
            seen.append((clock.sent, clock.closed, clock.limited, off.stats().budget_kept_bytes, off.stats().saved_bytes))
        finally:
            off.close()
    assert seen[0] == seen[1]
    sent, closed, limited, kept, _ = seen[0]
    assert closed and limited and kept > 0 and 0 < sent


def test_the_compiled_pack_is_off_when_asked_and_when_stale():
    code = textwrap.dedent("""
        from ssdtrain.engine import hooks, native
        print(hooks._native_pack is None, native.native_pack_status())
    """)
    env = dict(os.environ, SSDTRAIN_NATIVE="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(None, 1) == ["True", "off (SSDTRAIN_NATIVE=0)\n"]
    if COMPILED is None:
        return
    old = native.NATIVE_ABI
    try:
        native.NATIVE_ABI = old + 1
        assert native.load_pack(vars(hooks)) is None
        assert native.native_pack_status().startswith("stale build")
    finally:
        native.NATIVE_ABI = old
        assert native.load_pack(vars(hooks)) is not None and native.native_pack_status() == "compiled"


@needs_build
def test_a_joined_saves_leaves_are_not_the_collectors_and_still_die(tmp_path, monkeypatch):
    """Note [a save's leaves are not the collector's]: the compiled pack's Refs, their weak
    references, shapes and strides, host extents and storage handles are out of the cyclic
    collector's lists, and with the collector off every Ref of a step is still freed once
    backward used it (nothing of ours waits for a collection)."""
    import gc
    import weakref

    monkeypatch.setattr(offloader_mod, "_TIER_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(hooks, "_native_pack", COMPILED)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=128, seq=32, layers=3, hidden=32, heads=4))
    tokens = torch.randint(0, 128, (2, 32))
    off = ssdtrain.Offloader(model, path=str(tmp_path), backend="memory", min_bytes=0)
    pack, made = off._pack, []

    def spy(_self, t):
        out = pack(t)
        if isinstance(out, Ref):
            made.append(out)
        return out

    was = gc.isenabled()
    gc.disable()
    try:
        step(model, lambda: model(tokens, tokens), off)  # warm: groups open, the pool sized
        off.wait()
        off._pack = types.MethodType(spy, off)
        model.zero_grad(set_to_none=True)
        with off:
            loss = model(tokens, tokens)
        joined = [r for r in made if r.part is not r.entry and r.part.index > 0]
        compiled = [r for r in joined if not gc.is_tracked(r)]  # the others went to Python (a safe point first, ...)
        assert len(joined) > len(made) // 4 and len(compiled) >= 3 * len(joined) // 4
        for r in compiled:
            leaves = dict(ref=r, weak=r.weak, size=r.size, stride=r.stride, extent=r.part.extent,
                          storage_ref=r.part.storage_ref, guard_weak=r.part.guard_weak)
            assert [k for k, o in leaves.items() if gc.is_tracked(o)] == []
            assert r.part.whole is None or not gc.is_tracked(r.part.whole)
            assert gc.is_tracked(r.part) and gc.is_tracked(r.entry)  # in cycles until released: the collector's
        weaks = [weakref.ref(r) for r in made]
        del made[:], joined, compiled, r, leaves
        loss.backward()
        del loss
        off.wait()
        assert [w for w in weaks if w() is not None] == []
    finally:
        if was:
            gc.enable()
        off.close()
