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
  labelled as such in the report.

The model is the bench's GPT with a chunked loss (``GPTConfig.loss_chunk``: one chunk's logits
at a time; the whole logits would dominate at long sequences) and, by default, a realistic depth
(with checkpointing a step holds every block's input plus one recomputed block, so the depth
sets what offloading the inputs buys: about ``(L x input + block) / block``). At recompute's
longest sequence, recompute and recompute+offload then run side by side, alternated, for the
step-time ratio.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["MAX_SEQ_MODES", "MaxSeqArgs", "cpu_model", "gpu_model", "search", "run_probe", "describe", "run_max_seq",
           "format_max_seq", "plot_max_seq"]

MAX_SEQ_MODES = ("baseline", "recompute", "offload", "recompute+offload")
MMAP_THRESHOLD = 64 << 10
# Note [a probe's allocator does not fragment]: on a GPU a probe's child runs with expandable
# segments (unless PYTORCH_CUDA_ALLOC_CONF says otherwise), so that its out-of-memory comes at the
# memory the mode needs, not at the caching allocator's fragmentation: on an H200 (2026-11-27,
# a 6 GiB cap) recompute's limit was 32768 tokens with 0.5-1 GiB reserved but unallocated at each
# failure, and 40960 with expandable segments. Only the child's allocator: nothing in the caller.
ALLOC_CONF = "expandable_segments:True"
MIB = 1 << 20


def cpu_model():
    """The CPU's default: 32 blocks, hidden 64 (attention's s^2 work bounds what 2 cores can
    search in minutes: a step at 2k tokens takes seconds)."""
    from ssdtrain.bench.models import GPTConfig

    return GPTConfig(vocab=256, seq=512, layers=32, hidden=64, heads=2, loss_chunk=1024)


def gpu_model():
    """A GPU's default: 24 blocks of the bench's GPU width (about 1.2 B parameters)."""
    from ssdtrain.bench.models import GPTConfig

    return GPTConfig(vocab=32768, seq=2048, layers=24, hidden=2048, heads=16, loss_chunk=4096)


@dataclasses.dataclass(kw_only=True)
class MaxSeqArgs:
    model: Any  # GPTConfig; its ``seq`` is replaced by each probe's
    device: str = "cpu"
    dtype: str = "float32"
    batch: int = 1
    modes: tuple[str, ...] = MAX_SEQ_MODES
    budget_bytes: int | None = None  # the CPU's budget; on a GPU a cap on the allocator (None: all its memory)
    start: int = 256
    limit: int = 1 << 20
    path: str | None = None
    pairs: int = 2  # alternated recompute / recompute+offload pairs at recompute's longest sequence
    progress: Callable[[str], None] | None = None
    partial: Callable[[dict], None] | None = None  # given the probes so far after each one (a search cut off keeps them)

    def head(self) -> dict:
        """What a ``--json`` file says of the setup, before its probes."""
        return {"model": dataclasses.asdict(self.model), "device": self.device, "dtype": self.dtype,
                "batch": self.batch, "budget_bytes": self.budget_bytes}


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
    from ssdtrain.bench.models import GPT, GPTConfig
    from ssdtrain.bench.modes import Mode, offloader_factory

    cfg = GPTConfig(**spec["model"])
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
        mode = Mode(spec["mode"], GPT(cfg).to(dtype).to(dev), offloader_factory(spec.get("path"), None))
        tokens = torch.randint(0, cfg.vocab, (spec["batch"], cfg.seq), device=dev)
        out["per_step"] = steps = []

        def step() -> float:
            """One step, its record appended to ``steps`` first (an out-of-memory leaves it there,
            partial); returns its seconds."""
            rec: dict[str, Any] = {"step": len(steps) + 1}
            steps.append(rec)
            # as users do each step: the engine must not rely on the peak's age
            rec["start_bytes"] = _device.reset_memory_peaks(dev)
            before = mode.off.stats() if mode.off is not None else None
            try:
                t0 = time.perf_counter()
                mode.forward_backward(tokens, tokens)
                _device.synchronize(dev)
                rec["step_s"] = time.perf_counter() - t0
                return rec["step_s"]
            finally:
                rec["peak_bytes"] = _device.memory_peaks(dev)["max_memory_allocated_bytes"]
                if before is not None:
                    rec.update(_where_saves_went(mode, before))

        step()  # warm-up: the first step pays its first allocations
        mode.drain()
        while len(steps) < WARMUP_MAX and _learning(mode):  # Note [a probe measures the steady state]
            step()
            mode.drain()
        model_bytes = sum(p.numel() * p.element_size() for p in mode.model.parameters()) + sum(
            t.numel() * t.element_size() for st in mode.opt.state.values() for t in st.values()
            if isinstance(t, torch.Tensor))
        mode.opt.zero_grad(set_to_none=True)
        sampler.start()
        out["step_s"] = step()
        growth = sampler.stop()
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
    spec = {"model": dataclasses.asdict(args.model.replace(seq=seq)), "mode": mode, "device": args.device,
            "dtype": args.dtype, "batch": args.batch, "budget": args.budget_bytes, "path": args.path}
    return dict(probe_in_child(spec), mode=mode)


