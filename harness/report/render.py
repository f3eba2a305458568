"""Render a saved run (a fuzz output directory, or the one the pytest plugin writes) as one self-contained HTML
page, and the index of every run under a reports folder.

A saved run (harness/store.py reads it) renders again anywhere, later: `ssdiff report DIR`. The page shows what
the run stored — verdicts, localization, error maps, the minimized case and repro.py — and derives nothing.

    page = render_run("ssdiff-out/fuzz-20250101-120000")      # -> reports/fuzz-20250101-120000/index.html

The page: inline CSS, figures as inline PNG data URIs (harness/report/plots.py), one small inline script
for the copy buttons (the page reads the same without it); no external URL anywhere.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
from typing import Optional

from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape

from ssdiff.model.case import Case, CaseError
from ssdiff.model.features import BY_KEY
from ssdiff.model.stages import STAGE_ORDER
from ssdiff.model.stages import words as stage_words
from ssdiff.store import RunError, read_run
from ssdiff.investigate.tf32 import LIMIT as TF32_LIMIT

MAX_GRADIENT_MAPS = 4          # per side and divergence: the worst diverging gradients get a heatmap
# Inline images of one page, shared equally by its divergences (the 5 MB page limit, less room for text).
FIGURE_BUDGET = 3_500_000
RUN_RECORD = "run.json"
# summary.json entries shown in the page's run table, in this order
SETTINGS = ("impl", "against", "entry", "pass", "dtypes", "autotune", "isolate", "seed", "max_time_s", "max_examples",
            "factor", "known_policy", "elapsed_s", "stopped", "first_divergence_after_s", "tests",
            "expected_divergences")


def default_reports_root() -> str:
    """Where reports go unless told: $SSDIFF_REPORTS, else reports/ (relative to the working directory)."""
    return os.environ.get("SSDIFF_REPORTS") or "reports"


# ---- numbers in words ------------------------------------------------------------------------------------

def _as_float(x) -> Optional[float]:
    if x is None:
        return None
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return float(x)


def fmt_ratio(x) -> str:
    x = _as_float(x)
    if x is None:
        return "–"
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "∞"
    if x == 0:
        return "0"
    if x >= 1e4 or x < 1e-3:
        return f"{x:.2e}×"
    return f"{x:.3g}×"


def _severity_key(x) -> float:
    """A ratio for sorting: NaN / inf / missing (nonfinite, mismatch) first."""
    f = _as_float(x)
    return 1e308 if f is None or not math.isfinite(f) else f


def fmt_num(x) -> str:
    x = _as_float(x)
    if x is None:
        return "–"
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}"


def ratio_style(x) -> str:
    """Inline background for a ratio cell, on the heatmaps' colour scale."""
    from ssdiff.report.plots import ratio_colour

    x = _as_float(x)
    if x is None:
        return ""
    background, ink = ratio_colour(x)
    return f"background:{background};color:{ink}"


# ---- the page model --------------------------------------------------------------------------------------

def _flat_case(case: Optional[dict]) -> dict:
    if not case:
        return {}
    out = {}
    for key, value in case.items():
        if isinstance(value, dict):
            for k, v in value.items():
                out[f"{key}.{k}"] = v
        else:
            out[key] = value
    return out


def _describe(case: Optional[dict]) -> str:
    if not case:
        return ""
    try:
        return Case.from_dict(case).describe()
    except (CaseError, TypeError):
        return json.dumps(case)


def _case_columns(item: dict) -> dict:
    """Original, minimized (ssdiff minimize) and ablation-minimal cases side by side, differences marked."""
    columns = [("original", "case.json", item.get("case"))]
    if item.get("minimized"):
        columns.append(("minimized", item["minimized_file"], item["minimized"]))
    ablation = ((item["verdict"].get("localization") or {}).get("features") or {}).get("minimal_case")
    if ablation:
        columns.append(("feature-minimal", "feature ablation", ablation))
    flats = [_flat_case(c) for _, _, c in columns]
    keys = list(dict.fromkeys(k for f in flats for k in f))
    rows = []
    for key in keys:
        values = [f.get(key) for f in flats]
        rows.append({"field": key, "values": [json.dumps(v) for v in values],
                     "differs": any(v != values[0] for v in values[1:])})
    return {"columns": [{"label": label, "source": source, "description": _describe(case),
                         "json": json.dumps(case, indent=2)} for label, source, case in columns],
            "rows": rows, "changed": [r for r in rows if r["differs"]]}


