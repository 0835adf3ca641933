"""Run in a fresh process: RSS growth across one GPT forward, with or without offloading.

glibc is told (MALLOC_MMAP_THRESHOLD_) to map large blocks directly, so memory freed by the
offloader really leaves the process and RSS measures what is held.
"""

import json
import sys
import tempfile

import torch

import ssdtrain
from ssdtrain.bench.models import GPT, GPTConfig


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, seq=128, layers=8, hidden=256, heads=4, dropout=0.0)
    model = GPT(cfg)
    tok = torch.randint(0, cfg.vocab, (8, cfg.seq))
    off = None
    if mode == "offload":
        off = ssdtrain.Offloader(model, path=tempfile.mkdtemp(), min_bytes=0, max_inflight_bytes="4MiB",
                                 prefetch_bytes="4MiB", when_full="wait")
    for step in range(2):  # the first step warms allocator and kernels
        before = rss()
        if off is None:
            loss = model(tok, tok)
        else:
            with off:
                loss = model(tok, tok)
            off.wait()
        growth = rss() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
    print(json.dumps({"growth": growth, "stats": off.stats().as_dict() if off else None}))
    if off:
        off.close()


if __name__ == "__main__":
    main()
