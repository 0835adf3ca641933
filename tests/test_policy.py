"""Note [write only what comes back in time]: a drive too slow to bring the bytes back in time
is sent less (kept instead of waited for), and more again when it speeds up.

Two tests: a closed loop of the budget on a modelled drive and step (a fake clock: every figure
is deterministic), and the same end to end on a rate-limited test store, where gradients stay
exact and only byte counters are asserted (its waits are real time, so they are never compared).
"""

import torch
from torch import nn

import ssdtrain
from ssdtrain.config import OffloadConfig
from ssdtrain.engine.schedule import DriveAdvice, WriteBudget
from ssdtrain.store.memory import MemoryBackend
from ssdtrain.store.throttle import ThrottledBackend

from _equiv import assert_same, step


def test_a_slow_drive_is_sent_less_and_a_fast_one_more():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    x = torch.randn(256, 256)
    loss_fn = lambda: model(x).sum()  # noqa: E731
    base = step(model, loss_fn, None)
    # Reads at 4 MB/s: the ~3 MiB a step saves take most of a second to come back, while the
    # step computes for milliseconds. Writes are fast, so forward writes everything.
    store = ThrottledBackend(MemoryBackend(OffloadConfig(backend="memory")), write_bps=1e9, read_bps=4e6)
    # Writes that end after forward's end are written too: this tests the budget alone (forward
    # lasts milliseconds; Note [write what leaves before the peak] would keep most of it).
    off = ssdtrain.Offloader(model, store=store, min_bytes=0, late_writes=True)

    def run():
        before = off.stats()
        assert_same(base, step(model, loss_fn, off))
        off.wait()  # this step's writes are counted in this step, however slowly the I/O threads ran
        after = off.stats()
        return (after.written_bytes - before.written_bytes, after.read_stall_seconds - before.read_stall_seconds,
                after.budget_kept_bytes - before.budget_kept_bytes)

    slow = [run() for _ in range(8)]
    full = slow[0][0]
    assert full > 0 and slow[0][2] == 0, slow            # the first step sends everything it may
    assert off.stats().write_budget_bytes is not None    # backward waited, so a budget was learned
    later = slow[1:]  # the budget probes upward now and then (a clean step grows it): sums
    assert sum(w for w, _, _ in later) <= 0.75 * full * len(later), slow   # less is sent to the slow drive,
    assert sum(kept for _, _, kept in later) > 0, slow                     # and the rest is kept in memory
    store._read.bps = store._write.bps = 1e12          # the drive becomes fast
    fast = [run() for _ in range(12)]
    assert any(w == full and kept == 0 for w, _, kept in fast[3:]), fast  # everything is sent again
    off.close()
    store.close()


def test_the_budget_converges_to_what_the_drive_carries_and_follows_it():
    """The budget in a closed loop with a modelled step and drive, on a fake clock. Forward takes
    0.3 s and offers 100 saves of 10 MiB; backward computes for 0.6 s, so a drive reading R bytes/s
    brings back R * 0.6 s in time, and backward waits for the rest. The budget must learn that
    capacity from the waits alone (no rates are given to it), keep rather than stall, and follow
    the drive when it slows down and speeds up mid-run."""
    mib = 1 << 20
    budget = WriteBudget(0.0, mib)
    clock = 0.0

    def step(read_bps):
        nonlocal clock
        tally = budget.current
        sent = sum(10 * mib for _ in range(100) if budget.allows(10 * mib))
        stall = max(0.0, sent / read_bps - 0.6)
        budget.written(sent, tally)
        budget.stalled(stall, tally)
        clock += 0.3 + 0.6 + stall
        budget.finish(tally, clock)
        budget.new_step(clock)
        return sent, stall

    def settled(read_bps, steps):
        runs = [step(read_bps) for _ in range(steps)]
        late = runs[-6:]
        capacity = read_bps * 0.6
        mean_sent = sum(s for s, _ in late) / len(late)
        mean_stall = sum(w for _, w in late) / len(late)
        assert 0.8 * capacity <= mean_sent <= 1.2 * capacity, runs   # about what the drive carries,
        assert mean_stall <= 0.05 * 0.9, runs                           # with waits of a few % at most
        return runs

    first = step(500 * mib)
    assert first == (1000 * mib, 1000 / 500 - 0.6)   # no budget yet: everything, and a 1.4 s wait
    settled(500 * mib, 14)                           # 300 MiB come back in time
    slower = settled(250 * mib, 12)                  # the drive halves its speed mid-run
    assert slower[0][1] > 0.5 and slower[-1][1] < 0.1, slower  # one long wait, then it adapts
    faster = [step(4000 * mib) for _ in range(40)]   # a drive fast enough for everything
    assert faster[-1] == (1000 * mib, 0.0), faster   # everything is sent again, nothing waited
    assert [s for s, _ in faster] == sorted(s for s, _ in faster)   # growing all the way back


