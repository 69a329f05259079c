"""ResultsWriter.merge: a rerun's rows replace exactly the matching rows of the existing CSV."""
import pandas as pd

from shared.results import ResultsWriter


def test_merge_replaces_only_the_matching_rows(tmp_path):
    first = ResultsWriter("99", "merge_test")
    first.path = tmp_path / "99_merge_test.csv"
    first.add(backend="a", metric="m", value=1.0, unit="x", part="cpu_rows")
    first.add(backend="b", metric="m", value=2.0, unit="x", part="gpu_rows")
    first.save(first.path)
    again = ResultsWriter("99", "merge_test")
    again.path = first.path
    again.add(backend="b", metric="m", value=3.0, unit="x", part="gpu_rows", device="NVIDIA H200")
    again.merge(part="gpu_rows")
    df = pd.read_csv(first.path)
    assert sorted(zip(df.backend, df.value)) == [("a", 1.0), ("b", 3.0)]
    assert set(df[df.backend == "b"].device) == {"NVIDIA H200"}


def test_merge_without_a_csv_writes_one(tmp_path):
    res = ResultsWriter("99", "merge_test")
    res.path = tmp_path / "99_merge_test.csv"
    res.add(backend="a", metric="m", value=1.0, unit="x", part="p")
    res.merge(part="p")
    assert pd.read_csv(res.path).value.tolist() == [1.0]
