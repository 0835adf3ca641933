"""The drive-limited part of ``ssdtrain plan``: what a drive can take off a step at no cost.

A GPU makes activations 20-60x faster than one NVMe drive takes them, so the drive, not the
memory, decides what can be offloaded. In one micro-batch's step, roughly::

    offloadable at no cost ~ min(B_write * T_forward, B_read * T_backward)

bytes can go out during forward and come back during backward without compute waiting, less
what the order of the saves forbids. This module works that out save by save, from the model's
dimensions, the achieved compute rate and the drive, with the same rules the offloader follows
(``ssdtrain/engine/offloader.py``, ``writer.py``, ``schedule.py``):

* **Saves**, per layer in pack order, the 16 tensors of Korthikanti et al. (``plan.py``'s
  formula): LayerNorm input, QKV input, Q/K/V (one storage), [the s x s attention tensors with
  naive attention], projection input, [dropout mask], LayerNorm input, MLP input, GELU input
  (4 sbh), second MLP input (4 sbh), [dropout mask]; then the head: final LayerNorm input, head
  input, the fp32 log-softmax (4 sbV) and the targets. The token ids come first. With
  checkpointing a layer saves only its input (d sbh). Saves under ``min_bytes`` stay in memory.
* **Time** is proportional to FLOPs: forward per sequence QKV 6sh^2, attention 4s^2h, projection
  2sh^2, MLP 8sh^2 + 8sh^2, head 2shV, at ``tflops``; each op's backward is twice its FLOPs at
  ``backward_tflops``; LayerNorm, GELU, softmax and the loss take no time. A save is packed
  when its op runs forward and needed when that op's backward starts. With checkpointing a
  layer's backward first recomputes its forward, and needs its input when that recomputation
  starts.
* **Writes** (Note [the last save waits]): each save of ``min_bytes`` or more is held until the
  next one of at least a quarter of its size comes (a smaller one is queued at once instead),
  and the one still held at the end is never written; the pack that queues a save hands it over
  at once if it may (so the last save still sends the one before it). Queued saves go to the
  drive in pack order, at most ``handoff_bytes`` handed over at once (one more when none is in
  flight); the drive writes them one after another at ``B_write``. Note [write what leaves before the peak] (``peak.py``): a
  write that would end after forward ends is not made (its save stays in memory; a later,
  smaller one may still fit); what was written frees its memory before the peak, which falls by
  that much (``free_bytes``), of at most ``min(B_write * T_forward, saved)`` (``possible_bytes``).
  When backward begins, what is still queued is cancelled and kept (adaptive keep).
* **Reads**: what was written before backward began is read back in reverse pack order from
  the moment backward begins, at ``B_read``, one after another (the read-ahead window is assumed
  never to hold them back: the room backward frees is theirs). A read that ends after its save
  is needed makes backward wait. Note [write only what comes back in time]: when backward would
  wait longer than ``max(10 ms, 1% of the step)``, the write budget lets only the earliest saves
  go (backward needs them last) - the longest prefix whose reads all come in time.
* Writes and reads are separate directions of the drive (as the bench's throttles model them).
* **The host tier** (``--host-gbps``, ``--host-gib``; Note [copy what leaves before the peak] in
  ``copy_clock.py``): in front of the drive, queued saves are copied to pinned host memory one after
  another at ``B_host``, each no sooner than it is queued; a copy that would end after forward
  ends is not made, and the rest of that forward stays in memory (the copy clock closes); a save
  the tier has no room for (``host_gib``, shared by the micro-batches in flight) goes to the
  drive, under the drive's rules. What was copied is freed before the peak and read back at
  ``B_host`` from backward's start (no read budget: the tier has none).
* **1F1B** (``stages > 1``; the first stage, in steady state): a micro-batch's backward comes
  ``stages - 1`` slots after its forward, each slot one forward and one backward. The drive
  writes for every micro-batch in flight, so each gets one slot's share of it: its writes run
  from its packs to ``T_forward + T_backward`` after its forward began, and what is not written
  by then is kept (no tail: a write past its share takes the next micro-batch's). Its reads
  start a slot early (``Offloader.prefetch`` before the forward that precedes its backward, as
  the Megatron integration does), ``T_forward`` before its backward. What one micro-batch can
  carry is then about ``min(B_write, B_read) (T_forward + T_backward)``, against the single
  step's ``min(B_write T_forward, B_read T_backward)``. Measured (``benchmarks/pipeline_stage.py``,
  4 stages, 80 ms forward, 150 ms backward, ``benchmarks/RESULTS.md`` 2026-11-24 19:50): the
  engine wrote 11.7, 28.8 and 73 MiB per micro-batch at 50, 200 and 1000 MB/s, this model
  8, 44 and 66 MiB (the engine's budget settles below the slot's capacity at 200 MB/s), the
  single-step model 2, 12 and 65.

Not modelled: a real drive serves the I/O threads' requests side by side, so a save may be done
later than in the order above (``benchmarks/RESULTS.md``, 2026-11-24, has the measured effect);
under 1F1B, the read-ahead window may hold reads back. Drives for full offload are, as a sizing
rule, the saved bytes of a micro-batch over what one drive carries in its step (or slot).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

from ssdtrain.planner.plan_model import _divisors, _stage_counts, _stage_memory, _usable_bytes, evaluate

__all__ = [
    "DriveStep",
    "Save",
    "add_arguments",
    "drive_limited",
    "drive_step",
    "format_drive",
    "forward_flops",
    "input_fields",
    "saves",
    "simulate",
]

MIB = 1 << 20
# Note [write only what comes back in time] (schedule.py): read waits under these are a read's
# latency, not a drive too slow, and do not shrink the write budget.
DRIVE_BOUND = 0.01
MIN_DRIVE_STALL = 0.010
DRIVE_MODES = ("offload", "recompute+offload")


@dataclass(frozen=True)
class Save:
    """One saved tensor: its bytes, when forward packs it and when backward first needs it
    (seconds from the start of forward and of backward)."""

    nbytes: int
    packed_s: float
    needed_s: float


def _layer_ops(s: int, h: int, a: int, d: int, flash: bool, dropout: bool, *, arch: str = "gpt",
               kv_heads: int | None = None, ffn_hidden: int | None = None) -> list[tuple[float, int]]:
    """One transformer layer's ops in forward order: (forward FLOPs, bytes it saves), per sequence.

    ``arch="llama"``: RMSNorm (input, rstd), the q/k/v projections (their input), attention (q, k,
    v, output, log-sum-exp; the softmax output without flash), the o-projection (its input is the
    attention's output: nothing more), RMSNorm, gate and up (their input), SiLU (the gate), the
    product (``silu(gate)`` and up), the down projection (the product): ``plan_model``'s
    :func:`~ssdtrain.planner.plan_model.llama_activation_bytes_per_layer` and
    :func:`~ssdtrain.planner.plan_model.layer_forward_flops` op by op."""
    sh = s * h
    if arch == "llama":
        kv = h * (kv_heads or a) // a
        f = ffn_hidden or -(-8 * h // 3 // 256) * 256
        attn = d * s * (h + 2 * kv) + d * sh + 4 * a * s + (0 if flash else a * s * s * d)
        return [(0.0, d * sh + 4 * s), (2.0 * sh * (h + 2 * kv), d * sh), (2.0 * s * sh, attn),
                (2.0 * sh * h, 0), (0.0, d * sh + 4 * s), (4.0 * sh * f, d * sh), (0.0, d * s * f),
                (0.0, 2 * d * s * f), (2.0 * sh * f, d * s * f)]
    attn_saves = 3 * d * sh
    if not flash:
        attn_saves += a * s * s * (d + ((1 + d) if dropout else 0))
    ops = [(0.0, d * sh), (6.0 * sh * h, d * sh), (4.0 * s * sh, attn_saves), (2.0 * sh * h, d * sh)]
    if dropout:
        ops.append((0.0, sh))
    ops += [(0.0, d * sh), (8.0 * sh * h, d * sh), (0.0, 4 * d * sh), (8.0 * sh * h, 4 * d * sh)]
    if dropout:
        ops.append((0.0, sh))
    return ops


def forward_flops(*, layers: int, seq: int, hidden: int, vocab: int, micro_batch: int = 1, head: bool = True,
                  arch: str = "gpt", heads: int = 1, kv_heads: int | None = None,
                  ffn_hidden: int | None = None) -> float:
    """Forward FLOPs of one micro-batch: ``b(L(24sh^2 + 4s^2h) + 2shV)``, the head's term if ``head``
    (``arch="llama"``: ``2sh(2h + 2kv + 3f) + 2s^2h`` a layer, ``kv = hidden x kv_heads / heads``);
    divide by measured forward seconds for the compute rate ``--tflops`` wants (x 1e-12)."""
    s, h = seq, hidden
    if arch == "llama":
        kv = h * (kv_heads or heads) // heads
        f = ffn_hidden or -(-8 * h // 3 // 256) * 256
        layer = 2.0 * s * h * (2 * h + 2 * kv + 3 * f) + 2.0 * s * s * h
    else:
        layer = 24.0 * s * h * h + 4.0 * s * s * h
    return micro_batch * (layers * layer + (2.0 * s * h * vocab if head else 0.0))


def saves(*, layers: int, seq: int, hidden: int, heads: int, vocab: int, micro_batch: int,
          dtype_bytes: int, flash: bool, dropout: bool, checkpoint: bool, head: bool,
          tflops: float, backward_tflops: float, arch: str = "gpt", kv_heads: int | None = None,
          ffn_hidden: int | None = None) -> tuple[list[Save], float, float]:
    """The saves of one micro-batch's forward through ``layers`` layers (and the head, if
    ``head``), in pack order, with forward's and backward's seconds (backward includes the
    recomputation under ``checkpoint``). ``arch``, ``kv_heads``, ``ffn_hidden``: :func:`_layer_ops`."""
    s, h, b, d = seq, hidden, micro_batch, dtype_bytes
    fwd = b / (tflops * 1e12)           # seconds per forward FLOP of one sequence
    bwd = 2 * b / (backward_tflops * 1e12)  # seconds of backward per forward FLOP
    ops = _layer_ops(s, h, heads, d, flash, dropout, arch=arch, kv_heads=kv_heads, ffn_hidden=ffn_hidden)
    layer_flops = sum(f for f, _ in ops)
    # (bytes, forward seconds of the op that saves it, backward seconds of that op); ``extra``: the
    # seconds backward spends before that op's own backward (recomputing a checkpointed layer).
    plan: list[tuple[int, float, float]] = [(8 * s * b, 0.0, 0.0)]  # the token ids
    extra: list[float] = [0.0]
    for _ in range(layers):
        if checkpoint:
            plan.append((d * s * b * h, layer_flops * fwd, layer_flops * bwd))
            extra.append(layer_flops * fwd)  # its backward recomputes the layer first
            continue
        for flops, nbytes in ops:
            plan.append((nbytes * b, flops * fwd, flops * bwd))
            extra.append(0.0)
    if head:
        head_flops = 2.0 * s * h * vocab
        plan += [(d * s * b * h, 0.0, 0.0), (d * s * b * h, head_flops * fwd, head_flops * bwd),
                 (4 * s * b * vocab, 0.0, 0.0), (8 * s * b, 0.0, 0.0)]
        extra += [0.0] * 4
    # Forward: an op packs its saves when it starts. Backward runs the ops in reverse; each needs
    # its saves when its backward (after any recomputation) starts.
    packed, t = [], 0.0
    for _, fsec, _ in plan:
        packed.append(t)
        t += fsec
    forward_s = t
    needed = [0.0] * len(plan)
    t = 0.0
    for i in range(len(plan) - 1, -1, -1):
        needed[i] = t
        t += extra[i] + plan[i][2]
    return [Save(n, p, u) for (n, _, _), p, u in zip(plan, packed, needed)], forward_s, t


@dataclass(frozen=True)
class DriveStep:
    """What the drive does with one micro-batch's saves (bytes per micro-batch)."""

    saved_bytes: int
    """Every save (what baseline keeps)."""
    eligible_bytes: int
    """Saves of ``min_bytes`` or more, less the one held at the end (never written)."""
    capacity_bytes: float
    """``min(B_write * T_forward, B_read * T_backward)``: what the drive could carry (under 1F1B,
    ``min(B_write, B_read) * (T_forward + T_backward)``)."""
    possible_bytes: float
    """``min(B_write * T_forward, saved)``: the most the peak could fall by (under 1F1B, with the
    slot in place of the forward)."""
    free_bytes: int
    """Written during forward and read back in time: the memory offloading frees, at no cost,
    before the peak: the peak's fall."""
    tail_bytes: int
    """Handed to the drive and not written when backward began: written, but not freed (none in
    a step: such writes are not made; under 1F1B, none either)."""
    written_bytes: int
    """``free_bytes + tail_bytes``: what the step writes."""
    kept_bytes: int
    """Everything else stays in memory (``saved_bytes - free_bytes``)."""
    read_wait_s: float
    """What backward would wait on reads if all the written saves were read back."""
    budget_bound: bool
    """Whether the write budget had to hold saves back (reads would not come in time)."""
    forward_s: float
    backward_s: float
    host_bytes: int = 0
    """Copied to the host tier before forward ended: freed (part of ``free_bytes``)."""
    spilled_bytes: int = 0
    """Saves the host tier had no room for, handed to the drive."""