def _tensor_rows(verdict: dict) -> list:
    rows = []
    for t in verdict.get("tensors", []):
        if t.get("kind") == "stage":
            continue
        worst = t.get("worst") or {}
        coords = ", ".join(f"{k} {v}" for k, v in (worst.get("coords") or {}).items())
        rows.append({
            "name": t["name"], "kind": t.get("kind", ""), "status": t.get("status", ""), "ratio": t.get("ratio"),
            "ratio_text": fmt_ratio(t.get("ratio")), "ratio_style": ratio_style(t.get("ratio")),
            "out_of_budget": t.get("out_of_budget", 0), "judged": t.get("judged", 0),
            "max_abs": fmt_num(t.get("max_abs")), "rel_rms": fmt_num(t.get("rel_rms")),
            "baseline_rel_rms": fmt_num(t.get("baseline_rel_rms")),
            "budget": fmt_num(worst.get("budget")), "error": fmt_num(worst.get("error")),
            "actual": fmt_num(worst.get("actual")), "expected": fmt_num(worst.get("expected")),
            "where": coords, "detail": t.get("detail", ""),
        })
    return rows


def _stage_table(side_loc: dict) -> Optional[dict]:
    """The localization's stage result as table rows (None when the run stored none)."""
    stages = (side_loc or {}).get("stages")
    if stages is None:
        return None

    first, exposed = stages.get("first"), stages.get("exposed") or []
    names = [s for s in STAGE_ORDER if s in exposed or s == first]
    rows = []
    for s in names:
        ratio = (stages.get("ratios") or {}).get(s)
        if s == first:
            role = "first divergent (inferred)" if stages.get("inferred") else "first divergent"
        elif s in (stages.get("inherit") or []):
            role = "inherits it"
        elif s in exposed:
            r = _as_float(ratio)
            role = "within budget" if r is not None and r <= 1 else "out of budget"
        else:
            role = ""
        rows.append({"stage": s, "words": stage_words(s), "ratio_text": fmt_ratio(ratio) if s in exposed
                     else "not exposed", "ratio_style": ratio_style(ratio) if s in exposed else "",
                     "role": role, "first": s == first})
    return {"rows": rows, "text": stages.get("text", ""), "inferred": bool(stages.get("inferred")), "first": first}


def _features(loc: dict) -> Optional[dict]:
    features = (loc or {}).get("features")
    if not features:
        return None
    trigger = set(features.get("trigger") or [])
    rows = []
    for item in features.get("tried") or []:
        key = item.get("feature")
        result = item.get("result", "")
        rows.append({"feature": key, "label": BY_KEY[key].label if key in BY_KEY else key, "result": result,
                     "trigger": key in trigger, "vanishes": "vanishes" in result})
    return {"rows": rows, "text": features.get("text", ""), "labels": features.get("labels") or [],
            "minimal": features.get("minimal_case_description", "")}


def _floats(matrix) -> list:
    """A saved map's rows as floats ("inf" / "nan" as JSON writes them back to floats; missing as 0)."""
    return [[_as_float(v) if v is not None else 0.0 for v in row] for row in matrix]


class FigureBudget:
    """Bytes of inline images one divergence may still spend. The first figure of a divergence is always drawn;
    later ones only while the budget lasts, so a page stays small whatever the maps hold."""

    def __init__(self, limit: int):
        self.left = limit
        self.drawn = 0

    def allows(self) -> bool:
        return self.drawn == 0 or self.left > 0

    def spend(self, uri: str) -> str:
        self.left -= len(uri)
        self.drawn += 1
        return uri


