"""In one process: a read batch issued once the room freed holds the next entry (landed) against
once it holds two or three of its size (fewer, larger read batches; reads later). Read batches a
step counted. A prototype of Reader.prefetch's gate."""
import sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.engine import reader
from ssdtrain.engine.reader import READ_BATCH_SHARE, on_drive
from ssdtrain.host import tier

count = {"n": 0}
orig_submit = tier._Batches.submit
def counted(self, requests):
    if self._process.__name__ == "_copy_out":
        count["n"] += 1
    return orig_submit(self, requests)
tier._Batches.submit = counted
orig = reader.Reader.prefetch
K = {"k": 1}
def prefetch(self, scope, layer):
    if layer is not None:
        scope.layer_now = layer
    limit = self._window.limit(self._counters.total.resident_bytes, scope.ahead)
    if (self._many is not None and scope.ahead and scope.cursor >= 0
            and not on_drive(scope.order[scope.cursor].extent)):
        room = limit - scope.ahead
        if room < limit * READ_BATCH_SHARE:
            return
        if self._window.peak is not None and room < K["k"] * scope.order[scope.cursor].nbytes:
            return
    strict = self._window.peak is not None
    picked = scope.advance(layer, max_bytes=limit, max_layers=self._max_layers, strict=strict)
    if len(picked) > 1 and self._many is not None:
        self._issue_all(picked)
        return
    for e in picked:
        self.issue(e)
def variant(k):
    def setup(off):
        reader.Reader.prefetch = orig if k == 0 else prefetch
        K["k"] = k
    return setup
names = {"landed": 0, "two": 2, "three": 3}
pack_cost.alternate({n: variant(k) for n, k in names.items()}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
