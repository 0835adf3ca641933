"""``ssdtrain bench`` on the command line: flags to :class:`~ssdtrain.bench.runner.BenchArgs`,
the run, the table."""

from __future__ import annotations

import argparse
import json
import sys

from ssdtrain.bench._device import resolve_device
from ssdtrain.bench.drive import THROTTLES
from ssdtrain.bench.models import preset
from ssdtrain.bench.modes import MODES
from ssdtrain.bench.report import format_table, plot
from ssdtrain.bench.runner import DEVICES, DTYPES, BenchArgs, run

__all__ = ["args_from_cli", "main", "preset_name"]

DEFAULT_BUDGET = 40 << 20
"""``--memory-budget`` on the CPU when none is given: at the CPU model's size (19 MiB of weights and
AdamW state), recompute's longest sequence is then under 2k tokens, where a step takes seconds on
2 cores (attention's work grows with the square of the sequence)."""


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ssdtrain bench",
        description="Train a GPT-style decoder in the modes " + ", ".join(MODES) + ", alternated step by step, "
        "and print step time, memory and drive traffic side by side. save_on_cpu is "
        "torch.autograd.graph.save_on_cpu: pin_memory=True on a GPU; on the CPU pin_memory=False, which copies "
        "nothing (its hooks' cost only).",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model and few steps (seconds)")
    shape = ap.add_argument_group(
        "model shape", "each overrides the preset's: " + "; ".join(
            f"{name} ({when}) {c.layers} layers, hidden {c.hidden}, {c.heads} heads, seq {c.seq}, vocab {c.vocab}"
            for name, when, c in (("default", "on the CPU", preset("default")), ("gpu", "on a GPU", preset("gpu")),
                                  ("quick", "--quick", preset("quick")))))
    for flag in ("--layers", "--hidden", "--heads", "--seq", "--vocab"):
        shape.add_argument(flag, type=int)
    ap.add_argument("--batch", type=int, help="sequences per step (default 4; --quick 8)")
    ap.add_argument("--steps", type=int, help="timed steps per mode after one warm-up (default 3; 10 on a GPU, "
                    "whose steps are short and whose step ratios vary more between rounds)")
    ap.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICES) + ",cuda:N,sim:h100,sim:h200}",
                    help="where the model trains (default auto: CUDA where available, else cpu); "
                    "--device cuda without a GPU is an error; sim:h100 and sim:h200 train on a modelled GPU "
                    "(no GPU needed, no data computed: step times and peaks on a virtual clock, the table marked "
                    "as modelled with the rates it assumed)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--naive-attention", action="store_true", help="materialise the s x s scores")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ",".join(MODES) + " (default: all)")
    ap.add_argument("--path", help="offload directory (default: $SSDTRAIN_PATH, else the temp dir)")
    ap.add_argument("--drive-gbps", type=float, metavar="X",
                    help="run the offload modes on a drive limited to X GB/s each way (write and read)")
    ap.add_argument("--throttle", choices=THROTTLES, default="auto",
                    help="how --drive-gbps limits the drive: cgroup (blkio v1; root), backend (a rate limit "
                    "in the offloader's backend), auto (cgroup where possible; default)")
    ap.add_argument("--work-dir", help="cache for the token corpus (default ~/.cache/ssdtrain/bench)")
    ap.add_argument("--data", choices=("auto", "dali", "torch"), default="auto",
                    help="input pipeline (auto: DALI if installed)")
    ap.add_argument("--probe-size", type=_size, help="bytes the drive probe writes and reads (default 256MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--plot", metavar="PATH", help="draw each mode's memory timeline (needs matplotlib)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    long = ap.add_argument_group(
        "longest sequence (--max-seq)", "instead of the side-by-side run: for each mode, the longest sequence that "
        "trains (doubling, then bisection to 1/8) and its step time there; the model is deeper and chunks its loss "
        "(CPU: 32 blocks, hidden 64; GPU: 24 blocks, hidden 2048; the shape flags override them), batch 1")
    long.add_argument("--max-seq", action="store_true", help="search each mode's longest sequence")
    long.add_argument("--memory-budget", type=_size, metavar="SIZE",
                      help=f"on the CPU, the memory a step may use: its resident growth plus the model's weights and "
                      f"AdamW state (default {DEFAULT_BUDGET >> 20}MiB); on a GPU, a cap on its caching allocator "
                      "(a real out-of-memory at SIZE, for a search that ends in minutes; default: all its memory)")
    long.add_argument("--start-seq", type=int, default=None,
                      help="the first sequence length tried (default 64; 2048 on a GPU)")
    long.add_argument("--max-seq-limit", type=int, default=1 << 20, help="the longest sequence tried (default 2**20)")
    long.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                      help="the decoder searched: gpt (the bench's) or llama (RMSNorm, RoPE, grouped-query attention "
                      "with 4 query heads a key/value head, SwiGLU at 3.5x hidden, 32 blocks; CPU: hidden 64, 4 heads, "
                      "vocab 256; GPU: hidden 2048, 16 heads, vocab 32768); llama's default modes: "
                      "recompute,recompute+tiled,recompute+offload,recompute+offload+tiled")
    long.add_argument("--kv-heads", type=int, help="--model llama: key/value heads (default heads / 4)")
    long.add_argument("--tile-tokens", type=int,
                      help="the +tiled modes (any mode name with +tiled appended: every block's MLP computed along "
                      "the sequence a tile at a time, ssdtrain.longctx.tiled; +tiled-layer, --model llama: the whole "
                      "block but attention, ssdtrain.longctx.tiled_layer; +tiled-heads: that, and attention a query head at a time, "
                      "ssdtrain.longctx.head_groups): positions a tile (default: the hidden "
                      "size, DeepSpeed ALST's)")
    long.add_argument("--head-groups", type=int,
                      help="the +tiled-heads modes: groups of query heads attention runs one at a time (default: "
                      "one head a group); must divide --heads")
    long.add_argument("--layer-memory", type=_size, metavar="SIZE",
                      help="the +tiled-heads modes: what a recomputed layer may hold; at each sequence a layer then "
                      "takes fewer head groups and longer tiles where they fit, down to --head-groups and "
                      "--tile-tokens where nothing coarser does (ssdtrain.longctx.sizing; default: half of "
                      "--memory-budget; 0: never, always those)")
    long.add_argument("--pairs", type=int, default=2,
                      help="alternated rounds of recompute and each other recompute mode at recompute's longest "
                      "sequence, for the step ratios (default 2)")
    return ap


