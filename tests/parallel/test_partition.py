"""KV-Runahead partitions: even splits, validation, the searches on synthetic TTFT models, the lookup table."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import pytest

from kvserve.parallel.partition import (
    Partition,
    PartitionTable,
    default_table_path,
    even_partition,
    search_partition,
)


class FakeMeasure:
    """A synthetic TTFT model that records every partition it is asked to time."""

    def __init__(self, cost: Callable[[Partition], float]) -> None:
        self.cost = cost
        self.calls: list[Partition] = []

    def __call__(self, partition: Partition) -> float:
        self.calls.append(partition)
        return self.cost(partition)

    def assert_no_repeats(self) -> None:
        assert len(set(self.calls)) == len(self.calls)


def causal_max(partition: Partition) -> float:
    """Chunk i's causal attention area is b_{i+1}^2 - b_i^2; the slowest chunk sets TTFT."""
    return float(max(end * end - start * start for start, end in partition.chunks))


def balanced_boundaries(context_len: int, p: int) -> list[float]:
    """Equal causal areas: b_i = C * sqrt(i / p)."""
    return [context_len * math.sqrt(i / p) for i in range(1, p)]


# --- Partition and even partitions -------------------------------------------------------------------


def test_partition_properties():
    part = Partition((0, 6, 10, 12))
    assert (part.num_chunks, part.context_len) == (3, 12)
    assert part.chunks == [(0, 6), (6, 10), (10, 12)]
    assert part.sizes == [6, 4, 2]
    assert part.fractions() == (0.5, 10 / 12)
    assert Partition.from_sizes([6, 4, 2]) == part
    assert Partition([0, 6, 10, 12]).boundaries == (0, 6, 10, 12)  # a list becomes a (hashable) tuple
    assert Partition((0, 7)).fractions() == ()


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        ((1, 4, 8), "must start at 0, got 1"),
        ((0, 4, 4, 8), re.escape("chunk 1 of partition (0, 4, 4, 8) is empty: [4, 4)")),
        ((0, 5, 3, 8), "must increase, got 5 then 3"),
        ((0,), "at least two boundaries"),
        ((), "at least two boundaries"),
        ((0, 1.5, 3), "must be integers"),
    ],
)
def test_partition_rejects_bad_boundaries(boundaries, message):
    with pytest.raises(ValueError, match=message):
        Partition(boundaries)


def test_from_sizes_rejects_an_empty_chunk():
    with pytest.raises(ValueError, match="empty"):
        Partition.from_sizes([3, 0, 2])


def test_even_partition_divisible():
    assert even_partition(1024, 4).boundaries == (0, 256, 512, 768, 1024)
    assert even_partition(5, 1).boundaries == (0, 5)
    assert even_partition(3, 3).sizes == [1, 1, 1]


@pytest.mark.parametrize(("context_len", "p"), [(10, 3), (1000, 7), (4097, 8), (17, 16)])
def test_even_partition_non_divisible_differs_by_at_most_one(context_len, p):
    sizes = even_partition(context_len, p).sizes
    assert len(sizes) == p and sum(sizes) == context_len
    assert max(sizes) - min(sizes) == 1
    assert sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("context_len", "p", "message"), [(10, 0, "p >= 1"), (3, 4, "3 tokens over p=4")])
def test_even_partition_errors(context_len, p, message):
    with pytest.raises(ValueError, match=message):
        even_partition(context_len, p)


# --- search, p = 1 and p = 2 ---------------------------------------------------------------------------


def test_search_one_process_measures_the_whole_context_once():
    measure = FakeMeasure(lambda part: 0.25)
    result = search_partition(300, 1, measure)
    assert result.partition == Partition((0, 300))
    assert (result.seconds, result.measurements, measure.calls) == (0.25, 1, [Partition((0, 300))])


def _quadratic_v(context_len: int, a: float, c: float) -> tuple[Callable[[Partition], float], float]:
    """max(a b^2, c (C^2 - b^2)): the two processes' causal costs; optimum where they meet."""
    return (
        lambda part: max(a * part.boundaries[1] ** 2, c * (context_len**2 - part.boundaries[1] ** 2)),
        context_len * math.sqrt(c / (a + c)),
    )


