"""The exit-status contract every ssdiff command and every generated repro.py holds.

    0  OK            cases were judged and none diverged (a replay: the case does not diverge)
    1  DIVERGENCE    a new divergence was found (a repro: the defect is there)
    2  USAGE         bad usage, bad input, or an environment that cannot run what was asked: one line naming the
                     flag, field or device, what was expected and what was given (a repro that cannot run here)
    3  JOB_DIED      `ssdiff fuzz --jobs`: a job died and nothing diverged
    4  TOO_LITTLE    the campaign ran but judged too little to mean anything (no case judged, or more cases
                     failing inside ssdiff than judged)
    5  INTERNAL      ssdiff itself failed: the traceback is saved to a file, and one line names it
"""

from __future__ import annotations

OK = 0
DIVERGENCE = 1
USAGE = 2
JOB_DIED = 3
TOO_LITTLE = 4
INTERNAL = 5

# The contract in a few lines, for `ssdiff --help`.
SUMMARY = ("exit status: 0 judged, no divergence; 1 a new divergence; 2 bad usage, bad input or an environment "
           "that cannot run it; 3 a --jobs job died (nothing diverged); 4 judged too little to mean anything; "
           "5 an internal error (its traceback saved to a file)")

__all__ = ["OK", "DIVERGENCE", "USAGE", "JOB_DIED", "TOO_LITTLE", "INTERNAL", "SUMMARY"]
