"""CI regression gate: the searched schedule of every shipped config must not predict a slower
decode step than its stored baseline (benchmarks/baselines/<gpu>.json, section "predicted")."""
import pytest

from benchmarks.predicted_gate import main


@pytest.mark.slow
def test_no_predicted_latency_regression(capsys):
    rc = main(["check"])
    out = capsys.readouterr().out
    assert rc == 0, out
