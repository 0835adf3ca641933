"""``ssdtrain bench --max-seq``: the longest sequence each mode trains, and its step time there.

For each mode the sequence length doubles from ``start`` until a step does not fit, then
bisection narrows the limit to an eighth of the longest length that fit. Each probe is a child
process (a fresh model at that length, a warm-up step and a measured one), so a failure leaves
nothing behind in the parent. What "fits" means:

* on a GPU, the step ran: a real out-of-memory (``torch.OutOfMemoryError``) is a failure; with
  ``--memory-budget`` the child caps its caching allocator at that size first
  (``torch.cuda.set_per_process_memory_fraction``), so the out-of-memory comes at the budget: the
  search at a whole GPU's memory runs to sequences whose steps take minutes (attention's s^2);
* on the CPU, where memory is virtual and plentiful, the step's measured peak is within
  ``--memory-budget``: the child's resident-set growth over the step (sampled every 2 ms, with
  every allocation of 64 KiB or more its own mapping, returned when freed: Note [memory in a
  child process]; at 1 MiB the same probe measured 47 and 75 MiB of growth twice in a row) plus
  the model's weights and AdamW state, which were resident before the step began. It is
  labelled as such in the report. A step over the budget is stopped where it passes it, as a
  GPU's would fail there (Note [a CPU probe stops at its budget]).

The model is the bench's GPT with a chunked loss (``GPTConfig.loss_chunk``: one chunk's logits
at a time; the whole logits would dominate at long sequences) and, by default, a realistic depth
(with checkpointing a step holds every block's input plus one recomputed block, so the depth
sets what offloading the inputs buys: about ``(L x input + block) / block``). At recompute's
longest sequence, recompute and recompute+offload then run side by side, alternated, for the
step-time ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["LLAMA_MAX_SEQ_MODES", "MAX_SEQ_MODES", "MaxSeqArgs", "base_mode", "cpu_model", "gpu_model", "search",
           "run_probe", "describe", "measure_blocks", "run_max_seq", "format_max_seq", "plot_max_seq"]

MAX_SEQ_MODES = ("baseline", "recompute", "offload", "recompute+offload")
LLAMA_MAX_SEQ_MODES = ("recompute", "recompute+tiled", "recompute+offload", "recompute+offload+tiled")
"""``--model llama``'s default modes: ALST's recipe (checkpointing, the MLP tiled) without and
with offloading, beside checkpointing alone and checkpointing with offloading."""
TILED = "+tiled"
"""A mode name's suffix: the bench mode before it, every block's MLP tiled along the sequence
(:func:`ssdtrain.bench.models.tile_mlps`)."""
MMAP_THRESHOLD = 64 << 10
# Note [a probe's allocator does not fragment]: on a GPU a probe's child runs with expandable
# segments (unless PYTORCH_CUDA_ALLOC_CONF says otherwise), so that its out-of-memory comes at the
# memory the mode needs, not at the caching allocator's fragmentation: on an H200 (2026-11-27,
# a 6 GiB cap) recompute's limit was 32768 tokens with 0.5-1 GiB reserved but unallocated at each
# failure, and 40960 with expandable segments. Only the child's allocator: nothing in the caller.
ALLOC_CONF = "expandable_segments:True"
MIB = 1 << 20


def cpu_model(arch: str = "gpt"):
    """The CPU's default: 32 blocks, hidden 64 (attention's s^2 work bounds what 2 cores can
    search in minutes: a step at 2k tokens takes seconds). ``arch="llama"``: the Llama-shaped
    decoder at the same depth and width (4 query heads sharing 1 key/value head, SwiGLU of 224)."""
    from ssdtrain.bench.models import GPTConfig, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab=256, seq=512, layers=32, hidden=64, heads=4, loss_chunk=1024)
    return GPTConfig(vocab=256, seq=512, layers=32, hidden=64, heads=2, loss_chunk=1024)


def gpu_model(arch: str = "gpt"):
    """A GPU's default: 24 blocks of the bench's GPU width (about 1.2 B parameters);
    ``arch="llama"``: 32 Llama-shaped blocks of hidden 2048 (16 query heads, 4 key/value heads,
    SwiGLU of 7168, vocabulary 32768: about 1.9 B parameters)."""
    from ssdtrain.bench.models import GPTConfig, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab=32768, seq=2048, layers=32, hidden=2048, heads=16, loss_chunk=4096)
    return GPTConfig(vocab=32768, seq=2048, layers=24, hidden=2048, heads=16, loss_chunk=4096)


def base_mode(mode: str) -> tuple[str, bool]:
    """``(bench mode, tiled)`` of a max-seq mode name (``recompute+offload+tiled``:
    ``("recompute+offload", True)``)."""
    return (mode[:-len(TILED)], True) if mode.endswith(TILED) else (mode, False)


def arch_of(cfg) -> str:
    from ssdtrain.bench.models import LlamaConfig

    return "llama" if isinstance(cfg, LlamaConfig) else "gpt"


def _config(arch: str, fields: dict):
    from ssdtrain.bench.models import GPTConfig, LlamaConfig

    return (LlamaConfig if arch == "llama" else GPTConfig)(**fields)


@dataclasses.dataclass(kw_only=True)
class MaxSeqArgs:
    model: Any  # GPTConfig or LlamaConfig; its ``seq`` is replaced by each probe's
    device: str = "cpu"
    dtype: str = "float32"
    batch: int = 1
    modes: tuple[str, ...] = MAX_SEQ_MODES
    budget_bytes: int | None = None  # the CPU's budget; on a GPU a cap on the allocator (None: all its memory)
    start: int = 256
    limit: int = 1 << 20
    path: str | None = None
    pairs: int = 2  # alternated rounds (recompute and each other recompute mode) at recompute's longest sequence
    tile_tokens: int | None = None  # the +tiled modes' MLP tile (positions); None: the hidden size (ALST's default)
    bound: bool = True  # measure one block's bytes at recompute's longest, untiled and tiled, for the bound
    progress: Callable[[str], None] | None = None
    partial: Callable[[dict], None] | None = None  # given the probes so far after each one (a search cut off keeps them)

    def head(self) -> dict:
        """What a ``--json`` file says of the setup, before its probes."""
        return {"model": dataclasses.asdict(self.model), "arch": arch_of(self.model), "device": self.device,
                "dtype": self.dtype, "batch": self.batch, "budget_bytes": self.budget_bytes,
                "tile_tokens": self.tile_tokens or self.model.hidden}


def probe_in_child(spec: dict) -> dict:
    """One probe: ``{"seq", "fits", "peak_bytes", "step_s", "oom", "error"}``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    if spec["device"].startswith("cuda"):
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # Note [a probe's allocator does not fragment]
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", "ssdtrain.bench.maxseq"], input=json.dumps(spec),
                          capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # A process killed for memory (the kernel's OOM killer) is a failure to fit, said so.
        return {"seq": spec["model"]["seq"], "fits": False, "oom": proc.returncode < 0, "peak_bytes": None,
                "step_s": None, "error": (proc.stderr or "")[-2000:] or f"exit status {proc.returncode}"}
    return json.loads(lines[-1])