def _figures(side: str, verdict: dict, maps: Optional[dict], case: Optional[dict], budget: FigureBudget,
             first_stage: Optional[str] = None) -> dict:
    """The heatmaps and sequence plots of one side's diverging tensors: the first divergent stage when its map
    was saved (the localization's staged re-run), the outputs (head x chunk, by group, along the sequence),
    then the worst gradients (head x chunk)."""
    from ssdiff.report import plots

    out = {"available": maps is not None, "figures": [], "skipped": [], "over_budget": []}
    if maps is None:
        return out
    side_maps = (maps.get("sides") or {}).get(side) or {}
    failing = [t for t in verdict.get("tensors", [])
               if t.get("status") not in ("ok", None) and t.get("kind") != "stage"]
    outputs = [t for t in failing if t.get("kind") == "output"]
    grads = sorted((t for t in failing if t.get("kind") == "grad"), key=lambda t: -_severity_key(t.get("ratio")))
    chosen = outputs + grads[:MAX_GRADIENT_MAPS]
    out["skipped"] = [t["name"] for t in grads[MAX_GRADIENT_MAPS:]]
    stage_map = side_maps.get(f"stage.{first_stage}") if first_stage else None
    if stage_map is not None:
        chosen.insert(0, {"name": stage_map["name"], "status": stage_map["status"], "ratio": stage_map["ratio"],
                          "kind": "stage"})
    chunk_size = maps.get("chunk_size") or (case or {}).get("chunk_size") or 1
    seqlen = maps.get("seqlen") or (case or {}).get("seqlen") or 1

    def draw(fig, kind, alt, make):
        if not budget.allows():
            out["over_budget"].append(alt)
            return
        fig["images"].append({"kind": kind, "alt": alt, "uri": budget.spend(make())})

    for t in chosen:
        m = side_maps.get(t["name"])
        fig = {"name": t["name"], "status": t["status"], "ratio_text": fmt_ratio(t.get("ratio")), "images": [],
               "note": None}
        out["figures"].append(fig)
        if m is None:
            fig["note"] = (f"no error map: {t.get('detail') or t['status']}" if t["status"] != "diverged"
                           else "no error map was saved for this tensor")
            continue
        cols_axis = m.get("cols_axis")
        ncols = len(m["matrix"][0]) if m["matrix"] else 0
        cbin = m.get("cols_bin", 1)
        cols = [str(i * cbin) if cbin == 1 else f"{i * cbin}-" for i in range(ncols)] if cols_axis else [""]
        rows_axis = m.get("rows_axis") or ""
        xlabel = {"chunk": f"chunk ({chunk_size} tokens each)", "batch": "batch row", "seq": "sequence"}.get(
            cols_axis, "(no chunk axis)")
        label = f"{t['name']} (first divergent stage)" if t.get("kind") == "stage" else t["name"]
        title = (f"{label}: largest error / budget per {rows_axis or 'tensor'}"
                 + (f" × {cols_axis}" if cols_axis else ""))
        draw(fig, "heatmap", title, lambda: plots.heatmap(_floats(m["matrix"]), m["rows"], cols, title, xlabel,
                                                           rows_axis))
        if m.get("group_matrix") and t.get("kind") == "output":
            groups = _floats(m["group_matrix"])
            gtitle = f"{t['name']}: by group (heads pooled into their {len(groups)} groups)"
            draw(fig, "heatmap", gtitle, lambda: plots.heatmap(groups, [f"g{i}" for i in range(len(groups))], cols,
                                                                gtitle, xlabel, "group"))
        if m.get("sequence") and t.get("kind") == "output":
            by_batch = m.get("sequence_rows") == "batch"
            stitle = f"{t['name']}: largest error / budget at each token"
            draw(fig, "sequence", stitle, lambda: plots.sequence(
                _floats(m["sequence"]), m.get("sequence_bin", 1), chunk_size, seqlen, stitle,
                row_label="batch row" if by_batch else "sequence",
                segments=(case or {}).get("segments") if by_batch else None,
                padding=(case or {}).get("padding") if by_batch else None))
    return out


