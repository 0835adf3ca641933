"""The DeepSpeed plugin (integrations/deepspeed.py).

The config checks and the pass-through run in this process (DeepSpeed's own ``initialize`` is
replaced by a recorder). The training tests run real DeepSpeed on the CPU with gloo: two ranks
under torchrun (tests/_ds_worker.py) train each scenario with and without the ``"ssdtrain"``
section, once for the whole module; a timeout kills the whole process group so a crashed peer
cannot hang the suite. The first run on a machine compiles DeepSpeed's shared-memory comm op
(about 40 s, cached under ~/.cache/torch_extensions).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from _torchrun import torchrun
from ssdtrain import OffloadConfig
from ssdtrain.integrations import deepspeed as ssd_deepspeed

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ds_worker.py")
RUN_TIMEOUT = 420  # seconds for the whole torchrun; generous for the one-time op compile on 2 busy cores
MICROBATCHES, STEPS = 4, 3  # as in _ds_worker.py
PLAIN = ["plain", "plain_zero1", "plain_zero2", "plain_zero3", "plain_bf16", "plain_slow"]
PIPE = ["pipe", "pipe_ckpt", "pipe_ckpt_torch", "pipe_zero1", "pipe_bf16", "pipe_slow"]

DS_CONFIG = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2}


# -- without DeepSpeed -------------------------------------------------------------------------


def test_importing_the_plugin_does_not_import_deepspeed():
    code = textwrap.dedent("""
        import sys
        import ssdtrain.integrations, ssdtrain.integrations.deepspeed
        assert "deepspeed" not in sys.modules
        print("clean")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


def test_missing_deepspeed_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # makes `import deepspeed` fail
    with pytest.raises(ImportError, match=r"deepspeed is not installed; pip install 'ssdtrain\[deepspeed\]'"):
        ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=DS_CONFIG)


def test_section_becomes_an_offload_config(tmp_path):
    cfg = ssd_deepspeed.offload_config({**DS_CONFIG, "ssdtrain": {
        "enabled": True, "path": [str(tmp_path / "a"), str(tmp_path / "b")], "min_bytes": "4KiB",
        "prefetch_bytes": 1 << 20, "direct_io": None, "backend": "memory"}})
    assert isinstance(cfg, OffloadConfig)
    assert cfg.paths == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert cfg.min_bytes == 4096 and cfg.prefetch_bytes == 1 << 20 and cfg.backend == "memory"


def test_enabled_defaults_to_true_and_false_disables(tmp_path):
    assert ssd_deepspeed.offload_config({"ssdtrain": {"path": str(tmp_path)}}) is not None
    assert ssd_deepspeed.offload_config({"ssdtrain": {"enabled": False, "path": str(tmp_path)}}) is None
    assert ssd_deepspeed.offload_config(DS_CONFIG) is None


@pytest.mark.parametrize("section, named", [
    ({"enabled": True, "min_byte": 0}, "'min_byte'"),
    ({"enabled": False, "pth": "/x", "foo": 1}, "'foo', 'pth'"),   # checked even when disabled
    ({"min_bytes": "lots"}, "min_bytes='lots'"),
    ({"backend": "tape"}, "backend='tape'"),
    ({"io_threads": 0}, "io_threads=0"),
    ({"enabled": "yes"}, "enabled"),
    ("on", '"ssdtrain" section'),
])
def test_config_errors_name_the_key(section, named):
    with pytest.raises(ValueError) as info:
        ssd_deepspeed.offload_config({**DS_CONFIG, "ssdtrain": section})
    assert named in str(info.value)


# -- initialize() with DeepSpeed's initialize replaced by a recorder ---------------------------


@pytest.fixture
def recorder(monkeypatch):
    """Replaces deepspeed.initialize (keeping its signature); records each call's arguments."""
    deepspeed = pytest.importorskip("deepspeed")
    calls = []
    result = (SimpleNamespace(name="engine"), "optimizer", None, None)

    @functools.wraps(deepspeed.initialize)
    def fake(*args, **kwargs):
        ds_args = kwargs.get("args", args[0] if args else None)
        calls.append(SimpleNamespace(args=args, kwargs=kwargs,
                                     args_config=getattr(ds_args, "deepspeed_config", None)))
        return result

    monkeypatch.setattr(deepspeed, "initialize", fake)
    return SimpleNamespace(calls=calls, result=result)


def test_without_the_section_it_is_deepspeed_initialize(recorder):
    model, config = torch.nn.Linear(2, 2), dict(DS_CONFIG)
    out = ssd_deepspeed.initialize(None, model, config=config, dist_init_required=False)
    assert out is recorder.result
    (call,) = recorder.calls
    assert call.args == (None, model) and call.kwargs == {"config": config, "dist_init_required": False}
    assert call.kwargs["config"] is config


def test_disabled_section_is_stripped_and_nothing_attached(recorder, tmp_path):
    config = {**DS_CONFIG, "ssdtrain": {"enabled": False, "path": str(tmp_path)}}
    out = ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    assert out is recorder.result
    assert recorder.calls[0].kwargs["config"] == DS_CONFIG
    assert "ssdtrain" in config  # the caller's dict is left alone
    assert ssd_deepspeed.get_offloader(out[0]) is None


