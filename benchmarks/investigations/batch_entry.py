"""What a save would cost with one entry per hand-over batch: a prototype, not the engine.

Issue 64 asks the host tier's path for at most 10 us a pack and an unpack and 25 us of all threads
a save on this VM; the engine spends about 50, 40 and 127 (above the copies' own floor: Note [the
copies' own floor] in ``benchmarks/pack_cost.py``), spread over some forty functions a save
(entry, Ref, host extent, hand-over, completion, release, read, rebuild). This file measures the
design the 2026-11-29 note proposes before anyone builds it into the engine: the saves handed over
together share one entry (``_Batch``): one host region, one copy, one release, one read back; a
save is a dedup lookup, a part record and a handle. It keeps what every save must pay in the
engine too: storage dedup, views rebuilt with their own geometry, the version check, the op-return
rule (a batch goes only once the op that saved its last save returned), a copy thread and a read
thread, reads ahead in backward, memory released at a safe point once its copy is done. It leaves
out what is per step or per batch in the engine (scopes, clocks, budgets, counters, errors,
interrupts), so its figures are a floor for the design, not a promise.

    python benchmarks/investigations/batch_entry.py [--steps 20] [--rounds 5]

Prints, per mode (identity, copies, batch), pack and unpack us a call on the training thread and
all threads' CPU a save above identity, alternated rounds, medians; ``batch`` is checked against
identity's gradients (``torch.equal``) every step.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import pack_cost  # noqa: E402  (the copies floor, the timing wrapper)

from ssdtrain.bench.models import GPT, GPTConfig  # noqa: E402

BATCH = 8
_op_now = torch.autograd._get_sequence_nr
_Tensor, _Parameter = torch.Tensor, torch.nn.Parameter


class _Batch:
    __slots__ = ("parts", "nbytes", "op", "offset", "copied", "released", "buf", "read", "index")

    def __init__(self, index: int) -> None:
        self.parts: list = []  # [storage, alias (the version's holder), nbytes, offset in the batch, key]
        self.nbytes = 0
        self.op = None
        self.offset = -1  # in the pool, once handed over
        self.copied = self.released = False
        self.buf = None
        self.read = None
        self.index = index


class _Save:
    """The handle autograd holds: the batch, the part, and the view's geometry."""

    __slots__ = ("batch", "part", "dtype", "size", "stride", "offset", "version")


