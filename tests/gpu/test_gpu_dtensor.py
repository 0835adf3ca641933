"""DTensor saves on a GPU (Note [a DTensor is saved by its parts]): torch's tensor and sequence
parallelism on a 1-rank NCCL mesh, bf16, each backend; gradients ``torch.equal`` to the run
without offloading, and the DTensor shards written (more than with DTensors kept)."""

from __future__ import annotations

import pytest
import torch
from _gpu import BACKENDS

import ssdtrain
from ssdtrain.engine import keep

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    from torch.distributed.device_mesh import init_device_mesh

    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _grads(model, tokens, off):
    model.zero_grad(set_to_none=True)
    if off is None:
        loss = model(tokens, tokens.roll(-1, dims=1))
    else:
        with off:
            loss = model(tokens, tokens.roll(-1, dims=1))
            off.wait()  # inside the block: every write lands, backward reads them back
    loss.float().backward()
    torch.cuda.synchronize()
    return [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone() for p in model.parameters()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_sequence_parallel_blocks_on_a_gpu_are_exact(mesh, backend, tmp_path, monkeypatch):
    from _recipes_worker import VOCAB, SEQ, TinyGPT, TPBlock, tensor_parallel

    name, setup = backend
    torch.manual_seed(0)
    model = TinyGPT(hidden=256, heads=4, dropout=0.0, block=TPBlock).to("cuda", torch.bfloat16)
    tensor_parallel(model, mesh, True)
    tokens = torch.randint(0, VOCAB, (4, SEQ), device="cuda")
    want = _grads(model, tokens, None)
    if not _same(want, _grads(model, tokens, None)):
        pytest.skip("two runs without offloading differ here (non-deterministic kernels): nothing to compare")
    written = []
    for by_parts in (keep._BY_PARTS, ()):  # then DTensors kept as they are
        monkeypatch.setattr(keep, "_BY_PARTS", by_parts)
        with setup():
            off = ssdtrain.Offloader(model, backend=name, path=str(tmp_path / f"{len(written)}"), min_bytes=0)
        try:
            for _ in range(2):
                assert _same(_grads(model, tokens, off), want)
            written.append(off.stats().written_bytes)
            assert off.stats().read_bytes > 0
        finally:
            off.close()
    assert written[0] > written[1], written