def _divergence(item: dict, run_summary: dict, figure_bytes: int) -> dict:
    verdict = item["verdict"]
    budget = FigureBudget(figure_bytes)
    loc = verdict.get("localization") or {}
    sides_loc = loc.get("sides") or {}
    per_side = loc.get("per_side") or {}
    sides = []
    for name, v in (verdict.get("verdicts") or {}).items():
        side_loc = per_side.get(name) or {}
        table = _stage_table(side_loc) if v.get("status") != "ok" else None
        first_stage = table["first"] if table and not table["inferred"] else None
        sides.append({
            "name": name, "status": v.get("status", ""), "ratio_text": fmt_ratio(v.get("ratio")),
            "ratio_style": ratio_style(v.get("ratio")), "ok": v.get("status") == "ok",
            "detail": v.get("detail", ""), "notes": v.get("notes") or [], "seconds": v.get("seconds"),
            "tensors": _tensor_rows(v), "stages": table,
            "coordinates": [c.get("text", "") for c in side_loc.get("coordinates") or []],
            "configs": (side_loc.get("configs") or {}).get("text"),
            "figures": (_figures(name, v, item.get("maps"), item.get("case"), budget, first_stage)
                        if v.get("status") != "ok" else None),
        })
    pair = verdict.get("pair_ratio_by_tensor") or {}
    case = item.get("case")
    return {
        "number": item["number"], "anchor": item["name"], "folder": item["folder"], "files": item["files"],
        "description": _describe(case) or verdict.get("case_description", ""),
        "message": item.get("message", ""), "sides": sides,
        "sides_text": sides_loc.get("text", ""), "agrees_with": sides_loc.get("oracle_agrees_with"),
        "pair": [{"tensor": k, "ratio_text": fmt_ratio(v), "ratio_style": ratio_style(v)} for k, v in pair.items()],
        "localized": bool(loc), "features": _features(loc), "localization_text": loc.get("text", ""),
        "cases": _case_columns(item),
        "repro": item.get("repro"), "repro_file": item.get("repro_file"),
        "autotune": verdict.get("autotune"), "oracle": verdict.get("oracle") or run_summary.get("against", ""),
        "budget_rule": verdict.get("budget_rule", ""), "found_after_s": verdict.get("found_after_s"),
        "cases_before": verdict.get("cases_before"), "origin": verdict.get("origin", ""),
    }


def _largest(summary: dict) -> Optional[dict]:
    best = None
    for dtype, item in (summary.get("largest_ratio_by_dtype") or {}).items():
        r = _as_float(item.get("ratio"))
        if r is not None and (best is None or r > best["ratio"]):
            best = {**item, "ratio": r, "dtype": dtype}
    return best


def build_page(run: dict, name: str) -> dict:
    """The template's whole input for one run."""
    summary = run["summary"]
    share = FIGURE_BUDGET // max(1, len(run["divergences"]))
    divergences = [_divergence(item, summary, share) for item in run["divergences"]]
    largest = _largest(summary)
    env = summary.get("environment") or {}
    versions = env.get("versions") or {}
    if not versions and summary.get("python"):
        versions = {"python": summary.get("python")}
    stand_ins_used = sorted({n for d in divergences for s in d["sides"] for n in s["notes"] if "stand-in" in n})
    cases = summary.get("cases_tried")
    clean = not divergences
    by_dtype = [{"dtype": d, "ratio_text": fmt_ratio(i.get("ratio")), "ratio_style": ratio_style(i.get("ratio")),
                 "side": i.get("side"), "tensor": i.get("tensor"), "case": i.get("case")}
                for d, i in (summary.get("largest_ratio_by_dtype") or {}).items()]
    by_side = [{"key": k, "ratio_text": fmt_ratio(i.get("ratio")), "ratio_style": ratio_style(i.get("ratio")),
                "tensor": i.get("tensor"), "case": i.get("case")}
               for k, i in (summary.get("largest_ratio_by_side") or {}).items()]
    known_cases = sum(k.get("reproduced", 0) for k in summary.get("known") or [])
    outcome = ("clean" if clean else f"{len(divergences)} divergence{'s' if len(divergences) != 1 else ''}")
    if known_cases:
        outcome += f", {known_cases} known"
    tf32_explained = summary.get("tf32_explained") or []
    if tf32_explained:
        outcome += f", {len(tf32_explained)} TF32's"
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    ran = datetime.datetime.fromtimestamp(run["mtime"]).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return {
        "name": name, "source": run["dir"], "clean": clean, "outcome": outcome, "generated": generated, "ran": ran,
        "summary": summary, "cases": cases, "largest": largest,
        "largest_text": fmt_ratio(largest["ratio"]) if largest else None,
        "largest_style": ratio_style(largest["ratio"]) if largest else "",
        "by_dtype": by_dtype, "by_side": by_side, "divergences": divergences,
        "env": env, "versions": versions, "stand_ins_used": stand_ins_used,
        "skip_reasons": summary.get("skip_reasons") or {},
        "known": summary.get("known") or [],
        "known_cases": known_cases,
        "tf32_explained": tf32_explained, "tf32_limit": TF32_LIMIT,
        "settings": [(k, summary.get(k)) for k in SETTINGS if summary.get(k) not in (None, [], "")],
    }