def _child(spec: dict) -> dict:
    import torch

    from ssdtrain.bench import _device
    from ssdtrain.bench._measure import RssSampler
    from ssdtrain.bench.models import make_model, tile_mlps
    from ssdtrain.bench.modes import Mode, offloader_factory

    cfg = _config(spec.get("arch", "gpt"), spec["model"])
    name, tiled = base_mode(spec["mode"])
    dev = _device.resolve_device(spec["device"])  # "cuda" gets its index: the memory fraction's calls want one
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    out: dict[str, Any] = {"seq": cfg.seq, "fits": False, "oom": False, "peak_bytes": None, "step_s": None,
                           "error": None}
    sampler = RssSampler()
    try:
        if dev.type == "cuda" and spec["budget"] is not None:  # at most the GPU's memory: the command checks it
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(spec["budget"] / total, dev)
        model = make_model(cfg).to(dtype).to(dev)
        if tiled:
            tile_mlps(model, spec.get("tile_tokens"))
        mode = Mode(name, model, offloader_factory(spec.get("path"), None))
        tokens = torch.randint(0, cfg.vocab, (spec["batch"], cfg.seq), device=dev)
        out["per_step"] = steps = []
        cpu_budget = spec["budget"] if dev.type == "cpu" else None

        def held() -> int:
            """What the model holds between steps: weights, optimizer state and gradients."""
            return sum(p.numel() * p.element_size() + (0 if p.grad is None else p.grad.numel() * p.grad.element_size())
                       for p in mode.model.parameters()) + _state_bytes(mode.opt)

        def step(slack: float = 1.0) -> float:
            """One step, its record appended to ``steps`` first (an out-of-memory leaves it there,
            partial); returns its seconds. On the CPU the sampler measures its resident growth, and
            with a budget it stops the probe once the step is over ``slack`` times it (Note [a CPU
            probe stops at its budget])."""
            rec: dict[str, Any] = {"step": len(steps) + 1}
            steps.append(rec)
            # as users do each step: the engine must not rely on the peak's age
            rec["start_bytes"] = _device.reset_memory_peaks(dev)
            before = mode.off.stats() if mode.off is not None else None
            rec["held_bytes"] = holding = held()
            sampler.start(None if cpu_budget is None else int(cpu_budget * slack) - holding,
                          lambda growth: _over_budget(out, rec, holding, growth, slack))
            try:
                t0 = time.perf_counter()
                mode.forward_backward(tokens, tokens)
                _device.synchronize(dev)
                rec["step_s"] = time.perf_counter() - t0
                return rec["step_s"]
            finally:
                rec["growth_bytes"] = sampler.stop()
                rec["peak_bytes"] = _device.memory_peaks(dev)["max_memory_allocated_bytes"]
                if before is not None:
                    rec.update(_where_saves_went(mode, before))

        if cpu_budget is not None:  # Note [a CPU probe stops at its budget]: first-time costs out of its steps
            short = tokens[:, :PRE_WARM_TOKENS]  # without the offloader, which would learn its forward
            mode.forward_backward(short, short, hooks=contextlib.nullcontext())
        step(WARMUP_SLACK)  # warm-up: the first step pays its first allocations
        mode.drain()
        while len(steps) < WARMUP_MAX and _learning(mode):  # Note [a probe measures the steady state]
            step(WARMUP_SLACK)
            mode.drain()
        mode.opt.zero_grad(set_to_none=True)
        out["step_s"] = step()
        # with no gradients, what the model held before the step: its weights and AdamW state
        growth, model_bytes = steps[-1]["growth_bytes"], steps[-1]["held_bytes"]
        mode.drain()
        if "host_copied_bytes" in steps[-1]:
            out["offload"] = steps[-1]
        if dev.type == "cuda":
            out["peak_bytes"] = steps[-1]["peak_bytes"]
            out["fits"] = True
        else:
            out["peak_bytes"] = (growth or 0) + model_bytes
            out["model_bytes"], out["growth_bytes"] = model_bytes, growth
            out["fits"] = spec["budget"] is None or out["peak_bytes"] <= spec["budget"]
        out["start_bytes"] = steps[-1]["start_bytes"]
        mode.close()
    except torch.OutOfMemoryError as exc:
        out["oom"], out["error"] = True, f"step {len(out.get('per_step') or [])}: " + str(exc).splitlines()[0]
    finally:
        sampler.close()
    return out


