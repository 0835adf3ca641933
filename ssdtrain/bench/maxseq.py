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
  GPU's would fail there (Note [a CPU probe stops at its budget] in ``_maxseq_child.py``, which
  runs the probe).

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
(:func:`ssdtrain.bench.tiled_models.tile_mlps`)."""
TILED_LAYER = "+tiled-layer"
"""A mode name's suffix: the bench mode before it, every block tiled whole along the sequence,
attention over the whole of it (:func:`ssdtrain.bench.tiled_models.tile_layers`; Llama-shaped only)."""
TILED_HEADS = "+tiled-heads"
"""A mode name's suffix: as :data:`TILED_LAYER`, and attention one query head at a time (its q, k,
v, output and their gradients one head's at a time: :mod:`ssdtrain.longctx.head_groups`)."""
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


def base_mode(mode: str) -> tuple[str, str | None]:
    """``(bench mode, what is tiled)`` of a max-seq mode name: ``recompute+offload+tiled`` is
    ``("recompute+offload", "mlp")``, ``recompute+offload+tiled-layer``
    ``("recompute+offload", "layer")``, ``...+tiled-heads`` ``(..., "heads")``, ``recompute``
    ``("recompute", None)``."""
    if mode.endswith(TILED_HEADS):
        return mode[:-len(TILED_HEADS)], "heads"
    if mode.endswith(TILED_LAYER):
        return mode[:-len(TILED_LAYER)], "layer"
    return (mode[:-len(TILED)], "mlp") if mode.endswith(TILED) else (mode, None)


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
    head_groups: int | None = None  # the +tiled-heads modes' groups of query heads; None: one head a group
    layer_memory: int | None = None  # +tiled-heads: a layer's bytes to size to (None: half the budget; 0: never)
    bound: bool = True  # measure one block's bytes at recompute's longest, untiled and tiled, for the bound
    progress: Callable[[str], None] | None = None
    partial: Callable[[dict], None] | None = None  # given the probes so far after each one (a search cut off keeps them)

    def head(self) -> dict:
        """What a ``--json`` file says of the setup, before its probes."""
        return {"model": dataclasses.asdict(self.model), "arch": arch_of(self.model), "device": self.device,
                "dtype": self.dtype, "batch": self.batch, "budget_bytes": self.budget_bytes,
                "tile_tokens": self.tile_tokens or self.model.hidden,
                "head_groups": self.head_groups or self.model.heads, "layer_memory": self.sized_memory()}

    def sized_memory(self) -> int | None:
        """The bytes a ``+tiled-heads`` layer sizes its groups and tiles to
        (:mod:`ssdtrain.longctx.sizing`): :attr:`layer_memory`, else half the budget; ``None``: not
        sized (``layer_memory`` 0, or no budget)."""
        if self.layer_memory is not None:
            return self.layer_memory or None
        return None if self.budget_bytes is None else self.budget_bytes // 2


