"""In one process: unpack's common case with claim, finished, order_after, for_consumer and the
window's limit asked inline (this tree) against the functions of the tree before (HEAD~N given,
default 965701e), swapped in by name. `python benchmarks/cpu-results/2026-11-30-threads/ab_unpack_inline.py ROUNDS [REV]`."""
import subprocess, sys, types
sys.path.insert(0, "benchmarks")
import pack_cost
from ssdtrain.engine import reader, unpack
rev = sys.argv[2] if len(sys.argv) > 2 else "965701e"
def old(path, name):
    src = subprocess.check_output(["git", "show", f"{rev}:{path}"], text=True)
    mod = types.ModuleType(name)
    mod.__file__ = path
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod
old_reader, old_unpack = old("ssdtrain/engine/reader.py", "old_reader"), old("ssdtrain/engine/unpack.py", "old_unpack")
new = {"prefetch": reader.Reader.prefetch, "finished": reader.Reader.finished, "entry": unpack.UnpackHooks._unpack_entry}
def use_new(off):
    reader.Reader.prefetch, reader.Reader.finished = new["prefetch"], new["finished"]
    unpack.UnpackHooks._unpack_entry = new["entry"]
def use_old(off):
    reader.Reader.prefetch, reader.Reader.finished = old_reader.Reader.prefetch, old_reader.Reader.finished
    unpack.UnpackHooks._unpack_entry = old_unpack.UnpackHooks._unpack_entry
pack_cost.alternate({"inline": use_new, "before": use_old}, int(sys.argv[1]) if len(sys.argv) > 1 else 7)