def preset_name(quick: bool, device: str) -> str:
    """The model preset when no shape is given: ``quick`` with ``--quick``, else ``gpu`` where
    ``device`` resolves to a CUDA device, else ``default``."""
    if quick:
        return "quick"
    return "gpu" if resolve_device(device).type == "cuda" else "default"


def args_from_cli(ns: argparse.Namespace) -> BenchArgs:
    name = preset_name(ns.quick, ns.device)
    gpu = name == "gpu"
    base = preset(name)
    model = base.replace(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq=ns.seq, vocab=ns.vocab,
                         flash=False if ns.naive_attention else None)
    return BenchArgs(
        model=model,
        batch=ns.batch or (8 if ns.quick else 4),
        # On an H100 single rounds of one mode ranged x1.12-1.53 against baseline with 3 steps
        # (2026-11-24); a GPU step takes tenths of a second, so ten cost seconds.
        steps=ns.steps or (10 if gpu else 3),
        dtype=ns.dtype,
        device=ns.device,
        modes=tuple(m.strip() for m in ns.modes.split(",") if m.strip()),
        path=ns.path,
        drive_gbps=ns.drive_gbps,
        throttle=ns.throttle,
        work_dir=ns.work_dir,
        data=ns.data,
        # An NVMe drive behind a GPU moves 256 MiB in tens of milliseconds: probe it for longer.
        probe_bytes=ns.probe_size or ((64 << 20) if ns.quick else (1 << 30) if gpu else (256 << 20)),
        seed=ns.seed,
        progress=False if ns.no_progress else None,
        keep_timeline=bool(ns.plot),
        threads=ns.threads,
    )


