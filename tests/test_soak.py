"""The soak test (issue 34), short: `specdec serve` under 16 streaming clients for a minute while its drafter is
killed every 15 s and its verifier once; bench/soak.py checks every request's end and tokens, the stack's growth
and the verifier's leaks, and exits 1 on any failure. `python bench/soak.py` is the 10-minute, 32-client run."""
import sys

import pytest
from reliability_stack import REPO

sys.path.append(str(REPO / "bench"))
import soak  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_soak_one_minute_with_kills(tmp_path, capsys):
    code = soak.main(["--minutes", "1", "--clients", "16", "--kill-drafter-every", "15", "--max-tokens", "16",
                      "--log", str(tmp_path / "serve.log")])
    out = capsys.readouterr().out
    assert code == 0, out + (tmp_path / "serve.log").read_text()[-4000:]
    assert "kills: 3 drafter, 1 verifier" in out or "kills: 4 drafter, 1 verifier" in out, out
    assert "outputs differing from the reference: 0" in out
