"""The three float64 oracles as implementations (ref.recurrent, ref.quadratic, ref.chunked).

They take every case: any dtype (inputs are the rounded values, computed in float64), every entry point,
every feature, every stage. Registered so fuzz can set one oracle against another.
"""

from __future__ import annotations

from ssdiff import truth
from ssdiff.model.case import Case
from ssdiff.model.evaluation import Evaluation
from ssdiff.sides.registry import register
from ssdiff.sides.base import Capabilities, Implementation
from ssdiff.inputs import Inputs

DESCRIPTIONS = {
    "ref.recurrent": "float64 oracle, token by token (the definition)",
    "ref.quadratic": "float64 oracle, masked C.B^T over the whole sequence",
    "ref.chunked": "float64 oracle, chunked with passed states (vectorized)",
}


class OracleImplementation(Implementation):
    capabilities = Capabilities(entries=frozenset({"chunk_scan", "split_conv1d", "decode", "layer", "mamba3"}),
                                stages=truth.STAGE_ORDER)

    def __init__(self, name: str):
        self.name = name
        self.description = DESCRIPTIONS[name]

    def run(self, case: Case, inputs: Inputs, want_stages: bool = False) -> Evaluation:
        return truth.evaluate(case, inputs, self.name)


for _name in truth.ORACLES:
    register(OracleImplementation(_name))
