"""Chosen probes of ``ssdtrain bench --max-seq``: each ``MODE:SEQ`` in a child process of its own,
exactly as the search runs it (same model, budget and warm-up), for finishing a search that was
cut off or for comparing two modes at one length without searching again.

    python benchmarks/maxseq_probes.py --device cuda --layers 24 --hidden 1024 --heads 8 \\
        --memory-budget 6GiB --probe recompute+offload:73728 --probe recompute:40960 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssdtrain.bench._device import resolve_device  # noqa: E402
from ssdtrain.bench.maxseq import MAX_SEQ_MODES, MaxSeqArgs, cpu_model, describe, gpu_model, run_probe  # noqa: E402
from ssdtrain.config import parse_bytes  # noqa: E402


def _probe(text: str) -> tuple[str, int]:
    mode, _, seq = text.rpartition(":")
    if mode not in MAX_SEQ_MODES or not seq.isdigit() or int(seq) < 16:
        raise argparse.ArgumentTypeError(f"--probe {text!r}: give MODE:SEQ, MODE one of {', '.join(MAX_SEQ_MODES)} "
                                         "and SEQ a length of at least 16 tokens")
    return mode, int(seq)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--memory-budget", type=lambda v: parse_bytes(v, name="--memory-budget"), required=True)
    ap.add_argument("--path", default=None, help="the offloader's directory")
    ap.add_argument("--probe", type=_probe, action="append", required=True, help="MODE:SEQ, repeatable, run in order")
    ap.add_argument("--json", help="write every probe's result here (after each probe)")
    ns = ap.parse_args()
    dev = resolve_device(ns.device)
    gpu = dev.type == "cuda"
    model = gpu_model() if gpu else cpu_model()
    model = model.replace(**{k: getattr(ns, k) for k in ("layers", "hidden", "heads", "vocab")
                             if getattr(ns, k) is not None})
    args = MaxSeqArgs(model=model, device=str(dev), dtype=ns.dtype or ("bfloat16" if gpu else "float32"),
                      budget_bytes=ns.memory_budget, path=ns.path)
    results = []
    for mode, seq in ns.probe:
        r = run_probe(args, mode, seq)
        results.append(r)
        print(describe(r) + ("" if r["fits"] else f" {str(r.get('error') or '')[-300:]}"), flush=True)
        if ns.json:
            Path(ns.json).write_text(json.dumps({**args.head(), "probes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
