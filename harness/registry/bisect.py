"""Which releases of a package a case diverges on: `ssdiff bisect`.

Each release is installed into a directory of its own under the release cache (SSDIFF_RELEASES, else
~/.cache/ssdiff/releases; ``<package>-<version>/``), as ./dev installs the pinned one: mamba-ssm from its source
without the CUDA extension (MAMBA_SKIP_CUDA_BUILD, MAMBA_FORCE_BUILD, no build isolation, no dependencies), the
others from their wheels without dependencies. The case is replayed in a child process whose path has that directory
first, so the release there is the one loaded; the child prints its verdict as one JSON line.

A release is "bad" when the case diverges there, or its run fails with the exception the defect raises (a record's
finding.json names it; for a case file any failure counts), "good" when it passes, and "n/a" when the
implementation cannot run that release: it does not load, lacks the entry point, or fails otherwise (an old release
that does not run under this torch or triton says nothing of the defect). The search assumes one affected
interval: releases before the first bad one and from the first good one on pass. It probes the two ends of the range
and, when neither is bad, a release a hint names as affected (a record's first affected release), else releases
from the middle out until one is bad; then it halves each side of a bad release to its transition. With at most
LINEAR releases in the range it probes every one. An install is done once; offline, only cached releases count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Optional

from packaging.version import InvalidVersion, Version

from ssdiff.reproduce.repro import checkout

LINEAR = 4
BAD, GOOD, NA = "bad", "good", "n/a"
RUN_FAILURES = ("error", "crash", "hang")
RESULT_FILE = "bisect.json"


class BisectError(RuntimeError):
    """Bisect cannot proceed: no releases in the range, an install failed offline, a bad range."""


@dataclass(frozen=True)
class Probe:
    """One release's verdict on the case."""

    release: str
    verdict: str                 # BAD, GOOD or NA
    ratio: Optional[float] = None
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Bisection:
    package: str
    releases: list               # every release in the range, oldest first
    probes: dict = field(default_factory=dict)    # release -> Probe

    @property
    def tested(self) -> list:
        return [self.probes[r] for r in self.releases if r in self.probes]

    @property
    def first_bad(self) -> Optional[str]:
        return next((p.release for p in self.tested if p.verdict == BAD), None)

    @property
    def first_good(self) -> Optional[str]:
        """The first release after the first bad one that passes (None: no tested release after it passes)."""
        bad = self.first_bad
        if bad is None:
            return None
        after = [p for p in self.tested if Version(p.release) > Version(bad)]
        return next((p.release for p in after if p.verdict == GOOD), None)

    def to_dict(self) -> dict:
        return {"package": self.package, "range": [self.releases[0], self.releases[-1]] if self.releases else [],
                "first_bad": self.first_bad, "first_good": self.first_good,
                "probes": [{"release": p.release, "verdict": p.verdict, "ratio": p.ratio,
                            **({"why": _no_paths(p.detail)} if p.verdict == NA else {})} for p in self.tested]}


def _no_paths(text: str) -> str:
    """``text`` without this machine's directories (a traceback's file paths cut to their file names)."""
    return re.sub(r"(?<![\w.])/(?:[^\s/]+/)+", "", text)


def cache_root() -> Path:
    return Path(os.environ.get("SSDIFF_RELEASES") or Path.home() / ".cache" / "ssdiff" / "releases")


def release_dir(package: str, version: str) -> Path:
    return cache_root() / f"{package}-{version}"


def cached_version(where: Path, package: str) -> Optional[str]:
    """The release of ``package`` installed in directory ``where``, or None."""
    if not where.is_dir():
        return None
    found = next(iter(metadata.distributions(name=package, path=[str(where)])), None)
    return found.version if found is not None else None


def cached(package: str) -> list:
    """The releases of ``package`` in the release cache."""
    root = cache_root()
    if not root.is_dir():
        return []
    out = [cached_version(p, package) for p in root.glob(f"{package}-*")]
    return sorted({v for v in out if v}, key=Version)


