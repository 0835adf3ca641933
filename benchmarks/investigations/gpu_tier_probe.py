"""What a pinned host-memory tier can do on this GPU, measured before (and beside) the engine's.

Prints, and writes as JSON (``--json``):

* ``env``: RAM, the locked-memory limit, the GPU;
* ``pin``: seconds to pin a pool of N GiB at once (``torch.empty(pin_memory=True)``);
* ``rates``: device-to-host and host-to-device copy rates from pinned memory (one large copy;
  many 4 MiB copies queued on a side stream; both directions at once; beside a GEMM loop, and
  the GEMM loop's slowdown);
* ``host_us``: the training thread's cost, in microseconds, of each CUDA call a save would make;
* ``lag``: how far the host runs ahead of the device at the end of forward on the bench's GPT
  (launch time of forward on the host against the device's forward time);
* ``proto``: a minimal tier written for this probe (not the engine): saves of at least 1 MiB are
  copied to one pinned pool on a side stream, and their device memory is released either when
  the host sees the copy done (``poll``) or at once, with the compute stream made to wait for the
  copy (``ordered``, torchtune's way), each with a byte budget per step or none; reads come back
  on a side stream, ahead of need. Per variant: the step and forward time against baseline, the
  peak of ``max_memory_allocated`` above the memory before the step, and the bytes copied.

    python benchmarks/investigations/gpu_tier_probe.py --json out.json [--preset gpu] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import deque

import torch

from ssdtrain.bench.models import GPT, GPTConfig, preset

MiB = 1 << 20


def _sync() -> None:
    torch.cuda.synchronize()


def env() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    mem = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":")
            if k in ("MemTotal", "MemAvailable", "Mlocked", "HugePages_Total"):
                mem[k] = v.strip()
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "memlock_soft": soft, "memlock_hard": hard, "meminfo": mem, "cpus": os.cpu_count()}


def pin(sizes_gib: list[int]) -> dict:
    out = {}
    for g in sizes_gib:
        t0 = time.perf_counter()
        try:
            x = torch.empty(g << 30, dtype=torch.uint8, pin_memory=True)
            out[f"{g}GiB_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            x[:: 1 << 20].fill_(1)
            out[f"{g}GiB_touch_s"] = time.perf_counter() - t0
            del x
        except RuntimeError as e:
            out[f"{g}GiB_error"] = str(e)[:200]
    torch._C._host_emptyCache()
    return out


def _rate(nbytes: int, fn) -> float:
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return nbytes / (time.perf_counter() - t0) / 1e9


def rates() -> dict:
    n = 1 << 30
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side, side2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {"d2h_1GiB": _rate(n, lambda: host.copy_(dev, non_blocking=True)),
           "h2d_1GiB": _rate(n, lambda: dev.copy_(host, non_blocking=True))}

    def many(dst, src, stream):
        with torch.cuda.stream(stream):
            for i in range(0, n, 4 * MiB):
                dst[i:i + 4 * MiB].copy_(src[i:i + 4 * MiB], non_blocking=True)
    out["d2h_4MiB_x256"] = _rate(n, lambda: many(host, dev, side))
    out["h2d_4MiB_x256"] = _rate(n, lambda: many(dev, host, side))
    out["both_ways_GBps_each"] = _rate(n, lambda: (many(host, dev, side), many(dev2, host2, side2)))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def gemms(k=20):
        for _ in range(k):
            a @ a
    _sync()
    t0 = time.perf_counter(); gemms(); _sync(); alone = time.perf_counter() - t0
    t0 = time.perf_counter(); gemms(); _sync(); alone = min(alone, time.perf_counter() - t0)
    t0 = time.perf_counter()
    many(host, dev, side)
    gemms()
    _sync()
    both = time.perf_counter() - t0
    out["gemm_alone_s"] = alone
    out["gemm_with_d2h_s"] = both
    out["gemm_slowdown"] = both / alone
    del dev, dev2, host, host2, a
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    return out


def host_us() -> dict:
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    h = torch.empty(4 * MiB, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    ev = torch.cuda.Event()
    k = 2000

    def per(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        r = (time.perf_counter() - t0) / k * 1e6
        _sync()
        return r

    def copy_side():
        side.wait_event(ev)
        with torch.cuda.stream(side):
            h.copy_(x, non_blocking=True)

    out = {
        "Event()": per(lambda: torch.cuda.Event()),
        "Event(blocking)": per(lambda: torch.cuda.Event(blocking=True)),
        "event.record()": per(lambda: ev.record()),
        "current_stream()": per(lambda: torch.cuda.current_stream()),
        "stream.wait_event": per(lambda: cur.wait_event(ev)),
        "event.query()": per(lambda: ev.query()),
        "copy d2h on side (wait+copy)": per(copy_side),
        "torch.empty(0).set_": per(lambda: torch.empty(0, dtype=torch.uint8, device="cuda").set_(
            x.untyped_storage(), 0, (MiB,), (1,))),
        "record_stream": per(lambda: x.record_stream(cur)),
    }
    _sync()
    return out


def _saved_bytes_hook(params: set[int]):
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.nbytes() >= MiB and s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t
    return seen, pack


class Proto:
    """The probe's own minimal tier (see the module docstring)."""

    def __init__(self, pool: torch.Tensor, release: str, budget: int | None, params: set[int], min_bytes=MiB,
                 read_ahead=512 * MiB, ratio: float = 1.0) -> None:
        self.pool = pool
        self.ratio = ratio  # lagged: release a copy once the saves since reach ratio x the bytes copied up to it
        self.release, self.budget, self.params = release, budget, params
        self.min_bytes, self.read_ahead = min_bytes, read_ahead
        self.side, self.rside = torch.cuda.Stream(), torch.cuda.Stream()
        self.new_step()

    def new_step(self):
        self.off = 0
        self.order = []          # entries in pack order
        self.by_ptr = {}
        self.waiting = deque()   # copied, device memory still held
        self.copied = self.released = self.cum = 0
        self.cursor = None

    def pack(self, t):
        s = t.untyped_storage()
        n = s.nbytes()
        if n < self.min_bytes or s.data_ptr() in self.params:
            return t
        e = self.by_ptr.get(s.data_ptr())
        if e is None:
            self.cum += n
            e = {"dev": torch.empty(0, dtype=torch.uint8, device=t.device).set_(s, 0, (n,), (1,)), "host": None,
                 "done": None, "n": n, "buf": None, "rdone": None, "refs": 0, "used": 0, "gone": False}
            self.by_ptr[s.data_ptr()] = e
            self.order.append(e)
            if (self.budget is None or self.copied + n <= self.budget) and self.off + n <= self.pool.numel():
                ev = torch.cuda.Event()
                ev.record()
                self.side.wait_event(ev)
                e["host"] = self.pool[self.off:self.off + n]
                self.off += (n + 4095) // 4096 * 4096
                with torch.cuda.stream(self.side):
                    e["host"].copy_(e["dev"], non_blocking=True)
                e["done"] = torch.cuda.Event()
                e["done"].record(self.side)
                self.copied += n
                e["q_at"] = self.copied
                self.waiting.append(e)
        e["refs"] += 1
        self._release()
        return (e, t.dtype, t.size(), t.stride(), t.storage_offset())

    def _release(self, final=False):
        cur = torch.cuda.current_stream()
        while self.waiting:
            e = self.waiting[0]
            if self.release == "poll" and not e["done"].query():
                break
            if self.release == "lagged" and not final and self.cum < e["q_at"] * self.ratio:
                break
            if self.release in ("ordered", "lagged"):
                cur.wait_event(e["done"])
            self.by_ptr.pop(e["dev"].untyped_storage().data_ptr(), None)
            e["dev"] = None
            self.released += e["n"]
            self.waiting.popleft()

    def end_forward(self):
        self._release()
        self.released_before_peak = self.released
        self.cursor = len(self.order) - 1

    def _prefetch(self):
        ahead = sum(e["n"] for e in self.order if e["buf"] is not None and e["dev"] is None)
        while self.cursor >= 0 and ahead < self.read_ahead:
            e = self.order[self.cursor]
            self.cursor -= 1
            if e["dev"] is None and e["buf"] is None and not e["gone"]:
                e["buf"] = torch.empty(e["n"], dtype=torch.uint8, device="cuda")
                self.rside.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.rside):
                    e["buf"].copy_(e["host"], non_blocking=True)
                e["rdone"] = torch.cuda.Event()
                e["rdone"].record(self.rside)
                ahead += e["n"]

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        e, dtype, size, stride, offset = packed
        if e["dev"] is not None:
            buf = e["dev"]
        else:
            if self.cursor is not None:
                self._prefetch()
            if e["buf"] is None:  # out of order: read it now
                e["buf"] = torch.empty(e["n"], dtype=torch.uint8, device="cuda")
                e["buf"].copy_(e["host"], non_blocking=True)
            if e["rdone"] is not None:
                torch.cuda.current_stream().wait_event(e["rdone"])
                e["buf"].record_stream(torch.cuda.current_stream())
                e["rdone"] = None
            buf = e["buf"]
            e["used"] += 1
            if e["used"] >= e["refs"]:  # autograd holds what it was handed; the entry lets go
                e["buf"] = None
                e["gone"] = True
        return torch.empty(0, dtype=dtype, device="cuda").set_(buf.untyped_storage(), offset, size, stride)


