"""In one process: reads issued when a quarter of the window is free (landed) against half and
three quarters; with the read batches a step counted (h2d wake-ups). Not a design: a measurement."""
import sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.engine import reader
from ssdtrain.host import tier
count = {"n": 0}
orig = tier.TieredBackend.submit_reads
def counted(self, requests):
    count["n"] += 1
    return orig(self, requests)
orig_one = tier.TieredBackend.submit_read
def counted_one(self, *a, **k):
    count["n"] += 1
    return orig_one(self, *a, **k)
tier.TieredBackend.submit_reads, tier.TieredBackend.submit_read = counted, counted_one
def share(v):
    def setup(off):
        reader.READ_BATCH_SHARE = v
    return setup
runs = pack_cost.alternate({"0.25": share(0.25), "0.5": share(0.5), "0.75": share(0.75)},
                           int(sys.argv[1]) if len(sys.argv) > 1 else 7)
