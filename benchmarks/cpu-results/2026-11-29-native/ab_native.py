"""In one process, rounds alternated: the compiled pack against pure Python (``hooks._native_pack``
set to None). Run from the repository root."""
import sys
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.engine import hooks
native = hooks._native_pack
def on(off): hooks._native_pack = native
def off_(off): hooks._native_pack = None
pack_cost.alternate({"compiled": on, "pure": off_}, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