def install_command(package: str, version: str, target: Path) -> tuple:
    """(argv, extra environment) that install release ``version`` of ``package`` into ``target``."""
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    if package == "mamba-ssm":
        return (pip + ["--no-build-isolation", f"{package}=={version}"],
                {"MAMBA_SKIP_CUDA_BUILD": "TRUE", "MAMBA_FORCE_BUILD": "TRUE"})
    return pip + ["--only-binary", ":all:", f"{package}=={version}"], {}


def install(package: str, version: str, offline: bool = False) -> Path:
    """The cache directory holding release ``version`` of ``package``, installed there first when it is not."""
    where = release_dir(package, version)
    if cached_version(where, package) == version:
        return where
    if offline:
        raise BisectError(f"{package} {version} is not in the release cache ({cache_root()}) and --offline is given")
    where.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{package}-{version}-", dir=where.parent))
    argv, env = install_command(package, version, scratch)
    done = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        tail = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise BisectError(f"installing {package} {version} failed: {tail}")
    shutil.rmtree(where, ignore_errors=True)
    scratch.rename(where)
    return where


def index_versions(package: str) -> list:
    """The releases of ``package`` on the package index (`pip index versions`), [] when it cannot be asked."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                          text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("Available versions:")), "")
    return [v.strip() for v in line.split(":", 1)[1].split(",")] if line else []


def in_range(versions, text: Optional[str]) -> list:
    """The final releases of ``versions`` within ``text`` ("A..B", either end optional; None: all), oldest first."""
    lo, hi = (text.split("..", 1) + [""])[:2] if text else ("", "")
    if text and ".." not in text:
        raise BisectError(f"--releases takes A..B, got {text!r}")
    try:
        low, high = (Version(lo) if lo else None), (Version(hi) if hi else None)
    except InvalidVersion as err:
        raise BisectError(f"--releases: {err}") from None
    out = set()
    for v in versions:
        try:
            parsed = Version(v)
        except InvalidVersion:
            continue
        if parsed.is_prerelease or parsed.is_devrelease:
            continue
        if (low is None or parsed >= low) and (high is None or parsed <= high):
            out.add(v)
    return sorted(out, key=Version)


def search(releases: list, probe: Callable[[str], Probe], hint: Optional[str] = None) -> dict:
    """Probe releases (oldest first) to their transitions under the one-interval assumption (module docstring):
    release -> Probe of those probed."""
    seen = {}

    def look(i: int) -> str:
        r = releases[i]
        if r not in seen:
            seen[r] = probe(r)
        return seen[r].verdict

    n = len(releases)
    if n <= LINEAR:
        for i in range(n):
            look(i)
        return seen

    def nearest(lo: int, hi: int, want: Callable[[str], bool]) -> Optional[int]:
        """A release strictly between lo and hi whose verdict is not n/a, probed from the middle out."""
        mid = (lo + hi) // 2
        for k in sorted(range(lo + 1, hi), key=lambda i: (abs(i - mid), i)):
            if want(look(k)):
                return k
        return None

    def transition(lo: int, hi: int) -> None:
        """Halve (lo, hi), whose verdicts differ, until they are neighbours among the probed releases."""
        while hi - lo > 1:
            k = nearest(lo, hi, lambda v: v != NA)
            if k is None:
                return
            if look(k) == look(lo):
                lo = k
            else:
                hi = k

    look(0)
    look(n - 1)
    bad = next((i for i in (0, n - 1) if look(i) == BAD), None)
    if bad is None and hint in releases and look(releases.index(hint)) == BAD:
        bad = releases.index(hint)
    if bad is None:
        bad = nearest(0, n - 1, lambda v: v == BAD)
    if bad is None:
        return seen
    # the ends that run: an end that cannot is stepped inward from (old releases that lack the entry point)
    left = next((i for i in range(bad) if look(i) != NA), None)
    if left is not None and look(left) == GOOD:
        transition(left, bad)
    right = next((i for i in range(n - 1, bad, -1) if look(i) != NA), None)
    if right is not None and look(right) == GOOD:
        transition(bad, right)
    return seen


def replay_in(package: str, version: str, case_json: str, impl: str, device: Optional[str] = None,
              offline: bool = False, timeout: int = 900, raises: Optional[str] = None) -> Probe:
    """Release ``version`` of ``package`` (installed into the cache when it is not) judged on ``case_json`` by
    ``impl``, in a child process whose path has the release's directory first."""
    start = time.perf_counter()
    try:
        where = install(package, version, offline)
    except BisectError as err:
        return Probe(version, NA, detail=str(err), seconds=time.perf_counter() - start)
    repo = checkout()
    path = [str(where)] + ([str(repo)] if repo else []) + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    with tempfile.TemporaryDirectory(prefix="ssdiff-bisect-") as scratch:
        case_file = Path(scratch) / "case.json"
        case_file.write_text(case_json, encoding="utf-8")
        argv = [sys.executable, "-m", "ssdiff.registry.bisect", "--child", str(case_file), "--impl", impl,
                "--package", package] + (["--device", device] if device else [])
        # PYTHONSAFEPATH: the child's cwd does not lead its path (a checkout's kernels/ must not hide a package)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONSAFEPATH": "1"}
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=scratch, timeout=timeout)
        except subprocess.TimeoutExpired:
            return Probe(version, BAD, detail=f"hung past {timeout} s", seconds=time.perf_counter() - start)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return Probe(version, NA, detail=f"the replay did not run: {tail}", seconds=time.perf_counter() - start)
    said = json.loads(lines[-1])
    if said.get("loaded") != version:
        why = (f"{package} {said['loaded']} loaded instead" if said.get("loaded") else
               f"{package} {version} does not load") + (f": {said['detail']}" if said.get("detail") else "")
        return Probe(version, NA, detail=why, seconds=time.perf_counter() - start)
    if said["verdict"] == NA:
        return Probe(version, NA, None, said.get("detail", ""), time.perf_counter() - start)
    verdict = classify(said["status"], said.get("error_type", ""), raises)
    detail = said.get("detail", "") + (f" (not the defect's {raises or 'result'}: this release cannot run the case "
                                       f"here)" if verdict == NA else "")
    return Probe(version, verdict, said.get("ratio") if verdict != NA else None, detail,
                 time.perf_counter() - start)


