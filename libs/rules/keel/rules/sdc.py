"""Rung 5: locate a machine that silently corrupts data with dual-phase replay (group testing).

Pure planning and inference; the replays themselves are run elsewhere. ByteRobust's method: replay a
scaled-down job twice, keeping TP and PP fixed (the same communication pattern) and shrinking only DP,
so each replay group is a smaller data-parallel job on some of the machines, compared bitwise against
a reference. The machines are laid out in a grid (``grid_shape``, near-square):

- phase 1, **contiguous**: one group per grid row (machines ``[r*cols, (r+1)*cols)``);
- phase 2, **strided**: one group per grid column (machines ``c, c+cols, c+2*cols, ...``).

All groups of a phase run at the same time, so a phase is one replay round. A single bad machine
makes exactly one row and one column fail; the row gives one coordinate, the column the other, and
their intersection is the machine: 2 rounds for any number of machines, where a binary search needs
``ceil(log2 n)`` (24 machines: 2 instead of 5; 1,200: 2 instead of 11; for 2 or 3 machines a binary
search is as fast, the grid being a single row).

``locate`` intersects the failing groups of every phase. Exactly one suspect left: found. Several
(more than one bad machine) or none although every phase failed somewhere (results that do not
intersect): ambiguous, and ``next_phase`` tests each remaining candidate in its own group (padded with
machines that passed, up to the replay size) in one more round; after such a split, several failing
candidates are reported as ``"several"``. A phase where no group failed: ``"not_reproduced"``.

A "machine" is the unit by which the replay shrinks DP: a node, or the nodes that hold one model
replica when a replica spans several nodes; each replay group must be a runnable job of whole units.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

PhaseKind = Literal["contiguous", "strided", "split"]
LocalisationKind = Literal["found", "ambiguous", "several", "not_reproduced", "inconsistent"]


@dataclass(frozen=True, slots=True)
class Phase:
    """One replay round: ``groups`` run in parallel, each a scaled-down job on its machines.

    ``index`` counts rounds from 1. ``suspects`` are the machines under test (a split phase's padding
    machines already passed and are not suspects). Raises ``ValueError`` for a machine in two groups
    or an empty group.
    """

    index: int
    kind: PhaseKind
    groups: tuple[tuple[str, ...], ...]
    suspects: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for g in self.groups:
            if not g:
                raise ValueError(f"phase {self.index} has an empty group")
            for m in g:
                if m in seen:
                    raise ValueError(f"machine {m!r} is in two groups of phase {self.index}")
                seen.add(m)
        if not self.suspects:
            object.__setattr__(self, "suspects", tuple(m for g in self.groups for m in g))

    @property
    def machines(self) -> tuple[str, ...]:
        return tuple(m for g in self.groups for m in g)


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """Which groups of ``phase`` failed (their replay mismatched the bitwise reference), by index."""

    phase: Phase
    failed: frozenset[int]

    def __post_init__(self) -> None:
        bad = [i for i in self.failed if not 0 <= i < len(self.phase.groups)]
        if bad:
            raise ValueError(f"phase {self.phase.index} has {len(self.phase.groups)} groups; failed indices {bad} "
                             f"do not exist")


@dataclass(frozen=True, slots=True)
class Localisation:
    """The outcome so far: ``machine`` when ``kind == "found"``; ``candidates`` the machines still
    suspected (or, for ``"several"``, every machine that failed alone); ``next_phase`` the round to run
    when ``"ambiguous"``; ``rounds`` the replay rounds used."""

    kind: LocalisationKind
    machine: str | None
    candidates: tuple[str, ...]
    next_phase: Phase | None
    rounds: int
    reasons: tuple[str, ...]


def grid_shape(n: int, group_size: int | None = None) -> tuple[int, int]:
    """(rows, cols) of the grid for ``n`` machines; ``rows * cols >= n``, only the last row may be short.

    With ``group_size`` (machines per contiguous group, e.g. ``n // DP shrink factor``): ``cols =
    min(group_size, n)``. Without: the ``cols`` minimising ``rows + cols``, then the empty cells, then
    preferring ``rows <= cols`` (24 machines: 4 x 6; 7: 2 x 4; 1,200: 30 x 40).
    """
    if n < 1:
        raise ValueError(f"need at least one machine, got {n}")
    if group_size is not None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        cols = min(group_size, n)
        return math.ceil(n / cols), cols
    # the best sum rows + cols is at most 2 * ceil(sqrt(n)) + 1, so cols beyond that never win
    best = min(range(1, min(n, 2 * math.isqrt(n) + 3) + 1), key=lambda c: (math.ceil(n / c) + c, math.ceil(n / c) * c - n, math.ceil(n / c) > c, -c))
    return math.ceil(n / best), best


def plan_phases(machines: Sequence[str], group_size: int | None = None) -> tuple[Phase, Phase]:
    """The two replay rounds for ``machines`` (in their given order, e.g. by rack or rank):
    phase 1 contiguous (grid rows), phase 2 strided (grid columns). Raises ``ValueError`` for no
    machines or duplicates."""
    ms = tuple(machines)
    if len(set(ms)) != len(ms):
        raise ValueError("machine names must be unique")
    rows, cols = grid_shape(len(ms), group_size)
    contiguous = tuple(ms[r * cols:(r + 1) * cols] for r in range(rows))
    strided = tuple(ms[c::cols] for c in range(cols))
    return Phase(1, "contiguous", contiguous), Phase(2, "strided", strided)


def plan_split(candidates: Sequence[str], cleared: Sequence[str], group_size: int, index: int) -> Phase:
    """A fallback round: each candidate in its own group, padded with ``cleared`` machines (ones that
    passed) up to ``group_size`` while they last, so every group stays a runnable replay."""
    if not candidates:
        raise ValueError("nothing to split")
    spare = [m for m in cleared if m not in set(candidates)]
    groups = []
    per = max(group_size - 1, 0)
    for i, c in enumerate(candidates):
        groups.append((c, *spare[i * per:(i + 1) * per]))
    return Phase(index, "split", tuple(groups), tuple(candidates))


def _union(phase: Phase, indices: Iterable[int]) -> set[str]:
    return {m for i in indices for m in phase.groups[i]}


def locate(results: Sequence[PhaseResult]) -> Localisation:
    """Intersect the failing groups of every phase so far (both planned phases first, then any
    ``next_phase``), assuming a deterministic fault. See the module docstring for the outcomes."""
    if not results:
        raise ValueError("no phase results")
    first = results[0].phase
    order = {m: i for i, m in enumerate(first.machines)}
    group_size = max(len(g) for g in first.groups)
    suspects = set(first.machines)
    cleared: set[str] = set()
    failed_any: set[str] = set()
    reasons: list[str] = []
    rounds = len(results)
    reset_by: int | None = None  # the phase after which the intersection was empty and suspects were reset
    for res in results:
        ph = res.phase
        ph_machines = ph.machines
        unknown = [m for m in ph_machines if m not in order]
        if unknown:
            raise ValueError(f"phase {ph.index} names machines outside phase 1's: {unknown[:5]}")
        if not res.failed:
            return Localisation("not_reproduced", None, (), None, rounds, (
                f"no group failed in phase {ph.index} ({ph.kind}, {len(ph.groups)} groups): not reproduced; "
                f"the corruption is intermittent or needs the full job", *reasons))
        failed = _union(ph, res.failed)
        passed = set(ph_machines) - failed
        suspects &= failed
        cleared |= passed
        failed_any |= failed & set(ph.suspects)
        reasons.append(f"phase {ph.index} ({ph.kind}): {len(res.failed)} of {len(ph.groups)} group(s) failed "
                       f"({sorted(res.failed)}); {len(suspects)} suspect(s) left")
        reset_by = None
        if not suspects:
            suspects = failed_any - cleared
            if not suspects:
                return Localisation("inconsistent", None, (), None, rounds, (
                    "the failing groups do not intersect and every machine in them also passed in another phase: "
                    "the results contradict a deterministic fault (flaky replay?)", *reasons))
            reset_by = ph.index
    ranked = sorted(suspects, key=order.__getitem__)
    last = results[-1].phase
    if reset_by is not None:
        nxt = plan_split(ranked, sorted(cleared, key=order.__getitem__), group_size, last.index + 1)
        return Localisation("ambiguous", None, tuple(ranked), nxt, rounds, (
            f"the failing groups do not intersect; {len(ranked)} machine(s) never passed; next, each alone in "
            f"one more round (phase {nxt.index})", *reasons))
    if len(ranked) == 1:
        return Localisation("found", ranked[0], tuple(ranked), None, rounds, (
            f"machine {ranked[0]} is the only one in a failing group of every phase", *reasons))
    if last.kind == "split":
        return Localisation("several", None, tuple(ranked), None, rounds, (
            f"{len(ranked)} machines fail on their own: {', '.join(ranked)}; more than one machine corrupts", *reasons))
    nxt = plan_split(ranked, sorted(cleared, key=order.__getitem__), group_size, last.index + 1)
    return Localisation("ambiguous", None, tuple(ranked), nxt, rounds, (
        f"{len(ranked)} suspects remain ({', '.join(ranked[:8])}{', ...' if len(ranked) > 8 else ''}): "
        f"more than one bad machine; next, each alone in one more round (phase {nxt.index})", *reasons))


def binary_search_rounds(n: int) -> int:
    """Rounds a binary search needs to find one bad machine among ``n``: ``ceil(log2 n)``."""
    if n < 1:
        raise ValueError(f"need at least one machine, got {n}")
    return math.ceil(math.log2(n)) if n > 1 else 0


def replays_needed(n: int, group_size: int | None = None) -> int:
    """Worst-case replay rounds of the dual-phase scheme for one bad machine among ``n``: 2 (each grid
    cell is the only intersection of its row and column, so no fallback is needed); 0 for one machine
    (nothing to locate). ``simulate`` checks this for every possible bad machine."""
    grid_shape(n, group_size)  # validates
    return 0 if n == 1 else 2


@dataclass(frozen=True, slots=True)
class CaseResult:
    bad: tuple[str, ...]
    localisation: Localisation

    @property
    def correct(self) -> bool:
        loc = self.localisation
        if len(self.bad) == 1:
            return loc.kind == "found" and loc.machine == self.bad[0]
        return loc.kind == "several" and set(loc.candidates) == set(self.bad)


@dataclass(frozen=True, slots=True)
class Simulation:
    """Every case of ``simulate``: ``all_correct`` when each bad set was located exactly."""

    n: int
    rows: int
    cols: int
    cases: tuple[CaseResult, ...] = field(repr=False)

    @property
    def all_correct(self) -> bool:
        return all(c.correct for c in self.cases)

    @property
    def worst_rounds(self) -> int:
        return max((c.localisation.rounds for c in self.cases), default=0)

    @property
    def wrong(self) -> tuple[CaseResult, ...]:
        return tuple(c for c in self.cases if not c.correct)


def run_replays(machines: Sequence[str], bad: Iterable[str], group_size: int | None = None,
                max_rounds: int = 10, planned: tuple[Phase, Phase] | None = None) -> Localisation:
    """Play the whole scheme against a known truth: a group fails iff it holds a bad machine.

    Runs phase 1, stops if nothing failed, runs phase 2, then any fallback round ``locate`` asks for.
    ``planned``: ``plan_phases(machines, group_size)``, when the caller has it already.
    """
    bad_set = set(bad)
    if len(machines) == 1:
        return Localisation("found", machines[0], tuple(machines), None, 0, ("one machine: nothing to locate",))
    phases = list(planned or plan_phases(machines, group_size))
    results: list[PhaseResult] = []
    while True:
        ph = phases.pop(0)
        results.append(PhaseResult(ph, frozenset(i for i, g in enumerate(ph.groups) if bad_set.intersection(g))))
        if phases and results[-1].failed:
            continue
        loc = locate(results)
        if loc.kind != "ambiguous":
            return loc
        if len(results) >= max_rounds:
            raise RuntimeError(f"no localisation after {max_rounds} rounds: {loc.reasons[0]}")
        assert loc.next_phase is not None
        phases.append(loc.next_phase)


def simulate(n: int, group_size: int | None = None, bad_sets: Iterable[Sequence[int]] | None = None) -> Simulation:
    """For every possible bad machine among ``n`` (or each of ``bad_sets``, by machine index), run the
    scheme (``run_replays``) and record where it pointed."""
    width = len(str(n - 1))
    machines = [f"m{i:0{width}d}" for i in range(n)]
    rows, cols = grid_shape(n, group_size)
    sets = [(i,) for i in range(n)] if bad_sets is None else [tuple(s) for s in bad_sets]
    planned = plan_phases(machines, group_size)
    cases = tuple(CaseResult(tuple(machines[i] for i in s),
                             run_replays(machines, (machines[i] for i in s), group_size, planned=planned))
                  for s in sets)
    return Simulation(n, rows, cols, cases)
