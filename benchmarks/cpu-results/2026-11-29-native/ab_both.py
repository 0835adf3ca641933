import sys, itertools, importlib.util
sys.path.insert(0, "/work/main/benchmarks")
import pack_cost
from ssdtrain.engine import unpack, keep
spec = importlib.util.spec_from_file_location("unpack_old", "unpack_ac0ad3f.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_u, new_e, new_k = unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys
def old_k(models):
    return keep.storage_keys(t for m in models for t in itertools.chain(m.parameters(), m.buffers()))
def as_new(off): unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = new_u, new_e, new_k
def walk_only(off): unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = old.UnpackHooks._unpack, old.UnpackHooks._unpack_entry, new_k
def as_old(off): unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = old.UnpackHooks._unpack, old.UnpackHooks._unpack_entry, old_k
pack_cost.alternate({"both": as_new, "walk only": walk_only, "before": as_old}, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
