"""PoC 16 (split inference): the halves compose to the unsplit model, and the quick run over the shaped
link (or loopback where namespaces cannot be made) checks its transfers, writes its rows and cleans up."""
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from poc_module import load_poc

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "pocs" / "16_split_inference.py"


def poc():
    return load_poc(SCRIPT.name, "poc16")


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()} if out.returncode == 0 else set()


def test_diffusion_halves_compose_to_the_unsplit_model():
    from shared.diffusion import load_tiny_flux

    m, flux = poc(), load_tiny_flux()
    labels = torch.arange(3)
    x = torch.randn(3, flux.tokens, flux.token_values, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((3,), 0.7)
    with torch.no_grad():
        hidden, encoder, temb = m.flux_stage0(flux, x, sigma, labels, m.DIFF_SPLIT_BLOCK)
        split = m.flux_stage1(flux, hidden, encoder, temb, m.DIFF_SPLIT_BLOCK)
        assert torch.allclose(split, flux(x, sigma, labels), atol=1e-5, rtol=0)
        # and a perturbed hand-over changes the output: the test would see a stage that ignores its input
        assert not torch.allclose(m.flux_stage1(flux, hidden * 1.1, encoder, temb, m.DIFF_SPLIT_BLOCK), split)


def test_small_tensors_go_raw_and_large_ones_coded():
    m = poc()
    codec = object()
    assert m.coder_for("compressed", 1, codec, min_rows=8) is None
    assert m.coder_for("compressed", 8, codec, min_rows=8) is codec
    assert m.coder_for("raw", 4096, codec, min_rows=8) is None


def test_a_coded_message_without_a_codec_is_refused():
    m = poc()
    with pytest.raises(RuntimeError, match="no codec"):
        m.open_tensor([m.CODED, 4, 2, 2, 0], torch.zeros(4, dtype=torch.uint8), codec=None)


@pytest.mark.slow
def test_quick_run_checks_transfers_writes_rows_and_cleans_up(tmp_path):
    before = {ns for ns in namespaces() if ns.startswith("tcodec")}
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert {ns for ns in namespaces() if ns.startswith("tcodec")} <= before, "namespaces left behind"
    df = pd.read_csv(tmp_path / "16_split_inference.csv")
    assert (tmp_path / "16_split_inference.png").exists()
    assert set(df.device) == {"cpu"}
    check = df[df.phase == "check"]
    exact = check[check.metric == "bit_exact"]
    assert set(exact.task) == {"llm", "diffusion"} and (exact.value == 1).all()
    coded_cos = check[(check.metric == "cos") & (check["mode"] == "compressed")]
    assert len(coded_cos) == 2 and (coded_cos.value > 0.99).all() and (coded_cos.value < 1).all()
    cal = df[(df.phase == "calibration") & (df.metric == "cos")]
    assert (cal.value >= 0.999).all()
    steps = df[df.metric == "step_ms"]
    links = sorted(steps.link_mbit.dropna().unique())
    assert links == [50, 100, 1000] or (steps.link == "loopback").all()
    for (task, phase), group in steps.groupby(["task", "phase"]):
        assert set(group["mode"]) == {"raw", "compressed"}, (task, phase)
    quality = df[df.phase == "quality"].set_index(["task", "mode", "metric"]).value
    ppl_unsplit, ppl_raw = quality[("llm", "unsplit", "perplexity")], quality[("llm", "raw", "perplexity")]
    assert abs(ppl_raw / ppl_unsplit - 1) < 0.01                   # bf16 hand-over barely moves perplexity
    assert quality[("llm", "raw", "agreement")] >= 0.98
    ratio = df[(df.metric == "ratio") & (df.phase == "prefill")].value
    assert (ratio > 2).all()
    # a decode step is one token: it goes raw exactly when the codec's 1-token container is not smaller
    one = df[(df.phase == "container_size") & (df.task == "llm") & (df.tokens == 1)].set_index("metric").value
    decode_sent = set(df[(df.phase == "decode") & (df["mode"] == "compressed")].sent_as.dropna())
    assert decode_sent == ({"raw"} if one["container_bytes"] >= one["raw_bytes"] else {"coded"})
    assert "bit-exact True" in run.stdout + run.stderr


@pytest.mark.gpu
def test_gpu_quick_run_codes_on_the_gpu_and_adds_the_wide_decoder(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--gpu", "--loopback", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    df = pd.read_csv(tmp_path / "16_split_inference.csv")
    assert set(df.compute) == {"gpu"} and "cpu" not in set(df.device)
    check = df[df.phase == "check"]
    exact = check[check.metric == "bit_exact"]
    assert {"wide", "diffusion"} <= set(exact.task) and (exact.value == 1).all()  # SmolLM2 where its weights are
    coded_cos = check[(check.metric == "cos") & (check["mode"] == "compressed")]
    assert len(coded_cos) == len(set(exact.task)) and (coded_cos.value > 0.99).all() and (coded_cos.value < 1).all()
    split = df[df.phase == "split_in_one_process"].set_index("task").value
    assert split["wide"] < 1e-2  # the same bf16 ops in one process: the split is the model
    assert (tmp_path / "16_split_inference_gpu.png").exists()