def _state_bytes(opt) -> int:
    """The optimizer state's bytes (AdamW's two moments a parameter, and its step counts)."""
    import torch

    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


# Note [a CPU probe stops at its budget]: on a GPU a step over the budget fails at the allocation
# that passes it (the memory fraction), partway through. A CPU probe does the same: the sampling
# thread, once the step's resident growth plus what the model held before it passes the budget,
# writes the probe's result (does not fit, the growth seen so far) and ends the process at once,
# instead of finishing a step that could take minutes at a length already known not to fit (the
# warm-up too, as on a GPU, with the slack below). The offloader's files need no cleanup (they are
# unlinked at creation: ssdtrain/store/_arena.py), and the parent reads the line as it reads any.
# A first step costs more than the steps after it, whatever its length: the optimizer's state,
# lazy imports, thread pools (the Llama model's first step at 4096 tokens grew 21 MiB more than its
# second, 13 of them AdamW's moments). So a CPU probe with a budget first takes one step of
# PRE_WARM_TOKENS, unmeasured and without the offloader (whose write rule learns how long a
# forward takes: a 64-token forward taught it that a 4096-token one ends at once, and it kept all
# 35 MiB of checkpoints). The warm-up at the probe's length still pays first costs at that length:
# at 4096 tokens its peak was 6 MiB (recompute) and 14 MiB (recompute+offload+tiled: 46 against
# 32) over the measured step's. So a warm-up is stopped only at WARMUP_SLACK times the budget (a
# length that does not fit by that much is known not to fit), and the measured step at the budget.
PRE_WARM_TOKENS = 64
WARMUP_SLACK = 1.5


