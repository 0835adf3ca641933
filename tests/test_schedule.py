"""Prefetch, keep policy, backpressure, adaptive keep and micro-batch orders of pipeline schedules."""

import time

import pytest
import torch
from torch import nn

import ssdtrain
import ssdtrain.store.posix as posix
from ssdtrain.bench.models import GPT, GPTConfig
from ssdtrain.engine.schedule import KeepPolicy, ReadWindow, Scope, Scopes, WriteBudget, find_blocks

from _equiv import assert_same, step


def _stack(n=6, d=64):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.LayerNorm(d)) for _ in range(n)])


def _run_order(order, chunks, xs, off):
    """Runs forwards ("F", chunk, mb) and backwards ("B", chunk, mb) in the given order, passing
    activations between chunks like a pipeline (detached boundary, gradient handed back)."""
    for c in chunks:
        c.zero_grad(set_to_none=True)
    outs, ins, grads, losses = {}, {}, {}, {}
    for kind, c, mb in order:
        if kind == "F":
            x = xs[mb] if c == 0 else outs[(c - 1, mb)].detach().requires_grad_()
            ins[(c, mb)] = x
            if off is None:
                y = chunks[c](x)
            else:
                with off.microbatch((c, mb)):
                    y = chunks[c](x)
            outs[(c, mb)] = y
            if c == len(chunks) - 1:
                losses[mb] = y.pow(2).mean()
        else:
            if off is not None:
                off.prefetch((c, mb))
            if c == len(chunks) - 1:
                losses[mb].backward()
            else:
                outs[(c, mb)].backward(grads[(c + 1, mb)])
            if c > 0:
                grads[(c, mb)] = ins[(c, mb)].grad
    params = [p.grad.clone() for ch in chunks for p in ch.parameters()]
    return torch.stack([losses[m].detach() for m in sorted(losses)]), params


ONE_F_ONE_B = [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("B", 0, 0), ("F", 0, 3), ("B", 0, 1), ("F", 0, 4),
               ("B", 0, 2), ("B", 0, 3), ("B", 0, 4)]
# Two model chunks per stage (virtual pipeline 2), micro-batches in groups, as interleaved 1F1B does.
INTERLEAVED = [("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2), ("B", 1, 0), ("F", 0, 3),
               ("B", 1, 1), ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1), ("B", 1, 2), ("B", 1, 3),
               ("B", 0, 2), ("B", 0, 3)]


@pytest.mark.parametrize("order", [ONE_F_ONE_B, INTERLEAVED], ids=["1f1b", "interleaved"])
def test_pipeline_orders_are_exact(off_dir, order):
    model = _stack(6)
    nchunks = 1 + max(c for _, c, _ in order)
    chunks = [model[:3], model[3:]] if nchunks == 2 else [model]
    nmb = 1 + max(m for _, _, m in order)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(m)) for m in range(nmb)]
    base = _run_order(order, chunks, xs, None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, prefetch_bytes="64KiB")
    for _ in range(2):
        assert_same(base, _run_order(order, chunks, xs, off))
    s = off.stats()
    assert s.written_bytes > 0 and set(s.microbatches) == {(c, m) for _, c, m in order}
    off.wait()
    assert off.stats().live_entries == 0
    off.close()


class SlowBackward(torch.autograd.Function):
    """Identity whose backward takes a fixed time: deterministic compute to hide reads behind."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.03)
        return g


class Block(nn.Module):
    def __init__(self, d=128):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return SlowBackward.apply(self.lin(x).tanh())


def _hit_rate(off_dir, monkeypatch, **cfg):
    real = posix._preadv

    def slow_read(fd, bufs, offset):
        time.sleep(0.005)  # every read request takes at least 5 ms
        return real(fd, bufs, offset)

    monkeypatch.setattr(posix, "_preadv", slow_read)
    monkeypatch.setenv("SSDTRAIN_IO_ENGINE", "threads")  # the ring does not go through the seam
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(10)])
    x = torch.randn(64, 128)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, **cfg)
    warm = None
    for i in range(3):
        with off:
            loss = model(x).sum()
        off.wait()  # all on storage: every unpack needs a read, prefetched or not
        loss.backward()
        if i == 0:
            warm = off.stats()
    s = off.stats()
    off.close()
    return (s.prefetch_hits - warm.prefetch_hits) / (s.prefetch_hits + s.prefetch_misses
                                                     - warm.prefetch_hits - warm.prefetch_misses)


def test_prefetch_hides_slow_reads(off_dir, monkeypatch):
    model_blocks = find_blocks(nn.Sequential(nn.ModuleList(Block() for _ in range(3))), None)
    assert len(model_blocks) == 3
    rate = _hit_rate(off_dir, monkeypatch, prefetch_layers=2, prefetch_bytes="16MiB")
    assert rate >= 0.9, rate


def test_without_prefetch_reads_stall(off_dir, monkeypatch):
    """The same run with no read-ahead: the hit rate above is the prefetcher's doing."""
    rate = _hit_rate(off_dir, monkeypatch, prefetch_layers=0, prefetch_bytes=0)
    assert rate < 0.5, rate


