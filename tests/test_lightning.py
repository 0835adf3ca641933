"""The PyTorch Lightning callback (``integrations/lightning.py``), with the real ``lightning.Trainer``.

Each training test fits a tiny GPT (``tests/_recipes_worker.py``, dropout on) for 3 optimizer steps, once
with the callback and once without, from the same weights and seed, and compares the final
parameters with ``torch.equal``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from _rank_report import counted_entries
from _recipes_worker import SEQ, VOCAB, TinyGPT
from _torchrun import gloo_or_skip, torchrun
from ssdtrain.integrations import lightning as ssd_lightning

# lightning 2.6 still uses torch's LeafSpec, which torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning")


STEPS = 3
BATCH = 2


@pytest.fixture(autouse=True)
def _restore_environ():
    """transformers, accelerate and Lightning set environment variables as they go: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _pl():
    return pytest.importorskip("lightning.pytorch")


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return torch.utils.data.TensorDataset(tokens, tokens.roll(-1, dims=1))


def _module_class():
    _pl()
    from _lightning_ddp_worker import LitGPT  # imports lightning: only once it is known to be there

    return LitGPT


def _manual_class():
    """Two models, two optimizers, two backward passes per step (a GAN's shape)."""
    pl = _pl()

    class TwoModels(pl.LightningModule):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b = a, b
            self.automatic_optimization = False
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1
            tokens, targets = batch
            opt_a, opt_b = self.optimizers()
            loss_a = self.a(tokens, targets)
            self.manual_backward(loss_a)
            opt_a.step()
            opt_a.zero_grad()
            loss_b = self.b(tokens, targets)
            self.manual_backward(loss_b)
            opt_b.step()
            opt_b.zero_grad()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.a.parameters(), lr=1e-2), torch.optim.AdamW(self.b.parameters(), lr=1e-2)

    return TwoModels


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return TinyGPT()


def _fit(module, tmp_path, callbacks=(), *, val=False, **kwargs):
    pl = _pl()
    from lightning.pytorch.utilities.warnings import PossibleUserWarning

    trainer = pl.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(tmp_path), callbacks=list(callbacks),
        val_check_interval=1 if val else None, limit_val_batches=2 if val else None, **kwargs)
    loader = torch.utils.data.DataLoader(_data(4 * STEPS * BATCH), batch_size=BATCH)
    val_loader = torch.utils.data.DataLoader(_data(4, seed=2), batch_size=BATCH) if val else None
    torch.manual_seed(5)  # dropout draws the same masks in both runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PossibleUserWarning)  # few dataloader workers, small log interval
        trainer.fit(module, loader, val_loader)
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _assert_equal(got, want):
    assert got.keys() == want.keys()
    differ = [n for n in want if not torch.equal(got[n], want[n])]
    assert not differ, f"parameters differ: {differ}"


@pytest.fixture
def entries():
    """Counts ``with offloader:`` entries (all offloaders)."""
    with counted_entries() as count:
        yield count


