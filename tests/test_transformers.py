"""The Hugging Face ``Trainer`` callback (``integrations/transformers.py``), with the real Trainer.

Each training test runs a tiny random Llama (built from a config, nothing downloaded) for 3
optimizer steps of 2 accumulated micro-batches, once with the callback and once without, from the
same weights and seed, and compares the final parameters with ``torch.equal``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import ssdtrain
from _rank_report import counted_entries
from _torchrun import gloo_or_skip, torchrun
from ssdtrain.integrations import transformers as ssd_transformers

SEQ = 32
STEPS = 3
ACCUM = 2
BATCH = 2


@pytest.fixture(autouse=True)
def _restore_environ():
    """transformers, accelerate and Lightning set environment variables as they go: put them back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _hf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    transformers = _hf()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=2 * SEQ, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, SEQ), generator=g)
    return [{"input_ids": x, "labels": x, "attention_mask": torch.ones(SEQ, dtype=torch.long)} for x in ids]


def _train(model, out_dir, callbacks=(), *, eval_every=None, trainer_class=None, **args):
    transformers = _hf()
    targs = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, learning_rate=1e-2, seed=0, use_cpu=True, report_to=[],
        save_strategy="no", logging_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
        eval_strategy="steps" if eval_every else "no", eval_steps=eval_every, **args)
    trainer = (trainer_class or transformers.Trainer)(
        model=model, args=targs, train_dataset=_data(STEPS * ACCUM * BATCH),
        eval_dataset=_data(4, seed=2) if eval_every else None, callbacks=list(callbacks))
    trainer.train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


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
    code = ("import sys, ssdtrain.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_missing_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'ssdtrain\[transformers\]'"):
        ssd_transformers._define_callback()


def test_is_a_trainer_callback():
    transformers = _hf()
    cb = ssd_transformers.OffloadCallback()
    assert isinstance(cb, transformers.TrainerCallback)
    assert type(cb).__module__ == "ssdtrain.integrations.transformers"


@pytest.mark.parametrize("fields, match", [({"min_bytes": "lots"}, "min_bytes"),
                                           ({"when_full": "drop"}, "when_full"),
                                           ({"pth": "/tmp"}, "pth")])
def test_bad_settings_fail_when_the_callback_is_made(fields, match):
    _hf()
    with pytest.raises(ValueError, match=match):
        ssd_transformers.OffloadCallback(**fields)


def test_stats_before_training_says_so():
    _hf()
    with pytest.raises(RuntimeError, match="no training has run"):
        ssd_transformers.OffloadCallback().stats()


# -- the forward bracket (no Trainer) -------------------------------------------------------------------
class _Spy:
    """An offloader stand-in that records what the bracket does."""

    def __init__(self):
        self.log = []

    def __enter__(self):
        self.log.append("enter")
        return self

    def __exit__(self, exc_type, exc, tb):
        self.log.append("exit" if exc_type is None else f"exit:{exc_type.__name__}")


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, *, again=False, fail=False):
        if fail:
            raise KeyError("boom")
        y = self.lin(x)
        return self(y) if again else y


def test_bracket_enters_only_training_forwards_with_grad():
    m, spy = _Twice(), _Spy()
    bracket = ssd_transformers._ForwardOffload(m, spy)
    x = torch.randn(2, 4)
    out = m(x)
    assert torch.equal(out, m.lin(x))  # the pre-hook leaves the arguments alone
    assert spy.log == ["enter", "exit"]
    m(x, again=True)  # nested: one step
    assert spy.log == ["enter", "exit"] * 2
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    assert spy.log == ["enter", "exit"] * 2
    m.train()
    bracket.remove()
    m(x)
    assert spy.log == ["enter", "exit"] * 2


def test_bracket_passes_a_forward_error_on():
    m, spy = _Twice(), _Spy()
    ssd_transformers._ForwardOffload(m, spy)
    with pytest.raises(KeyError):
        m(torch.randn(2, 4), fail=True)
    assert spy.log == ["enter", "exit:KeyError"]
    try:
        raise ValueError("the caller's own, being handled")
    except ValueError:
        m(torch.randn(2, 4))  # succeeds inside someone's except block: a normal exit
    assert spy.log == ["enter", "exit:KeyError", "enter", "exit"]


