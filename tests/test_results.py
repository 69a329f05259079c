"""Results files: quick runs never replace committed CSVs or figures; a full rerun says what it changes."""
import sys

import pandas as pd
import pytest

from shared import results


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A scratch repository root with results/ and figures/, in place of the real ones."""
    monkeypatch.setattr(results, "ROOT", tmp_path)
    monkeypatch.setattr(results, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(results, "FIGURES", tmp_path / "figures")
    (tmp_path / "results").mkdir()
    return tmp_path


def writer(values, quick, extra=()):
    res = results.ResultsWriter("99", "demo", quick=quick)
    for i, v in enumerate(values):
        res.add(backend="x265", metric="ratio", value=v, unit="x", k=8 * (i + 1))
    for k, v in extra:
        res.add(backend="zstd", metric="ratio", value=v, unit="x", k=k)
    return res


def test_quick_run_writes_local_and_marks_its_rows(tree, monkeypatch):
    committed = writer([2.0, 3.0], quick=False).save()
    before = committed.read_bytes()
    monkeypatch.setattr(sys, "argv", ["pocs/99_demo.py", "--quick"])
    assert results.is_quick()
    res = results.ResultsWriter("99", "demo")  # quick taken from the command line
    res.add(backend="x265", metric="ratio", value=9.0, unit="x", k=8)
    path = res.save(tree / "results" / "99_demo.csv")  # even when a PoC names the committed path
    assert path == tree / "results" / "local" / "99_demo.csv"
    assert committed.read_bytes() == before
    assert set(pd.read_csv(path).run) == {"quick"}
    assert results.csv_path("99_demo") == path  # figures of a quick run read the quick CSV


def test_full_rerun_prints_what_changes(tree, capsys):
    writer([2.0, 3.0], quick=False).save()
    capsys.readouterr()
    path = writer([2.0, 3.3], quick=False, extra=[(1, 5.0)]).save()
    out = capsys.readouterr().out
    assert "replacing results/99_demo.csv" in out
    assert "2 rows before, 3 now: 1 added, 0 removed, 1 of 2 matched values changed" in out
    assert "3 -> 3.3 (+10.0%)" in out
    assert set(pd.read_csv(path).run) == {"full"}


def test_diff_summary_matches_rows_on_settings_not_on_versions():
    old = pd.DataFrame({"poc": ["1", "1"], "backend": ["a", "a"], "metric": ["m", "m"], "value": [1.0, 2.0],
                        "unit": ["x", "x"], "k": [8, 16], "qp": [None, 18.0], "setting": [None, "qp18"],
                        "v_numpy": ["1.0", "1.0"], "date": ["d1", "d1"]})  # empty cells, as real CSVs have
    new = old.assign(v_numpy="2.0", date="d2")
    assert results.diff_summary(old, new)[0] == "2 rows before, 2 now: 0 added, 0 removed, 0 of 2 matched values changed"
    gone = results.diff_summary(old, new.iloc[:1])
    assert gone[0].startswith("2 rows before, 1 now: 0 added, 1 removed")


def test_quick_figure_goes_to_figures_local(tree, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pocs/99_demo.py", "--quick"])
    writer([2.0], quick=True).save()
    plt = results.apply_style()
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4], label="a")
    results.legend_outside(ax)
    path = results.save_figure(fig, "99_demo", "99_demo.csv")
    assert path == tree / "figures" / "local" / "99_demo.png" and path.stat().st_size > 0
    assert not (tree / "figures" / "99_demo.png").exists()
    footer = fig.texts[-1].get_text()
    assert footer == "data: results/local/99_demo.csv (quick run)"


def test_series_styles_are_distinct():
    pairs = [tuple(results.series_style(i).values()) for i in range(70)]
    assert len(set(pairs)) == 70
    assert len({p[0] for p in pairs[:7]}) == 7 and len({p[1] for p in pairs[:7]}) == 7


def test_api_table_names_how_its_rows_were_timed(tree, monkeypatch):
    """The API table's caption follows its CSV: rows timed in turns say so with their repeats; rows
    of runs before the turns (no timing column) keep the median of 10 they were made with."""
    from shared import report

    monkeypatch.setattr(report, "RESULTS", tree / "results")

    def api_rows(after=(), **timing):
        rows = [dict(poc="09", device="NVIDIA H200", backend="rans", path="api", metric=m, value=v, unit="u",
                     tensor_mb=64.0, lane_tokens="default", source="demo", **timing)
                for m, v in (("encode_gbps", 150.0), ("decode_gbps", 200.0), ("ratio", 4.6), *after)]
        rows += [dict(poc="09", device="NVIDIA H200", backend="rans", path="pcie_copy", metric=m, value=50.0,
                      unit="GB/s", tensor_mb=64.0, source="demo", **timing) for m in ("d2h_gbps", "h2d_gbps")]
        pd.DataFrame(rows).to_csv(tree / "results" / "09_backend_bench.csv", index=False)
        return report.api_speed()

    turns = api_rows(timing="in turns", repeats=20)
    assert "median of 20 turns" in turns and "3.00x / 4.00x" in turns
    blocks = api_rows(timing="blocks in turns", repeats=24,
                      after=(("encode_gbps_after_copy", 120.0), ("decode_gbps_after_copy", 180.0)))
    assert "median of 24 calls in turns" in blocks and "3.00x / 4.00x" in blocks
    assert "| 120.0 / 180.0 |" in blocks  # the first call after a copy, in its own column
    queued = api_rows(timing="blocks in turns", repeats=24, after=(("encode_gbps_queued", 75.0),))
    assert "| 75.0 (1.50x) |" in queued  # queued encodes, beside the D2H copy of the same bytes
    assert "median of 10;" in api_rows()
