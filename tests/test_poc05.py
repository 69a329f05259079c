"""PoC 05's LLM bookkeeping: runs split by --prefixes / --part merge into one CSV without losing rows,
and the text windows of each protocol never overlap between fit, calibration and held-out text."""
import pandas as pd
import pytest

from poc_module import load_poc
from shared.results import ResultsWriter


@pytest.fixture(scope="module")
def poc():
    return load_poc("05_downstream_quality.py", "poc05")


def llm_row(res, prefix, part, curve, value, ratio):
    res.add(backend=curve, metric="perplexity_change", value=value, unit="fraction", domain="llm", curve=curve,
            method=f"{curve} {value}", prefix=prefix, part=part, ratio=ratio, chunks=4)


def test_split_runs_merge_into_one_csv(poc, tmp_path):
    path = tmp_path / "05.csv"
    first = ResultsWriter("05", "downstream_quality")
    first.path = path
    llm_row(first, 512, "peers", "KIVI-style int4", 0.004, 3.2)
    llm_row(first, 512, "best", "codec, all ideas", 0.002, 6.0)
    llm_row(first, 512, "best", "codec, all ideas", 0.02, 9.0)
    llm_row(first, 2048, "best", "codec, all ideas", 0.5, 1.0)  # replaced below
    first.add(backend="x265", metric="psnr", value=40.0, unit="dB", domain="diffusion")
    poc.save(first, ["llm", "diffusion"], [512, 2048], ["peers", "ablation", "best"])
    again = ResultsWriter("05", "downstream_quality")
    again.path = path
    llm_row(again, 2048, "best", "codec, all ideas", 0.001, 7.0)
    llm_row(again, 2048, "best", "codec, all ideas", 0.03, 11.0)
    poc.save(again, ["llm"], [2048], ["best"])
    df = pd.read_csv(path)
    change = df[df.metric == "perplexity_change"]
    assert sorted(zip(change.prefix, change.part, change.value)) == [
        (512, "best", 0.002), (512, "best", 0.02), (512, "peers", 0.004), (2048, "best", 0.001), (2048, "best", 0.03)]
    assert (df.domain == "diffusion").sum() == 1
    at = df[df.metric == "ratio_at_ppl_change"]
    # recomputed from every row now in the CSV, once per (curve, prefix, target)
    assert not at.duplicated(["curve", "prefix", "target"]).any()
    got = at[(at.prefix == 2048) & (at.target == 0.01)].value
    assert len(got) == 1 and float(got.iloc[0]) == pytest.approx(7.0 + (11.0 - 7.0) * (0.01 - 0.001) / 0.029)


@pytest.mark.parametrize("quick", [False, True])
def test_text_regions_never_overlap(poc, quick):
    main = poc.QUICK_PREFIX if quick else poc.PREFIX
    for prefix in [main] + ([poc.QUICK_LONG] if quick else poc.LONG_PREFIXES):
        spec = poc.protocol(prefix, main, quick, n_eval=4, n_long=4)

        def span(s):
            start, n, length, stride = s
            return start, start + (n - 1) * stride + length

        fit, cal, held = span(spec["fit"]), span(spec["calib"]), span(spec["held"])
        assert fit[1] <= cal[0] and cal[1] <= held[0], (prefix, spec)
        assert spec["held"][3] == spec["held"][2]  # held-out windows do not overlap each other
        if prefix == main:
            assert spec["calib"][3] == spec["calib"][2]
        else:  # overlapping windows, but a token scored in one window is never scored in another
            assert spec["calib"][2] - prefix == spec["calib"][3]
