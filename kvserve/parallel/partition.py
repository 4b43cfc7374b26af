"""How KV-Runahead splits a prompt's context over p processes: even, searched, or predicted from a table.

KV-Runahead (Cho et al., ICML'24, https://arxiv.org/abs/2405.05329) parallelises prefill: process i computes
the contiguous chunk ``[b_i, b_{i+1})`` of a C-token context and receives the KV cache of ``[0, b_i)`` from
process i-1. Causal attention makes a later chunk cost more than an earlier one of the same size, so the
partition that minimises time-to-first-token (TTFT) is uneven, with earlier chunks larger. The paper's three
ways to choose it live here:

- even (KVR-E): ``even_partition``; chunk sizes differ by at most one token.
- searched (KVR-S): ``search_partition`` times real prefills through a caller's ``measure`` callable; a
  unimodal (binary) search over the one boundary when p = 2, a hierarchical grid search when p >= 3.
- predicted (KVR-P): ``PartitionTable`` keeps searched partitions as fractions of their context length and
  interpolates them for a new length, so the search runs once per machine, not once per prompt.

Pure Python: no tensors and no ``torch.distributed`` here; ``parallel/runahead.py`` runs the partitions.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TABLE_FORMAT = "kvserve-runahead-table"
TABLE_VERSION = 1
TABLE_PATH_ENV = "KVSERVE_RUNAHEAD_TABLE"

# The coarse grid of the p >= 3 search has at most this many points (plus the even partition): every point
# is a real prefill, and the refinement levels recover the precision the coarse grid gives up.
_COARSE_POINTS = 32

Measure = Callable[["Partition"], float]


@dataclass(frozen=True)
class Partition:
    """Chunk boundaries ``b_0 = 0 < b_1 < ... < b_p = C``: process i computes tokens ``[b_i, b_{i+1})``."""

    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            boundaries = tuple(operator.index(b) for b in self.boundaries)
        except TypeError as exc:
            raise ValueError(f"partition boundaries must be integers, got {self.boundaries!r}") from exc
        object.__setattr__(self, "boundaries", boundaries)
        if len(boundaries) < 2:
            raise ValueError(f"a partition needs at least two boundaries (0 and C), got {boundaries!r}")
        if boundaries[0] != 0:
            raise ValueError(f"partition boundaries must start at 0, got {boundaries[0]} in {boundaries!r}")
        for i, (start, end) in enumerate(itertools.pairwise(boundaries)):
            if end == start:
                raise ValueError(f"chunk {i} of partition {boundaries!r} is empty: [{start}, {end})")
            if end < start:
                raise ValueError(f"partition boundaries must increase, got {start} then {end} in {boundaries!r}")

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> Partition:
        """The partition whose chunks have these sizes, in order."""
        return cls((0, *itertools.accumulate(sizes)))

    @property
    def num_chunks(self) -> int:
        return len(self.boundaries) - 1

    @property
    def context_len(self) -> int:
        return self.boundaries[-1]

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """``(start, end)`` per process, end exclusive."""
        return list(itertools.pairwise(self.boundaries))

    @property
    def sizes(self) -> list[int]:
        return [end - start for start, end in itertools.pairwise(self.boundaries)]

    def fractions(self) -> tuple[float, ...]:
        """The p-1 inner boundaries over C: the length-free shape a ``PartitionTable`` stores."""
        return tuple(b / self.context_len for b in self.boundaries[1:-1])


def even_partition(context_len: int, p: int) -> Partition:
    """KVR-E: sizes differ by at most one token, the larger chunks first (they are the cheaper ones)."""
    if p < 1:
        raise ValueError(f"a partition needs p >= 1 processes, got p={p}")
    if context_len < p:
        raise ValueError(f"cannot split a context of {context_len} tokens over p={p} processes (needs >= {p})")
    size, extra = divmod(context_len, p)
    return Partition.from_sizes([size + 1] * extra + [size] * (p - extra))


@dataclass(frozen=True)
class SearchResult:
    """The fastest partition measured, its time, and every measurement in the order it was made."""

    partition: Partition
    seconds: float
    measurements: int
    trace: list[tuple[Partition, float]]


class _BudgetSpent(Exception):
    """Raised inside the search when ``max_measurements`` is reached; the search returns its best so far."""


@dataclass
class _Timings:
    """Wraps the caller's ``measure`` so that no partition is prefilled twice and every time is recorded."""

    measure: Measure
    max_measurements: int | None
    seen: dict[Partition, float] = field(default_factory=dict)
    trace: list[tuple[Partition, float]] = field(default_factory=list)

    def __call__(self, partition: Partition) -> float:
        if partition in self.seen:
            return self.seen[partition]
        if self.max_measurements is not None and len(self.trace) >= self.max_measurements:
            raise _BudgetSpent
        seconds = float(self.measure(partition))
        if math.isnan(seconds) or seconds < 0:
            raise ValueError(f"measure({partition.boundaries}) returned {seconds}; it must return seconds >= 0")
        self.seen[partition] = seconds
        self.trace.append((partition, seconds))
        return seconds

    def best(self) -> Partition:
        """The fastest so far; the earliest measured wins a tie."""
        return min(self.trace, key=lambda entry: entry[1])[0]