@pytest.mark.parametrize(
    ("context_len", "step", "cost_and_optimum"),
    [
        (4096, 16, _quadratic_v(4096, 1.0, 1.0)),
        (4096, 64, _quadratic_v(4096, 1.0, 3.0)),
        (1000, 16, _quadratic_v(1000, 2.0, 1.0)),
        (4096, 16, (lambda part: abs(part.boundaries[1] - 1001), 1001)),
        (8192, 16, (lambda part: abs(part.boundaries[1] - 7000) + 5.0, 7000)),
        (2048, 16, (lambda part: abs(part.boundaries[1] - 20), 20)),  # optimum at the edge of the range
    ],
)
def test_search_two_processes_finds_the_optimum_with_few_measurements(context_len, step, cost_and_optimum):
    cost, optimum = cost_and_optimum
    measure = FakeMeasure(cost)
    result = search_partition(context_len, 2, measure, step=step, min_chunk=16)
    boundary = result.partition.boundaries[1]
    assert abs(boundary - optimum) <= step
    assert boundary % step == 0
    candidates = [Partition((0, b, context_len)) for b in range(step, context_len - 16 + 1, step)]
    assert result.seconds == min(cost(part) for part in candidates)  # the grid's true minimum
    assert result.measurements == len(measure.calls) <= 2 * math.log2(context_len / step) + 4
    measure.assert_no_repeats()
    assert result.trace == [(part, cost(part)) for part in measure.calls]


def test_search_two_processes_short_context_without_a_step_multiple():
    measure = FakeMeasure(lambda part: 1.0)
    result = search_partition(40, 2, measure, step=64, min_chunk=8)
    assert result.partition == Partition((0, 20, 40))
    assert result.measurements == 1


# --- search, p >= 3 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("context_len", "p"), [(2048, 3), (4096, 3), (2048, 4)])
def test_grid_search_lands_near_the_balanced_optimum(context_len, p):
    measure = FakeMeasure(causal_max)
    result = search_partition(context_len, p, measure, step=16, min_chunk=16)
    inner = result.partition.boundaries[1:-1]
    assert all(abs(b - o) <= 3 * 16 for b, o in zip(inner, balanced_boundaries(context_len, p), strict=True))
    assert result.seconds <= causal_max(even_partition(context_len, p))  # never worse than KVR-E
    assert result.measurements == len(measure.calls) <= 300  # exhaustive over the step grid: ~10^4 to ~10^6
    measure.assert_no_repeats()
    assert all(size >= 16 for part in measure.calls for size in part.sizes)
    assert result.trace == [(part, causal_max(part)) for part in measure.calls]
    assert result.partition == min(result.trace, key=lambda entry: entry[1])[0]


def test_grid_search_on_a_separable_cost_finds_the_exact_grid_point():
    target = (1104, 1600)
    measure = FakeMeasure(lambda part: sum(abs(b - t) for b, t in zip(part.boundaries[1:-1], target, strict=True)))
    result = search_partition(2048, 3, measure, step=16, min_chunk=16)
    assert result.partition.boundaries == (0, *target, 2048)
    assert result.seconds == 0
    measure.assert_no_repeats()


def test_more_levels_do_not_make_the_search_worse():
    coarse = search_partition(4096, 3, causal_max, levels=0)
    fine = search_partition(4096, 3, causal_max, levels=3)
    assert fine.seconds <= coarse.seconds
    assert fine.measurements > coarse.measurements


def test_max_measurements_stops_the_search_with_the_best_so_far():
    measure = FakeMeasure(causal_max)
    result = search_partition(4096, 4, measure, max_measurements=10)
    assert result.measurements == len(measure.calls) == 10
    assert result.seconds == min(seconds for _, seconds in result.trace)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_len": 40, "p": 3, "min_chunk": 16}, "40 tokens cannot give p=3 chunks of min_chunk=16"),
        ({"context_len": 400, "p": 0}, "p >= 1, got p=0"),
        ({"context_len": 400, "p": 2, "step": 0}, "step >= 1, got step=0"),
        ({"context_len": 400, "p": 3, "levels": -1}, "levels >= 0"),
        ({"context_len": 400, "p": 3, "max_measurements": 0}, "max_measurements >= 1"),
    ],
)
def test_search_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        search_partition(measure=causal_max, **kwargs)


def test_search_rejects_a_nan_measurement():
    with pytest.raises(ValueError, match="returned nan"):
        search_partition(400, 2, lambda part: float("nan"))


# --- the lookup table (KVR-P) ------------------------------------------------------------------------------


def _table() -> PartitionTable:
    table = PartitionTable()
    table.add(1024, Partition((0, 768, 1024)))  # 0.75
    table.add(2048, Partition((0, 1434, 2048)))  # ~0.7002
    table.add(1000, Partition((0, 600, 850, 1000)))  # 0.6, 0.85
    table.add(3000, Partition((0, 1500, 2400, 3000)))  # 0.5, 0.8
    return table


def test_table_returns_a_stored_partition_exactly():
    table = _table()
    assert table.predict(1024, 2).boundaries == (0, 768, 1024)
    assert table.predict(2048, 2).boundaries == (0, 1434, 2048)
    assert table.predict(3000, 3).boundaries == (0, 1500, 2400, 3000)
    assert table.lengths(2) == [1024, 2048] and table.lengths(5) == []


