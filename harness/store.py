"""The saved-run format: the one writer and reader of what fuzz, the pytest plugin and minimize leave on disk.

A saved run is a directory:

    summary.json                 the run: configuration, runtime, counts, largest ratios, the divergences
    divergence-NNN/
        case.json                the case (replayable: `ssdiff replay`, `ssdiff minimize`)
        verdict.json             every side's verdict tensor by tensor, the pair's disagreement, the localization
        message.txt              the same in words
        error_maps.json          the verdicts' error maps (harness/verdict/maps.py)
        minimized.json           the minimized case (when minimized)
        minimized-verdict.json   its verdict and how it was reached
        repro.py                 the standalone reproducer (harness/reproduce/repro.py)
    tf32-NNN/                    a float32 divergence under TF32 within budget with exact float32 dots
                                 (harness/investigate/tf32.py): the same files as a divergence folder, not a divergence

Records carry ``"format": FORMAT``; records without it are the first format, read the same way. A record
from a newer format is refused with one line naming both versions.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Optional

FORMAT = 2

SUMMARY = "summary.json"
PROGRESS = "progress.json"
CASE = "case.json"
VERDICT = "verdict.json"
MESSAGE = "message.txt"
MAPS = "error_maps.json"
MINIMIZED = "minimized.json"
MINIMIZED_VERDICT = "minimized-verdict.json"
REPRO = "repro.py"


class RunError(ValueError):
    """The directory or file is not a saved run this version reads; the message says why, on one line."""


def jsonable(x):
    """``x`` with every value JSON can hold as is, non-finite floats as strings ("inf", "nan"), the rest str()."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


def _write_json(path: pathlib.Path, data, indent: Optional[int] = 2) -> pathlib.Path:
    path.write_text(json.dumps(jsonable(data), indent=indent) + "\n", encoding="utf-8")
    return path


# ---- writing ---------------------------------------------------------------------------------------------

def divergence_folder(run_dir, number: int) -> pathlib.Path:
    folder = pathlib.Path(run_dir) / f"divergence-{number:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def tf32_folder(run_dir, number: int) -> pathlib.Path:
    """Where divergence NNN goes once TF32 explains it (harness/investigate/tf32.py): not read as a divergence."""
    return pathlib.Path(run_dir) / f"tf32-{number:03d}"


def write_divergence(folder, case, verdicts: dict, message: str, localization: Optional[dict] = None,
                     staged: Optional[dict] = None, **fields) -> pathlib.Path:
    """case.json, verdict.json, message.txt and error_maps.json of one divergence. ``verdicts``: side ->
    ssdiff.verdict.judge.Verdict; ``staged``: side -> the verdict with stages from localization (its error maps
    are kept too); ``fields``: more of the record (device, runtime, oracle, autotune, pair ratios, ...)."""
    from ssdiff.verdict.maps import error_maps

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CASE).write_text(case.to_json() + "\n", encoding="utf-8")
    record = {"format": FORMAT, "case": case.to_dict(), "case_description": case.describe(), **fields,
              "verdicts": {side: v.to_dict() for side, v in verdicts.items()},
              "localization": localization or {}, "message": message}
    _write_json(folder / VERDICT, record)
    (folder / MESSAGE).write_text(message + "\n", encoding="utf-8")
    _write_json(folder / MAPS, error_maps(case, {**verdicts, **(staged or {})}), indent=None)
    return folder


def write_summary(run_dir, summary: dict) -> pathlib.Path:
    run = pathlib.Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    return _write_json(run / SUMMARY, {"format": FORMAT, **summary})


def write_progress(run_dir, state: dict) -> pathlib.Path:
    """progress.json: where a running campaign stands (cases, skipped, rate, worst ratios, elapsed)."""
    run = pathlib.Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    tmp = run / (PROGRESS + ".tmp")
    tmp.write_text(json.dumps(state, default=str) + "\n", encoding="utf-8")
    return tmp.replace(run / PROGRESS)         # atomic: a reader never sees half a file