# ---- writing ---------------------------------------------------------------------------------------------

def _jinja() -> Environment:
    env = Environment(loader=PackageLoader("ssdiff.report", "templates"),
                      autoescape=select_autoescape(["html", "j2"], default_for_string=True, default=True),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["ratio"] = fmt_ratio
    env.filters["num"] = fmt_num
    env.filters["ratio_style"] = ratio_style
    return env


def run_name(run_dir) -> str:
    return pathlib.Path(run_dir).resolve().name


def render_run(run_dir, reports_root=None, name: Optional[str] = None, output=None, index: bool = True) -> pathlib.Path:
    """Render the saved run ``run_dir`` to ``output`` (default: <reports_root>/<name>/index.html, name = the
    summary's run_name, else the run directory's name), write run.json beside it and, with ``index``, rebuild
    <reports_root>/index.html."""
    run = read_run(run_dir)
    name = name or run["summary"].get("run_name") or run_name(run_dir)
    root = pathlib.Path(reports_root or default_reports_root())
    target = pathlib.Path(output) if output is not None else root / name / "index.html"
    target.parent.mkdir(parents=True, exist_ok=True)
    page = build_page(run, name)
    text = _jinja().get_template("run.html.j2").render(page=page)
    target.write_text(text, encoding="utf-8")
    record = {"name": name, "page": str(target.resolve()), "source": run["dir"], "clean": page["clean"],
              "outcome": page["outcome"], "divergences": len(page["divergences"]), "cases": page["cases"],
              "largest_ratio": page["largest"]["ratio"] if page["largest"] else None,
              "impl": run["summary"].get("impl"), "against": run["summary"].get("against"),
              "device": run["summary"].get("device"), "ran": page["ran"], "generated": page["generated"],
              "bytes": len(text.encode("utf-8")),
              "signatures": [d.get("signature", "") for d in run["summary"].get("divergences") or []]}
    (target.parent / RUN_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if index and output is None:
        render_index(root)
    return target


def render_index(reports_root=None) -> pathlib.Path:
    """<reports_root>/index.html: every run rendered under it (each <name>/run.json), newest first."""
    root = pathlib.Path(reports_root or default_reports_root())
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for record_path in sorted(root.glob(f"*/{RUN_RECORD}")):
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        record["href"] = f"{record_path.parent.name}/index.html"
        record["largest_text"] = fmt_ratio(record.get("largest_ratio"))
        record["largest_style"] = ratio_style(record.get("largest_ratio"))
        record["mtime"] = record_path.stat().st_mtime
        runs.append(record)
    runs.sort(key=lambda r: -r["mtime"])
    page = {"runs": runs, "clean": sum(1 for r in runs if r.get("clean")),
            "diverged": sum(1 for r in runs if not r.get("clean")),
            "generated": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")}
    target = root / "index.html"
    target.write_text(_jinja().get_template("index.html.j2").render(page=page), encoding="utf-8")
    return target


__all__ = ["build_page", "render_run", "render_index", "default_reports_root", "RunError",
           "fmt_ratio", "fmt_num"]
