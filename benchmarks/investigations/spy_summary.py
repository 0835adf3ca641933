"""A short text summary of a ``py-spy record --threads --idle -f raw`` profile, per thread.

py-spy's raw output of a few seconds of a GPU step is tens of MB (more than a lent GPU machine
sends back); this reduces it where it was taken: each thread's samples, the frames where its
samples end (its own time, asleep included with ``--idle``) and the frames on its stacks
(inclusive), each frame as ``function file:line`` (or the library, for native frames).

    py-spy record --threads --idle -r 250 -f raw -o spy.txt -- python benchmarks/investigations/tier_host_cost.py ...
    python benchmarks/investigations/spy_summary.py spy.txt [--threads 4] [--top 40] > spy-summary.txt
"""

from __future__ import annotations

import argparse
import collections
import sys


def frame(f: str) -> str:
    """``name (path/to/file.py:12)`` as ``name file.py:12``."""
    if " (" not in f or not f.endswith(")"):
        return f
    name, loc = f.split(" (", 1)
    return f"{name} {loc[:-1].rsplit('/', 1)[-1]}"


def summarize(lines, threads: int = 4, top: int = 40) -> str:
    total: collections.Counter = collections.Counter()
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    on_stack: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        body = [frame(f) for f in frames if not f.startswith(("thread ", "process "))]
        total[thread] += n
        if body:
            own[thread][body[-1]] += n
        for f in set(body):
            on_stack[thread][f] += n
    out = [f"{n:8d} samples  {t}" for t, n in total.most_common()]
    for t, n in total.most_common(threads):
        out.append(f"\n=== {t}: {n} samples; own (where samples end)")
        out += [f"{c:8d} {100 * c / n:5.1f}%  {f}" for f, c in own[t].most_common(top)]
        out.append(f"=== {t}: on the stack (inclusive)")
        out += [f"{c:8d} {100 * c / n:5.1f}%  {f}" for f, c in on_stack[t].most_common(top)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", help="py-spy's raw output (-f raw)")
    ap.add_argument("--threads", type=int, default=4, help="threads detailed, busiest first")
    ap.add_argument("--top", type=int, default=40, help="frames per list")
    args = ap.parse_args(argv)
    with open(args.raw, errors="replace") as f:
        sys.stdout.write(summarize(f, args.threads, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