def _queue(saves_: list[Save], eligible: list[int]) -> list[tuple[int, float]]:
    """The saves queued for writing, in queue order, with the time each is queued: a save is held
    until the next one of at least a quarter of its size (``WriteQueue.hold``); a smaller one is
    queued at once; the one held at the end is not queued."""
    queue: list[tuple[int, float]] = []
    held = None
    for i in eligible:
        if held is not None and 4 * saves_[i].nbytes < saves_[held].nbytes:
            queue.append((i, saves_[i].packed_s))
            continue
        if held is not None:
            queue.append((held, saves_[i].packed_s))
        held = i
    return queue


def _write(saves_: list[Save], queue: list[tuple[int, float]], forward_s: float, bps: float,
           handoff: int, deadline: float | None = None) -> list[float | None]:
    """Completion time of each queued write (None: still queued when backward began, or not made
    because it would end after ``deadline``)."""
    order = [i for i, _ in queue]
    done: list[float | None] = [None] * len(order)
    end = 0.0          # when the drive finishes what it was handed
    flight: list[tuple[float, int]] = []  # (end, bytes) of the writes handed over, oldest first
    inflight = 0
    for k, i in enumerate(order):
        # Handed over once the writes in flight are under ``handoff`` bytes (or none is left).
        t = queue[k][1]
        while flight and inflight >= handoff:
            t = max(t, flight[0][0])
            inflight -= flight.pop(0)[1]
        while flight and flight[0][0] <= t:
            inflight -= flight.pop(0)[1]
        if t > forward_s:
            break  # backward began: the rest is cancelled (a save's pack hands over before it ends)
        finish = max(end, t) + saves_[i].nbytes / bps
        if deadline is not None and finish > deadline:
            done[k] = math.inf  # not made: it would end after the peak; its save stays in memory
            continue
        end = done[k] = finish
        flight.append((finish, saves_[i].nbytes))
        inflight += saves_[i].nbytes
    return done