def test_keep_last_layers_writes_nothing_for_them(off_dir):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=32, layers=4, hidden=64, heads=4)
    model = GPT(cfg)
    tok = torch.randint(0, 256, (2, 32))
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, keep_last_layers=2)
    assert len(off._blocks) == 4
    with off:
        loss = model(tok, tok)
    off.wait()
    by_layer = {}
    for e in off._entries.values():
        by_layer.setdefault(e.layer, []).append(e)
    assert set(by_layer) >= {0, 1, 2, 3}
    for layer in (2, 3):
        assert all(not e.offloaded and e.extent is None for e in by_layer[layer])
    for layer in (0, 1):
        assert all(e.offloaded for e in by_layer[layer])
    kept = sum(e.nbytes for layer in (2, 3) for e in by_layer[layer])
    s = off.stats()
    assert s.kept_bytes >= kept > 0
    assert s.written_bytes <= s.unique_bytes - kept
    loss.backward()
    base = step(model, lambda: model(tok, tok), None)
    assert_same(base, step(model, lambda: model(tok, tok), off))
    off.close()


def _slow_writes(monkeypatch, delay=0.02):
    real = posix._pwrite

    def slow(fd, buf, offset):
        time.sleep(delay)
        return real(fd, buf, offset)

    monkeypatch.setattr(posix, "_pwrite", slow)


@pytest.mark.parametrize("when_full", ["wait", "keep"])
def test_backpressure(off_dir, monkeypatch, when_full):
    _slow_writes(monkeypatch)
    model = _stack(8, 128)
    x = torch.randn(64, 128)
    base = step(model, lambda: model(x).sum(), None)
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, max_inflight_bytes="64KiB",
                             when_full=when_full, io_threads=1)
    assert_same(base, step(model, lambda: model(x).sum(), off))
    s = off.stats()
    if when_full == "wait":
        assert s.backpressure_waits > 0 and s.backpressure_stall_seconds > 0 and s.backpressure_keeps == 0
    else:
        assert s.backpressure_keeps > 0 and s.backpressure_waits == 0 and s.kept_bytes > 0
    off.close()


def test_adaptive_keep_cancels_what_backward_needs_first(off_dir, monkeypatch):
    _slow_writes(monkeypatch, 0.05)
    model = _stack(8, 128)
    x = torch.randn(64, 128)
    base = step(model, lambda: model(x).sum(), None)
    # One thread and small requests: only a few writes are in flight, the rest wait in the queue.
    off = ssdtrain.Offloader(model, path=str(off_dir), min_bytes=0, io_threads=1, chunk_bytes="4KiB")
    assert_same(base, step(model, lambda: model(x).sum(), off))  # backward right after forward
    s = off.stats()
    assert s.cancelled_writes > 0 and s.adaptive_keep_bytes > 0
    assert s.forwarded_bytes >= s.adaptive_keep_bytes
    assert s.written_bytes + s.adaptive_keep_bytes <= s.unique_bytes
    off.close()


# torch 2.11 (the GPU machines' torch) warns that the profiler clears its events each cycle.
@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events:UserWarning")
def test_profiler_ranges(off_dir):
    from torch.profiler import profile

    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    x = torch.randn(256, 256, requires_grad=True)
    # I/O runs on ssdtrain's threads: the profiler must be told to record all threads.
    cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(experimental_config=cfg) as prof:
        with off:
            y = x
            for _ in range(4):
                y = (y * 1.1).tanh()
        off.wait()
        y.sum().backward()
    names = {e.name for e in prof.events() if e.name.startswith("ssdtrain.")}
    assert {"ssdtrain.pack", "ssdtrain.unpack", "ssdtrain.write", "ssdtrain.read"} <= names
    off.close()


