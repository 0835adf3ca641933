"""In one process, rounds alternated: the tier's batch of copies with the GIL released once
(compiled) against one ctypes call a copy. Run from the repository root."""
import sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.device import copies
native = copies._compiled()
assert native is not None
def batched(off): copies._native = native
def per_copy(off): copies._native = False
pack_cost.alternate({"batched": batched, "per-copy": per_copy}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