def _copy(saves_: list[Save], queue: list[tuple[int, float]], forward_s: float, bps: float,
          capacity: float) -> tuple[list[int], list[tuple[int, float]]]:
    """The host tier's share of ``queue`` (the module docstring's "host tier"): the saves copied
    before forward ends, and the queue of those it had no room for (the drive's)."""
    copied: list[int] = []
    spill: list[tuple[int, float]] = []
    end, used = 0.0, 0
    for i, t in queue:
        n = saves_[i].nbytes
        finish = max(end, t) + n / bps
        if t > forward_s or finish > forward_s:
            break  # due after forward's end: not copied, and the rest of forward is kept
        if used + n > capacity:
            spill.append((i, t))
            continue
        end, used = finish, used + n
        copied.append(i)
    return copied, spill


def _read_wait(saves_: list[Save], idx: list[int], bps: float, lead_s: float = 0.0) -> float:
    """Backward's wait if ``idx`` (pack order) are read back in reverse from ``lead_s`` before
    backward's start."""
    wait, t = 0.0, -lead_s
    for i in reversed(idx):
        t += saves_[i].nbytes / bps
        wait = max(wait, t - saves_[i].needed_s)
    return wait


def simulate(saves_: list[Save], *, forward_s: float, backward_s: float, write_bps: float, read_bps: float,
             handoff_bytes: int, min_bytes: int, pipelined: bool = False, host_bps: float = 0.0,
             host_capacity: float = 0) -> DriveStep:
    """What the offloader writes, frees and keeps of one micro-batch's ``saves_`` on a drive of
    ``write_bps`` / ``read_bps`` bytes per second (the rules in the module docstring), behind a
    host tier of ``host_bps`` and ``host_capacity`` bytes (0: none).

    ``pipelined``: the micro-batch is one of a 1F1B stage's in steady state, with others' slots
    between its forward and its backward (the module docstring's "1F1B")."""
    if not (write_bps > 0 and read_bps > 0 and handoff_bytes > 0 and min_bytes >= 0 and host_bps >= 0
            and host_capacity >= 0):
        raise ValueError(f"drive rates and handoff_bytes must be > 0, min_bytes and the host tier's figures >= 0, got "
                         f"write_bps={write_bps!r}, read_bps={read_bps!r}, handoff_bytes={handoff_bytes!r}, "
                         f"min_bytes={min_bytes!r}, host_bps={host_bps!r}, host_capacity={host_capacity!r}")
    eligible = [i for i, s in enumerate(saves_) if s.nbytes and s.nbytes >= min_bytes]
    queue = _queue(saves_, eligible)
    eligible_bytes = sum(saves_[i].nbytes for i, _ in queue)
    copied: list[int] = []
    tier = host_bps > 0 and host_capacity > 0
    if tier:
        copied, queue = _copy(saves_, queue, forward_s, host_bps, host_capacity)
    order = [i for i, _ in queue]
    total = sum(s.nbytes for s in saves_)
    # The writes' time: until backward begins; in a pipeline, one slot's share of the drive.
    until = forward_s + backward_s if pipelined else forward_s
    lead = forward_s if pipelined else 0.0  # reads start a slot early, as another forward runs
    done = _write(saves_, queue, until, write_bps, handoff_bytes, None if pipelined else forward_s)
    freed = [i for i, t in zip(order, done) if t is not None and t <= until]
    # A pipeline's micro-batch has no tail: a write past its slot's share takes the next one's.
    tail = 0 if pipelined else sum(saves_[i].nbytes for i, t in zip(order, done)
                                   if t is not None and until < t < math.inf)
    wait = _read_wait(saves_, freed, read_bps, lead)
    bound = False
    tolerance = max(MIN_DRIVE_STALL, DRIVE_BOUND * (forward_s + backward_s))
    if wait > tolerance:
        # The budget: the earliest saves, as many as come back in time; nothing else is queued.
        bound, tail = True, 0
        while freed and _read_wait(saves_, freed, read_bps, lead) > tolerance:
            freed.pop()
    host = sum(saves_[i].nbytes for i in copied)
    if copied:
        wait = max(wait, _read_wait(saves_, copied, host_bps, lead))
    written = sum(saves_[i].nbytes for i in freed)
    free = written + host
    host_possible = min(host_bps * forward_s, host_capacity) if tier else 0.0
    return DriveStep(
        saved_bytes=total, eligible_bytes=eligible_bytes,
        capacity_bytes=min(write_bps * until, read_bps * (backward_s + lead)),
        possible_bytes=min(write_bps * until + host_possible, total), free_bytes=free, tail_bytes=tail,
        written_bytes=written + tail, kept_bytes=total - free, read_wait_s=wait, budget_bound=bound,
        forward_s=forward_s, backward_s=backward_s, host_bytes=host, spilled_bytes=sum(saves_[i].nbytes for i in order),
    )