def _over_budget(out: dict, rec: dict, held: int, growth: int, slack: float) -> None:
    result = {"seq": out["seq"], "fits": False, "oom": False, "over_budget": True, "step_s": None,
              "peak_bytes": held + growth, "growth_bytes": growth, "held_bytes": held, "stopped_at_step": rec["step"],
              "error": f"step {rec['step']}: resident growth {growth >> 20} MiB over what the model held "
                       f"({held >> 20} MiB) passed " + ("the budget" if slack == 1 else f"{slack} times the budget")
                       + "; stopped there"}
    os.write(1, (json.dumps(result) + "\n").encode())
    os._exit(0)


def _where_saves_went(mode, before) -> dict:
    """A step's offloading, in bytes: where its saves went (the host tier, the drives, kept on
    the device), and the tier's state: so that a probe whose peak is not what the mode
    promises says why (H200, 2026-11-27: recompute+offload's peak grew 47 KB a token where the
    block inputs it offloads are 48 of recompute's 60)."""
    after = mode.off.stats()
    diff = {f: getattr(after, f) - getattr(before, f)
            for f in ("saved_bytes", "unique_bytes", "host_copied_bytes", "written_bytes", "spilled_bytes",
                      "kept_bytes", "budget_kept_bytes", "peak_kept_bytes")}
    diff["drive_bytes"] = diff.pop("written_bytes") - diff["host_copied_bytes"]
    diff.update(host_tier_pinned_bytes=after.host_tier_pinned_bytes, host_tier_peak_bytes=after.host_tier_peak_bytes,
                peak_resident_bytes=after.peak_resident_bytes)
    tier = getattr(mode.off, "_tier", None)
    if tier is not None:  # the copy clock as this step's forward began (0: the forward measured copying nothing)
        clock = tier.clock
        diff.update(copy_limit_bytes=clock.limit, copy_deferred=clock.deferred, copy_rate=clock.rate,
                    host_tier_wanted_bytes=tier.pool.wanted if tier.pool is not None else None)
    return diff


# Note [a probe measures the steady state]: an offloader with the host tier learns its copy
# budget over its first steps (the copy rate, measured once the first pinned slab is in; then a
# forward measured with no copy where the device has room: Note [the reference forward needs
# room]), so a probe's measured step comes after that: at most ``WARMUP_MAX`` warm-up steps. On an
# H200 (2026-11-27) a probe with one warm-up measured the forward that copies nothing: its peak was
# recompute's.
WARMUP_MAX = 5


def _learning(mode) -> bool:
    """Whether ``mode``'s host tier is still learning its copy budget, or its pool is still being
    pinned up to what a step asked of it (Note [the pool grows to its demand])."""
    tier = getattr(mode.off, "_tier", None)
    if tier is None or tier.pool is None:
        return False
    clock, pool = tier.clock, tier.pool
    growing = pool.pinned < min(pool.wanted, pool.capacity) and pool.error is None
    return clock.rate is None or clock.ratio is None and not clock.deferred or growing


