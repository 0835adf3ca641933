"""benchmarks/opinfo_sweep.py on a handful of ops: every sample's outputs and gradients equal, bit
for bit, with every save offloaded (``min_bytes=0``) and with every save written and read back
(``late_writes=True, when_full="wait"``, ``wait()`` after the forward). rrelu (training) saves its
noise before its kernel fills it: an offloader that copies a save before its op returns gives it
back unfilled. The whole sweep: ``python benchmarks/opinfo_sweep.py``."""

import io

import pytest
from _benchmarks import load_benchmark

pytest.importorskip("torch")

OPS = ["nn.functional.rrelu", "nn.functional.dropout", "mul", "nn.functional.layer_norm", "matmul"]


def test_opinfo_sweep_a_few_ops(tmp_path):
    sweep = load_benchmark("opinfo_sweep")
    summary = sweep.sweep(ops=OPS, dtypes=["float64"], max_samples=3, large_rounds=1, large_numel=1 << 18,
                          path=str(tmp_path))
    text = io.StringIO()
    sweep.report(summary, text)
    assert summary["ops_run"] == len(OPS), text.getvalue()
    assert summary["cases_run"] >= 3 * len(OPS), text.getvalue()
    assert summary["skipped"].get("nondeterministic", 0) == 0, text.getvalue()
    for setting, counts in summary["counts"].items():
        assert counts["equal"] == summary["cases_run"], f"{setting}:\n{text.getvalue()}"
    assert summary["bytes"]["written"]["written"] > 0  # the second setting went through the files
    assert list(tmp_path.iterdir()) == []  # every offloader closed, its files gone
