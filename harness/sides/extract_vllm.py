"""Copy out of vLLM's wheel only the files ssdiff's vLLM adapters use, for a GPU runner without network.

The wheel is 336 MB; the SSD ops and the few small modules ssdiff.sides.upstream_vllm imports as they ship are about
0.5 MB. On a machine with the wheel (or vLLM installed):

    python -m ssdiff.sides.extract_vllm vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl DEST   # from the wheel
    python -m ssdiff.sides.extract_vllm --installed DEST                                      # from the installed one

then on the runner put DEST first on the path (``PYTHONPATH=DEST``): ``ssdiff list`` shows vllm loaded from
DEST. Nothing here imports vLLM, and the extracted files are never committed (they are vLLM's, Apache-2.0).
``MANIFEST`` is the list; properties/test_vllm.py checks that the adapters run from an extraction alone.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import shutil
import sys
import zipfile
from pathlib import Path

OPS = "model_executor/layers/mamba/ops"
# Paths inside the vllm package. Package __init__ files are copied for the import system to see packages;
# ssdiff.sides.upstream_vllm never runs vllm's own (it registers bare packages), but runs these as shipped.
MANIFEST = (
    "__init__.py", "_version.py",
    "envs.py", "logger.py",
    "logging_utils/__init__.py", "logging_utils/formatter.py", "logging_utils/lazy.py", "logging_utils/log_time.py",
    "logging_utils/torch_tensor.py", "logging_utils/uvicorn_logging.py",
    "utils/__init__.py", "utils/platform_utils.py", "utils/math_utils.py",
    "model_executor/__init__.py", "model_executor/layers/__init__.py", "model_executor/layers/mamba/__init__.py",
    f"{OPS}/__init__.py", f"{OPS}/ssd_combined.py", f"{OPS}/ssd_bmm.py", f"{OPS}/ssd_chunk_scan.py",
    f"{OPS}/ssd_chunk_state.py", f"{OPS}/ssd_state_passing.py", f"{OPS}/mamba_ssm.py", f"{OPS}/triton_helpers.py",
    f"{OPS}/configs/selective_state_update/*.json",     # the step kernel's tuned launch configs, read at run time
    "v1/__init__.py", "v1/attention/__init__.py", "v1/attention/backends/__init__.py",
    "v1/attention/backends/utils.py",                  # read for PAD_SLOT_ID / NULL_BLOCK_ID, not imported
    "v1/attention/backends/mamba_attn.py",             # the model runner's chunk-metadata builder (its source)
)


class ExtractError(RuntimeError):
    """The source is not a vllm wheel or installation, or lacks a listed file; the message says which."""


def _members(names, prefix: str) -> dict:
    """Manifest path -> member name, for every manifest entry (a pattern may match several)."""
    found = {}
    for entry in MANIFEST:
        hits = [n for n in names if fnmatch.fnmatchcase(n, prefix + entry)]
        if not hits and "*" not in entry:
            raise ExtractError(f"{prefix}{entry} is not in the source")
        for name in hits:
            found[name[len(prefix):]] = name
    return found


def extract(source, dest) -> list:
    """Write the manifest's files from ``source`` (a .whl, or a vllm package directory) under ``dest``/vllm/.
    Returns the written paths."""
    source, dest = Path(source), Path(dest)
    root = dest / "vllm"
    written = []
    if source.is_file() and source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            for rel, member in sorted(_members(wheel.namelist(), "vllm/").items()):
                target = root / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(wheel.read(member))
                written.append(target)
    elif source.is_dir() and (source / "__init__.py").is_file():
        names = [p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()]
        for rel, member in sorted(_members(names, "").items()):
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / member, target)
            written.append(target)
    else:
        raise ExtractError(f"{source}: expected a vllm wheel (.whl) or an installed vllm package directory")
    return written


def installed_location() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ExtractError("vllm is not installed here (give the wheel instead)")
    return Path(list(spec.submodule_search_locations)[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssdiff.sides.extract_vllm", description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", help="the vllm wheel (.whl) or a vllm package directory")
    parser.add_argument("dest", help="directory to write vllm/... under (put it on PYTHONPATH)")
    parser.add_argument("--installed", action="store_true", help="take the files from the installed vllm")
    args = parser.parse_args(argv)
    if bool(args.source) == args.installed:
        parser.error("give the wheel (or a vllm directory) or --installed, not both")
    try:
        written = extract(installed_location() if args.installed else args.source, args.dest)
    except (ExtractError, zipfile.BadZipFile, OSError) as err:
        print(f"extract_vllm: {err}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in written)
    print(f"wrote {len(written)} files ({size / 2**20:.2f} MiB) under {Path(args.dest) / 'vllm'}; "
          f"use PYTHONPATH={args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
