"""A fuzz campaign over ssdiff's own kernels (ssdiff.triton) with the autotune-config sweep on: every config of
every kernel runs on every case, forward and backward, both entry points, fp32 and fp16 — and nothing diverges.
On the device under test (``--device``; the interpreter on a CPU)."""

from ssdiff.campaign.fuzz import FuzzConfig, Fuzzer
from ssdiff.model.bounds import Bounds

SMALL = Bounds(max_batch=2, max_seqlen=24, max_nheads=4, max_headdim=8, max_dstate=8, chunk_sizes=(8, 16))


def test_fuzz_with_every_autotune_config_finds_nothing(tmp_path, device):
    report = Fuzzer(FuzzConfig(impl="ssdiff.triton", autotune="sweep", pass_="mixed", max_examples=6, max_time=None,
                               seed=7, bounds=SMALL, device=device, out_dir=str(tmp_path), report_dir=None,
                               keep_going=True)).run()
    assert report.tried >= 6, report.skip_reasons
    messages = [f.localization.get("text", "") for f in report.findings]
    assert not report.findings, "\n\n".join(messages)
