"""Localization: where a divergence lives — in the pipeline, in the tensor, in the case's features, and on
which side of a pair.

Each function returns a plain dict (JSON-ready, written into verdict.json) with a ``text`` entry that says it
in words:

- `stages`: stage intermediates compared in pipeline order (harness/model/stages.py: STAGE_ORDER); the first
  one out of budget is the culprit and later ones are marked as inheriting it. When the diverging side exposes
  no stages, the stage is inferred from the feature trigger (a divergence that needs rmsnorm enters at the
  gated RMSNorm) and said to be inferred.
- `coordinates`: from the per-element error maps kept by the verdict — which batch rows, heads or groups,
  chunks, tokens; whether only the last partial chunk is hit, whether the errors start at a sequence
  boundary; `configs` says which autotune configs diverge.
- `features` (`minimal_trigger`): re-run with each optional feature switched off (harness/model/features.py, in its
  order), keeping every switch-off under which the divergence persists; what is left is a minimal set of
  features that triggers it (no single one can be dropped), with the simplified case as a smaller repro.
- `sides`: which implementation the oracle agrees with.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional

from ssdiff import runtime
from ssdiff.model.axes import HEAD_PARTS, TensorAxes, coordinates_of, token_sequences
from ssdiff.model.case import Case
from ssdiff.model.features import BY_KEY, FEATURES, switch_off
from ssdiff.model.stages import STAGE_ORDER
from ssdiff.model.stages import words as stage_words
from ssdiff.examine import same_divergence
from ssdiff.verdict.judge import RUN_FAILURES, TensorVerdict, Verdict


# ---- features ----------------------------------------------------------------------------------------------

def minimal_trigger(case: Case, still_diverges: Callable[[Case], bool],
                    budget_runs: Optional[int] = None, deadline: Optional[float] = None) -> dict:
    """Switch features off one at a time (in harness/model/features.py's order), keeping each switch-off under which
    ``still_diverges`` holds; at most ``budget_runs`` runs, none begun once time.perf_counter() passes
    ``deadline`` (a feature not tried stays in the trigger).
    Returns {"trigger": [keys], "labels": [...], "minimal_case": Case dict, "tried": [{key, kept}], "text"}."""
    current = case
    trigger, tried = [], []
    runs = 0
    for f in FEATURES:
        candidate = switch_off(current, f.key)
        if candidate is None:
            continue
        if budget_runs is not None and runs >= budget_runs:
            tried.append({"feature": f.key, "result": "not tried (run budget spent)"})
            trigger.append(f.key)
            continue
        if deadline is not None and time.perf_counter() >= deadline:
            tried.append({"feature": f.key, "result": "not tried (time bound spent)"})
            trigger.append(f.key)
            continue
        runs += 1
        persists = still_diverges(candidate)
        tried.append({"feature": f.key, "result": "divergence persists without it" if persists
                      else "divergence vanishes without it"})
        if persists:
            current = candidate
        else:
            trigger.append(f.key)
    labels = [BY_KEY[k].label for k in trigger]
    if labels:
        text = "trigger: " + " together with ".join(labels) if len(labels) <= 2 else \
            "trigger: " + ", ".join(labels[:-1]) + " and " + labels[-1]
        text += f" (no one of them can be switched off; {len(tried)} ablations run)"
    else:
        text = f"trigger: none of the optional features ({len(tried)} ablations; it diverges on the plainest case)"
    return {"trigger": trigger, "labels": labels, "minimal_case": current.to_dict(),
            "minimal_case_description": current.describe(), "tried": tried, "text": text}


# ---- stages ------------------------------------------------------------------------------------------------

def stages(verdict: Verdict, trigger: Optional[list] = None) -> dict:
    """The first stage out of budget in pipeline order; the ones after it inherit it.
    ``trigger``: feature keys (from `minimal_trigger`) to infer the stage when none are exposed."""
    judged = {t.name[len("stage."):]: t for t in verdict.tensors if t.kind == "stage"}
    exposed = [s for s in STAGE_ORDER if s in judged and s != "y"]
    if exposed:
        first = next((s for s in exposed if not judged[s].ok), None)
        if first is not None:
            later = [s for s in exposed[exposed.index(first) + 1:] if not judged[s].ok]
            clean = [s for s in exposed[:exposed.index(first)]]
            t = judged[first]
            text = (f"first divergent stage: {first} ({stage_words(first)}), ratio {t.ratio:.3g}x"
                    + (f"; {', '.join(later)} inherit it" if later else "")
                    + (f"; before it {', '.join(clean)} are within budget" if clean else ""))
            return {"first": first, "inherit": later, "within_budget": clean, "exposed": exposed,
                    "ratios": {s: _ratio(judged[s]) for s in exposed}, "inferred": False, "text": text}
        after = exposed[-1]
        inferred = _infer_from_trigger(trigger, after_stage=after)
        text = (f"every exposed stage ({', '.join(exposed)}) is within budget: the divergence enters after "
                f"{after}" + (f" — at {inferred} ({stage_words(inferred)}), inferred from the "
                              f"feature trigger" if inferred else ""))
        return {"first": inferred, "inherit": [], "within_budget": exposed, "exposed": exposed,
                "ratios": {s: _ratio(judged[s]) for s in exposed}, "inferred": bool(inferred),
                "after": after, "text": text}
    inferred = _infer_from_trigger(trigger)
    if inferred:
        text = (f"first divergent stage: {inferred} ({stage_words(inferred)}) — inferred: the "
                f"implementation exposes no stages, and the divergence needs "
                f"{_stage_feature_label(trigger, inferred)}")
    else:
        text = "stage: not known (the implementation exposes no stage intermediates)"
    return {"first": inferred, "inherit": [], "within_budget": [], "exposed": [], "ratios": {},
            "inferred": bool(inferred), "text": text}


def _ratio(t: TensorVerdict):
    return t.ratio if math.isfinite(t.ratio) else str(t.ratio)


def _infer_from_trigger(trigger, after_stage: Optional[str] = None) -> Optional[str]:
    """The earliest stage that exists only because of a trigger feature (after ``after_stage``)."""
    if not trigger:
        return None
    owned = [BY_KEY[k].stage for k in trigger if k in BY_KEY and BY_KEY[k].stage]
    if after_stage is not None:
        owned = [s for s in owned if STAGE_ORDER.index(s) > STAGE_ORDER.index(after_stage)]
    return min(owned, key=STAGE_ORDER.index) if owned else None


def _stage_feature_label(trigger, stage) -> str:
    return next(BY_KEY[k].label for k in trigger if k in BY_KEY and BY_KEY[k].stage == stage)


def first_stage(examiner, case: Case, side: str, choice="tuned") -> Optional[str]:
    """The first divergent stage of ``side`` on ``case`` examined by ``examiner`` (ssdiff.examine.Examiner), when
    measured from stage intermediates (None when it runs out of stages, fails to run, or only an inferred stage is
    known)."""
    staged = examiner.examine(case, choice, stages=True, sides=[side]).verdicts[side]
    if staged.status in RUN_FAILURES:
        return None
    found = stages(staged)
    return found["first"] if not found.get("inferred") else None


# ---- coordinates -------------------------------------------------------------------------------------------

def _ranges(values) -> str:
    values = sorted(set(int(v) for v in values))
    if not values:
        return "none"
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(parts)


def coordinates(t: TensorVerdict, case: Case) -> dict:
    """Where tensor ``t``'s out-of-budget elements are, from its error map."""
    if t.ratio_map is None:
        return {"tensor": t.name, "text": f"{t.name}: no error map ({t.status})"}
    m = t.ratio_map > 1.0
    axes = t.map_axes
    idx = m.nonzero().tolist()
    res: dict = {"tensor": t.name, "out_of_budget": t.out_of_budget, "judged": t.judged}
    if not idx:
        res["text"] = f"{t.name}: nothing out of budget"
        return res
    heads, groups, batches, tokens, chunks, parts, steps = set(), set(), set(), set(), set(), set(), set()
    per_row_tokens: dict = {}
    per_row_chunks: dict = {}
    map_axes = TensorAxes(axes, t.axes.channels if t.axes is not None else ())
    for coord in idx:
        where = coordinates_of(coord, map_axes, case)
        for key, found in (("batch", batches), ("head", heads), ("group", groups), ("token", tokens),
                           ("chunk", chunks), ("part", parts), ("step", steps)):
            if key in where:
                found.add(where[key])
        if "batch" in where and "token" in where:
            per_row_tokens.setdefault(where["batch"], set()).add(where["token"])
        if "batch" in where and "chunk" in where:
            per_row_chunks.setdefault(where["batch"], set()).add(where["chunk"])
    words = []
    head_axis = "head" in axes or any(p in HEAD_PARTS for p in parts)
    if head_axis and heads:
        res["heads"] = sorted(heads)
        res["nheads"] = case.nheads
        some = len(heads) < case.nheads
        words.append(f"heads {_ranges(heads)} of {case.nheads}" if some else f"all {case.nheads} heads")
        if some and case.ngroups > 1:
            words[-1] += f" (groups {_ranges(groups)} of {case.ngroups}; {case.heads_per_group} heads per group)"
    if groups:
        res["groups"] = sorted(groups)
        if "group" in axes and not head_axis:
            words.append(f"groups {_ranges(groups)} of {case.ngroups}")
    if parts:
        res["channel_parts"] = sorted(parts)
    if batches:
        res["batches"] = sorted(batches)
        if case.batch > 1:
            words.append(f"batch rows {_ranges(batches)} of {case.batch}")
    if chunks and ("token" in axes or "chunk" in axes):
        res["chunks"] = sorted(chunks)
        res["nchunks"] = case.nchunks
        words.append(f"chunks {_ranges(chunks)} of {case.nchunks}" if len(chunks) < case.nchunks
                     else f"all {case.nchunks} chunks")
        ragged = case.seqlen % case.chunk_size != 0
        last = case.nchunks - 1
        res["last_partial_chunk_only"] = bool(ragged and chunks == {last})
        if res["last_partial_chunk_only"]:
            words.append(f"only the last, partial chunk (tokens {last * case.chunk_size}-{case.seqlen - 1}, "
                         f"{case.seqlen - last * case.chunk_size} of chunk_size {case.chunk_size})")
    if tokens:
        res["tokens"] = {"first": min(tokens), "last": max(tokens), "count": len(tokens)}
        words.append(f"tokens {_ranges(tokens)}" if len(tokens) <= 12 else
                     f"{len(tokens)} tokens from {min(tokens)} to {max(tokens)}")
    if steps:                          # the decode entry: which single-token steps after the prefill
        res["decode_steps"] = sorted(steps)
        words.append(f"decode steps {_ranges(steps)} of {case.decode_steps} (after a prefill of {case.prefill_len} "
                     "tokens)")
    if case.segments is not None and (tokens or chunks):
        marks = token_sequences(case)
        if per_row_tokens:
            members = [marks[b][tok] for b, toks in per_row_tokens.items() for tok in toks if marks[b][tok]]
        else:   # chunk-indexed: the sequence at each chunk's first token, each chunk in its own batch row
            rows = per_row_chunks or {b: chunks for b in (batches or range(case.batch))}
            members = [marks[b][c * case.chunk_size] for b, row_chunks in rows.items() for c in row_chunks
                       if c * case.chunk_size < case.seqlen and marks[b][c * case.chunk_size]]
        if members:
            after = all(k >= 1 for k, _ in members)
            res["after_boundary_only"] = after
            res["min_offset_after_boundary"] = min(off for k, off in members if k >= 1) \
                if any(k >= 1 for k, _ in members) else None
            if after:
                words.append("only after a sequence boundary (every affected token belongs to a later sequence "
                             f"of its row; the nearest is {res['min_offset_after_boundary']} tokens past its start)")
            else:
                res["in_first_sequence"] = True
    res["text"] = f"{_label(t.name)}: " + "; ".join(words)
    return res


def _label(name: str) -> str:
    return name.replace("stage.", "stage ").replace("grad.", "gradient of ")


def configs(per_index: list) -> dict:
    """Which autotune config indices diverge. ``per_index``: [(index, diverged, launches)] from a sweep."""
    bad = [i for i, d, _ in per_index if d]
    good = [i for i, d, _ in per_index if not d]
    res = {"diverging": bad, "within_budget": good,
           "launches": {i: [{"kernel": l.kernel, "config": l.config, "index": l.index, "of": l.nconfigs}
                            for l in launches] for i, _, launches in per_index}}
    if not per_index:
        res["text"] = "autotune configs: not swept"
    elif bad and good:
        good_configs = {(l.kernel, l.config) for i, _, launches in per_index if i in good for l in launches}
        culprits = sorted({f"{l.kernel} [{l.config}]" for i, _, launches in per_index if i in bad for l in launches
                           if (l.kernel, l.config) not in good_configs})
        res["suspects"] = culprits
        res["text"] = (f"autotune: diverges only with config index {_ranges(bad)} (within budget with "
                       f"{_ranges(good)})" + (f"; configs used only there: {'; '.join(culprits)}" if culprits else ""))
    elif bad:
        res["text"] = f"autotune: diverges with every config index swept ({_ranges(bad)})"
    else:
        res["text"] = "autotune: no config diverges when re-run (flaky?)"
    return res


# ---- sides -------------------------------------------------------------------------------------------------

STATUS_WORDS = {"diverged": "diverges from the float64 oracle", "nonfinite": "returns NaN/Inf where the oracle is finite",
                "mismatch": "returns a missing, misshapen or mistyped result", "error": "raises an exception",
                "crash": "crashes", "hang": "hangs"}


def sides(verdicts: dict, pair: Optional[dict] = None) -> dict:
    """``verdicts``: side name -> Verdict against the oracle (one or two sides). ``pair``: tensor -> ratio of
    the two sides' difference to their joint budget."""
    names = list(verdicts)
    agree = [n for n in names if verdicts[n].ok]
    diverge = [n for n in names if not verdicts[n].ok]
    res = {"oracle_agrees_with": agree, "diverging": diverge,
           "statuses": {n: verdicts[n].status for n in names}}
    if pair:
        res["pair_ratio"] = max(pair.values())
    said = {n: STATUS_WORDS.get(verdicts[n].status, verdicts[n].status) for n in diverge}
    if len(names) == 1:
        res["text"] = f"{names[0]} {said[names[0]]}" if diverge else f"{names[0]} agrees with the float64 oracle"
    elif len(agree) == 1:
        res["text"] = f"the oracle agrees with {agree[0]}; {diverge[0]} {said[diverge[0]]}"
    elif not agree:
        together = bool(pair) and max(pair.values()) <= 1.0
        res["text"] = ("the oracle agrees with neither side (" + "; ".join(f"{n} {said[n]}" for n in diverge) + ")" +
                       ("; the two agree with each other (a shared bug, or different semantics)" if together else ""))
    else:
        res["text"] = "both sides agree with the oracle"
    return res


def describe_primary(verdict: Verdict, stage_result: Optional[dict]) -> Optional[TensorVerdict]:
    """The tensor whose coordinates to report: the first divergent stage, else the worst output/gradient."""
    if stage_result and stage_result.get("first") and not stage_result.get("inferred"):
        t = verdict.tensor(f"stage.{stage_result['first']}")
        if t is not None:
            return t
    judged = [t for t in verdict.tensors if t.kind != "stage" and not t.ok]
    outputs = [t for t in judged if t.kind == "output" and t.ratio_map is not None]
    pool = outputs or [t for t in judged if t.ratio_map is not None]
    if not pool:
        return None
    return max(pool, key=lambda t: (t.name == "y", t.ratio if math.isfinite(t.ratio) else 0))


# ---- a whole divergence -------------------------------------------------------------------------------------

MAX_CONFIGS_SWEPT = 16


def investigate(examiner, outcome, ablation_runs: Optional[int] = None, explore_configs: bool = False,
                deadline: Optional[float] = None) -> tuple:
    """Localize ``outcome``'s divergence with ``examiner`` (ssdiff.examine.Examiner): the sides, the feature
    trigger (each switch-off judged with ssdiff.examine.same_divergence against the case it starts from, on what
    it leaves), and per failing side the first divergent stage and the coordinates, and with ``explore_configs``
    the autotune configs that diverge. Returns (localization dict, {side: the verdict with stages}); re-examining
    the case reuses its evidence."""
    case = outcome.case
    choice = outcome.choice if outcome.choice != "sweep" else "tuned"
    failing = outcome.failing
    result = {"sides": sides(outcome.verdicts, outcome.pair or None)}
    texts = [result["sides"]["text"]]

    # the case each switch-off starts from, examined: minimal_trigger keeps every switch-off that persists
    start = [outcome]

    def same(candidate: Case) -> bool:
        try:
            again = examiner.examine(candidate, choice, sides=list(failing))
        except Exception:           # a case the oracle or the baseline cannot take: not the same divergence
            return False
        if not same_divergence(start[0], again, on_what_is_left=True):
            return False
        start[0] = again
        return True

    trigger = None
    if not any(v.status == "hang" for v in failing.values()):
        trigger = minimal_trigger(case, same, ablation_runs, deadline)
        result["features"] = trigger
    examiner.keep(outcome)
    per_side, staged_verdicts = {}, {}
    for spec, v in failing.items():
        entry: dict = {}
        if v.status not in RUN_FAILURES:
            staged = examiner.examine(case, choice, stages=True, sides=[spec]).verdicts[spec]
            if staged.status in RUN_FAILURES:
                staged = v
            staged_verdicts[spec] = staged
            found = stages(staged, trigger["trigger"] if trigger else None)
            entry["stages"] = found
            coords = []
            primary = describe_primary(staged, found)
            if primary is not None:
                coords.append(coordinates(primary, case))
            worst_out = describe_primary(staged, None)
            if worst_out is not None and (primary is None or worst_out.name != primary.name):
                coords.append(coordinates(worst_out, case))
            entry["coordinates"] = coords
            if explore_configs and any(l.nconfigs > 1 for l in outcome.launches.get(spec, [])):
                entry["configs"] = _config_sweep(examiner, case, spec, deadline)
        per_side[spec] = entry
    result["per_side"] = per_side
    for spec, entry in per_side.items():
        prefix = f"{spec}: " if len(outcome.verdicts) > 1 else ""
        if "stages" in entry:
            texts.append(prefix + entry["stages"]["text"])
        for c in entry.get("coordinates", []):
            texts.append(prefix + "where: " + c["text"])
        if "configs" in entry:
            texts.append(prefix + entry["configs"]["text"])
    if trigger:
        texts.append(trigger["text"])
        texts.append(f"minimal case: {trigger['minimal_case_description']}")
    result["text"] = "\n".join(texts)
    return result, staged_verdicts


def _config_sweep(examiner, case: Case, spec: str, deadline: Optional[float] = None) -> dict:
    per_index, sweep = [], runtime.ConfigSweep(limit=MAX_CONFIGS_SWEPT)
    for index in sweep:
        if deadline is not None and time.perf_counter() >= deadline:
            break
        out = examiner.examine(case, index, sides=[spec])
        launches = out.launches.get(spec, [])
        per_index.append((index, not out.verdicts[spec].ok, launches))
        sweep.ran(launches)
    return configs(per_index)


__all__ = ["first_stage", "minimal_trigger", "stages", "coordinates", "configs",
           "sides", "describe_primary", "investigate"]