def drive_step(inp, mode: str, stages: int, micro_batch: int, *, head: bool | None = None,
               inflight: int = 1) -> DriveStep:
    """:func:`simulate` for ``inp`` (a :class:`ssdtrain.planner.plan.Inputs`): one micro-batch of the
    first of ``stages`` pipeline stages (the whole model, head included, when ``stages == 1``;
    under 1F1B otherwise), ``inflight`` micro-batches sharing the host tier."""
    if mode not in DRIVE_MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {DRIVE_MODES}")
    layers = math.ceil(inp.layers / stages)
    list_, fwd, bwd = saves(
        layers=layers, seq=inp.seq, hidden=inp.hidden, heads=inp.heads, vocab=inp.vocab, micro_batch=micro_batch,
        dtype_bytes=inp.dtype_bytes, flash=inp.flash, dropout=inp.dropout, checkpoint=mode != "offload",
        head=stages == 1 if head is None else head, tflops=inp.tflops,
        backward_tflops=inp.backward_tflops or inp.tflops, arch=inp.arch, kv_heads=inp.kv_heads,
        ffn_hidden=inp.ffn_hidden)
    return simulate(list_, forward_s=fwd, backward_s=bwd, write_bps=inp.drive_gbps * inp.drives * 1e9,
                    read_bps=inp.read_gbps * inp.drives * 1e9, handoff_bytes=inp.handoff_bytes * inp.drives,
                    min_bytes=inp.min_bytes, pipelined=stages > 1,
                    host_bps=inp.host_gbps * 1e9 if inp.host_tier else 0.0,
                    host_capacity=inp.host_gib * (1 << 30) / inflight if inp.host_tier else 0)