def _max_seq(ns: argparse.Namespace) -> int:
    from ssdtrain.bench.maxseq import (LLAMA_MAX_SEQ_MODES, MAX_SEQ_MODES, MaxSeqArgs, base_mode, cpu_model,
                                       format_max_seq, gpu_model, plot_max_seq)
    from ssdtrain.bench.runner import default_dtype

    dev = resolve_device(ns.device)
    gpu = dev.type == "cuda"
    if ns.memory_budget is not None and ns.memory_budget <= 0:
        raise ValueError(f"--memory-budget must be a positive size, got {ns.memory_budget}")
    if gpu and ns.memory_budget is not None:
        import torch

        total = torch.cuda.get_device_properties(dev).total_memory
        if ns.memory_budget > total:
            raise ValueError(f"--memory-budget {ns.memory_budget >> 20} MiB is more than {dev}'s {total >> 20} MiB: "
                             "give a smaller one, or none for all of it")
    llama = ns.model == "llama"
    modes = tuple(m.strip() for m in ns.modes.split(",") if m.strip()) if ns.modes != ",".join(MODES) else (
        LLAMA_MAX_SEQ_MODES if llama else MAX_SEQ_MODES + (("save_on_cpu",) if gpu else ()))
    bad = [m for m in modes if base_mode(m)[0] not in MODES or base_mode(m)[0] == "save_on_cpu" and base_mode(m)[1]]
    if bad or not modes:
        raise ValueError(f"--modes: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(MODES)}, "
                         "each but save_on_cpu also with +tiled (and, with --model llama, +tiled-layer or +tiled-heads)")
    if not llama and any(base_mode(m)[1] in ("layer", "heads") for m in modes):
        raise ValueError("--modes: +tiled-layer and +tiled-heads tile Llama blocks: give --model llama (a GPT's MLP "
                         "tiles with +tiled)")
    if ns.head_groups is not None and (ns.head_groups < 1 or not any(base_mode(m)[1] == "heads" for m in modes)):
        raise ValueError(f"--head-groups ({ns.head_groups}) is a positive int for the +tiled-heads modes")
    if ns.layer_memory is not None and (ns.layer_memory < 0 or not any(base_mode(m)[1] == "heads" for m in modes)):
        raise ValueError(f"--layer-memory ({ns.layer_memory}) is a size >= 0 for the +tiled-heads modes")
    if ns.tile_tokens is not None and ns.tile_tokens < 1:
        raise ValueError(f"--tile-tokens must be a positive int, got {ns.tile_tokens}")
    if ns.kv_heads is not None and not llama:
        raise ValueError("--kv-heads is for --model llama")
    if ns.pairs < 1:
        raise ValueError(f"--pairs must be at least 1, got {ns.pairs}")
    arch = "llama" if llama else "gpt"
    model = (gpu_model(arch) if gpu else cpu_model(arch)).replace(layers=ns.layers, hidden=ns.hidden, heads=ns.heads,
                                                                  vocab=ns.vocab)
    if llama:
        model = model.replace(kv_heads=ns.kv_heads)
    start = ns.start_seq or (2048 if gpu else 64)
    if start < 16:
        raise ValueError(f"--start-seq must be at least 16, got {start}")
    progress = None if ns.no_progress else (lambda text: print("  " + text, file=sys.stderr, flush=True))
    args = MaxSeqArgs(model=model, device=str(dev), dtype=ns.dtype or default_dtype(dev), batch=ns.batch or 1,
                      modes=modes, budget_bytes=ns.memory_budget if gpu else (ns.memory_budget or DEFAULT_BUDGET),
                      start=start, limit=ns.max_seq_limit, path=ns.path, progress=progress, pairs=ns.pairs,
                      tile_tokens=ns.tile_tokens, head_groups=ns.head_groups, layer_memory=ns.layer_memory,
                      partial=None if not ns.json else lambda r: _outputs(ns, r, None, ""))
    from ssdtrain.bench.maxseq import run_max_seq

    result = run_max_seq(args)
    print(format_max_seq(result))
    _outputs(ns, result, lambda: plot_max_seq(result, ns.plot), "sequence vs step time")
    return 0