def test_bracket_under_torch_compile(tmp_path):
    """The hooks run eagerly (a graph break at the model's boundary); gradients stay exact."""
    def grads(offload):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3)])
        x = torch.randn(8, 32)
        off = ssdtrain.Offloader(m, path=str(tmp_path), min_bytes=0) if offload else None
        bracket = ssd_transformers._ForwardOffload(m, off) if offload else None
        compiled = torch.compile(m, backend="aot_eager")
        for _ in range(2):
            loss = compiled(x).square().sum()
            loss.backward()
        saved = 0
        if offload:
            bracket.remove()
            saved = off.stats().saved_bytes  # one compiled op's saves: kept for backward (as in test_trainer_torch_compile)
            off.close()
        return [p.grad for p in m.parameters()], saved

    want, _ = grads(False)
    # Compiled code traced without hooks would be reused for the hooked model (torch does not
    # guard on hooks); the callback warns when that happens (test_warns_when_no_forward_...).
    torch._dynamo.reset()
    got, saved = grads(True)
    torch._dynamo.reset()
    assert saved > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# -- the real Trainer -----------------------------------------------------------------------------------
def test_trainer_params_equal_with_and_without(llama, tmp_path, entries):
    want = _train(copy.deepcopy(llama), tmp_path / "base")
    entries.clear()
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    got = _train(copy.deepcopy(llama), tmp_path / "off", [cb])
    _assert_equal(got, want)
    assert entries == [True] * (STEPS * ACCUM)  # one offloaded forward per micro-batch
    s = cb.stats()
    assert s.written_bytes > 0 and s.read_bytes + s.forwarded_bytes >= s.written_bytes  # read, or handed back
    assert cb.offloader is None  # closed at on_train_end
    assert not list((tmp_path / "act").rglob("*.*")), "arena files left behind"


def test_evaluation_is_not_offloaded(llama, tmp_path, entries):
    want = _train(copy.deepcopy(llama), tmp_path / "base", eval_every=1)
    plain = ssd_transformers.OffloadCallback(path=str(tmp_path / "act0"), min_bytes=0)
    _train(copy.deepcopy(llama), tmp_path / "plain", [plain])
    entries.clear()
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act1"), min_bytes=0)
    got = _train(copy.deepcopy(llama), tmp_path / "off", [cb], eval_every=1)
    _assert_equal(got, want)
    assert entries == [True] * (STEPS * ACCUM)  # 3 evaluations ran, none entered
    assert cb.stats().saved_bytes == plain.stats().saved_bytes


def test_the_users_own_block_around_the_callbacks(llama, tmp_path, entries):
    """A ``with offloader:`` of the user's own around each loss (a Trainer subclass), the
    callback's inside it: one step per micro-batch (Note [nested blocks are one]), exact."""
    transformers = _hf()
    want = _train(copy.deepcopy(llama), tmp_path / "base")
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)

    class OwnBlock(transformers.Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            with cb.offloader:
                return super().compute_loss(model, inputs, **kwargs)

    entries.clear()
    got = _train(copy.deepcopy(llama), tmp_path / "off", [cb], trainer_class=OwnBlock)
    _assert_equal(got, want)
    assert entries == [True] * (2 * STEPS * ACCUM)  # the user's, then the callback's (nested)
    s = cb.stats()
    # Every byte written came back, read or handed back from memory (whether a write lands before
    # backward needs it depends on the machine's timing: the trainer does not wait).
    assert s.written_bytes > 0 and s.read_bytes + s.forwarded_bytes >= s.written_bytes and s.live_entries == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert not list((tmp_path / "act").rglob("*.*")), "arena files left behind"


def test_activation_checkpointing_offloads_the_checkpoints(llama, tmp_path):
    full = ssd_transformers.OffloadCallback(path=str(tmp_path / "act0"), min_bytes=0)
    _train(copy.deepcopy(llama), tmp_path / "full", [full])
    want = _train(copy.deepcopy(llama), tmp_path / "base", activation_checkpointing=True)
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act1"), min_bytes=0)
    got = _train(copy.deepcopy(llama), tmp_path / "off", [cb], activation_checkpointing=True)
    _assert_equal(got, want)
    # Only what checkpointing keeps reaches the offloader: each layer's input, and the rest of
    # the model outside the layers.
    assert 0 < cb.stats().written_bytes
    assert cb.stats().saved_bytes < full.stats().saved_bytes / 2


# peft 0.21 still asks transformers 5 for the deprecated name.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_peft_lora(llama, tmp_path):
    peft = pytest.importorskip("peft")

    def lora():
        torch.manual_seed(3)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(copy.deepcopy(llama), cfg)

    start = {n: p.detach().clone() for n, p in lora().named_parameters()}
    want = _train(lora(), tmp_path / "base")
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    got = _train(lora(), tmp_path / "off", [cb])
    _assert_equal(got, want)
    trained = {n for n in want if not torch.equal(want[n], start[n])}
    assert trained and all("lora_" in n for n in trained)  # LoRA trained, the base frozen
    assert cb.stats().written_bytes > 0


# peft 0.21 still asks transformers 5 for the deprecated name.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_long_context_recipe(tmp_path):
    """docs/recipes.md, long-context fine-tuning: gradient checkpointing (non-reentrant) + LoRA +
    ``OffloadCallback(min_bytes=0)`` on a tiny Llama at a sequence 32x its width, exact against the
    same run without the callback, every layer's input written (what checkpointing keeps)."""
    transformers, peft = _hf(), pytest.importorskip("peft")
    seq, layers, hidden = 2048, 4, 64
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=seq, use_cache=False)

    def model():
        torch.manual_seed(0)
        m = transformers.LlamaForCausalLM(config)
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(3)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(m, lora)

    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x, "attention_mask": torch.ones(seq, dtype=torch.long)}
            for x in torch.randint(0, 128, (2, seq), generator=g)]

    def train(callbacks, out):
        m = model()
        targs = transformers.TrainingArguments(
            output_dir=str(out), max_steps=2, per_device_train_batch_size=1, learning_rate=1e-2, seed=0,
            use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
            disable_tqdm=True)
        transformers.Trainer(model=m, args=targs, train_dataset=data, callbacks=list(callbacks)).train()
        return {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}

    want = train([], tmp_path / "base")
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    got = train([cb], tmp_path / "off")
    _assert_equal(got, want)
    s = cb.stats()
    layer_input = seq * hidden * 4  # fp32, one sequence
    # The first step writes every layer's input it is given (nothing is known of the drive yet).
    assert s.written_bytes >= layers * layer_input
    # Per step: the layers' inputs and the head's saves (the logits in fp32: 4 x seq x vocab),
    # none of a layer's internals (an MLP's alone is 2 x seq x 2h x 4 bytes = 4 layer inputs).
    assert s.saved_bytes / 2 < (layers + 4) * layer_input + 3 * 4 * seq * 128