@pytest.mark.parametrize("where", ["config", "config_params", "args.deepspeed_config"])
def test_section_is_found_where_deepspeed_looks(recorder, tmp_path, where):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS_CONFIG, "ssdtrain": {"enabled": False}}))
    args = SimpleNamespace(local_rank=0, deepspeed_config=str(path) if where.startswith("args") else None)
    kwargs = {} if where.startswith("args") else {where: str(path)}
    ssd_deepspeed.initialize(args=args, model=torch.nn.Linear(2, 2), **kwargs)
    (call,) = recorder.calls
    if where.startswith("args"):
        # DeepSpeed refuses a config next to args.deepspeed_config: hidden during the call only.
        assert call.args_config is None and call.kwargs["config"] == DS_CONFIG
        assert args.deepspeed_config == str(path)
    else:
        assert call.kwargs[where] == DS_CONFIG


def test_config_errors_fail_at_initialize_before_deepspeed(recorder, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**DS_CONFIG, "ssdtrain": {"enabled": True, "paht": str(tmp_path)}}))
    with pytest.raises(ValueError, match="'paht'"):
        ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2), config=str(path))
    with pytest.raises(ValueError, match="max_inflight_bytes=0"):
        ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                 config={**DS_CONFIG, "ssdtrain": {"max_inflight_bytes": 0}})
    assert recorder.calls == []


def test_unusable_path_fails_before_deepspeed_starts(recorder, tmp_path):
    section = {"path": str(tmp_path / "missing"), "create_path": False}
    with pytest.raises(ValueError, match="missing"):
        ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2), config={**DS_CONFIG, "ssdtrain": section})
    assert recorder.calls == []


def test_offloader_is_closed_when_deepspeed_fails(monkeypatch, tmp_path):
    deepspeed = pytest.importorskip("deepspeed")
    import ssdtrain

    made = []

    class Recorded(ssdtrain.Offloader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    @functools.wraps(deepspeed.initialize)
    def failing(*args, **kwargs):
        raise RuntimeError("DeepSpeed could not start")

    monkeypatch.setattr(ssdtrain, "Offloader", Recorded)
    monkeypatch.setattr(deepspeed, "initialize", failing)
    with pytest.raises(RuntimeError, match="could not start"):
        ssd_deepspeed.initialize(model=torch.nn.Linear(2, 2),
                                 config={**DS_CONFIG, "ssdtrain": {"path": str(tmp_path), "backend": "posix"}})
    (off,) = made
    with pytest.raises(RuntimeError, match="closed"):
        with off:
            pass
    assert os.listdir(tmp_path) == []


# -- real DeepSpeed, two ranks under torchrun --------------------------------------------------


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("ds_out")
    storage = tmp_path_factory.mktemp("ds_storage")
    torchrun(WORKER, "--storage", str(storage), "--out", str(out), "--scenarios", ",".join(PLAIN + PIPE),
             timeout=RUN_TIMEOUT, env={"DS_ACCELERATOR": "cpu"})
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return SimpleNamespace(ranks=ranks, storage=storage)


def _scenario(ds_run, name):
    results = [rank[name] for rank in ds_run.ranks]
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r}, {name}:\n{res.get('traceback')}"
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN + PIPE)
def test_training_is_bit_identical(ds_run, name):
    for res in _scenario(ds_run, name):
        assert len(res["losses_off"]) == (STEPS if name.startswith("pipe") else STEPS * MICROBATCHES)
        assert res["losses_off"] == res["losses_base"]
        assert res["params_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN + PIPE)
def test_every_rank_writes_and_leaves_nothing_on_disk(ds_run, name):
    for r, res in enumerate(_scenario(ds_run, name)):
        stats = res["stats"]
        assert stats["written_bytes"] > 0, (r, stats)   # every stage of the pipeline, too
        assert stats["live_entries"] == 0
        assert res["visible_while_open"] == []           # arena files are unlinked once opened
        assert res["left_on_disk"] == []
    assert os.listdir(ds_run.storage / name) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["plain_slow", "pipe_slow"])
def test_a_slow_drive_keeps_what_it_cannot_take(ds_run, name):
    """On a 200 KB/s drive (bit-identical above): what could not be written in time stayed in
    memory, by the write budget or adaptive keep, on every rank."""
    for r, res in enumerate(_scenario(ds_run, name)):
        stats = res["stats"]
        assert stats["budget_kept_bytes"] + stats["adaptive_keep_bytes"] > 0, (r, stats)


@pytest.mark.slow
@pytest.mark.parametrize("name", PLAIN + PIPE)
def test_destroy_closes_and_detach_restores_the_engine(ds_run, name):
    for res in _scenario(ds_run, name):
        assert res["closed_by_destroy"]
        assert res["restored"]


@pytest.mark.slow
@pytest.mark.parametrize("name", PIPE)
def test_pipeline_microbatch_scopes_and_prefetch_order(ds_run, name):
    """Each micro-batch's forward has its own scope (ids 0..3 in every batch, not buffer slots),
    and each micro-batch is prefetched once, after its forward, in the order of the backwards."""
    for r, res in enumerate(_scenario(ds_run, name)):
        assert res["microbatches"] == list(range(MICROBATCHES))
        batches, current = [], []
        for call in res["calls"]:
            if call == ["step"]:
                batches.append(current)
                current = []
            else:
                current.append(tuple(call))
        assert len(batches) == STEPS and current == []
        for calls in batches:
            forwards = [mb for kind, mb in calls if kind == "forward"]
            prefetches = [mb for kind, mb in calls if kind == "prefetch"]
            assert forwards == list(range(MICROBATCHES)), (r, calls)
            assert prefetches == list(range(MICROBATCHES)), (r, calls)   # 1F1B: FIFO
            for mb in range(MICROBATCHES):
                assert calls.index(("forward", mb)) < calls.index(("prefetch", mb)), (r, calls)
