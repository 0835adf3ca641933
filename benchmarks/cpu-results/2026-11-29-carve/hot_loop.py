import time, torch, tempfile
import ssdtrain
from ssdtrain.engine import offloader as om
om._TIER_DEVICES = ("cuda", "cpu")
torch.set_num_threads(1)
model = torch.nn.Linear(4, 4)
off = ssdtrain.Offloader(model, path=tempfile.mkdtemp(), min_bytes=0, backend="memory")
xs = [torch.randn(8192) * 1.0 for _ in range(200)]   # 32 KB each, like pack_cost's
for rep in range(6):
    with off:
        t0 = time.thread_time()
        refs = [off._pack(x) for x in xs]
        t1 = time.thread_time()
    off.wait()
    t2 = time.thread_time()
    outs = [off._unpack(r) for r in reversed(refs)]
    t3 = time.thread_time()
    del refs, outs
    off.wait()
    print(f"hot loop: pack {(t1-t0)/200*1e6:.1f} us, unpack {(t3-t2)/200*1e6:.1f} us a save, entries: groups")
