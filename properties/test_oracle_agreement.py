"""The three float64 oracles (recurrent, quadratic, chunked) agree on every output, gradient and stage, over
generated cases spanning every feature of both entry points."""

from hypothesis import example, given

from harness.case import Case, Regime
from harness.strategies import cases
from properties.oracle_checks import oracles_agree


@given(cases(dtypes=("float32", "float16", "bfloat16")))
@example(Case(seqlen=3, nheads=5, headdim=3, dstate=2, chunk_size=4, dtype="float16", D="channel", has_z=True,
              has_dt_bias=False, initial_states=True, segments=((1,),), padding=(2,),
              regime=Regime(decay="strong", dt_large=True, scale=0.25), pass_="backward", seed=20013))
@example(Case(seqlen=1, nheads=2, headdim=1, dstate=7, chunk_size=4, D="none", dt_limit=(0.0, 1.0),
              regime=Regime(decay="mild", values="integer", layout="strided"), seed=1))
def test_three_oracles_agree(device, case):
    oracles_agree(case, device)