def _fits(inp, mode: str, p: int, b: int, m: int) -> tuple[float, DriveStep]:
    """Peak bytes per GPU at (p, b) when each micro-batch in flight frees what the host tier and the
    drive can take."""
    inflight = min(m, p)
    step = drive_step(inp, mode, p, b, inflight=inflight)
    if mode == "offload":
        layer_act = math.ceil(inp.layers / p) * inp.act_layer(b)
        return _stage_memory(inp, "offload", p, b, m, min(1.0, step.free_bytes / layer_act)), step
    return _stage_memory(inp, "recompute", p, b, m) - inflight * step.free_bytes, step


def _best(inp, mode: str) -> dict | None:
    usable = _usable_bytes(inp)
    best = None
    for p in _stage_counts(inp):
        dp = inp.gpus // p
        if inp.global_batch % dp:
            continue
        for b in _divisors(inp.global_batch // dp):
            cfg = evaluate(inp, "baseline" if mode == "offload" else "recompute", p, b)
            if cfg is None:
                continue
            memory, step = _fits(inp, mode, p, b, cfg.num_microbatches)
            if memory > usable:
                continue
            key = (float(f"{cfg.step_time_s:.9g}"), p, -b)
            if best is None or key < best[0]:
                best = (key, cfg, memory, step)
    if best is None:
        return None
    _, cfg, memory, step = best
    m = cfg.num_microbatches
    return {"stages": cfg.stages, "data_parallel": cfg.data_parallel, "micro_batch": cfg.micro_batch,
            "num_microbatches": m, "bubble_fraction": cfg.bubble_fraction, "memory_gib": memory / (1 << 30),
            "step_time_s": cfg.step_time_s, "free_bytes_per_step": step.free_bytes * m,
            "written_bytes_per_step": step.written_bytes * m, "saved_bytes_per_step": step.saved_bytes * m,
            "drive": asdict(step)}


def _max_micro_batch(inp, mode: str, p: int) -> int:
    usable = _usable_bytes(inp)
    if _fits(inp, mode, p, 1, p)[0] > usable:
        return 0
    lo, hi = 1, 2
    while hi < 1 << 20 and _fits(inp, mode, p, hi, p)[0] <= usable:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(inp, mode, p, mid, p)[0] <= usable else (lo, mid)
    return lo


def drive_limited(inp) -> dict:
    """The drive-limited section of the plan: per mode, at its fastest fitting configuration,
    the bytes a step offloads at no cost, the micro-batch and bubble that buys, and the drives
    needed to offload everything."""
    out: dict = {"drives": inp.drives, "write_gbps_per_drive": inp.drive_gbps, "read_gbps_per_drive": inp.read_gbps,
                 "handoff_bytes_per_drive": inp.handoff_bytes, "min_bytes": inp.min_bytes,
                 "host_gbps": inp.host_gbps if inp.host_tier else 0.0, "host_gib": inp.host_gib if inp.host_tier else 0.0}
    for mode in DRIVE_MODES:
        best = _best(inp, mode)
        row: dict = {"best": best, "max_micro_batch": None, "drives_for_full_offload": None}
        if best is not None:
            row["max_micro_batch"] = _max_micro_batch(inp, mode, best["stages"])
            one = inp.__class__(**{**asdict(inp), "drives": 1, "host_gbps": 0.0})  # a drive's own carry
            per_drive = drive_step(one, mode, best["stages"], best["micro_batch"]).capacity_bytes
            need = best["drive"]["saved_bytes"]
            row["drives_for_full_offload"] = math.ceil(need / per_drive) if per_drive > 0 else None
        out[mode] = row
    return out


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / MIB:.1f} MiB"


