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


# ---------------------------------------------------------------- reruns say what they reproduced (issue #42)

def rows(values, **env):
    """A small results frame: two ratios (one setting k), a timing, and environment columns `env`."""
    df = pd.DataFrame({"poc": ["99"] * 3, "device": ["cpu"] * 3, "backend": ["x265", "x265", "zstd"],
                       "metric": ["ratio", "ratio", "encode_ms"], "value": values, "unit": ["x", "x", "ms"],
                       "k": [8, 16, None], "source": ["gauss", "gauss", "gauss"]})
    return df.assign(**env)


ENV_OLD = dict(python="3.11.9", cpu_count="2", v_torch="2.5.0", v_numpy="1.26.4", driver="550.1", code="1234567",
               run="full", date="2026-11-01")
ENV_NEW = dict(python="3.12.1", cpu_count="16", v_torch="2.9.0", v_numpy="2.1.0", driver="580.2", code="abcdef0+",
               run="full", date="2026-12-06")


def test_a_rerun_differing_only_in_environment_reproduced_every_value():
    """Code, date, run, library versions, python, driver, cpu count: none of them makes a row another
    row, so a rerun that only ran elsewhere or later matches every row and says all reproduced."""
    old = rows([2.0, 3.0, 12.5], **ENV_OLD)
    new = rows([2.0, 3.0 * (1 + 1e-9), 12.5], **ENV_NEW)
    new["k"] = pd.Series([8, "16.0", None], dtype=object)  # old: 8.0, 16.0, NaN (a CSV and memory differ so)
    lines = results.diff_summary(old, new)
    assert lines[0] == "3 rows before, 3 now: 0 added, 0 removed, 0 of 3 matched values changed"
    assert lines[1] == "all 3 matched values reproduced (within rel 1e-06, abs 1e-09)"
    assert len(lines) == 2


def test_a_changed_value_is_named_and_timings_are_counted_within_5_percent():
    old = rows([2.0, 3.0, 12.5], **ENV_OLD)
    new = rows([2.0, 3.3, 12.75], **ENV_NEW)  # a ratio moved 10%, the timing 2%
    lines = results.diff_summary(old, new)
    assert lines[0] == "3 rows before, 3 now: 0 added, 0 removed, 2 of 3 matched values changed"
    assert lines[1] == ("reproduced: 1 of 3 matched values within rel 1e-06, abs 1e-09, 2 within 5%; "
                        "timings (ms): 1 of 1 within 5%")
    assert lines[2] == "changed:"
    assert lines[3] == "  [metric=ratio, backend=x265, k=16, source=gauss, device=cpu]: 3 -> 3.3 (+10.0%)"
    assert lines[4] == "  [metric=encode_ms, backend=zstd, source=gauss, device=cpu]: 12.5 -> 12.75 (+2.0%)"


def test_the_values_that_changed_most_come_first_up_to_show():
    old = pd.DataFrame({"poc": "99", "device": "cpu", "backend": "b", "metric": "m", "unit": "x",
                        "value": [1.0] * 8, "i": range(8), "date": "d1"})
    new = old.assign(value=[1.0 + 0.01 * i for i in range(8)], date="d2")
    lines = results.diff_summary(old, new, show=3)
    assert lines[2] == "changed most (of 7):"
    assert [line.split("]")[0] for line in lines[3:]] == ["  [metric=m, backend=b, i=7, device=cpu",
                                                          "  [metric=m, backend=b, i=6, device=cpu",
                                                          "  [metric=m, backend=b, i=5, device=cpu"]


def test_device_and_a_poc_column_named_like_the_environment_stay_keys():
    old = rows([2.0, 3.0, 12.5], **ENV_OLD)
    other_gpu = old.assign(device="NVIDIA H100 80GB HBM3")
    assert results.diff_summary(old, other_gpu)[0].startswith("3 rows before, 3 now: 3 added, 3 removed, 0 of 0")
    # a PoC column "driver" (its own setting) sits beside env_driver, the machine's: it is a key
    mine = old.assign(env_driver="550.1", driver=["hf", "hf", "hf"])
    theirs = mine.assign(env_driver="580.2", driver=["hf", "spill", "hf"])
    assert results.key_columns(mine)[-1] == "driver" and "env_driver" not in results.key_columns(mine)
    assert results.diff_summary(mine, theirs)[0] == "3 rows before, 3 now: 1 added, 1 removed, 0 of 2 matched values changed"


def test_every_environment_column_is_left_out_of_the_key():
    for name in [*results.environment(), *results.BOOKKEEPING_COLUMNS, "code", "driver", "v_anything", "env_python"]:
        assert results.is_environment_column(name), name
    assert not results.is_environment_column("device") and not results.is_environment_column("k")


def test_a_full_rerun_elsewhere_prints_that_it_reproduced(tree, capsys, monkeypatch):
    """Through ResultsWriter.save: the committed CSV read back against this run's frame in memory."""
    machine = lambda env: {k: v for k, v in env.items() if k not in ("run", "date")}  # noqa: E731
    monkeypatch.setattr(results, "environment", lambda: machine(ENV_OLD))
    writer([2.0, 3.0], quick=False, extra=[(1, 5.0)]).save()
    capsys.readouterr()
    monkeypatch.setattr(results, "environment", lambda: machine(ENV_NEW))
    writer([2.0, 3.0], quick=False, extra=[(1, 5.0)]).save()
    out = capsys.readouterr().out
    assert "3 rows before, 3 now: 0 added, 0 removed, 0 of 3 matched values changed" in out
    assert "all 3 matched values reproduced" in out


def test_a_key_column_on_one_side_only_is_named_and_rows_still_match():
    old = rows([2.0, 3.0, 12.5], **ENV_OLD)
    new = rows([2.0, 3.0, 12.5], **ENV_NEW).assign(lanes=[256, 256, 256])  # a setting this run added
    lines = results.diff_summary(old, new)
    assert lines[0] == "key columns not matched on: only now: lanes"
    assert lines[1:] == ["3 rows before, 3 now: 0 added, 0 removed, 0 of 3 matched values changed",
                         "all 3 matched values reproduced (within rel 1e-06, abs 1e-09)"]