def search_partition(
    context_len: int,
    p: int,
    measure: Measure,
    step: int = 16,
    min_chunk: int = 16,
    levels: int = 3,
    *,
    max_measurements: int | None = None,
) -> SearchResult:
    """KVR-S: the partition with the lowest measured TTFT, from as few real prefills as the search can manage.

    ``measure(partition)`` runs (or models) one prefill and returns its seconds; each partition is measured at
    most once. Inner boundaries are multiples of ``step`` tokens (except the even partition, a p >= 3
    candidate) and every chunk has at least ``min_chunk`` tokens. p = 2 assumes TTFT is unimodal in the
    boundary and binary-searches it: about ``2 * log2(C / step)`` measurements. p >= 3 measures a coarse grid of
    boundary fractions, then refines ``levels`` times, halving the spacing and using ``step`` at the last level,
    each time moving to the fastest of the 3^(p-1) - 1 neighbours while one is faster; so with ``levels >= 1``
    the result is a local minimum on the ``step`` grid. The cost grows as 3^(p-1) (hundreds of measurements
    for p = 5), hence ``max_measurements``, which stops the search with the best partition measured so far.
    """
    _check_search_args(context_len, p, step, min_chunk, levels, max_measurements)
    timings = _Timings(measure, max_measurements)
    try:
        if p == 1:
            timings(Partition((0, context_len)))
        elif p == 2:
            _search_boundary(timings, context_len, step, min_chunk)
        else:
            _search_grid(timings, context_len, p, step, min_chunk, levels)
    except _BudgetSpent:
        pass
    best = timings.best()
    return SearchResult(best, timings.seen[best], len(timings.trace), timings.trace)


def _check_search_args(
    context_len: int, p: int, step: int, min_chunk: int, levels: int, max_measurements: int | None
) -> None:
    for name, value in (("p", p), ("step", step), ("min_chunk", min_chunk)):
        if value < 1:
            raise ValueError(f"search_partition needs {name} >= 1, got {name}={value}")
    if levels < 0:
        raise ValueError(f"search_partition needs levels >= 0, got levels={levels}")
    if max_measurements is not None and max_measurements < 1:
        raise ValueError(f"search_partition needs max_measurements >= 1 or None, got {max_measurements}")
    if context_len < p * min_chunk:
        raise ValueError(
            f"a context of {context_len} tokens cannot give p={p} chunks of min_chunk={min_chunk} tokens "
            f"(needs >= {p * min_chunk})"
        )