def test_window_grows_with_waiting_and_shrinks_without():
    """Note [a window as small as the drive allows], on a made-up clock: a pass that waited on
    reads for more than 0.25% of its time doubles the window for the next one, small waits keep
    it, none shrinks it by a quarter down to where it started; waits that add up to 10% of the
    last pass double it at once."""
    clock = [1000.0]
    w0 = 16 << 20
    win = ReadWindow(w0, 128 << 20, clock[0])

    def backward_pass(seconds, stalls=()):
        """The window this pass reads ahead with; then it waits ``stalls`` and lasts ``seconds``."""
        win.begin_pass(clock[0], 0)
        window = win.bytes
        for stall in stalls:
            win.stalled(clock[0], stall)
        clock[0] += seconds
        return window

    clock[0] += 1.0                                   # the first forward
    assert backward_pass(2.0, [0.002]) == w0
    assert backward_pass(2.0, [0.004, 0.004]) == w0   # 0.1% waited before: kept
    assert backward_pass(2.0) == 2 * w0               # 0.4% waited before: doubled
    assert backward_pass(2.0) == 2 * w0 - w0 // 2     # no wait: a quarter less
    sizes = [backward_pass(2.0) for _ in range(6)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == w0  # down to the floor, not below
    for _ in range(8):
        backward_pass(2.0, [0.1])
    assert backward_pass(2.0) == 128 << 20            # at most prefetch_bytes
    win.begin_pass(clock[0], 0)
    win.bytes = w0
    win.stalled(clock[0], 0.1)                        # 5% of the last pass: wait for the pass
    assert win.bytes == w0
    win.stalled(clock[0], 0.15)                       # 12.5%: now
    assert win.bytes == 2 * w0


def test_reads_fill_what_backward_freed_never_above_its_start():
    """Note [reads never raise the peak]: the room to read ahead is the window plus whatever
    backward has freed of the saved bytes resident when it began."""
    win = ReadWindow(16, 64, 0.0)
    win.begin_pass(1.0, 1000)          # backward begins with 1000 saved bytes resident
    assert win.limit(1000, 0) == 16    # nothing freed yet: the window alone
    assert win.limit(600, 0) == 416    # 400 freed: the window and those 400
    assert win.limit(900, 300) == 416  # 300 of the 900 resident are reads ahead: the same room
    assert win.limit(1200, 0) == 16    # more than at the start (pipelines): never less than the window
    assert ReadWindow(16, 0, 0.0).limit(0, 0) == 0  # prefetch_bytes=0: no read-ahead at all


def test_write_budget_shrinks_when_backward_waits_and_grows_back():
    """Note [write only what comes back in time], on made-up steps of 10 s: a step whose
    backward waited more than 1% of it sends less next time (in proportion to the wait, at
    most halved); a step held back by the budget that did not wait lets it grow by a tenth."""
    step = 1 << 20
    b = WriteBudget(0.0, step)
    t = 0.0

    def run(sent, stall):
        """One step: offers ``sent`` bytes in 1 MiB saves, waits ``stall`` s; returns the bytes allowed."""
        nonlocal t
        tally = b.current
        allowed = sum(step for _ in range(sent // step) if b.allows(step))
        b.written(allowed, tally)
        b.stalled(stall, tally)
        t += 10.0
        b.finish(tally, t)  # its backward is over, then the next forward begins
        b.new_step(t)
        return allowed

    assert run(800 * step, 0.05) == 800 * step and b.limit is None   # 0.5%: the window's to fix
    assert run(800 * step, 2.0) == 800 * step                      # 20% waited: ...
    assert b.limit == 480 * step                                   # ... 40% less (1 - 2 * 0.2)
    assert run(800 * step, 9.0) == 480 * step                      # 90% waited: ...
    assert b.limit == 240 * step                                   # ... at most halved
    assert run(800 * step, 0.0) == 240 * step
    assert b.limit == 264 * step + step                            # no wait, held back: +10%
    grown = [run(800 * step, 0.0) for _ in range(30)]
    assert grown == sorted(grown) and grown[-1] == 800 * step      # back to all, as the drive allows
    limit = b.limit
    assert run(100 * step, 0.0) == 100 * step and b.limit == limit  # not held back: unchanged


def test_only_a_forward_sent_under_the_limit_as_it_is_can_raise_it():
    """Pipelines report forwards late and out of step: a clean one sent under a limit lowered
    since (by a peer that waited) must not raise it back (measured at 50 MB/s under 1F1B: the
    limit climbed from 23 to 74 MiB while every step waited 0.3 s), nor a clean one sent under
    a lower limit than now raise it again. A clean one sent under the current limit does."""
    mib = 1 << 20
    b = WriteBudget(0.0, mib)
    b.limit = 48 * mib

    def forward(now):
        tally = b.new_step(now)
        allowed = sum(mib for _ in range(80) if b.allows(mib))
        assert allowed == 48 * mib and tally.bound
        b.written(14 * mib, tally)  # the drive took 14 MiB before backward; the rest was kept
        return tally

    a, waited = forward(0.0), forward(0.1)
    b.stalled(0.1, waited)
    b.finish(waited, 0.3)          # half of a 0.2 s slot waited: what it wrote, halved
    assert b.limit == 7 * mib
    b.finish(a, 0.35)              # clean, but sent under 48 MiB: says nothing of 7 MiB
    assert b.limit == 7 * mib
    c = b.new_step(0.4)
    assert sum(mib for _ in range(80) if b.allows(mib)) == 7 * mib
    b.finish(c, 0.6)               # clean under the current limit: +10% and 1 MiB
    assert b.limit == int(7 * mib * 1.1) + mib
    b.finish(c, 0.7)               # (a stale report of the same forward: the limit moved on)
    assert b.limit == int(7 * mib * 1.1) + mib


def test_the_last_save_is_kept_for_backward(off_dir):
    """Note [the last save waits]: the last save's write never starts when backward comes next
    (it needs that tensor first); it does when another forward runs before that backward."""
    x = torch.randn(256, 256, requires_grad=True)
    nbytes = x.numel() * x.element_size()

    def forward():
        a = (x * 2).sigmoid()   # saves its output
        return (a * 3).exp()    # saves its output: the last save

    def run(schedule):
        off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
        outs = schedule(off)  # no wait(): it would write the waiting last saves too
        grads = []
        for out in outs:
            out.sum().backward()
            grads.append(x.grad)
            x.grad = None
        off.wait()  # writes still in flight (backward took those tensors from memory) count
        s = off.stats()
        off.close()
        return s, grads

    def plain(off):
        with off:
            return [forward()]

    def one_microbatch(off):
        with off.microbatch(0):
            return [forward()]

    def two_forwards(off):  # F0 F1 B0 B1
        with off.microbatch(0):
            y0 = forward()
        with off.microbatch(1):
            y1 = forward()
        return [y0, y1]

    reference = forward()
    reference.sum().backward()
    expected, x.grad = x.grad, None
    for schedule, written, kept in ((plain, 1, 1), (one_microbatch, 1, 1), (two_forwards, 3, 1)):
        s, grads = run(schedule)
        assert s.unique_bytes == 2 * nbytes * len(grads)
        assert (s.written_bytes, s.adaptive_keep_bytes) == (written * nbytes, kept * nbytes), schedule.__name__
        assert all(torch.equal(g, expected) for g in grads)


def test_a_small_last_save_does_not_release_the_large_one_before_it(off_dir):
    """Note [the last save waits], with a loss at the end: cross-entropy saves the large
    log-softmax and then the small targets. The targets are queued themselves and the
    log-softmax stays held, so backward gets it from memory and it is never written in vain."""
    torch.manual_seed(0)
    logits_in = torch.randn(256, 512, requires_grad=True)
    head = nn.Linear(512, 4096)
    targets = torch.randint(0, 4096, (256,))

    def loss_fn():
        return nn.functional.cross_entropy(head(logits_in), targets)

    expected = torch.autograd.grad(loss_fn(), [logits_in, head.weight])
    off = ssdtrain.Offloader(path=str(off_dir), min_bytes=0)
    with off:
        loss = loss_fn()
    got = torch.autograd.grad(loss, [logits_in, head.weight])
    off.wait()
    s = off.stats()
    off.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    log_softmax = 256 * 4096 * 4
    assert s.adaptive_keep_bytes >= log_softmax           # held, then cancelled as backward began
    # The head's input is a leaf (kept as it is); the targets, queued themselves, are the last op's
    # saves: they wait for its return (Note [a save is copied only after its op returned]), and
    # backward comes first. Nothing is written in vain.
    assert s.written_bytes == 0 and s.adaptive_keep_bytes >= log_softmax + 256 * 8
