"""Issue 52's snippet, 20 rounds per setting and size; prints wrong elements per round."""
import sys, tempfile, time, torch, ssdtrain
print("torch", torch.__version__)
for n in (1 << 20, 1 << 24):
    for setting in ("default", "min_bytes=0, late_writes=True, when_full='wait'"):
        bad = []
        t0 = time.time()
        for r in range(20):
            x = (torch.rand(n, dtype=torch.float64) + 0.1).requires_grad_()
            kw = dict(min_bytes=0, late_writes=True, when_full="wait") if setting != "default" else {}
            off = ssdtrain.Offloader(path=tempfile.mkdtemp(dir="/tmp"), **kw)
            with off:
                y = torch.nn.functional.rrelu(x * 1.0, 0.0, 1.0, training=True)
                if setting != "default":
                    off.wait()
            (g,) = torch.autograd.grad(y.sum(), x)
            bad.append(int((g != 1).sum()))
            written = off.stats().written_bytes
            off.close()
        print(f"{n:>9} elements, {setting}: wrong per round {bad} (last round wrote {written} bytes) {time.time()-t0:.0f}s", flush=True)
