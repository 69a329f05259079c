"""PoC 15 (pocs/15_p2p_multi_gpu.py) in its quick mode: two ranks, host-staged transfers raw and
compressed, checked on arrival; no NCCL rows on a machine with fewer than 2 GPUs."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("numba")


@pytest.mark.slow
def test_quick_run_checks_and_writes_rows(tmp_path):
    import pandas as pd
    import torch

    csv, fig = tmp_path / "15.csv", tmp_path / "15.png"
    run = subprocess.run([sys.executable, str(ROOT / "pocs" / "15_p2p_multi_gpu.py"), "--quick",
                          "--csv", str(csv), "--figure", str(fig)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "raw bit-exact on 3 tensors (matches)" in run.stdout
    assert "BELOW TARGET" not in run.stdout
    df = pd.read_csv(csv)
    assert set(df.backend) == {"raw", "rans"} and set(df.source) == {"synthetic"}
    paths = set(df.path)
    if torch.cuda.device_count() < 2:
        assert paths == {"host_staged"} and "NCCL rows need 2 GPUs" in run.stdout
    else:
        assert paths == {"host_staged", "nccl"}
    for metric in ("latency_ms", "single_gbps", "stream_gbps"):
        assert (df[df.metric == metric].value > 0).all() and len(df[df.metric == metric]) == 2 * 2 * len(paths)
    assert (df[df.metric == "cos_min"].value >= 0.999 - 5e-4).all()
    assert (df[df.metric == "ratio"].value > 1).all()
    assert fig.stat().st_size > 0