def test_table_interpolates_fractions_between_entries():
    table = _table()
    middle = (0.75 + 1434 / 2048) / 2
    assert table.predict(1536, 2).boundaries == (0, round(middle * 1536), 1536)
    # half way from 1000 to 3000: fractions 0.55 and 0.825
    assert table.predict(2000, 3).boundaries == (0, 1100, 1650, 2000)


def test_table_clamps_outside_its_range():
    table = _table()
    assert table.predict(512, 2).boundaries == (0, 384, 512)  # 0.75, the shortest entry
    assert table.predict(100, 3).boundaries == (0, 60, 85, 100)
    assert table.predict(10_000, 3).boundaries == (0, 5000, 8000, 10_000)


def test_table_prediction_keeps_every_chunk_non_empty():
    table = PartitionTable()
    table.add(1000, Partition((0, 997, 998, 999, 1000)))
    for length in (4, 5, 9, 50):
        part = table.predict(length, 4)
        assert part.num_chunks == 4 and part.context_len == length and min(part.sizes) >= 1


def test_table_errors():
    table = _table()
    with pytest.raises(ValueError, match=re.escape("no entry for p=4 (it has p in [2, 3])")):
        table.predict(2000, 4)
    with pytest.raises(ValueError, match="2 tokens over p=3"):
        table.predict(2, 3)
    with pytest.raises(ValueError, match="covers 1024 tokens, not 2000"):
        table.add(2000, Partition((0, 512, 1024)))


def test_table_save_load_round_trip(tmp_path):
    table = _table()
    machine = {"nproc": 2, "device": "cpu", "model": "SmolLM2-135M-Instruct"}
    path = table.save(tmp_path / "nested" / "table.json", machine)
    document = json.loads(path.read_text())
    assert (document["version"], document["machine"]) == (1, machine)
    loaded = PartitionTable.load(path)
    assert loaded.machine == machine
    assert loaded.entries == table.entries
    for length, p in [(1536, 2), (1500, 3), (512, 2), (9000, 3)]:
        assert loaded.predict(length, p) == table.predict(length, p)
    assert not list(tmp_path.rglob("*.partial"))


def _valid_document() -> dict:
    return {
        "format": "kvserve-runahead-table",
        "version": 1,
        "machine": {"nproc": 2},
        "entries": [{"p": 3, "context_len": 1000, "fractions": [0.6, 0.85]}],
    }


def _broken(**changes: object) -> str:
    document = _valid_document()
    document.update(changes)
    return json.dumps(document)


def _broken_entry(**changes: object) -> str:
    entry = {"p": 3, "context_len": 1000, "fractions": [0.6, 0.85]} | changes
    return _broken(entries=[entry])


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "not a readable runahead table"),
        ("[1, 2]", "expected a JSON object, got list"),
        (_broken(format="something-else"), "'format' is 'something-else'"),
        (_broken(version=2), "'version' is 2; this kvserve reads version 1"),
        (_broken(machine=None), "'machine' must be an object"),
        (_broken(entries={"p": 2}), "'entries' must be a list"),
        (_broken(entries=[[3, 1000]]), "entry 0 must be an object"),
        (_broken_entry(p=0), "entry 0 needs integers p >= 1"),
        (_broken_entry(p=True), "entry 0 needs integers p >= 1"),
        (_broken_entry(context_len=2), "context_len >= p"),
        (_broken_entry(fractions=[0.6]), "p-1=2 fractions"),
        (_broken_entry(fractions=[0.85, 0.6]), "strictly increasing fractions inside"),
        (_broken_entry(fractions=[0.6, 1.0]), "strictly increasing fractions inside"),
        (_broken_entry(fractions=[0.6, "0.8"]), "strictly increasing fractions inside"),
        (_broken(entries=[_valid_document()["entries"][0]] * 2), "entry 1 repeats p=3, context_len=1000"),
    ],
)
def test_load_rejects_a_malformed_file(tmp_path, text, problem):
    path = tmp_path / "table.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + re.escape(problem)):
        PartitionTable.load(path)


def test_load_names_a_missing_file(tmp_path):
    path = tmp_path / "missing.json"
    with pytest.raises(ValueError, match=re.escape(str(path))):
        PartitionTable.load(path)


def test_save_rejects_a_machine_that_is_not_a_dict(tmp_path):
    with pytest.raises(ValueError, match="machine must be a dict"):
        _table().save(tmp_path / "t.json", machine="cpu")


def test_default_table_path(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_RUNAHEAD_TABLE", str(tmp_path / "mine.json"))
    assert default_table_path() == tmp_path / "mine.json"
    monkeypatch.delenv("KVSERVE_RUNAHEAD_TABLE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_table_path() == tmp_path / ".cache" / "kvserve" / "runahead-table.json"