# -- the callback itself ------------------------------------------------------------------------------
def test_import_is_lean():
    code = ("import sys, ssdtrain.integrations.lightning; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_missing_lightning_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ImportError, match=r"pip install 'ssdtrain\[lightning\]'"):
        ssd_lightning._define_callback()


def test_is_a_lightning_callback():
    pl = _pl()
    cb = ssd_lightning.OffloadCallback()
    assert isinstance(cb, pl.Callback)
    assert type(cb).__module__ == "ssdtrain.integrations.lightning"


@pytest.mark.parametrize("fields, match", [({"min_bytes": "lots"}, "min_bytes"), ({"pth": "/tmp"}, "pth")])
def test_bad_settings_fail_when_the_callback_is_made(fields, match):
    _pl()
    with pytest.raises(ValueError, match=match):
        ssd_lightning.OffloadCallback(**fields)


def test_stats_before_training_says_so():
    _pl()
    with pytest.raises(RuntimeError, match="no training has run"):
        ssd_lightning.OffloadCallback().stats()


# -- the real Trainer -----------------------------------------------------------------------------------
def test_fit_params_equal_with_and_without(gpt, tmp_path, entries):
    lit = _module_class()
    want = _fit(lit(copy.deepcopy(gpt)), tmp_path / "base")
    entries.clear()
    cb = ssd_lightning.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    module = lit(copy.deepcopy(gpt))
    got = _fit(module, tmp_path / "off", [cb])
    _assert_equal(got, want)
    assert entries == [True] * STEPS
    s = cb.stats()
    assert s.written_bytes > 0 and s.read_bytes + s.forwarded_bytes >= s.written_bytes  # read, or handed back
    assert cb.offloader is None  # closed at the end of fit()
    assert "training_step" not in vars(module)  # the module is as it was


def test_the_users_own_block_inside_the_callbacks(gpt, tmp_path, entries):
    """A ``with offloader:`` of the user's own around the model's call, inside the callback's
    around ``training_step`` (Note [nested blocks are one]): exact, nothing left."""
    lit = _module_class()
    want = _fit(lit(copy.deepcopy(gpt)), tmp_path / "base")
    cb = ssd_lightning.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)

    class OwnBlock(lit):
        def training_step(self, batch, batch_idx):
            tokens, targets = batch
            with cb.offloader:
                return self.model(tokens, targets)

    entries.clear()
    module = OwnBlock(copy.deepcopy(gpt))
    got = _fit(module, tmp_path / "off", [cb])
    _assert_equal(got, want)
    assert entries == [True] * (2 * STEPS)  # the callback's, then the user's (nested)
    s = cb.stats()
    # Every byte written came back, read or handed back from memory (whether a write lands before
    # backward needs it depends on the machine's timing: the trainer does not wait).
    assert s.written_bytes > 0 and s.read_bytes + s.forwarded_bytes >= s.written_bytes and s.live_entries == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_gradient_accumulation_and_validation(gpt, tmp_path, entries):
    lit = _module_class()
    want = _fit(lit(copy.deepcopy(gpt)), tmp_path / "base", val=True, accumulate_grad_batches=2)
    entries.clear()
    cb = ssd_lightning.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    got = _fit(lit(copy.deepcopy(gpt)), tmp_path / "off", [cb], val=True, accumulate_grad_batches=2)
    _assert_equal(got, want)
    assert entries == [True] * (2 * STEPS)  # one per micro-batch; the validation steps entered none
    assert cb.stats().written_bytes > 0


def test_manual_optimization_two_backwards_per_step(gpt, tmp_path, entries):
    two = _manual_class()
    torch.manual_seed(7)
    other = TinyGPT()
    want = _fit(two(copy.deepcopy(gpt), copy.deepcopy(other)), tmp_path / "base")
    entries.clear()
    cb = ssd_lightning.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    module = two(copy.deepcopy(gpt), copy.deepcopy(other))
    got = _fit(module, tmp_path / "off", [cb])
    _assert_equal(got, want)
    # Each model's forward, before its own backward (each optimizer step counts toward max_steps).
    assert module.calls == 2
    assert entries == [True] * (2 * module.calls)
    assert cb.stats().written_bytes > 0
    assert "training_step" not in vars(module) and "manual_backward" not in vars(module)
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_a_failing_step_closes_and_restores(gpt, tmp_path):
    lit = _module_class()

    class Failing(lit):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise KeyError("boom")
            return super().training_step(batch, batch_idx)

    cb = ssd_lightning.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    module = Failing(copy.deepcopy(gpt))
    with pytest.raises(KeyError, match="boom"):
        _fit(module, tmp_path / "off", [cb])
    assert cb.offloader is None
    assert "training_step" not in vars(module)
    assert cb.stats().written_bytes > 0  # the first step's


@pytest.mark.slow
def test_ddp_strategy_two_ranks(tmp_path):
    """``strategy="ddp"`` under torchrun (2 ranks, gloo): with the callback each rank's parameters
    are ``torch.equal`` to those without it, every ``training_step`` was offloaded, and each rank
    wrote its own activations and left no file."""
    _pl()
    gloo_or_skip()
    torchrun(os.path.join(os.path.dirname(__file__), "_lightning_ddp_worker.py"), "--out", str(tmp_path))
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["strategy"] == "DDPStrategy" and rep["trained"], (rank, rep)
        assert rep["differ"] == [], f"rank {rank}: parameters differ: {rep['differ']}"
        assert rep["entries"] == [True] * STEPS, (rank, rep["entries"])
        assert rep["written_bytes"] > 0, (rank, rep)
        assert rep["left_behind"] == [], (rank, rep["left_behind"])