def _child(case_path: str, impl: str, package: str, device: Optional[str]) -> dict:
    """Judge the case with the releases this process loads: the child's JSON line."""
    from ssdiff.examine import UsageError
    from ssdiff.investigate.minimize import replay
    from ssdiff.model.case import Case
    from ssdiff.registry.known import installed_version
    from ssdiff.sides.registry import UnknownImplementation

    loaded = installed_version(package)
    try:
        outcome = replay(Case.load(case_path), impl, device=device)
    except (UsageError, UnknownImplementation) as err:
        return {"loaded": loaded, "verdict": NA, "detail": str(err).splitlines()[0][:300]}
    verdict = outcome.verdicts[impl]
    if verdict.status == "unavailable":
        return {"loaded": loaded, "verdict": NA, "detail": (verdict.detail or "")[:300]}
    detail, error_type = verdict.status, ""
    if verdict.detail and verdict.status in RUN_FAILURES:
        first = verdict.detail.splitlines()[0]
        detail += ": " + first.rsplit(" (at ", 1)[0][:200]
        error_type = first.split(":", 1)[0].strip()
    return {"loaded": loaded, "verdict": GOOD if verdict.ok else BAD, "status": verdict.status, "ratio": verdict.ratio,
            "detail": detail, "error_type": error_type}


def bisect(case_json: str, impl: str, package: str, releases: Optional[str] = None, hint: Optional[str] = None,
           offline: bool = False, device: Optional[str] = None,
           on_probe: Callable[[Probe], None] = lambda p: None, raises: Optional[str] = None) -> Bisection:
    """Bisect ``package``'s releases within ``releases`` ("A..B") for the case (JSON text) judged by ``impl``."""
    known = cached(package) if offline else sorted(set(index_versions(package)) | set(cached(package)), key=Version)
    chosen = in_range(known, releases)
    if not chosen:
        raise BisectError(f"no release of {package} in {releases or 'any range'}"
                          + (" in the release cache (--offline)" if offline else ""))
    result = Bisection(package, chosen)

    def probe(version: str) -> Probe:
        found = replay_in(package, version, case_json, impl, device, offline, raises=raises)
        on_probe(found)
        return found

    result.probes = search(chosen, probe, hint)
    return result


