"""HTML divergence reports: one self-contained page per run (verdict tables, error heatmaps, the error along
the sequence, the stage and feature localization, the cases, the repro, the environment) and an index of runs.

    from ssdiff.report import render_run
    render_run("ssdiff-out/fuzz-20250101-120000")     # -> reports/fuzz-20250101-120000/index.html

Modules: maps (compact error maps from verdicts; what a fuzz run saves as error_maps.json), plots (matplotlib,
offline, inline PNG), render (saved run -> page, jinja2 templates in templates/), environment (versions,
device, stand-ins), browser (headless Chromium over the DevTools pipe, for tests), pytest_plugin
(``--ssdiff-report``). Importing this package loads neither matplotlib nor jinja2.
"""

from __future__ import annotations


def render_run(run_dir, reports_root=None, **kwargs):
    from ssdiff.report.render import render_run as _render_run

    return _render_run(run_dir, reports_root, **kwargs)


def render_index(reports_root=None):
    from ssdiff.report.render import render_index as _render_index

    return _render_index(reports_root)


def default_reports_root() -> str:
    from ssdiff.report.render import default_reports_root as _default

    return _default()


__all__ = ["render_run", "render_index", "default_reports_root"]
