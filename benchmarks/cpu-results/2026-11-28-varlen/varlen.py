import torch, contextlib
from ssdtrain.bench.maxseq import cpu_model
from ssdtrain.bench.models import make_model
from ssdtrain.bench.modes import Mode, offloader_factory
torch.manual_seed(0)
cfg = cpu_model("llama").replace(seq=2048, layers=8)
m = make_model(cfg)
mode = Mode("recompute+offload", m, offloader_factory(None, None))
M = 2**20
for L in [128, 128, 128, 2048, 2048, 128, 2048]:
    tok = torch.randint(0, 256, (1, L))
    b = mode.off.stats()
    mode.forward_backward(tok, tok); mode.drain()
    a = mode.off.stats()
    print(L, "unique %.2f written %.2f peak_kept %.2f" % ((a.unique_bytes-b.unique_bytes)/M, (a.written_bytes-b.written_bytes)/M, (a.peak_kept_bytes-b.peak_kept_bytes)/M))
