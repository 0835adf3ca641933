"""The host tier's copy clock over forwards of changing length (Note [a copy clock for forwards of
any length]), on the modelled H100 of ``benchmarks/copy_clock_lengths.py``: the engine's own
``CopyClock`` driven as the engine drives it, on a modelled timeline (no GPU, no threads)."""

import pytest
from _benchmarks import load_benchmark

bench = load_benchmark("copy_clock_lengths")


@pytest.mark.parametrize("schedule", ["cycle", "long-after-short", "short-after-long", "steady-16k", "steady-1k"])
def test_copies_keep_up_when_the_length_changes(schedule):
    """Llama-3.1-8B-shaped recompute+offload: steps of 1k, 8k, 2k, 16k and 4k tokens in turn, a 16k
    step after 50 of 1k, short steps after long ones, and steady steps: once the clock has a
    reference, every step's peak falls by at least 80% of what the copy engine could take during
    its forward, at a step within x1.05 of the same step without the tier. Placed by bytes (the
    clock before 2026-11-28), a 16k step after 1k ones copied 3%."""
    steps = bench.run_schedule(schedule, "recompute+offload")
    learned = [s for s in steps if s.learned]
    assert len(learned) >= len(steps) - 1
    for s in learned:
        assert s.share >= 0.8, (s.seq, s.copied, s.bound)
        assert s.ratio <= 1.05, (s.seq, s.ratio)


def test_plain_offload_a_long_step_after_short_ones():
    """Plain offload (every save of a block; the copy engine's budget binds): a 16k step after 50
    of 1k, and 16k steps among shorter ones, copy at least 80% of their bound. The 1k steps are
    paced by the host (100 us a copy on the modelled host: Note [the host paces the copies]); their
    pace does not hold back a longer step, which has more device time to hide its copies in."""
    for schedule in ("long-after-short", "cycle"):
        steps = bench.run_schedule(schedule, "offload")
        long = [s for s in steps if s.learned and s.seq == 16384]
        assert long and all(s.share >= 0.8 for s in long), [(s.seq, s.share) for s in steps]
        assert all(s.ratio <= 1.1 for s in steps if s.learned)


def test_every_save_is_counted():
    """Saves of a storage saved before count with no bytes, and move the count on: a forward is
    placed by its count of saves."""
    clock = bench.new_clock()
    clock.begin()
    clock.produced(100)
    clock.produced(0)
    assert clock.saves == 2 and clock.pos == 100