def write_minimized(folder, minimal, record: dict) -> list:
    """minimized.json (the case) and minimized-verdict.json (``record``: how it was reached, its verdicts)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MINIMIZED).write_text(minimal.to_json() + "\n", encoding="utf-8")
    return [folder / MINIMIZED, _write_json(folder / MINIMIZED_VERDICT, {"format": FORMAT, **record})]


# ---- reading ---------------------------------------------------------------------------------------------

def _read_json(path: pathlib.Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RunError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    version = data.get("format", 1) if isinstance(data, dict) else 1
    if isinstance(version, int) and version > FORMAT:
        raise RunError(f"{path}: saved-run format {version}, newer than this ssdiff reads (up to {FORMAT})")
    return data


def _text(path: pathlib.Path) -> Optional[str]:
    return path.read_text(encoding="utf-8") if path.is_file() else None


def read_run(run_dir) -> dict:
    """A saved run: {"dir", "summary", "mtime", "divergences": [{folder, name, number, files, case, verdict,
    message, maps, minimized_file, minimized, minimized_record, repro_file, repro}]}."""
    run = pathlib.Path(run_dir)
    if not run.is_dir():
        raise RunError(f"{run_dir}: not a directory")
    folders = sorted(p for p in run.iterdir() if p.is_dir() and p.name.startswith("divergence-"))
    summary_path = run / SUMMARY
    if not summary_path.is_file() and not folders:
        raise RunError(f"{run_dir}: not a saved run (no {SUMMARY} and no divergence-*/ folders)")
    summary = _read_json(summary_path) if summary_path.is_file() else {}
    divergences = []
    for folder in folders:
        item = {"folder": str(folder.resolve()), "name": folder.name, "files": sorted(p.name for p in folder.iterdir())}
        try:
            item["number"] = int(folder.name.split("-", 1)[1])
        except ValueError:
            item["number"] = len(divergences) + 1
        item["verdict"] = _read_json(folder / VERDICT) if (folder / VERDICT).is_file() else {}
        item["case"] = _read_json(folder / CASE) if (folder / CASE).is_file() else item["verdict"].get("case")
        message = _text(folder / MESSAGE)
        item["message"] = message if message is not None else item["verdict"].get("message", "")
        item["maps"] = _read_json(folder / MAPS) if (folder / MAPS).is_file() else None
        item["minimized_file"] = item["minimized"] = None
        if (folder / MINIMIZED).is_file():
            item["minimized_file"], item["minimized"] = MINIMIZED, _read_json(folder / MINIMIZED)
            if (folder / MINIMIZED_VERDICT).is_file():
                item["minimized_record"] = _read_json(folder / MINIMIZED_VERDICT)
        repro = _text(folder / REPRO)
        item["repro_file"], item["repro"] = (REPRO if repro is not None else None), repro
        divergences.append(item)
    return {"dir": str(run.resolve()), "summary": summary, "divergences": divergences,
            "mtime": summary_path.stat().st_mtime if summary_path.is_file() else run.stat().st_mtime}


def recorded_sides(case_path) -> list:
    """The sides recorded next to a saved case (its folder's verdict.json), or []."""
    record = pathlib.Path(case_path).with_name(VERDICT)
    if not record.is_file():
        return []
    try:
        return list(_read_json(record).get("verdicts", {}))
    except (RunError, OSError):
        return []


def stored_verdicts(case_path) -> Optional[dict]:
    """The verdicts saved next to a case file (minimized-verdict.json for minimized.json, else verdict.json)."""
    path = pathlib.Path(case_path)
    record = path.with_name(MINIMIZED_VERDICT if path.name == MINIMIZED else VERDICT)
    if not record.is_file():
        return None
    try:
        return _read_json(record).get("verdicts")
    except (RunError, OSError):
        return None


__all__ = ["FORMAT", "RunError", "jsonable", "divergence_folder", "write_divergence", "write_summary",
           "write_minimized", "read_run", "recorded_sides", "stored_verdicts"]
