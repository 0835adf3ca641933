"""What issuing the host tier's copies on an I/O thread costs the training thread (issue 29, item 4).

The training thread launches small kernels in a loop (a host-bound forward's stand-in) while an
I/O thread issues device-to-host copies into pinned memory on a side stream, one after another,
as the tier's copy thread does. The loop's time per launch, beside the same loop alone, is what
each issued copy takes from the training thread: the copy thread holds the GIL while torch
queues a copy (``Tensor.copy_`` does not release it), so the training thread waits. Ways of
issuing, side by side in one process, alternated over rounds:

* ``alone``: no copies (the reference);
* ``torch``: as ``ssdtrain.device.copies.queue_copies`` does: ``torch.cuda.stream`` context, ``copy_``
  with ``non_blocking=True``, one event recorded after each batch;
* ``ctypes`` (CUDA only): ``cudaMemcpyAsync`` and ``cudaEventRecord`` called through ctypes on
  the ``libcudart`` torch loaded, which releases the GIL during each call.

Prints, per way: the loop's microseconds per launch, its extra over ``alone`` per copy issued,
and the copy thread's microseconds per copy. On the CPU (``--device cpu``) only ``alone`` and
``torch`` run (``copy_`` between host tensors), a smoke run of the harness.

    python benchmarks/investigations/copy_issue_cost.py --device cuda [--copies 400] [--mib 8] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading
import time

import torch

from ssdtrain.bench._device import resolve_device

MODES = ("alone", "torch", "ctypes")
D2H = 2  # cudaMemcpyDeviceToHost


def _cudart() -> ctypes.CDLL:
    """The libcudart torch has loaded (found in this process's mappings)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    if not paths:
        raise RuntimeError("no libcudart is loaded in this process")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    return lib


def _issue(mode: str, dev: torch.device, srcs: list, dsts: list, batch: int, out: dict) -> None:
    """The copy thread: every copy issued, ``batch`` at a time; its own time per copy."""
    start = time.thread_time()
    if mode == "torch":
        cuda = dev.type == "cuda"
        stream = torch.cuda.Stream(dev) if cuda else None
        for i in range(0, len(srcs), batch):
            if cuda:
                with torch.cuda.device(dev), torch.cuda.stream(stream):
                    for s, d in zip(srcs[i:i + batch], dsts[i:i + batch]):
                        d.copy_(s, non_blocking=True)
                    torch.cuda.Event().record(stream)
            else:
                for s, d in zip(srcs[i:i + batch], dsts[i:i + batch]):
                    d.copy_(s)
    elif mode == "ctypes":
        lib = _cudart()
        lib.cudaSetDevice(dev.index or 0)
        stream = torch.cuda.Stream(dev)
        events = []
        for i in range(0, len(srcs), batch):
            for s, d in zip(srcs[i:i + batch], dsts[i:i + batch]):
                err = lib.cudaMemcpyAsync(d.data_ptr(), s.data_ptr(), s.nbytes, D2H, stream.cuda_stream)
                if err:
                    raise RuntimeError(f"cudaMemcpyAsync failed: error {err}")
            ev = torch.cuda.Event()
            events.append(ev)
            if not ev.cuda_event or lib.cudaEventRecord(ev.cuda_event, stream.cuda_stream):
                ev.record(stream)  # torch makes its event at the first record: then through torch
        stream.synchronize()
    out["thread_us_per_copy"] = (time.thread_time() - start) / max(1, len(srcs)) * 1e6
    out["issued_at"] = time.perf_counter()  # every copy queued by then


def run_round(mode: str, dev: torch.device, copies: int, nbytes: int, launches: int, batch: int) -> dict:
    cuda = dev.type == "cuda"
    srcs = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(copies)] if mode != "alone" else []
    dsts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in srcs]
    y = torch.zeros(16, device=dev)
    if cuda:
        torch.cuda.synchronize(dev)
    out: dict = {}
    thread = threading.Thread(target=_issue, args=(mode, dev, srcs, dsts, batch, out)) if srcs else None
    t0 = time.perf_counter()
    if thread is not None:
        thread.start()
    for _ in range(launches):
        y.add_(1)
    loop_end = time.perf_counter()
    loop_s = loop_end - t0
    if thread is not None:
        thread.join()
    if cuda:
        torch.cuda.synchronize(dev)
    return {"mode": mode, "loop_us_per_launch": loop_s / launches * 1e6, "copies": len(srcs),
            "thread_us_per_copy": out.get("thread_us_per_copy"),
            # the extra per copy counts every copy only if all were issued while the loop ran
            "issued_within_loop": thread is None or out["issued_at"] <= loop_end}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--copies", type=int, default=400, help="copies issued per round")
    ap.add_argument("--mib", type=float, default=8.0, help="bytes per copy, MiB")
    ap.add_argument("--launches", type=int, default=20000, help="kernel launches of the training loop per round")
    ap.add_argument("--batch", type=int, default=4, help="copies per batch on the copy thread")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    ns = ap.parse_args(argv)
    dev = resolve_device(ns.device)
    modes = MODES if dev.type == "cuda" else MODES[:2]
    nbytes = int(ns.mib * (1 << 20))
    run_round("torch", dev, 8, nbytes, 100, ns.batch)  # warm-up: the stream, the allocator
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(ns.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            rows[mode].append(run_round(mode, dev, ns.copies, nbytes, ns.launches, ns.batch))
    alone = statistics.median(x["loop_us_per_launch"] for x in rows["alone"])
    result = []
    print(f"{dev}: {ns.launches} launches a round beside {ns.copies} copies of {ns.mib:g} MiB, {ns.rounds} rounds")
    print(f"{'way':8} {'us/launch':>10} {'extra us per copy issued':>26} {'copy thread us/copy':>20}")
    for mode in modes:
        loop = statistics.median(x["loop_us_per_launch"] for x in rows[mode])
        per = None if mode == "alone" else (loop - alone) * ns.launches / ns.copies
        thread = [x["thread_us_per_copy"] for x in rows[mode] if x["thread_us_per_copy"] is not None]
        th = statistics.median(thread) if thread else None
        result.append({"mode": mode, "loop_us_per_launch": loop, "extra_us_per_copy": per, "thread_us_per_copy": th})
        print(f"{mode:8} {loop:10.2f} {'-' if per is None else f'{per:.1f}':>26} {'-' if th is None else f'{th:.1f}':>20}")
    if not all(x["issued_within_loop"] for xs in rows.values() for x in xs):
        print("some copies were issued after the loop ended: the extra per copy is a lower bound (more --launches)")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"device": str(dev), "args": vars(ns), "rows": result}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
