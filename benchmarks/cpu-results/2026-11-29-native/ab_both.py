"""In one process, rounds alternated (``pack_cost.alternate``): Note [unpack's common case without
calls] and Note [a model's storages are found in one walk] against unpack as of ac0ad3f (read from
git) and the pinned keys from ``parameters()`` and ``buffers()``. Run from the repository root:
``python benchmarks/cpu-results/2026-11-29-native/ab_both.py``."""
import subprocess, sys, tempfile, itertools, importlib.util
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.engine import unpack, keep
_old_src = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
_old_src.write(subprocess.run(["git", "show", "ac0ad3f:ssdtrain/engine/unpack.py"], capture_output=True, text=True,
                              check=True).stdout)
_old_src.close()
spec = importlib.util.spec_from_file_location("unpack_old", _old_src.name)
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_u, new_e, new_k = unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys
from ssdtrain.engine.offloader import Offloader
_see = Offloader._see_peak
def _see_guarded(self):  # _see_peak as of ac0ad3f, which asked its own question (the old unpack relies on it)
    if self._tier.clock.reference is not None or self._fwd_dev is None:
        return
    _see(self)
def old_k(models):
    return keep.storage_keys(t for m in models for t in itertools.chain(m.parameters(), m.buffers()))
def as_new(off):
    unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = new_u, new_e, new_k
    Offloader._see_peak = _see
def walk_only(off):
    unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = old.UnpackHooks._unpack, old.UnpackHooks._unpack_entry, new_k
    Offloader._see_peak = _see_guarded
def as_old(off):
    unpack.UnpackHooks._unpack, unpack.UnpackHooks._unpack_entry, keep.model_storage_keys = old.UnpackHooks._unpack, old.UnpackHooks._unpack_entry, old_k
    Offloader._see_peak = _see_guarded
pack_cost.alternate({"both": as_new, "walk only": walk_only, "before": as_old}, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