def test_in_a_pipeline_the_budget_learns_from_each_micro_batch_without_compounding():
    """1F1B on one stage of 4, on a fake clock: micro-batch j's forward (0.1 s, 100 saves of
    1 MiB offered) runs in slot j, its backward (0.2 s) in slot j + 3, after the forward of
    micro-batch j + 3; its reads start a slot early, so a drive reading R bytes/s brings back
    R * 0.3 s in time, and backward waits for the rest. Micro-batches sent under one limit all
    report late and alike: the limit must not fall again for each of them (measured with a
    step-wide budget: 74 MiB to 1 MiB in one round), and must settle at about what the drive
    carries."""
    mib = 1 << 20
    stages, read_bps = 4, 200 * mib  # 60 MiB come back in time per micro-batch
    budget = WriteBudget(0.0, mib)
    clock = 0.0
    sent: dict[int, tuple] = {}
    limits, stalls = [], []
    for slot in range(60):
        tally = budget.new_step(clock)
        mb_sent = sum(mib for _ in range(100) if budget.allows(mib))
        budget.written(mb_sent, tally)
        sent[slot] = (tally, mb_sent)
        clock += 0.1
        if slot >= stages - 1:
            back, b_sent = sent.pop(slot - stages + 1)
            stall = max(0.0, b_sent / read_bps - 0.3)
            budget.stalled(stall, back)
            clock += 0.2 + stall
            budget.finish(back, clock)
            stalls.append(stall)
        limits.append(budget.limit)
    capacity = read_bps * 0.3
    first = next(i for i, lim in enumerate(limits) if lim is not None)
    assert limits[first] == 50 * mib  # the first wait (0.2 s of a 0.5 s slot): 100 MiB less 40%
    assert min(lim for lim in limits if lim is not None) >= 0.5 * capacity, limits  # never compounded
    late = [b for _, (_, b) in sorted(sent.items())][-4:] + [s for s in limits[-8:]]
    assert 0.75 * capacity <= sum(late) / len(late) <= 1.1 * capacity, limits
    # Late waits: the budget still probes upward (+10% after clean micro-batches) and finds out
    # a pipeline's depth later, so a few micro-batches wait briefly: 3% of a slot on average at most.
    assert sum(stalls[-20:]) / 20 <= 0.03 * 0.5, stalls