def format_drive(section: dict) -> list[str]:
    """Lines of the human-readable plan for :func:`drive_limited`'s section."""
    tier = (f"; host tier {section['host_gbps']:g} GB/s, {section['host_gib']:g} GiB per GPU in front of it"
            if section.get("host_gbps") else "; no host tier")
    lines = [f"drive-limited (at no cost: never waits on the drive): {section['drives']} drive(s) per GPU, "
             f"{section['write_gbps_per_drive']:g} GB/s write, {section['read_gbps_per_drive']:g} GB/s read each"
             + tier]
    for mode in DRIVE_MODES:
        row = section[mode]
        best = row["best"]
        if best is None:
            lines.append(f"  {mode}: does not fit at any configuration")
            continue
        d = best["drive"]
        share = d["free_bytes"] / d["saved_bytes"] if d["saved_bytes"] else 0.0
        possible = d["free_bytes"] / d["possible_bytes"] if d["possible_bytes"] else 0.0
        lines.append(
            f"  {mode}: the peak falls by {_gib(d['free_bytes'])} per micro-batch at no cost ({share:.0%} of "
            f"{_gib(d['saved_bytes'])} saved; {possible:.0%} of the possible {_gib(d['possible_bytes'])}, what the "
            f"{'host tier and the drive take' if section.get('host_gbps') else 'drive takes'} in "
            f"{'a slot' if best['stages'] > 1 else 'forward'}); "
            f"{_gib(best['free_bytes_per_step'])} of {_gib(best['saved_bytes_per_step'])} per step; "
            f"{best['stages']} stage(s), micro-batch {best['micro_batch']} (max {row['max_micro_batch']}), "
            f"bubble {best['bubble_fraction']:.1%}, {best['memory_gib']:.1f} GiB/GPU, step {best['step_time_s']:.3f}s")
        if best["stages"] > 1:
            carry = (f"per micro-batch (1F1B): drive could carry {_gib(d['capacity_bytes'])} = min(write, read) x "
                     f"slot {d['forward_s'] + d['backward_s']:.3f}s (forward {d['forward_s']:.3f}s + backward "
                     f"{d['backward_s']:.3f}s)")
        else:
            carry = (f"per micro-batch: drive could carry {_gib(d['capacity_bytes'])} = min(write x forward "
                     f"{d['forward_s']:.3f}s, read x backward {d['backward_s']:.3f}s)")
        if section.get("host_gbps"):
            lines.append(f"    host tier: {_gib(d['host_bytes'])} copied before the peak, {_gib(d['spilled_bytes'])} it "
                         "had no room for handed to the drive")
        lines.append(
            f"    {carry}; full offload needs {row['drives_for_full_offload']} drive(s) per GPU"
            + ("; reads would not come back in time: the write budget keeps the rest" if d["budget_bound"] else ""))
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The drive-limited model's flags on ``ssdtrain plan``'s parser."""
    ap.add_argument("--drives", type=int, default=1, help="drives per GPU, each of --drive-gbps (default 1)")
    ap.add_argument("--drive-read-gbps", type=float, default=None,
                    help="sustained read GB/s of one drive (default: --drive-gbps)")
    ap.add_argument("--backward-tflops", type=float, default=None,
                    help="achieved TFLOPS in backward (default: --tflops); with --tflops, the compute rate "
                    "measured on a machine (FLOPs of forward over its seconds, 2x that for backward)")
    ap.add_argument("--host-gbps", type=float, default=25.0,
                    help="the host tier's copy rate between a GPU and pinned host memory, GB/s each way (default 25: "
                    "PCIe 4.0 x16; an H100's PCIe 5.0 measured 54; `ssdtrain probe` measures it); 0: no host tier")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="pinned host memory per GPU for the tier (host_bytes; default 64: a quarter of 2 TB among 8 "
                    "GPUs, ssdtrain's default share); 0: no host tier")
    ap.add_argument("--node-host-gib", type=float, default=None, metavar="GIB",
                    help="pinned host memory of one node for the tier, all its GPUs together: each GPU's share is "
                    "this over --gpus-per-node (instead of --host-gib)")
    ap.add_argument("--gpus-per-node", type=int, default=None,
                    help="GPUs per node sharing --node-host-gib (default: --gpus, at most 8)")
    ap.add_argument("--min-bytes", type=int, default=1 << 20,
                    help="saves under this many bytes stay in memory (the offloader's min_bytes; default 1 MiB)")
    ap.add_argument("--handoff-mib", type=float, default=64.0,
                    help="MiB the offloader hands to one drive at once: 2 x chunk_bytes x io_threads "
                    "(default 64: 8 MiB chunks, 4 threads)")


def input_fields(args: argparse.Namespace) -> dict:
    """:class:`ssdtrain.planner.plan.Inputs` fields from :func:`add_arguments`'s flags."""
    if args.host_gib is not None and args.node_host_gib is not None:
        raise ValueError("give --host-gib (per GPU) or --node-host-gib (per node), not both")
    return {"drives": args.drives, "drive_read_gbps": args.drive_read_gbps, "backward_tflops": args.backward_tflops,
            "min_bytes": args.min_bytes, "handoff_bytes": int(args.handoff_mib * MIB), "host_gbps": args.host_gbps,
            "host_gib": 64.0 if args.host_gib is None else args.host_gib, "node_host_gib": args.node_host_gib,
            "gpus_per_node": args.gpus_per_node}
