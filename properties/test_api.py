"""The public face: `import ssdiff`, its `__all__`, the README's example run as a stranger would run it, and a
committed tree that names no machine.

- the public set is exactly `__all__`, and each name resolves;
- `ssdiff.check` raises `ssdiff.Divergence` (an AssertionError carrying the verdict's message and how to replay)
  on a diverging case, returns the outcome on an agreeing one, and takes a registry name, "module:function", an
  Implementation or a plain callable;
- the README's API example, written to a file outside the repository and run with plain pytest (the plugin comes
  from the installed distribution's pytest11 entry point), finds the seed divergence and prints the verdict;
- the README's map of the tree names every folder of harness/ and nothing that is not there;
- no committed file carries a path of the machine that wrote it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ssdiff
from ssdiff.model.case import Case, Regime
from ssdiff.sides import doubles

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_the_public_set_is_what_all_says():
    assert sorted(dir(ssdiff)) == sorted(ssdiff.__all__)
    for name in ssdiff.__all__:
        assert getattr(ssdiff, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ssdiff.nope  # noqa: B018


def test_the_readme_lists_the_public_set():
    section = README.split("## The API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`ssdiff\.(\w+)`", section))
    assert named <= set(ssdiff.__all__), sorted(named - set(ssdiff.__all__))


GROUPED = Case(entry="split_conv1d", batch=1, seqlen=8, nheads=4, ngroups=2, headdim=4, dstate=4, chunk_size=4,
               rmsnorm=True, return_final_states=False, regime=Regime(decay="typical"))


def test_check_raises_a_divergence_with_the_verdict_and_the_replay(device):
    with pytest.raises(ssdiff.Divergence) as raised:
        ssdiff.check("mamba_ssm.split_conv1d_ref", GROUPED, device=device)
    text = str(raised.value)
    assert isinstance(raised.value, AssertionError)
    assert "mamba_ssm.split_conv1d_ref" in text and "budget" in text
    assert "ssdiff replay case.json --impl mamba_ssm.split_conv1d_ref" in text
    assert Case.from_json(text.split("case: ", 1)[1].splitlines()[0]) == GROUPED
    assert "mamba-ref-norm-over-whole-dim" in text               # the known defect that explains it
    assert not raised.value.outcome.verdicts["mamba_ssm.split_conv1d_ref"].ok


def test_check_takes_a_name_an_implementation_or_a_callable(device):
    case = Case(batch=1, seqlen=12, nheads=4, ngroups=2, headdim=3, dstate=4, chunk_size=4)
    assert ssdiff.check("ssdiff.sides.doubles:healthy", case, device=device).verdicts
    assert ssdiff.check(doubles.healthy, case, device=device).verdicts
    with pytest.raises(ssdiff.Divergence, match="ngroups|group"):
        ssdiff.check(doubles.group_bug, case, device=device)

    def plain(x, dt, A, B, C, chunk_size, D=None, dt_bias=None, dt_softplus=False, return_final_states=False):
        """A callable with part of mamba_chunk_scan_combined's signature: what it lacks is switched off."""
        return _reference(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, return_final_states)

    outcome = ssdiff.check(plain, case.replace(has_z=True, initial_states=True), device=device)
    assert not outcome.case.has_z and not outcome.case.initial_states


def _reference(x, dt, A, B, C, chunk_size, D, dt_bias, dt_softplus, return_final_states):
    """The chunked float64 oracle in the caller's dtype: a correct implementation with a partial signature."""
    import torch

    from ssdiff.truth import chunked

    dtype = x.dtype
    res = chunked.scan(*(t.double() for t in (x, dt, A, B, C)), chunk_size=chunk_size,
                       D=None if D is None else D.double(), dt_bias=None if dt_bias is None else dt_bias.double(),
                       dt_softplus=dt_softplus)
    y = res.outputs["y"].to(dtype)
    return (y, res.outputs["final_states"].to(torch.float32)) if return_final_states else y


def test_the_readme_example_finds_the_seed_divergence_outside_the_repository(tmp_path):
    """The README's example, copied into a new file outside the repository and run with plain pytest."""
    after = README.split("<!-- api-example: run by properties/test_api.py -->", 1)[1]
    example = re.search(r"```python\n(.*?)```", after, re.S).group(1)
    test = tmp_path / "test_example.py"
    test.write_text(example, encoding="utf-8")
    # nothing of the checkout on the path (ssdiff comes from its installation), the caller's other entries kept
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SSDIFF_PROFILE")}
    env.update({"PYTHONPATH": os.pathsep.join(path)} if path else {})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=900, env=env)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-4000:]
    assert "Divergence[mamba_ssm.split_conv1d_ref diverged]" in out, out[-4000:]
    assert "mamba_ssm.split_conv1d_ref" in out and "budget" in out, out[-4000:]
    found = [line for line in out.splitlines() if "Divergence[mamba_ssm.split_conv1d_ref diverged]: " in line]
    assert found, out[-4000:]
    case_line = found[0].split("]: ", 1)[1]
    assert int(re.search(r" g=(\d+) ", case_line).group(1)) > 1 and "rmsnorm" in case_line, case_line


def test_the_readme_map_is_the_tree():
    block = README.split("## Where things are", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    listed = [line.split()[0] for line in block.splitlines() if line and not line.startswith(" ")]
    missing = [path for path in listed if not (REPO / path).exists()]
    assert not missing, f"the README lists what is not there: {missing}"
    folders = sorted(f"{p.relative_to(REPO)}/" for p in (REPO / "harness").rglob("*")
                     if p.is_dir() and p.name != "__pycache__")
    unlisted = [f for f in folders if f not in listed]
    assert not unlisted, f"the README's map lacks: {unlisted}"


MACHINE = re.compile(r"/(work|home|root)/\w|/[^\s\"'`]*/site-packages/|[A-Z]:\\\\Users")


def test_no_committed_file_carries_a_path_of_the_machine_that_wrote_it():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        if path.suffix in (".png", ".whl") or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE.search(line) and "MACHINE = re.compile" not in line:
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found[:20])