def lag_and_proto(cfg: GPTConfig, batch: int, steps: int, variants: list[tuple[str, str | None, float | None, bool]],
                  d2h: float, pool: torch.Tensor) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), device="cuda")
    x, y = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for name, release, budget_share, recompute in variants:
      try:
        model.recompute = recompute
        proto = None
        rows = []
        for i in range(steps + 1):
            model.zero_grad(set_to_none=True)
            _sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            t0 = time.perf_counter()
            e0.record()
            if release is None:
                seen, count = _saved_bytes_hook(params)
                with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
                    loss = model(x, y)
            else:
                if proto is None:
                    budget = None
                    if budget_share is not None:
                        budget = int(budget_share * d2h * 1e9 * results["baseline"]["fwd_gpu_s"])
                    ref = results["recompute" if recompute and "recompute" in results else "baseline"]
                    ratio = 1.1 * ref["saved_unique"] / ref["fwd_gpu_s"] / (d2h * 1e9)
                    proto = Proto(pool, release, budget, params, ratio=ratio)
                proto.new_step()
                with torch.autograd.graph.saved_tensors_hooks(proto.pack, proto.unpack):
                    loss = model(x, y)
                proto.end_forward()
            t_launch = time.perf_counter() - t0
            e1.record()
            loss.backward()
            e2.record()
            _sync()
            t_step = time.perf_counter() - t0
            row = {"step_s": t_step, "fwd_host_launch_s": t_launch, "fwd_gpu_s": e0.elapsed_time(e1) / 1e3,
                   "bwd_gpu_s": e1.elapsed_time(e2) / 1e3, "peak_above_step_start": torch.cuda.max_memory_allocated() - base}
            if release is None:
                row["saved_unique"] = sum(seen.values())
            else:
                row["copied"] = proto.copied
                row["released_before_fwd_end"] = proto.released_before_peak
            if i:
                rows.append(row)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        if name != "baseline" and "baseline" in results:
            b = results["recompute" if recompute and "recompute" in results else "baseline"]
            med["step_vs_ref"] = med["step_s"] / b["step_s"]
            med["peak_fall"] = b["peak_above_step_start"] - med["peak_above_step_start"]
        results[name] = med
        print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in med.items()}, flush=True)
        del proto
        torch.cuda.empty_cache()
      except Exception as err:  # one variant failing must not lose the others
        import traceback
        traceback.print_exc()
        results[name] = {"error": repr(err)[:300]}
        proto = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_tier_probe: no CUDA device")
        return 1
    out = {"env": env()}
    print(json.dumps(out["env"]), flush=True)
    for name, fn in (("pin", lambda: pin([1, 4] if args.quick else [1, 4, 16])), ("rates", rates),
                     ("host_us", host_us)):
        try:
            out[name] = fn()
        except Exception as err:
            import traceback
            traceback.print_exc()
            out[name] = {"error": repr(err)[:300]}
        print(name, out[name], flush=True)
    d2h = out["rates"].get("d2h_4MiB_x256", 25.0)
    variants = [("baseline", None, None, False), ("poll_all", "poll", None, False),
                ("ordered_all", "ordered", None, False), ("poll_budget", "poll", 0.9, False),
                ("ordered_budget", "ordered", 0.9, False), ("lagged_all", "lagged", None, False),
                ("lagged_budget", "lagged", 0.9, False),
                ("recompute", None, None, True), ("recompute_poll", "poll", None, True),
                ("recompute_ordered", "ordered", None, True), ("recompute_lagged", "lagged", None, True)]
    shapes = {"gpu_preset_b4": (preset("gpu"), 4)}
    if not args.quick:
        shapes["6x4096_s4096_b2"] = (GPTConfig(vocab=32768, seq=4096, layers=6, hidden=4096, heads=32), 2)
        shapes["24x2048_s8192_b1"] = (GPTConfig(vocab=32768, seq=8192, layers=24, hidden=2048, heads=16), 1)
    out["proto"] = {}
    pool = torch.empty(16 << 30, dtype=torch.uint8, pin_memory=True)
    for name, (cfg, batch) in shapes.items():
        print("==", name, flush=True)
        out["proto"][name] = lag_and_proto(cfg, batch, args.steps, variants, d2h, pool)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
