import torch, time, tempfile, ssdtrain, statistics, sys
from ssdtrain.engine import offloader as om
from ssdtrain.host import tier
om._TIER_DEVICES=("cuda","cpu")
orig=tier._Batches.submit
def inline(self, request):
    fut=tier.IOFuture()
    try: self._process([request]); fut.set_result(None)
    except BaseException as e: fut.set_exception(e)
    return fut
def noop(self, request):
    fut=tier.IOFuture(); request[0].landed=None; fut.set_result(None); return fut
for name, sub in [("thread",orig),("inline",inline),("noop",noop),("thread",orig)]:
    tier._Batches.submit=sub
    off=ssdtrain.Offloader(path=tempfile.mkdtemp(), min_bytes=0, backend="memory")
    x=torch.randn(2,64,64,requires_grad=True)
    res=[]; wall=[]
    for r in range(10):
        ts=[(x*1.0) for _ in range(300)]
        with off:
            t0=time.thread_time(); w0=time.perf_counter()
            refs=[off._pack(t) for t in ts]
            res.append((time.thread_time()-t0)/300*1e6); wall.append((time.perf_counter()-w0)/300*1e6)
        del refs, ts
        off.wait()
    print(name, "pack cpu us", round(statistics.median(res[2:]),1), "wall", round(statistics.median(wall[2:]),1))
    off.close()