def _modelled(ns: argparse.Namespace) -> int:
    """``--device sim:...``: the bench's modes on a modelled GPU (``ssdtrain.bench.modelled``)."""
    from ssdtrain.bench.maxseq import MAX_SEQ_MODES, gpu_model
    from ssdtrain.bench.modelled import (SIM_MODES, ModelledArgs, format_modelled, max_seq_modelled, run_modelled,
                                         sim_rates)

    unsupported = [flag for flag, given in (("--drive-gbps", ns.drive_gbps), ("--plot", ns.plot),
                                            ("--naive-attention", ns.naive_attention),
                                            ("--model llama", ns.model == "llama")) if given]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: not modelled with --device {ns.device}; run without it, "
                         "or on a GPU (--device cuda)")
    default = tuple(m for m in MAX_SEQ_MODES if m in SIM_MODES) if ns.max_seq else SIM_MODES
    modes = tuple(m.strip() for m in ns.modes.split(",") if m.strip()) if ns.modes != ",".join(MODES) else default
    base = gpu_model("gpt") if ns.max_seq else preset("quick" if ns.quick else "gpu")
    model = base.replace(layers=ns.layers, hidden=ns.hidden, heads=ns.heads, seq=ns.seq, vocab=ns.vocab)
    args = ModelledArgs(device=ns.device, model=model, batch=ns.batch or (1 if ns.max_seq else 4),
                        steps=ns.steps or 3, modes=modes, dtype=DTYPES[ns.dtype or "bfloat16"])
    if not ns.max_seq:
        result = run_modelled(args)
        print(format_modelled(result))
        _outputs(ns, result, None, "")
        return 0
    budget = ns.memory_budget or sim_rates(ns.device).memory_bytes
    found = [max_seq_modelled(args, m, budget, start=ns.start_seq or 2048, limit=ns.max_seq_limit) for m in modes]
    print(f"MODELLED, not measured: {ns.device}; the longest sequence within {budget >> 20} MiB of device memory "
          f"(weights and AdamW state included), GPT {model.layers} x {model.hidden}, batch {args.batch}")
    for f in found:
        step = f.get("step") or {}
        print(f"  {f['mode']:<20} {f['seq'] or 'none':>8}  step {step.get('seconds', float('nan')) * 1e3:8.1f} ms  "
              f"peak {step.get('peak_bytes', 0) >> 20} MiB  did not fit: {f['failed'] or '-'}")
    _outputs(ns, {"device": ns.device, "modelled": True, "budget_bytes": budget, "max_seq": found}, None, "")
    return 0


def _outputs(ns: argparse.Namespace, data: dict, draw, what: str) -> None:
    """``--json`` and ``--plot`` of a run: ``data`` as JSON, ``draw()`` the plot (``None``: none yet)."""
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
    if ns.plot and draw is not None:
        draw()
        print(f"{what}: {ns.plot}")


def main(argv: list[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    if ns.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("ssdtrain bench: --plot needs matplotlib; pip install 'ssdtrain[plot]'", file=sys.stderr)
            return 2
    if ns.device.startswith("sim:"):
        try:
            return _modelled(ns)
        except ValueError as exc:
            print(f"ssdtrain bench: {exc}", file=sys.stderr)
            return 2
    if ns.max_seq:
        try:
            return _max_seq(ns)
        except (ValueError, ImportError) as exc:
            print(f"ssdtrain bench: {exc}", file=sys.stderr)
            return 2
    try:
        args = args_from_cli(ns)
        bad = [m for m in args.modes if m not in MODES]
        if bad or not args.modes:
            raise ValueError(f"--modes: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(MODES)}")
        if args.drive_gbps is not None and not args.drive_gbps > 0:
            raise ValueError(f"--drive-gbps must be a positive number of GB/s, got {args.drive_gbps}")
        result = run(args)
    except (ValueError, ImportError) as exc:
        print(f"ssdtrain bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    _outputs(ns, {k: v for k, v in result.items() if k != "timeline"}, lambda: plot(result, ns.plot),
             "memory timeline")
    return 0
