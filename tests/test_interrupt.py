"""Note [an interrupt never unbalances a count] and Note [a lost __del__ is found again]:
KeyboardInterrupts at random moments of training never hang wait() or close(), leave no disk
bytes counted and no file. One live entry was still left in about 1 run of 10 seeds (issue 17's
note); the child reports live entries and resident bytes, asserted here once that is found."""

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(r"""
    import gc, json, os, random, signal, sys
    import torch
    import ssdtrain

    random.seed(int(sys.argv[2]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                                      torch.nn.LayerNorm(256)) for _ in range(6)])
    x = torch.randn(256, 256)
    off = ssdtrain.Offloader(model, path=sys.argv[1], min_bytes=0, chunk_bytes="64KiB", io_threads=1)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    hits = 0
    for step in range(60):
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(0.0005, 0.03))
            with off:
                loss = model(x).sum()
            loss.backward()
            off.wait()
        except KeyboardInterrupt:
            hits += 1
        finally:
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
""")


def test_random_interrupts_leave_nothing_behind(off_dir):
    for seed in (1, 2, 3):
        out = subprocess.run([sys.executable, "-c", CHILD, str(off_dir), str(seed)], capture_output=True, text=True,
                             timeout=240, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert out.returncode == 0, out.stderr[-3000:]
        r = json.loads(out.stdout.strip().splitlines()[-1])
        assert r["hits"] >= 10, r  # the interrupts really landed inside steps
        assert r["written"] > 0, r
        assert r["disk"] == 0, r
        assert r["left"] == [], r
