"""The campaign's progress line: where a campaign stands, in one line of text (the console of `ssdiff fuzz`, and
of `ssdiff fuzz --jobs`, which merges its jobs' states into one)."""

from __future__ import annotations


def progress_text(state: dict, max_time=None, max_examples=None) -> str:
    """The fuzz progress line from a campaign's progress state (`Fuzzer._progress`; `ssdiff fuzz --jobs` merges
    its jobs' states into one): cases, skips, rate, the largest ratio per dtype, divergences, known defects and
    the budget spent."""
    budget = []
    if max_time is not None:
        budget.append(f"{state.get('elapsed', 0.0):.0f}/{max_time:.0f} s")
    if max_examples is not None:
        budget.append(f"{state['tried']}/{max_examples} cases")
    if state.get("ahead") and state["ahead"][0] < state["ahead"][1]:
        budget.append(f"compiled ahead {state['ahead'][0]}/{state['ahead'][1]}")
    worst = " ".join(f"{d} {w['ratio']:.3g}x" for d, w in sorted(state["worst"].items())) or "-"
    known_text = f" | known {state['known']}" if state.get("known") else ""
    return (f"cases {state['tried']} (skipped {state['skipped']}; {state.get('per_minute', 0):.0f}/min) | "
            f"worst ratio to budget: {worst} | divergences {state['divergences']}{known_text} | {', '.join(budget)}")


__all__ = ["progress_text"]