def probe_in_child(spec: dict) -> dict:
    """One probe: ``{"seq", "fits", "peak_bytes", "step_s", "oom", "error"}``."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    if spec["device"].startswith("cuda"):
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)  # Note [a probe's allocator does not fragment]
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-m", "ssdtrain.bench._maxseq_child"], input=json.dumps(spec),
                          capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        # A process killed for memory (the kernel's OOM killer) is a failure to fit, said so.
        return {"seq": spec["model"]["seq"], "fits": False, "oom": proc.returncode < 0, "peak_bytes": None,
                "step_s": None, "error": (proc.stderr or "")[-2000:] or f"exit status {proc.returncode}"}
    return json.loads(lines[-1])


def measure_blocks(args: MaxSeqArgs, seq: int, reps: int = 3) -> dict:
    """One block's bytes at ``seq`` tokens (a child process: :func:`_blocks_child`), and the bound
    they set on what offloading the inputs and tiling the MLP buy over checkpointing alone:
    ``(L x input + block) / block_tiled`` (checkpointing holds every block's input and one
    recomputed block; with the inputs offloaded and the MLP tiled, one tiled block)."""
    layer = any(base_mode(m)[1] == "layer" for m in args.modes)
    heads = any(base_mode(m)[1] == "heads" for m in args.modes)
    spec = {"kind": "blocks", "model": dataclasses.asdict(args.model.replace(seq=seq)), "arch": arch_of(args.model),
            "device": args.device, "dtype": args.dtype, "batch": args.batch, "tile_tokens": args.tile_tokens,
            "reps": reps, "layer": layer, "heads": heads, "head_groups": args.head_groups}
    r = probe_in_child(spec)
    if "block_bytes" not in r:
        return {"seq": seq, "error": r.get("error")}
    layers = args.model.layers
    r["layers"] = layers
    held = layers * r["input_bytes"] + r["block_bytes"]
    r["bound"] = held / r["block_tiled_bytes"]
    r["bound_untiled"] = held / r["block_bytes"]
    if "block_layer_bytes" in r:
        r["bound_layer"] = held / r["block_layer_bytes"]
    if "block_heads_bytes" in r:
        r["bound_heads"] = held / r["block_heads_bytes"]
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
            "path": args.path, "tile_tokens": args.tile_tokens, "head_groups": args.head_groups,
            "layer_memory": args.sized_memory()}
    return dict(probe_in_child(spec), mode=mode)


def describe(r: dict) -> str:
    """A probe's result in a line."""
    peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / MIB:.0f} MiB"
    step = "-" if r.get("step_s") is None else f"{r['step_s']:.2f}s"
    if r.get("over_budget"):
        peak = f"over {peak} when stopped in step {r['stopped_at_step']}"
    line = f"{r['mode']} seq {r['seq']}: {'fits' if r['fits'] else 'does not fit'} (peak {peak}, step {step})"
    if r.get("whole_layer"):  # sized to the layer's memory (ssdtrain.longctx.sizing)
        line += "; the layer untiled (it fits)"
    elif r.get("head_groups"):
        line += f"; tiles of {r['tile_tokens']}, {r['head_groups']} head group{'s' if r['head_groups'] > 1 else ''}"
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
        headline = next((m for m in ("recompute+offload+tiled-heads", "recompute+offload+tiled-layer", "recompute+offload+tiled", "recompute+offload")
                         if m in every), others[0])
        result["vs_recompute"] = dict(every[headline], mode=headline)
        if args.bound and any(base_mode(m)[1] for m in args.modes):
            blocks = measure_blocks(args, seq)
            say(f"per block at {seq} tokens: " + _blocks_line(blocks))
            result["blocks"] = blocks
    return result


def _blocks_line(b: dict) -> str:
    if "bound" not in b:
        return f"not measured ({(b.get('error') or '')[-300:]})"
    line = (f"input {b['input_bytes'] / MIB:.2f} MiB, block {b['block_bytes'] / MIB:.2f} MiB, block tiled "
            f"{b['block_tiled_bytes'] / MIB:.2f} MiB; bound (L x input + block) / block_tiled = "
            f"({b['layers']} x {b['input_bytes'] / MIB:.2f} + {b['block_bytes'] / MIB:.2f}) / "
            f"{b['block_tiled_bytes'] / MIB:.2f} = x{b['bound']:.2f} (untiled: / block = x{b['bound_untiled']:.2f})")
    if "bound_layer" in b:
        line += (f"; layer tiled {b['block_layer_bytes'] / MIB:.2f} MiB: bound / block_layer = "
                 f"x{b['bound_layer']:.2f}")
    if "bound_heads" in b:
        line += (f"; layer tiled, a head at a time {b['block_heads_bytes'] / MIB:.2f} MiB: bound / block_heads = "
                 f"x{b['bound_heads']:.2f}")
    return line


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
    tiles = (f"; +tiled: MLP tiles of {result['tile_tokens']} tokens (+tiled-layer, +tiled-heads: the whole layer's)"
             if any(base_mode(r["mode"])[1] for r in result["max_seq"]) and result.get("tile_tokens") else "")
    if any(base_mode(r["mode"])[1] == "heads" for r in result["max_seq"]) and result.get("head_groups"):
        tiles += f"; +tiled-heads: attention in {result['head_groups']} groups of query heads"
        if result.get("layer_memory"):
            tiles += (f", fewer and longer tiles where a layer fits {result['layer_memory'] / MIB:.0f} MiB "
                      "(ssdtrain.longctx.sizing)")
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
                bound = blocks["bound"]
                for suffix, key in ((TILED_LAYER, "bound_layer"), (TILED_HEADS, "bound_heads")):
                    if name.endswith(suffix) and key in blocks:
                        bound = blocks[key]
                lines.append(f"{name} reaches {vs['seq_ratio'] / bound:.0%} of the bound")
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
