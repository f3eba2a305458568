"""When a campaign judges what, and under which autotune config: the clock (`Budget`), a pooled round's shares
(`round_shares`) and, natively, the order of each compile key's representative cases and the config a case runs
under while its key is still compiling (`Schedule`).

Natively every new shape compiles every kernel it launches: a campaign compiles its keys' representative cases
ahead in worker processes (ssdiff.campaign.precompile), judges each representative as soon as the config it runs
under is compiled, and runs a drawn case of a key still compiling under config 0 rather than tuned (tuned, this
process would compile every config of every kernel itself first). Everything here is testable with a stand-in for
the workers and for the judge.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from ssdiff.inputs import huge

ROUND_EXAMPLES = 100
# Natively, the keys of the next rounds' rotations are compiled ahead, this many: on a warm cache the workers, with
# nothing of the current keys to do, get that far ahead of the search.
COMPILE_AHEAD_ROUNDS = 3
# The percentage of a round's cases drawn from its huge key, when it has one (harness/inputs/huge.py: each takes
# seconds).
HUGE_CASES_PERCENT = 2
# How long a key's representative case waits for the workers compiling it ahead; past that, this process compiles
# what is missing itself.
COMPILE_WAIT_S = 120.0

# judge(case, choice) -> True when the campaign should stop (a divergence found)
Judge = Callable[..., bool]


class Budget:
    """A campaign's clock and budgets: ``max_time`` seconds and ``max_examples`` judged cases (None: unbounded),
    counted from `start`; `request_stop` ends it early (a signal handler may call it)."""

    def __init__(self, max_time: Optional[float], max_examples: Optional[int], judged: Callable[[], int]):
        self.max_time = max_time
        self.max_examples = max_examples
        self.judged = judged
        self.started: Optional[float] = None
        self.stop_requested: Optional[str] = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def time_left(self, cap: float) -> float:
        """``cap`` seconds, or what is left of the time budget if less."""
        return cap if self.max_time is None else min(cap, self.max_time - self.elapsed())

    def spent(self) -> Optional[str]:
        """Why the campaign must stop now (a budget spent, a stop requested), or None."""
        if self.stop_requested:
            return self.stop_requested
        if self.max_time is not None and self.elapsed() >= self.max_time:
            return f"time budget ({self.max_time:g} s) spent"
        if self.max_examples is not None and self.judged() >= self.max_examples:
            return f"example budget ({self.max_examples}) spent"
        return None

    def request_stop(self, why: str = "interrupted") -> None:
        self.stop_requested = why


def round_shares(keys, examples: int, round_: int) -> list:
    """(slot, key, examples) of each search of a pooled round: its ``examples`` spread over its keys, a huge key
    HUGE_CASES_PERCENT of them, the others equal shares (the remainder one each, from slot ``round_`` on), in slot
    order from ``round_`` (so that a round cut short by the budget does not always cut the same kind of key).
    One search per key, not one whose draws pick the key: Hypothesis picks a key where its draws lead (unequal
    shares; a targeted search climbs in the key of its largest ratio), while a key's share of the cases should be
    its share of the keys (a production key's, the pool's Mix.production)."""
    n = len(keys)
    order = [(round_ + i) % n for i in range(n)]
    big = [i for i in order if keys[i].kind == "huge"]
    regular = [i for i in order if keys[i].kind != "huge"]
    counts = dict.fromkeys(order, 0)
    if regular:
        for i in big:
            counts[i] = round(examples * HUGE_CASES_PERCENT / 100)
        left = examples - sum(counts.values())
        for j, i in enumerate(regular):
            counts[i] = left // len(regular) + (j < left % len(regular))
    else:
        for j, i in enumerate(big):
            counts[i] = examples // len(big) + (j < examples % len(big))
    return [(i, keys[i], counts[i]) for i in order if counts[i]]


class Schedule:
    """The order of compile keys' representative cases and the config each case runs under. ``autotune``: the
    campaign's policy ("tuned", "random", "sweep" or an index); ``backward``: its pass (None: both); ``compiler``:
    the workers compiling ahead (ssdiff.campaign.precompile.Compiler: submit, wait, ready), or None (no pool, or
    nothing compiled ahead); ``budget``: the campaign's `Budget`; ``report``: its tallies (a FuzzReport:
    compile_wait_s, the time waited for the workers; untuned_while_compiling, the tuned cases run under config 0
    while their key compiled). ``pending`` holds the representatives judged under config 0 while their configs
    compiled, to be judged tuned (`judge_pending`)."""

    def __init__(self, autotune, backward: Optional[bool], budget: Budget, report, compiler=None):
        self.autotune = autotune
        self.backward = backward
        self.budget = budget
        self.report = report
        self.compiler = compiler
        self.pending: list = []

    def choice_for(self, key, case, choice):
        """The config a drawn case of ``key`` (None: drawn without a pool) runs under: a boundary key's under its
        config; a tuned one under config 0 while its key's representative is still compiling, counted."""
        if key is not None and key.boundary is not None and self.autotune in ("tuned", "random"):
            return key.boundary.config          # the config whose block this case straddles
        if choice == "tuned" and key is not None and self.compiler is not None \
                and not self.compiler.wait(key.case(backward=case.backward), 0):
            self.report.untuned_while_compiling += 1
            return 0
        return choice

    def representatives_of(self, keys) -> list:
        """(case, the config it is judged under) of each key's representatives: forward ones first, then backward
        ones, production shapes last in each (the cheapest verdicts first)."""
        backward = (False, True) if self.backward is None else (self.backward,)
        reps = []
        for key in keys:
            choice = key.boundary.config if key.boundary is not None and self.autotune in ("tuned", "random") \
                else (0 if self.autotune == "random" else self.autotune)
            # one case for both passes where the key's cases are forward only (a decoded layer)
            reps += [(case, choice, key.kind in ("production", "huge"))
                     for case in dict.fromkeys(key.case(backward=b) for b in backward)]
        return [(case, choice) for case, choice, _ in sorted(reps, key=lambda rep: (rep[0].backward, rep[2]))]

    def compile_ahead(self, keys) -> None:
        """Hand the keys' representative cases to the workers, in the order they are judged (none of a huge key:
        each worker would draw the whole case)."""
        if self.compiler is not None:
            self.compiler.submit([case for case, _ in self.representatives_of(keys) if not huge.is_huge(case)])

    def representatives(self, keys, judge: Judge) -> bool:
        """Judge each key's representative case first (what was compiled ahead); True when ``judge`` says stop.
        Where cases are compiled ahead, each is judged as soon as the config it runs under is in (the workers
        compile every case's config 0 first, then config 1, ...; while the workers are still starting, this process
        compiles it instead): one to be judged tuned whose configs are not all in yet is judged under config 0 and
        waits in `pending`. No case is begun once the budget is spent, a wait included."""
        reps = self.representatives_of(keys)
        later = [] if self.compiler is not None else reps
        for case, choice in (reps if self.compiler is not None else []):
            if choice == "sweep" or (choice == "tuned" and self.compiler.wait(case, 0)):
                later.append((case, choice))    # every config: judged once all are in (or all are in already)
                continue
            if choice == "tuned":
                self.pending.append(case)
            first = 0 if choice == "tuned" else choice
            if self.compiler.ready():
                self._wait(case, index=first)
            # else the workers are still starting (spawning, importing): compiled here, sooner; the job, when a
            # worker gets to it, finds the variants on disk
            if self.budget.spent():
                return False
            if judge(case, first):
                return True
        for case, choice in later:
            if self.compiler is not None:
                self._wait(case)
            if self.budget.spent():
                return False
            if judge(case, choice):
                return True
        return False

    def judge_pending(self, judge: Judge) -> bool:
        """Judge tuned the representatives judged under config 0 whose every config is in by now (between
        rounds); True when ``judge`` says stop."""
        for case in [c for c in self.pending if self.compiler.wait(c, 0)]:
            self.pending.remove(case)
            if self.budget.spent():
                return False
            if judge(case, "tuned"):
                return True
        return False

    def _wait(self, case, index=None) -> None:
        """Wait (at most COMPILE_WAIT_S, or what is left of the budget) for the workers' jobs of ``case`` (those of
        config ``index`` alone when given)."""
        start = time.perf_counter()
        self.compiler.wait(case, self.budget.time_left(COMPILE_WAIT_S), index=index)
        self.report.compile_wait_s += time.perf_counter() - start


__all__ = ["Budget", "Schedule", "round_shares", "ROUND_EXAMPLES", "COMPILE_AHEAD_ROUNDS", "HUGE_CASES_PERCENT",
           "COMPILE_WAIT_S"]