def _blocks_child(spec: dict) -> dict:
    """One block's bytes at ``seq`` tokens: its input, and what its recomputation and backward
    hold (``torch.utils.checkpoint`` of the block, then backward from a gradient of its output),
    untiled and with its MLP tiled: the peak over ``reps`` runs, after one warm-up each; plus the
    output's gradient, which exists while a block runs backward in a model."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from ssdtrain.bench import _device
    from ssdtrain.bench._measure import RssSampler
    from ssdtrain.bench.models import make_model, tile_mlps

    cfg = _config(spec.get("arch", "gpt"), spec["model"]).replace(layers=1)
    dev = _device.resolve_device(spec["device"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    torch.manual_seed(0)
    model = make_model(cfg).to(dtype).to(dev)
    block = model.blocks[0]
    b, s, h = spec["batch"], cfg.seq, cfg.hidden
    x = torch.randn(b, s, h, dtype=dtype, device=dev, requires_grad=True)
    g = torch.randn(b, s, h, dtype=dtype, device=dev)
    out = {"seq": s, "input_bytes": x.numel() * x.element_size()}
    sampler = RssSampler()
    try:
        for key in ("block_bytes", "block_tiled_bytes"):
            if key == "block_tiled_bytes":
                tile_mlps(model, spec.get("tile_tokens"))
            peaks = []
            for rep in range(spec.get("reps", 3) + 1):
                block.zero_grad(set_to_none=True)
                x.grad = None
                start = _device.reset_memory_peaks(dev)
                sampler.start()
                y = checkpoint(block, x, use_reentrant=False)
                y.backward(g)
                _device.synchronize(dev)
                growth = sampler.stop()
                del y
                if dev.type == "cuda":
                    growth = _device.memory_peaks(dev)["max_memory_allocated_bytes"] - start
                if rep:  # the first is a warm-up
                    peaks.append(growth or 0)
            out[key] = max(peaks) + g.numel() * g.element_size()
            out[key + "_runs"] = peaks
    finally:
        sampler.close()
    return out


def measure_blocks(args: MaxSeqArgs, seq: int, reps: int = 3) -> dict:
    """One block's bytes at ``seq`` tokens (a child process: :func:`_blocks_child`), and the bound
    they set on what offloading the inputs and tiling the MLP buy over checkpointing alone:
    ``(L x input + block) / block_tiled`` (checkpointing holds every block's input and one
    recomputed block; with the inputs offloaded and the MLP tiled, one tiled block)."""
    spec = {"kind": "blocks", "model": dataclasses.asdict(args.model.replace(seq=seq)), "arch": arch_of(args.model),
            "device": args.device, "dtype": args.dtype, "batch": args.batch, "tile_tokens": args.tile_tokens,
            "reps": reps}
    r = probe_in_child(spec)
    if "block_bytes" not in r:
        return {"seq": seq, "error": r.get("error")}
    layers = args.model.layers
    r["layers"] = layers
    r["bound"] = (layers * r["input_bytes"] + r["block_bytes"]) / r["block_tiled_bytes"]
    r["bound_untiled"] = (layers * r["input_bytes"] + r["block_bytes"]) / r["block_bytes"]
    return r


def search(mode: str, probe: Callable[[str, int], dict], start: int, limit: int) -> tuple[int | None, list[dict]]:
    """The longest sequence ``probe(mode, seq)`` fits at: doubling from ``start``, then bisection
    to an eighth of the longest that fit (in multiples of 16). Returns it (``None``: not even
    ``start``) and every probe."""
    probes: list[dict] = []
    lo = hi = None
    seq = start
    while seq <= limit:
        r = probe(mode, seq)
        probes.append(r)
        if not r["fits"]:
            hi = seq
            break
        lo, seq = seq, seq * 2
    if lo is None or hi is None:
        return lo, probes
    while hi - lo > max(16, lo // 8):
        mid = (lo + hi) // 2 // 16 * 16
        if mid <= lo:
            break
        r = probe(mode, mid)
        probes.append(r)
        lo, hi = (mid, hi) if r["fits"] else (lo, mid)
    return lo, probes


def run_probe(args: MaxSeqArgs, mode: str, seq: int) -> dict:
    """One probe of ``mode`` at ``seq`` tokens with ``args``' model, device and budget (a child
    process: :func:`probe_in_child`); its result, with ``mode``."""
    spec = {"model": dataclasses.asdict(args.model.replace(seq=seq)), "arch": arch_of(args.model), "mode": mode,
            "device": args.device, "dtype": args.dtype, "batch": args.batch, "budget": args.budget_bytes,
            "path": args.path, "tile_tokens": args.tile_tokens}
    return dict(probe_in_child(spec), mode=mode)


def describe(r: dict) -> str:
    """A probe's result in a line."""
    peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / MIB:.0f} MiB"
    step = "-" if r.get("step_s") is None else f"{r['step_s']:.2f}s"
    if r.get("over_budget"):
        peak = f"over {peak} when stopped in step {r['stopped_at_step']}"
    line = f"{r['mode']} seq {r['seq']}: {'fits' if r['fits'] else 'does not fit'} (peak {peak}, step {step})"
    off = r.get("offload")
    if off:  # where the measured step's saves went
        line += (f"; saved {off['unique_bytes'] / MIB:.0f} MiB: tier {off['host_copied_bytes'] / MIB:.0f}, drive "
                 f"{off['drive_bytes'] / MIB:.0f}, kept {off['kept_bytes'] / MIB:.0f} MiB; tier pinned "
                 f"{off['host_tier_pinned_bytes'] / MIB:.0f} MiB")
    return line