def describe(r: dict) -> str:
    """A probe's result in a line."""
    peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / MIB:.0f} MiB"
    step = "-" if r.get("step_s") is None else f"{r['step_s']:.2f}s"
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
    rec, ro = found.get("recompute"), found.get("recompute+offload")
    if rec and ro and rec["max_seq"] and ro["max_seq"]:
        seq, ratios, misfits = rec["max_seq"], [], []
        for i in range(args.pairs):  # alternated: the machine's noise hits both alike
            times = {}
            for mode in (("recompute", "recompute+offload") if i % 2 == 0 else ("recompute+offload", "recompute")):
                r = probe(mode, seq)
                times[mode] = r["step_s"] if r["fits"] else None
                if not r["fits"]:
                    misfits.append(mode)
            if times["recompute"] and times["recompute+offload"]:
                ratios.append(times["recompute+offload"] / times["recompute"])
        # A mode that fits a length in the search and not a shorter one here has no longest
        # sequence (H200, 2026-11-27: recompute+offload trained 65536 tokens, then ran out of
        # memory at 40960): said, not hidden in a missing ratio.
        result["vs_recompute"] = {"seq": seq, "seq_ratio": ro["max_seq"] / seq, "step_ratios": ratios,
                                  "step_ratio": statistics.median(ratios) if ratios else None,
                                  "did_not_fit": misfits}
    return result


def format_max_seq(result: dict) -> str:
    m = result["model"]
    on_gpu = str(result["device"]).startswith("cuda")
    cap = f" capped at {result['budget_bytes'] / MIB:.0f} MiB" if result["budget_bytes"] else ""
    cap += f", PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ALLOC_CONF)}"
    limit = (f"the GPU's memory{cap} (a real out-of-memory in a child process)" if on_gpu else
             f"a memory budget of {result['budget_bytes'] / MIB:.0f} MiB: the step's resident growth plus the model's "
             "weights and AdamW state, measured in a child process (on the CPU, memory is not the limit: this stands "
             "for it)")
    lines = [f"longest sequence per mode: {m['layers']} blocks, hidden {m['hidden']}, {m['heads']} heads, vocab "
             f"{m['vocab']}, loss in chunks of {m['loss_chunk']} tokens; batch {result['batch']}, {result['dtype']}, "
             f"{result['device']}; limit: {limit}", ""]
    rows = [("mode", "longest seq", "step there", "peak there")]
    for r in result["max_seq"]:
        rows.append((r["mode"], "-" if r["max_seq"] is None else f"{r['max_seq']}" + ("+" if r["hit_limit"] else ""),
                     "-" if r["step_s"] is None else f"{r['step_s']:.2f}s",
                     "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / MIB:.0f} MiB"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for i, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    vs = result.get("vs_recompute")
    if vs:
        step = "-" if vs["step_ratio"] is None else f"x{vs['step_ratio']:.2f}"
        lines += ["", f"recompute+offload trains x{vs['seq_ratio']:.2f} the sequence of recompute within the same "
                  f"limit; at recompute's longest ({vs['seq']}), its step is {step} of recompute's (median of "
                  f"{len(vs['step_ratios'])} alternated pairs)"]
        if vs.get("did_not_fit"):
            lines.append(f"NOT SETTLED: {', '.join(sorted(set(vs['did_not_fit'])))} did not fit at {vs['seq']} "
                         f"tokens in {len(vs['did_not_fit'])} of the side-by-side probes, though the search found it "
                         "training as long or longer")
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
    sys.stdout.write(json.dumps(_child(spec)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
