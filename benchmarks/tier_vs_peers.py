"""ssdtrain's host tier against the host-memory offloaders users reach for, on a GPU, side by side.

Modes, alternated round by round in one process on one model (bf16, the bench's GPT):

* ``baseline``; ``recompute`` (``torch.utils.checkpoint`` per block);
* ``offload``: ``ssdtrain.Offloader`` with its defaults (the host tier on, drives behind it);
* ``recompute+offload``: checkpointing, and an Offloader with ``min_bytes=0`` (block inputs);
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
* ``streamed_pinned``: an equivalent of torchtune's ``OffloadActivations`` (torchtune is not
  installed on the GPU machines), written here: each save of at least 1 MiB is copied to pinned
  host memory on a side stream, and its device memory is released after the next save, once
  the compute stream is made to wait for the copy; backward copies it back on a side stream,
  one save ahead. Labelled as ours in every table.

Per mode: the step time against its reference (baseline; recompute for ``recompute+offload``),
and the device memory peak of the step above the memory at its start (``max_memory_allocated``).
For ``offload``, the peak's fall against its bound ``min(D2H rate x forward time, saved bytes)``
(forward time: baseline's, on the device; saved bytes: distinct storages of at least 1 MiB);
for ``recompute+offload``, the share of the checkpoints' bytes kept off the device.

    python benchmarks/tier_vs_peers.py [--layers 12 --hidden 2048 --seq 2048 --batch 4] [--json F]
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import json
import pstats
import statistics
import sys
import time

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig

MiB = 1 << 20


class StreamedPinned:
    """Our equivalent of torchtune's ``OffloadActivations`` (see the module docstring)."""

    def __init__(self, params: set[int], min_bytes: int = MiB) -> None:
        self.params, self.min_bytes = params, min_bytes
        self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()
        self.stash: list = []  # (device tensor, copy event): released at the next save
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self.ahead: dict[int, tuple] = {}
        self.order: list = []

    def __enter__(self):
        self.order = []
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self._release()

    def _release(self):
        cur = torch.cuda.current_stream()
        for t, ev in self.stash:
            cur.wait_event(ev)
        self.stash.clear()

    def pack(self, t):
        if t.numel() * t.element_size() < self.min_bytes or t.untyped_storage().data_ptr() in self.params:
            return t
        self._release()
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        self.d2h.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        t.record_stream(self.d2h)
        self.stash.append((t, ev))
        packed = [host, None, None]
        self.order.append(packed)
        return packed

    def _fetch(self, packed):
        if packed[1] is None:
            self.h2d.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.h2d):
                dev = packed[0].to("cuda", non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.h2d)
            packed[1], packed[2] = dev, ev

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        self._fetch(packed)
        i = next((k for k in range(len(self.order) - 1, -1, -1) if self.order[k] is packed), None)
        if i:  # one ahead, in reverse pack order
            self._fetch(self.order[i - 1])
        cur = torch.cuda.current_stream()
        cur.wait_event(packed[2])
        dev = packed[1]
        dev.record_stream(cur)
        return dev


def d2h_rate() -> float:
    n = 256 * MiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return n / best


