"""Stress: KeyboardInterrupts at random moments of training (SIGALRM), then wait() and close().

    python benchmarks/interrupt_soak.py [--seeds 20] [--path DIR] [--min-bytes N]

``--min-bytes 4096`` makes the LayerNorms' statistics small saves (Note [a small save skips the
cache]) beside the activations that go to the drive.

Prints, per seed, the interrupts that landed and what was left: live entries, resident and disk
bytes, drive space retired (``lost_bytes``), files. A seed that hangs is killed after 100 s, with
every thread's stack. Real signals land where timing puts them; for the same stress at
reproducible moments see ``tests/test_interrupt.py`` (interrupts as a random Python function
begins). Results: see Note [an interrupt never unbalances a count] in docs/design.md.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r'''

import faulthandler, gc, json, os, random, signal, sys
import torch
import ssdtrain

faulthandler.dump_traceback_later(100, exit=True)  # a hang: every thread's stack, before the kill

random.seed(int(sys.argv[2]))
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                                  torch.nn.LayerNorm(256)) for _ in range(6)])
x = torch.randn(256, 256)
off = ssdtrain.Offloader(model, path=sys.argv[1], min_bytes=int(sys.argv[3]), chunk_bytes="64KiB", io_threads=1)

armed = [False]  # one interrupt per step, and none once the step is over (a late timer)

def interrupt(signum, frame):
    if armed[0]:
        armed[0] = False
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, interrupt)
hits = 0
for step in range(60):
    try:
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.03))
        with off:
            loss = model(x).sum()
        loss.backward()
        off.wait()
    except KeyboardInterrupt:
        hits += 1
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    loss = None
    model.zero_grad(set_to_none=True)
    gc.collect()
off.wait()
s = off.stats()
off.close()
print(json.dumps(dict(hits=hits, live=s.live_entries, disk=s.live_disk_bytes, lost=getattr(s, "lost_bytes", 0),
                      resident=s.resident_bytes, written=s.written_bytes,
                      left=os.listdir(sys.argv[1]))))
'''


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--path", default=None)
    p.add_argument("--min-bytes", type=int, default=0)
    ns = p.parse_args(argv)
    bad = 0
    for seed in range(1, ns.seeds + 1):
        d = tempfile.mkdtemp(dir=ns.path)
        try:
            out = subprocess.run([sys.executable, "-c", CHILD, d, str(seed), str(ns.min_bytes)], capture_output=True, text=True,
                                 timeout=120)
            line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
            r = json.loads(line) if line else {"error": out.stderr.strip().splitlines()[-1:]}
            if "Timeout" in out.stderr:
                r = {"error": "hung", "stacks": out.stderr[-6000:]}
        except subprocess.TimeoutExpired:
            r = {"error": "hung"}
        ok = r.get("live") == 0 and r.get("resident") == 0 and r.get("disk") == 0 and r.get("left") == []
        bad += not ok
        print(f"seed {seed:3d} {'ok ' if ok else 'BAD'} {json.dumps(r)}", flush=True)
        os.rmdir(d) if not os.listdir(d) else None
    print(f"{ns.seeds - bad} of {ns.seeds} seeds clean")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
