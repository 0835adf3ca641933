"""In one process, alternating steps: unpack cost with read buffers shaped as their save (new) and as bytes (old)."""
import sys, time, types, tempfile, statistics, torch
torch.set_num_threads(1)
import ssdtrain
from ssdtrain.engine import offloader as offloader_mod, reader as reader_mod
from ssdtrain.bench.models import GPT, GPTConfig
offloader_mod._TIER_DEVICES = ("cuda", "cpu")
torch.manual_seed(0)
model = GPT(GPTConfig(vocab=512, seq=64, layers=12, hidden=64, heads=4))
tokens = torch.randint(0, 512, (2, 64))
off = ssdtrain.Offloader(model, path=tempfile.mkdtemp(), min_bytes=0, backend="memory")
shaped = reader_mod.Reader._buffer
def as_bytes(self, e):
    return self._backend.alloc_buffer(e.nbytes, e.device, extent=e.extent)
spent = {"u": 0.0, "n": 0}
fn = off._unpack
def run(_self, ref):
    t = time.thread_time()
    try: return fn(ref)
    finally:
        spent["u"] += time.thread_time() - t; spent["n"] += 1
off._unpack = types.MethodType(run, off)
res = {"shaped": [], "bytes": []}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 60):
    kind = "shaped" if i % 2 else "bytes"
    reader_mod.Reader._buffer = shaped if kind == "shaped" else as_bytes
    spent["u"] = 0.0; spent["n"] = 0
    with off:
        loss = model(tokens, tokens)
    loss.backward(); off.wait()
    if i >= 6:
        res[kind].append(spent["u"] / spent["n"] * 1e6)
pairs = [b / a for a, b in zip(res["bytes"], res["shaped"])]
print(f"unpack us a save: bytes {statistics.median(res['bytes']):.1f}, shaped {statistics.median(res['shaped']):.1f}; "
      f"median pairwise ratio {statistics.median(pairs):.3f} over {len(pairs)} pairs")