def saved_bytes(model, x, y, params: set[int], min_bytes: int) -> int:
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.nbytes() >= min_bytes and s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=8,
                    help="rounds before the measured ones: the tier learns its budget, and the host paces it")
    ap.add_argument("--modes", default="baseline,recompute,offload,recompute+offload,save_on_cpu,streamed_pinned")
    ap.add_argument("--path", default=None)
    ap.add_argument("--host-bytes", default=None, help="the offloaders' host_bytes (default: theirs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="MODE",
                    help="after the rounds, profile the host side of 5 of MODE's steps (cProfile, all of the "
                         "training thread's calls), to find what its forward's host time goes to")
    args = ap.parse_args(argv)
    if args.profile is not None and args.profile not in args.modes.split(","):
        ap.error(f"--profile {args.profile}: not one of --modes ({args.modes}); add it there")
    if not torch.cuda.is_available():
        print("tier_vs_peers: no CUDA device")
        return 1
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]
    modes = args.modes.split(",")
    extra = {} if args.host_bytes is None else {"host_bytes": args.host_bytes}
    path = {} if args.path is None else {"path": args.path}
    offs = {"offload": ssdtrain.Offloader(model, **path, **extra),
            "recompute+offload": ssdtrain.Offloader(model, min_bytes=0, **path, **extra)}
    # Diagnostics: the drives alone (no host tier), and the tier releasing a save only once the
    # device says its copy is done (no due positions: Note [copy what leaves before the peak]).
    if "offload_drive" in args.modes:
        offs["offload_drive"] = ssdtrain.Offloader(model, **path, host_bytes=0)
    if "offload_done" in args.modes:
        offs["offload_done"] = ssdtrain.Offloader(model, **path, **extra)
        offs["offload_done"]._tier.clock.schedule = lambda n: float("inf")
    # Diagnostic: recompute+offload with the host's pacing off (Note [the host paces the copies]):
    # what copying every block input it may costs the step, against the paced default.
    if "recompute+offload_unpaced" in args.modes:
        offs["recompute+offload_unpaced"] = ssdtrain.Offloader(model, min_bytes=0, **path, **extra)
        offs["recompute+offload_unpaced"]._tier.clock._pace = lambda *_: None  # noqa: E731
    peer = StreamedPinned(params)
    rate = d2h_rate()
    model.recompute = False
    saved = saved_bytes(model, x, y, params, MiB)
    model.recompute = True
    saved_ckpt = saved_bytes(model, x, y, params, 0)
    block_inputs = cfg.layers * args.batch * cfg.seq * cfg.hidden * 2  # what checkpointing keeps per block

    def ctx(mode):
        if mode in offs:
            return offs[mode]
        if mode == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        if mode == "streamed_pinned":
            return peer
        return contextlib.nullcontext()

    def begin(mode):
        model.recompute = mode == "recompute" or mode.startswith("recompute+offload")
        model.zero_grad(set_to_none=True)

    def run_step(mode):  # untimed (--profile)
        begin(mode)
        with ctx(mode):
            loss = model(x, y)
        loss.backward()
        torch.cuda.synchronize()
        if mode in offs:
            offs[mode].wait()

    rows: dict[str, list[dict]] = {m: [] for m in modes}
    trace: dict[str, list[tuple]] = {}  # each round: copy budget and copied (MiB), host forward (ms)
    for r in range(args.warmup + args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            begin(mode)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            before = offs[mode].stats() if mode in offs else None
            t0 = time.perf_counter()
            e0.record()
            with ctx(mode):
                loss = model(x, y)
            launch = time.perf_counter() - t0
            e1.record()
            loss.backward()
            e2.record()
            torch.cuda.synchronize()
            step = time.perf_counter() - t0
            row = {"step_s": step, "fwd_s": e0.elapsed_time(e1) / 1e3, "bwd_s": e1.elapsed_time(e2) / 1e3,
                   "fwd_host_s": launch, "peak": torch.cuda.max_memory_allocated() - start}
            if mode in offs:
                s = offs[mode].stats()
                drive = sum(s.written_bytes_by_path.values()) - sum(before.written_bytes_by_path.values())
                row.update(host_copied=s.host_copied_bytes - before.host_copied_bytes, drive=drive,
                           tier_peak=s.host_tier_peak_bytes, spilled=s.spilled_bytes - before.spilled_bytes,
                           stall=s.stall_seconds - before.stall_seconds, copy_limit=s.host_copy_limit_bytes or 0)
                offs[mode].wait()
                trace.setdefault(mode, []).append((round(row["copy_limit"] / 2**20), round(row["host_copied"] / 2**20),
                                                   round(launch * 1e3, 1)))
            if r >= args.warmup:
                rows[mode].append(row)
    med = {m: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for m, rs in rows.items() if rs}
    out = {"gpu": torch.cuda.get_device_name(), "shape": vars(args), "d2h_GBps": rate / 1e9,
           "saved_bytes": saved, "checkpoint_bytes": saved_ckpt, "block_input_bytes": block_inputs, "modes": med,
           "trace": trace}
    base = med.get("baseline")
    rec = med.get("recompute")
    print(f"{out['gpu']}: D2H {rate / 1e9:.1f} GB/s; saved {saved / 2**30:.2f} GiB (>= 1 MiB), "
          f"checkpointed {saved_ckpt / 2**30:.2f} GiB")
    for m, v in med.items():
        ref = rec if m.startswith("recompute+offload") and rec else base
        line = (f"{m:18s} step {v['step_s'] * 1e3:7.1f} ms (device fwd {v['fwd_s'] * 1e3:.1f}, bwd {v['bwd_s'] * 1e3:.1f};"
                f" host fwd {v['fwd_host_s'] * 1e3:.1f})")
        if ref is not None and m not in ("baseline",):
            line += f" x{v['step_s'] / ref['step_s']:.3f} of {'recompute' if ref is rec else 'baseline'}"
        line += f"  peak {v['peak'] / 2**30:6.2f} GiB"
        if ref is not None and m != "baseline":
            fall = ref["peak"] - v["peak"]
            line += f" (fall {fall / 2**30:5.2f} GiB)"
            if m.startswith("offload") and base is not None:
                bound = min(rate * base["fwd_s"], saved)
                v["bound"], v["fall_of_bound"] = bound, fall / bound
                line += f", {fall / bound:.0%} of the bound {bound / 2**30:.2f} GiB"
            if m.startswith("recompute+offload"):
                v["checkpoints_off"] = fall / saved_ckpt
                v["block_inputs_off"] = fall / block_inputs
                line += (f", {fall / saved_ckpt:.0%} of what checkpointing saves ({fall / block_inputs:.0%} of the block"
                         " inputs) off the GPU")
        if "host_copied" in v:
            line += (f"; per step: tier took {v['host_copied'] / 2**30:.2f} GiB, drive {v['drive'] / 2**30:.2f},"
                     f" stall {v['stall'] * 1e3:.1f} ms,"
                     f" tier peak {v['tier_peak'] / 2**30:.2f}, copy budget {v['copy_limit'] / 2**30:.2f} GiB")
        print(line, flush=True)
    for m, t in trace.items():
        print(f"{m:18s} each round (budget MiB, copied MiB, host fwd ms): {t}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.profile:
        prof = cProfile.Profile()
        for _ in range(5):
            prof.enable()
            run_step(args.profile)
            prof.disable()
        print(f"--- {args.profile}: 5 steps' calls on the training thread (forward and backward)")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof).sort_stats(key).print_stats(25)
    for off in offs.values():
        off.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