def run_max_seq(args: MaxSeqArgs) -> dict:
    """Searches each mode's longest sequence; returns the ``--json`` structure (``max_seq``: a list
    of ``{"mode", "max_seq", "step_s"}``)."""
    say = args.progress or (lambda text: None)
    head = args.head()

    def probe(mode: str, seq: int) -> dict:
        r = run_probe(args, mode, seq)
        say(describe(r))
        done.append(r)
        if args.partial is not None:
            args.partial({**head, "partial": True, "probes": done})
        return r

    rows, probes, done = [], [], []
    for mode in args.modes:
        longest, tried = search(mode, probe, args.start, args.limit)
        probes += tried
        at = [p for p in tried if p["fits"] and p["seq"] == longest]
        rows.append({"mode": mode, "max_seq": longest, "step_s": at[0]["step_s"] if at else None,
                     "peak_bytes": at[0]["peak_bytes"] if at else None, "hit_limit": longest == args.limit})
    result: dict[str, Any] = {**head, "max_seq": rows, "probes": probes}
    found = {r["mode"]: r for r in rows}
    rec = found.get("recompute")
    others = [m for m in args.modes if m != "recompute" and base_mode(m)[0] in ("recompute", "recompute+offload")
              and found[m]["max_seq"]]
    if rec and rec["max_seq"] and others:
        seq = rec["max_seq"]
        times: dict[str, list] = {m: [] for m in ["recompute"] + others}
        misfits: dict[str, list] = {m: [] for m in others}
        for i in range(args.pairs):  # alternated rounds: the machine's noise hits every mode alike
            order = ["recompute"] + others
            round_: dict[str, float | None] = {}
            for mode in (order if i % 2 == 0 else order[::-1]):
                r = probe(mode, seq)
                round_[mode] = r["step_s"] if r["fits"] else None
                if not r["fits"] and mode != "recompute":
                    misfits[mode].append(mode)
            for mode in order:
                times[mode].append(round_[mode])
        every = {}
        for m in others:
            ratios = [t / r for t, r in zip(times[m], times["recompute"]) if t and r]
            # A mode that fits a length in the search and not a shorter one here has no longest
            # sequence (H200, 2026-11-27: recompute+offload trained 65536 tokens, then ran out of
            # memory at 40960): said, not hidden in a missing ratio.
            every[m] = {"seq": seq, "seq_ratio": found[m]["max_seq"] / seq, "step_ratios": ratios,
                        "step_ratio": statistics.median(ratios) if ratios else None, "did_not_fit": misfits[m]}
        rec_times = [t for t in times["recompute"] if t]
        result["recompute_step_per_token_s"] = statistics.median(rec_times) / (seq * args.batch) if rec_times else None
        result["vs_recompute_all"] = every
        headline = next((m for m in ("recompute+offload+tiled", "recompute+offload") if m in every), others[0])
        result["vs_recompute"] = dict(every[headline], mode=headline)
        if args.bound and any(base_mode(m)[1] for m in args.modes):
            blocks = measure_blocks(args, seq)
            say(f"per block at {seq} tokens: " + _blocks_line(blocks))
            result["blocks"] = blocks
    return result


def _blocks_line(b: dict) -> str:
    if "bound" not in b:
        return f"not measured ({(b.get('error') or '')[-300:]})"
    return (f"input {b['input_bytes'] / MIB:.2f} MiB, block {b['block_bytes'] / MIB:.2f} MiB, block tiled "
            f"{b['block_tiled_bytes'] / MIB:.2f} MiB; bound (L x input + block) / block_tiled = "
            f"({b['layers']} x {b['input_bytes'] / MIB:.2f} + {b['block_bytes'] / MIB:.2f}) / "
            f"{b['block_tiled_bytes'] / MIB:.2f} = x{b['bound']:.2f} (untiled: / block = x{b['bound_untiled']:.2f})")


