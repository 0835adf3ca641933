# Where a tier pack's time goes (issue 29, item 4): 300 packs of fresh CPU tensors through the tier (as CUDA
# saves go on a GPU), the training thread's CPU time per pack, with parts of the engine stubbed out.
# python benchmarks/cpu-results/2026-11-27-pack-cost/isolated_pump.py
import torch, time, tempfile, ssdtrain, statistics, sys
from ssdtrain.engine import offloader as om, writer, hooks
from ssdtrain.host import tier
om._TIER_DEVICES=("cuda","cpu")
def measure(label, patch=None, unpatch=None):
    if patch: patch()
    off=ssdtrain.Offloader(path=tempfile.mkdtemp(), min_bytes=0, backend="memory")
    x=torch.randn(2,64,64,requires_grad=True)
    res=[]
    for r in range(12):
        ts=[(x*1.0) for _ in range(300)]
        with off:
            t0=time.thread_time()
            refs=[off._pack(t) for t in ts]
            res.append((time.thread_time()-t0)/300*1e6)
        del refs, ts
        try: off.wait()
        except Exception: pass
    off.close()
    if unpatch: unpatch()
    print(f"{label:30s} {statistics.median(res[3:]):6.1f} us/pack")
orig_pump = writer.WriteQueue.pump
measure("tier")
measure("tier, no pump", lambda: setattr(writer.WriteQueue, "pump", lambda self: None), lambda: setattr(writer.WriteQueue, "pump", orig_pump))
orig_safe = hooks.SaveHooks._safe_point
measure("tier, no safe point", lambda: setattr(hooks.SaveHooks, "_safe_point", lambda self, raise_errors: None), lambda: setattr(hooks.SaveHooks, "_safe_point", orig_safe))
measure("tier again")
import itertools
for k in (2, 4, 8, 16):
    cnt = itertools.count()
    def every(self, k=k, cnt=cnt):
        if next(cnt) % k == 0:
            orig_pump(self)
    measure(f"tier, pump every {k}", lambda every=every: setattr(writer.WriteQueue, "pump", every), lambda: setattr(writer.WriteQueue, "pump", orig_pump))