def test_each_micro_batch_is_learned_from_once_its_backward_is_over(monkeypatch):
    """The wiring of the per-forward tallies, in a 1F1B order on one stage of 3: each
    micro-batch's tally is finished once, after its own backward and before the next forward
    (whose limit it may change), not when the next forward of the schedule ends; with the
    bytes of its own saves written."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(3)])
    xs = [torch.randn(32, 64) for _ in range(5)]
    off = ssdtrain.Offloader(model, backend="memory", min_bytes=0)
    tallies, losses, events = {}, {}, []
    real_finish = WriteBudget.finish

    def finish(budget, tally, now):
        events.append(("learn", next(i for i, t in tallies.items() if t is tally)))
        real_finish(budget, tally, now)

    monkeypatch.setattr(WriteBudget, "finish", finish)

    def forward(i):
        with off.microbatch(i):
            events.append(("F", i))
            tallies[i] = off._budget.current
            losses[i] = model(xs[i]).square().sum()
            off.wait()  # its writes land now: each tally's written bytes are all of its own

    def backward(i):
        off.prefetch(i)
        losses.pop(i).backward()
        events.append(("B", i))

    for i in range(2):
        forward(i)
    for i in range(5):  # 1F1B: F2 B0 F3 B1 F4 B2 B3 B4
        if i + 2 < 5:
            forward(i + 2)
        backward(i)
    off.wait()
    per_mb = off.stats().microbatches
    off.close()
    assert events == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("learn", 0), ("F", 3), ("B", 1), ("learn", 1),
                      ("F", 4), ("B", 2), ("learn", 2), ("B", 3), ("learn", 3), ("B", 4), ("learn", 4)], events
    for i, tally in tallies.items():
        assert tally.written == per_mb[i]["written_bytes"] > 0, (i, tally.written, per_mb[i])


def test_drive_advice_speaks_once_when_the_drive_takes_little_and_the_drive_is_why():
    # Note [say when the drive carries little]: running totals (saved, written, kept for the
    # drive) at each forward's end, 100 MiB saved per forward; per_forward in MiB.
    mib = 1 << 20

    def feed(advice, per_forward, forwards):
        said = []
        u = w = k = 0.0
        for _ in range(forwards):
            u, w, k = u + 100 * mib, w + per_forward[0] * mib, k + per_forward[1] * mib
            said.append(advice.observe(u, w, k))
        return said

    said = feed(DriveAdvice(), (2, 98), 12)        # 2% written, the rest kept by the budget
    assert said[:7] == [None] * 7                  # the budget is given 8 forwards to settle
    msg = said[7]
    assert msg and "2.0% of what the last 4 forwards saved" in msg and "(2.0 MiB of 100.0 MiB per forward)" in msg
    assert "checkpoint" in msg and "ssdtrain plan" in msg
    assert said[8:] == [None] * 4                  # once
    assert feed(DriveAdvice(), (6, 94), 20) == [None] * 20  # 6%: the drive takes a share worth having
    assert feed(DriveAdvice(), (1, 30), 20) == [None] * 20  # kept mostly for another reason (min_bytes)
    assert feed(DriveAdvice(), (0, 0), 20) == [None] * 20   # nothing offloadable saved at all...
    advice = DriveAdvice()
    assert [advice.observe(0, 0, 0) for _ in range(20)] == [None] * 20  # ...or nothing saved


def test_an_offloader_warns_once_when_its_drive_takes_little(recwarn):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)])
    x = torch.randn(512, 1024)
    loss_fn = lambda: model(x).sum()  # noqa: E731
    base = step(model, loss_fn, None)
    # A drive that writes 2 MB/s: a step saves 32 MiB in tens of milliseconds, so nearly all of
    # it is still queued when backward begins and is kept (adaptive keep). Reads are fast.
    cfg = OffloadConfig(backend="memory", chunk_bytes=1 << 20, io_threads=1, min_bytes=0)
    slow = ThrottledBackend(MemoryBackend(cfg), write_bps=2e6, read_bps=1e12)
    off = ssdtrain.Offloader(model, config=cfg, store=slow)
    for i in range(12):
        assert_same(base, step(model, loss_fn, off))
        said = [w for w in recwarn.list if "the drive took" in str(w.message)]
        assert len(said) == (0 if i < 7 else 1), (i, [str(w.message) for w in recwarn.list])
    assert said[0].category is RuntimeWarning and said[0].filename.endswith("_equiv.py")  # points at the `with off:`
    s = off.stats()
    # Kept: still queued when backward began, refused by the budget, or by the peak rule (which of
    # them depends on the machine's pace: on a loaded one forward is slower, the peak later).
    kept = s.adaptive_keep_bytes + s.budget_kept_bytes + s.peak_kept_bytes
    assert s.written_bytes < 0.05 * s.unique_bytes and kept > s.unique_bytes / 2
    off.close()
    slow.close()
    # The same model on a drive that keeps up (every write lands before backward): nothing is said.
    fast = ThrottledBackend(MemoryBackend(cfg), write_bps=1e12, read_bps=1e12)
    off = ssdtrain.Offloader(model, config=cfg, store=fast)
    for _ in range(12):
        assert_same(base, step(model, loss_fn, off, wait=True))
    assert not [w for w in recwarn.list if "the drive took" in str(w.message) and w not in said]
    assert off.stats().written_bytes > 0.5 * off.stats().unique_bytes
    off.close()
    fast.close()