def test_trainer_torch_compile(llama, tmp_path):
    """``torch_compile=True``: the hooks run eagerly, a graph break at the model's boundary.
    AOTAutograd (``aot_eager``) is bit-exact as is; with inductor a compiled run is bit-equal to
    another only under ``full_determinism=True`` (then with and without the callback alike)."""
    torch._dynamo.reset()
    args = {"torch_compile": True, "torch_compile_backend": "aot_eager"}
    want = _train(copy.deepcopy(llama), tmp_path / "base", **args)
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    got = _train(copy.deepcopy(llama), tmp_path / "off", [cb], **args)
    torch._dynamo.reset()
    _assert_equal(got, want)
    # The compiled model is one autograd op saving as forward ends: its saves reach the offloader
    # and are kept for backward, which needs them first (Note [a save is copied only after its op
    # returned]); offloading a compiled model is a per-block compile's (tests/test_recipes.py).
    assert cb.stats().saved_bytes > 0


def test_warns_when_no_forward_reaches_the_offloader(llama, tmp_path):
    class SkipsHooks(type(llama)):
        def __call__(self, *args, **kwargs):  # what compiled code traced before the hooks does
            return self.forward(*args, **kwargs)

    model = SkipsHooks(llama.config)
    model.load_state_dict(llama.state_dict())
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    with pytest.warns(RuntimeWarning, match="no training forward ran under the offloader"):
        _train(model, tmp_path / "off", [cb])
    assert cb.stats().saved_bytes == 0


def test_train_twice_gets_a_fresh_offloader(llama, tmp_path):
    cb = ssd_transformers.OffloadCallback(path=str(tmp_path / "act"), min_bytes=0)
    model = copy.deepcopy(llama)
    _train(model, tmp_path / "a", [cb])
    first = cb.stats().written_bytes
    _train(model, tmp_path / "b", [cb])
    assert 0 < cb.stats().written_bytes
    assert first > 0
    assert not model._forward_hooks and not model._forward_pre_hooks


@pytest.mark.slow
def test_trainer_under_ddp_two_ranks(tmp_path):
    """The Trainer wraps the model in DDP itself (torchrun, 2 ranks, gloo): with the callback each
    rank's parameters are ``torch.equal`` to those without it, every micro-batch's forward was
    offloaded, and each rank wrote and read back its own activations."""
    _hf()
    gloo_or_skip()
    torchrun(os.path.join(os.path.dirname(__file__), "_trainer_ddp_worker.py"), "--out", str(tmp_path))
    for rank in range(2):
        rep = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert rep["ddp"] and rep["trained"], (rank, rep)
        assert rep["differ"] == [], f"rank {rank}: parameters differ: {rep['differ']}"
        assert rep["entries"] == [True] * (STEPS * ACCUM), (rank, rep["entries"])
        assert rep["written_bytes"] > 0 and rep["read_bytes"] > 0, (rank, rep)
        assert rep["left_behind"] == [], (rank, rep["left_behind"])
