"""docs/recipes.md's SAC recipe, run as `python -W error::FutureWarning`: no warning, what SAC keeps written, gradients equal."""
import functools, tempfile, torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
import ssdtrain
H, S, B, L = 256, 256, 8, 4
MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
def policy(ctx, op, *a, **k):
    return CheckpointPolicy.MUST_SAVE if op in MM else CheckpointPolicy.PREFER_RECOMPUTE
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)) for _ in range(L))
def step(ctx_fn, off=None):
    blocks.zero_grad(set_to_none=True)
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with off if off is not None else torch.enable_grad():
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False, context_fn=ctx_fn)
        loss = h.square().mean()
        if off is not None:
            off.wait()
    loss.backward()
    return [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
want = step(functools.partial(create_selective_checkpoint_contexts, policy))
off = ssdtrain.Offloader(blocks, path=tempfile.mkdtemp(), min_bytes=0, when_full="wait")
ctx = ssdtrain.sac_context(policy, off)
got = [step(ctx, off) for _ in range(2)]
s = off.stats(); off.close()
kept = L * B * S * 5 * H * 4
print("torch", torch.__version__, "| SAC keeps", kept, "bytes a step | written over 2 steps:", s.written_bytes,
      f"({s.written_bytes / (2 * kept):.0%}) | read back:", s.read_bytes,
      "| gradients torch.equal:", all(torch.equal(a, b) for g in got for a, b in zip(g, want)))
