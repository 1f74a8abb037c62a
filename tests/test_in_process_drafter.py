"""`specdec verifier --in-process-drafter`: the drafter inside the verifier's process (the control for what the
service split costs). Its greedy output is the target's, its drafts are really verified, and the flags that cannot
go together are refused in one line."""
import pytest

from specdec_tools.cli import main
from specdec_tools.commands.in_process_drafter import in_process_drafter
from specdec.sampling_params import SamplingParams
from verifier_service.builder import VerifierConfig, build_engine

PROMPTS = [[5, 17, 3, 99, 42], [7, 7, 7, 7, 7, 7, 7, 7], [200, 1, 30]]


def _engine(tiny_dir, kind=None, k=3):
    config = VerifierConfig(model_dir=str(tiny_dir), num_drafts=k if kind else 0, in_process_drafter=kind,
                            max_context=128, max_running=4, max_batched_tokens=64, prefill_chunk=16, warm_up=False)
    return build_engine(config, in_process_drafter(kind) if kind else None)


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_in_process_drafter_is_lossless_and_drafts(tiny_dir, kind):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = _engine(tiny_dir).generate(PROMPTS, params)
    engine = _engine(tiny_dir, kind)
    assert type(engine.drafter).__name__ == {"mtp": "MTPDrafter", "ngram": "NgramDrafter"}[kind]
    assert engine.generate(PROMPTS, params) == plain
    stats = engine.stats
    assert stats.drafted > 0 and stats.verify_steps > 0          # drafts were proposed and verified
    if kind == "ngram":   # the repeated prompt: its n-gram drafts are the target's own continuation at times
        assert stats.accepted > 0


def test_the_factory_is_needed(tiny_dir):
    with pytest.raises(ValueError, match="factory"):
        build_engine(VerifierConfig(model_dir=str(tiny_dir), in_process_drafter="mtp", warm_up=False))


@pytest.mark.parametrize("flags, words", [
    (["--drafter-address", "127.0.0.1:1", "--in-process-drafter", "ngram"], "exclude each other"),
    (["--draft-vocab", "v.json"], "--draft-vocab goes with --in-process-drafter mtp"),
    (["--draft-vocab", "v.json", "--in-process-drafter", "ngram"], "--draft-vocab goes with"),
])
def test_conflicting_flags_are_one_line_errors(tiny_dir, capsys, flags, words):
    assert main(["verifier", "--model", str(tiny_dir), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