class BatchHooks:
    def __init__(self) -> None:
        self.pool = torch.empty(512 << 20, dtype=torch.uint8)
        self.base = self.pool.data_ptr()
        self.lock = threading.Lock()
        self.copy_q: deque = deque()
        self.read_q: deque = deque()
        self.wake_copy = threading.Event()
        self.wake_read = threading.Event()
        self.done: deque = deque()  # batches copied, released at the next safe point
        threading.Thread(target=self._copier, daemon=True).start()
        threading.Thread(target=self._reader, daemon=True).start()
        self.new_step()

    def new_step(self) -> None:
        self.keys: dict = {}  # storage key -> (batch, part)
        self.batches: list[_Batch] = []
        self.open = _Batch(0)
        self.used = 0

    # -- pack: a lookup, a part, a handle; a hand-over every BATCH new storages ------------------
    def pack(self, t: torch.Tensor):
        if type(t) is _Parameter or (t.requires_grad and t.is_leaf) or type(t) is not _Tensor:
            return t
        if self.done:
            self._release()
        storage = t.untyped_storage()
        key = storage._cdata
        op = _op_now()
        found = self.keys.get(key)
        if found is None:
            b = self.open
            if b.parts and b.op != op and len(b.parts) >= BATCH:  # its last save's op returned
                self._hand_over(b)
                b = self.open
            n = storage.nbytes()
            part = len(b.parts)
            b.parts.append([storage, t.detach(), n, b.nbytes, key])
            b.nbytes += n
            b.op = op
            found = self.keys[key] = (b, part)
        s = _Save()
        s.batch, s.part = found
        s.dtype, s.size, s.stride = t.dtype, t.shape, t.stride()
        s.offset = found[0].parts[found[1]][3] + t.storage_offset() * t.itemsize
        s.version = t._version
        return s

    def _hand_over(self, b: _Batch) -> None:
        b.offset = self.used
        self.used += b.nbytes
        self.batches.append(b)
        self.open = _Batch(len(self.batches))
        self.copy_q.append(b)
        self.wake_copy.set()

    def _copier(self) -> None:
        while True:
            self.wake_copy.wait()
            self.wake_copy.clear()
            while self.copy_q:
                b = self.copy_q.popleft()
                at = self.base + b.offset
                for storage, _, n, off, _key in b.parts:
                    ctypes.memmove(at + off, storage.data_ptr(), n)
                b.copied = True
                self.done.append(b)

    def _release(self) -> None:
        """At a safe point: a copied batch's memory goes (its aliases and storages)."""
        while self.done:
            b = self.done.popleft()
            for p in b.parts:
                p[0] = p[1] = None
                # its address may be a new storage's from here on (Note [a storage is not its address])
                if self.keys.get(p[4], (None,))[0] is b:
                    del self.keys[p[4]]
            b.released = True

    # -- unpack: the batch read back whole, ahead; the view rebuilt on its buffer ------------------
    def unpack(self, s):
        if type(s) is not _Save:
            return s
        b = s.batch
        if not b.released:
            p = b.parts[s.part]
            alias = p[1]
            if alias is None:  # released meanwhile (by the copier's batch, at a safe point)
                return self._from_buffer(s, b)
            if alias._version != s.version:
                raise RuntimeError("modified in place after save")
            out = torch.empty(0, dtype=s.dtype).set_(p[0], (s.offset - p[3]) // s.dtype.itemsize, s.size, s.stride)
            return out
        return self._from_buffer(s, b)

    def _from_buffer(self, s, b: _Batch):
        if b.read is None:
            self._read(b)
        if b.index > 0 and self.batches[b.index - 1].read is None:  # one batch ahead
            self._read(self.batches[b.index - 1])
        if not b.read.is_set():
            b.read.wait()
        return torch.empty(0, dtype=s.dtype).set_(b.buf.untyped_storage(), s.offset // s.dtype.itemsize, s.size,
                                                  s.stride)

    def _read(self, b: _Batch) -> None:
        b.read = threading.Event()
        b.buf = torch.empty(b.nbytes, dtype=torch.uint8)
        self.read_q.append(b)
        self.wake_read.set()

    def _reader(self) -> None:
        while True:
            self.wake_read.wait()
            self.wake_read.clear()
            while self.read_q:
                b = self.read_q.popleft()
                while not b.copied:
                    time.sleep(0.0001)
                ctypes.memmove(b.buf.data_ptr(), self.base + b.offset, b.nbytes)
                b.read.set()

    def step_done(self) -> None:
        if self.open.parts:
            self._hand_over(self.open)  # (the engine keeps the last ones; here they go like any)
        while self.copy_q:
            time.sleep(0.0001)
        self._release()
        self.new_step()


def measure(mode: str, model, tokens, steps: int, want) -> dict:
    spent = dict.fromkeys(("_pack", "_unpack", "_pack_n", "_unpack_n", "_pack_calls_n", "profile"), 0)
    batch = BatchHooks() if mode == "batch" else None
    mover = pack_cost._Mover() if mode == "copies" else None
    if batch is not None:
        hooks = pack_cost._Hooks(batch.pack, batch.unpack)
    elif mover is not None:
        hooks = pack_cost._Hooks(mover.pack, mover.unpack)
    else:
        hooks = pack_cost._Hooks(lambda t: t, lambda t: t)
    pack_cost._timed(hooks, spent, None)
    step_all = []
    for i in range(steps + 3):
        if i == 3:
            for k in spent:
                spent[k] = 0
        model.zero_grad(set_to_none=True)
        p = time.process_time()
        with torch.autograd.graph.saved_tensors_hooks(hooks._pack, hooks._unpack):
            loss = model(tokens, tokens)
        loss.backward()
        if batch is not None:
            batch.step_done()
        if mover is not None:
            mover.step_done()
        p2 = time.process_time()
        if i >= 3:
            step_all.append(p2 - p)
        if mode == "batch":
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want)), "batch: gradients differ"
    if mover is not None:
        mover.running = False
    return {"mode": mode, "pack_us": spent["_pack"] / spent["_pack_n"] * 1e6,
            "unpack_us": spent["_unpack"] / max(spent["_unpack_n"], 1) * 1e6,
            "saves": spent["_pack_n"] / steps, "step_ms": statistics.median(step_all) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
    tokens = torch.randint(0, 512, (2, 64))
    model(tokens, tokens).backward()
    want = [p.grad.clone() for p in model.parameters()]  # dropout 0: every step's gradients are these
    runs: dict[str, list] = {"identity": [], "copies": [], "batch": []}
    for _ in range(a.rounds):
        for mode in runs:
            runs[mode].append(measure(mode, model, tokens, a.steps, want))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("pack_us", "unpack_us", "saves", "step_ms")}
           for m, rs in runs.items()}
    print(f"{'mode':9s} {'pack us':>8s} {'unpack us':>10s} {'all threads +us/save':>21s}")
    for m, r in med.items():
        extra = (r["step_ms"] - med["identity"]["step_ms"]) * 1e3 / r["saves"]
        print(f"{m:9s} {r['pack_us']:8.1f} {r['unpack_us']:10.1f} {extra:21.1f}")
    print("batch: gradients torch.equal to identity's at every step; all threads: the step's process CPU above "
          "identity's, a save (copies: the same storages moved out and back with no engine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