def _search_boundary(timings: _Timings, context_len: int, step: int, min_chunk: int) -> None:
    """p = 2: binary search for the minimum of a unimodal TTFT(b) over multiples of ``step``.

    Comparing f(m) with f(m + 1) tells which side of m the minimum lies on (the paper's binary search).
    """
    first = -(-min_chunk // step) * step
    candidates = list(range(first, context_len - min_chunk + 1, step)) or [context_len // 2]
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        left = timings(Partition((0, candidates[mid], context_len)))
        right = timings(Partition((0, candidates[mid + 1], context_len)))
        if left <= right:
            hi = mid
        else:
            lo = mid + 1
    timings(Partition((0, candidates[lo], context_len)))


def _search_grid(timings: _Timings, context_len: int, p: int, step: int, min_chunk: int, levels: int) -> None:
    """p >= 3: coarse grid over boundary fractions, then finer and finer neighbourhoods of the best."""
    cells = _coarse_cells(context_len, p, step)
    timings(even_partition(context_len, p))
    for inner in itertools.combinations(range(1, cells), p - 1):
        partition = _valid(tuple(_snap(k * context_len / cells, step) for k in inner), context_len, min_chunk)
        if partition is not None:
            timings(partition)
    spacing = context_len / cells
    for level in range(levels):
        spacing = step if level == levels - 1 else max(step, _snap(spacing / 2, step))
        _climb(timings, spacing, step, min_chunk)
        if spacing == step:
            break


def _coarse_cells(context_len: int, p: int, step: int) -> int:
    """The most grid cells (fraction spacing 1 / cells) whose grid has at most ``_COARSE_POINTS`` points."""
    cells = p
    while math.comb(cells, p - 1) <= _COARSE_POINTS and (cells + 1) * step <= context_len:
        cells += 1
    return cells


def _climb(timings: _Timings, spacing: int, step: int, min_chunk: int) -> None:
    """Move to the fastest neighbour of the best partition until none is faster.

    A neighbour grows or shrinks each chunk after the first by ``spacing`` tokens (or leaves it), the first
    chunk taking up the difference, so boundaries can move by different amounts at once: a balanced
    (max-over-chunks) TTFT has ridges that no move of every boundary by the same +-spacing climbs off.
    Every move strictly lowers the best time over a finite grid, so the climb ends.
    """
    while True:
        best = timings.best()
        inner, context_len = best.boundaries[1:-1], best.context_len
        for changes in itertools.product((-1, 0, 1), repeat=len(inner)):
            shifts = list(itertools.accumulate(reversed(changes)))[::-1]  # boundary i moves by sum(changes[i:])
            moved = tuple(b if d == 0 else _snap(b + d * spacing, step) for b, d in zip(inner, shifts, strict=True))
            partition = _valid(moved, context_len, min_chunk)
            if partition is not None:
                timings(partition)
        if timings.best() == best:
            return


def _snap(tokens: float, step: int) -> int:
    return round(tokens / step) * step


def _valid(inner: tuple[int, ...], context_len: int, min_chunk: int) -> Partition | None:
    """The partition with these inner boundaries, or None if a chunk would be shorter than ``min_chunk``."""
    boundaries = (0, *inner, context_len)
    if all(end - start >= min_chunk for start, end in itertools.pairwise(boundaries)):
        return Partition(boundaries)
    return None


@dataclass
class PartitionTable:
    """KVR-P: searched partitions per process count, as boundary fractions keyed by context length.

    ``predict`` interpolates the fractions linearly between the two nearest lengths (the best partition's
    shape changes slowly with length) and clamps outside the table, so one search per table entry serves
    every prompt length. ``machine`` describes where the table was measured: timings do not transfer.
    """

    entries: dict[int, dict[int, tuple[float, ...]]] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def add(self, context_len: int, partition: Partition) -> None:
        """Record (or replace) the partition for this length and its number of chunks."""
        if partition.context_len != context_len:
            raise ValueError(
                f"the partition {partition.boundaries} covers {partition.context_len} tokens, not {context_len}"
            )
        self.entries.setdefault(partition.num_chunks, {})[context_len] = partition.fractions()

    def lengths(self, p: int) -> list[int]:
        """The context lengths with an entry for p processes, ascending."""
        return sorted(self.entries.get(p, {}))

    def predict(self, context_len: int, p: int) -> Partition:
        """The partition for ``context_len`` tokens over p processes, from the entries for that p."""
        by_length = self.entries.get(p)
        if not by_length:
            have = sorted(self.entries) or "none"
            raise ValueError(f"the runahead table has no entry for p={p} (it has p in {have}); search one first")
        if context_len < p:
            raise ValueError(f"cannot split a context of {context_len} tokens over p={p} processes (needs >= {p})")
        return _from_fractions(_interpolate(by_length, context_len), context_len)

    def save(self, path: str | os.PathLike[str], machine: dict[str, Any]) -> Path:
        """Write the table as JSON with the machine it was measured on; the file is replaced atomically."""
        if not isinstance(machine, dict):
            raise ValueError(f"machine must be a dict describing the machine, got {type(machine).__name__}")
        path = Path(path).expanduser()
        entries = [
            {"p": p, "context_len": length, "fractions": list(self.entries[p][length])}
            for p in sorted(self.entries)
            for length in sorted(self.entries[p])
        ]
        document = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "machine": machine, "entries": entries}
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
        partial.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PartitionTable:
        """Read a table written by ``save``; a ValueError names the file and what is wrong with it."""
        path = Path(path).expanduser()
        try:
            document = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a readable runahead table: {exc}") from exc
        try:
            return _parse_table(document)
        except ValueError as exc:
            raise ValueError(f"{path} is not a valid runahead table: {exc}") from exc


def default_table_path() -> Path:
    """``$KVSERVE_RUNAHEAD_TABLE`` if set, else ``~/.cache/kvserve/runahead-table.json``."""
    override = os.environ.get(TABLE_PATH_ENV)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "kvserve" / "runahead-table.json"


def _interpolate(by_length: dict[int, tuple[float, ...]], context_len: int) -> tuple[float, ...]:
    """Linear interpolation of the fractions between the nearest lengths; the end entries outside the range."""
    lengths = sorted(by_length)
    if context_len <= lengths[0]:
        return by_length[lengths[0]]
    if context_len >= lengths[-1]:
        return by_length[lengths[-1]]
    upper = bisect.bisect_left(lengths, context_len)
    lo, hi = lengths[upper - 1], lengths[upper]
    if hi == context_len:
        return by_length[hi]
    t = (context_len - lo) / (hi - lo)
    return tuple((1 - t) * a + t * b for a, b in zip(by_length[lo], by_length[hi], strict=True))


def _from_fractions(fractions: Sequence[float], context_len: int) -> Partition:
    """Round the fractions to token boundaries, nudged so every chunk keeps at least one token."""
    p = len(fractions) + 1
    boundaries = [0]
    for i, fraction in enumerate(fractions, start=1):
        lowest, highest = boundaries[-1] + 1, context_len - (p - i)
        boundaries.append(min(max(round(fraction * context_len), lowest), highest))
    return Partition((*boundaries, context_len))


def _parse_table(document: object) -> PartitionTable:
    if not isinstance(document, dict):
        raise ValueError(f"expected a JSON object, got {type(document).__name__}")
    if document.get("format") != TABLE_FORMAT:
        raise ValueError(f"'format' is {document.get('format')!r}, expected {TABLE_FORMAT!r}")
    if document.get("version") != TABLE_VERSION:
        raise ValueError(f"'version' is {document.get('version')!r}; this kvserve reads version {TABLE_VERSION}")
    machine, entries = document.get("machine"), document.get("entries")
    if not isinstance(machine, dict):
        raise ValueError(f"'machine' must be an object, got {machine!r}")
    if not isinstance(entries, list):
        raise ValueError(f"'entries' must be a list, got {entries!r}")
    table = PartitionTable(machine=machine)
    for index, entry in enumerate(entries):
        p, length, fractions = _parse_entry(entry, index)
        if length in table.entries.get(p, {}):
            raise ValueError(f"entry {index} repeats p={p}, context_len={length}")
        table.entries.setdefault(p, {})[length] = fractions
    return table


def _parse_entry(entry: object, index: int) -> tuple[int, int, tuple[float, ...]]:
    """``(p, context_len, fractions)`` of one entry: p - 1 strictly increasing fractions inside (0, 1)."""
    if not isinstance(entry, dict) or not {"p", "context_len", "fractions"} <= entry.keys():
        raise ValueError(f"entry {index} must be an object with 'p', 'context_len' and 'fractions', got {entry!r}")
    p, length, fractions = entry["p"], entry["context_len"], entry["fractions"]
    if not _is_int(p) or p < 1 or not _is_int(length) or length < p:
        raise ValueError(
            f"entry {index} needs integers p >= 1 and context_len >= p, got p={p!r}, context_len={length!r}"
        )
    if not isinstance(fractions, list) or len(fractions) != p - 1:
        raise ValueError(f"entry {index} needs a list of p-1={p - 1} fractions, got {fractions!r}")
    numbers = all(_is_number(f) for f in fractions)
    if not numbers or any(hi <= lo for lo, hi in itertools.pairwise([0.0, *fractions, 1.0])):
        raise ValueError(f"entry {index} needs strictly increasing fractions inside (0, 1), got {fractions!r}")
    return p, length, tuple(float(f) for f in fractions)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