@dataclass(frozen=True)
class Target:
    """What `ssdiff bisect` replays: the case (JSON text), the implementation, the package, a release the record
    names as affected (the search's hint) and the record's id (None for a case file)."""

    case_json: str
    impl: str
    package: str
    hint: Optional[str] = None
    record: Optional[str] = None
    # The exception type the defect raises (a record's finding.json "raised"), "" when it raises none, None when
    # unknown (a case file): which run failures are the defect (see `classify`).
    raises: Optional[str] = None


def target(spec: str, impl: Optional[str] = None, package: Optional[str] = None) -> Target:
    """A known defect's id (its example, its first implementation and its package by default) or a case file's path
    (``impl`` needed; the package mamba-ssm by default)."""
    from ssdiff.model.case import Case
    from ssdiff.registry.known import BY_ID

    record = BY_ID.get(spec)
    if record is not None:
        found = stored_finding(record.id)
        raises = ((found.get("raised") or "").split(":", 1)[0] if found and found.get("reproduces") else None)
        return Target(record.example.to_json(), impl or record.implementations[0], package or record.package,
                      record.affected[0], record.id, raises)
    if not Path(spec).is_file():
        raise BisectError(f"{spec!r} is neither a known defect (`ssdiff known`) nor a case file")
    if not impl:
        raise BisectError("a case file needs --impl NAME")
    return Target(Case.load(spec).to_json(), impl, package or "mamba-ssm")


def stored_finding(defect_id: str) -> Optional[dict]:
    """A record's finding.json (harness/registry/findings.py), or None."""
    from ssdiff.registry.findings import FINDINGS_DIR, RECORD_FILE

    path = FINDINGS_DIR / defect_id / RECORD_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def classify(status: str, error_type: str, raises: Optional[str]) -> str:
    """A replay's verdict on a release: GOOD when it passes; BAD when it diverges, and when it fails to run with
    the exception the defect raises (``raises``; any failure when that is unknown); NA when it fails to run
    otherwise (an old release that does not run under this torch or triton is not the defect)."""
    if status == "ok":
        return GOOD
    if status in RUN_FAILURES and raises is not None and error_type != raises:
        return NA
    return BAD


def stored(defect_id: str, root: Optional[Path] = None) -> Optional[dict]:
    """The bisect result stored for record ``defect_id`` (reports/findings/<id>/bisect.json), or None."""
    from ssdiff.registry.findings import FINDINGS_DIR

    path = Path(root or FINDINGS_DIR) / defect_id / RESULT_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def store(defect_id: str, result: Bisection, root: Optional[Path] = None) -> Path:
    from ssdiff.registry.findings import FINDINGS_DIR

    folder = Path(root or FINDINGS_DIR) / defect_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESULT_FILE
    path.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def verdict_at(result: dict, version: str) -> Optional[str]:
    """What a stored result says of release ``version``: BAD inside [first_bad, first_good), GOOD outside it within
    the range, None outside the range (the one-interval assumption, as the search makes it)."""
    lo, hi = (Version(v) for v in result["range"])
    v = Version(version)
    if not lo <= v <= hi:
        return None
    bad, good = result["first_bad"], result["first_good"]
    return BAD if bad is not None and v >= Version(bad) and (good is None or v < Version(good)) else GOOD


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssdiff.registry.bisect", description=__doc__.split("\n\n")[0])
    p.add_argument("--child", metavar="CASE.json", required=True)
    p.add_argument("--impl", required=True)
    p.add_argument("--package", required=True)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    from ssdiff import runtime

    runtime.configure()
    print(json.dumps(_child(args.child, args.impl, args.package, args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Target", "target", "Bisection", "Probe", "BisectError", "bisect", "search", "in_range", "install",
           "install_command", "replay_in", "classify", "cached", "cache_root", "release_dir", "stored", "store",
           "verdict_at", "BAD", "GOOD", "NA", "LINEAR"]