def format_max_seq(result: dict) -> str:
    m = result["model"]
    on_gpu = str(result["device"]).startswith("cuda")
    cap = f" capped at {result['budget_bytes'] / MIB:.0f} MiB" if result["budget_bytes"] else ""
    cap += f", PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ALLOC_CONF)}"
    limit = (f"the GPU's memory{cap} (a real out-of-memory in a child process)" if on_gpu else
             f"a memory budget of {result['budget_bytes'] / MIB:.0f} MiB: the step's resident growth plus the model's "
             "weights and AdamW state, measured in a child process (on the CPU, memory is not the limit: this stands "
             "for it)")
    if result.get("arch") == "llama":
        cfg = _config("llama", m)  # its key/value heads and MLP width, defaults resolved
        shape = (f"Llama-shaped, {m['layers']} blocks, hidden {m['hidden']}, {m['heads']} query heads / {cfg.n_kv} "
                 f"key-value heads, SwiGLU {cfg.n_ffn}, RMSNorm, RoPE, {'tied' if m['tie'] else 'untied'} head")
    else:
        shape = f"{m['layers']} blocks, hidden {m['hidden']}, {m['heads']} heads"
    tiles = (f"; +tiled: MLP tiles of {result['tile_tokens']} tokens" if any(r["mode"].endswith(TILED)
             for r in result["max_seq"]) and result.get("tile_tokens") else "")
    lines = [f"longest sequence per mode: {shape}, vocab {m['vocab']}, loss in chunks of {m['loss_chunk']} tokens"
             f"{tiles}; batch {result['batch']}, {result['dtype']}, {result['device']}; limit: {limit}", ""]
    every = result.get("vs_recompute_all") or {}
    rows = [("mode", "longest seq", "x recompute", "step there", "peak there", "step at rec. longest")]
    rec_seq = (result.get("vs_recompute") or {}).get("seq")
    for r in result["max_seq"]:
        vs_r = every.get(r["mode"])
        at = ("x1.00" if r["mode"] == "recompute" and every else
              "-" if not vs_r or vs_r["step_ratio"] is None else f"x{vs_r['step_ratio']:.2f}")
        rows.append((r["mode"], "-" if r["max_seq"] is None else f"{r['max_seq']}" + ("+" if r["hit_limit"] else ""),
                     "-" if not rec_seq or not r["max_seq"] else f"x{r['max_seq'] / rec_seq:.2f}",
                     "-" if r["step_s"] is None else f"{r['step_s']:.2f}s",
                     "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:.0f} MiB", at))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    vs = result.get("vs_recompute")
    if vs:
        name = vs.get("mode", "recompute+offload")
        step = "-" if vs["step_ratio"] is None else f"x{vs['step_ratio']:.2f}"
        per_token = result.get("recompute_step_per_token_s")
        lines += ["", f"{name} trains x{vs['seq_ratio']:.2f} the sequence of recompute within the same "
                  f"limit; at recompute's longest ({vs['seq']}), its step is {step} of recompute's (median of "
                  f"{len(vs['step_ratios'])} alternated pairs)" +
                  (f"; recompute's step there: {per_token * 1e3:.2f} ms a token" if per_token else "")]
        blocks = result.get("blocks")
        if blocks:
            lines.append(f"per block at {blocks['seq']} tokens (measured): " + _blocks_line(blocks))
            if "bound" in blocks:
                lines.append(f"{name} reaches {vs['seq_ratio'] / blocks['bound']:.0%} of the bound")
        for mode, v in (every or {name: vs}).items():
            if v.get("did_not_fit"):
                lines.append(f"NOT SETTLED: {mode} did not fit at {v['seq']} tokens in {len(v['did_not_fit'])} of "
                             "the side-by-side probes, though the search found it training as long or longer")
    return "\n".join(lines)


def plot_max_seq(result: dict, path: str) -> None:
    """Sequence length against step time, per mode (the probes that fit)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode in dict.fromkeys(p["mode"] for p in result["probes"]):
        pts = sorted({p["seq"]: p["step_s"] for p in result["probes"] if p["mode"] == mode and p["fits"]}.items())
        if pts:
            ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("step time (s)")
    ax.set_title("longest sequence per mode: where each line ends")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    spec = json.loads(sys.stdin.read())
    sys.stdout.write(json.dumps(_blocks_child(spec) if spec.get("kind") == "blocks" else _child(spec)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
