"""The agent's timings given on its command line (or their environment
variables) are finite, positive seconds: nan and inf are refused in one
line, as the gateway's float settings are (app/cli.py, app/gateway/settings/_group.py)."""

from __future__ import annotations

import pytest

from app.cli import main


@pytest.mark.parametrize("flag", ["--start-timeout", "--upgrade-timeout"])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "1e400", "0", "-1"])
def test_an_agent_timing_that_is_not_finite_and_positive_is_refused(
        capsys: pytest.CaptureFixture[str], flag: str, raw: str) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["agent", f"{flag}={raw}"])
    err = capsys.readouterr().err
    assert ended.value.code == 2
    assert f"argument {flag}: {raw!r} is not a positive number of seconds" in err, err


@pytest.mark.parametrize("variable", ["LLMGW_ENGINE_START_TIMEOUT",
                                      "LLMGW_AGENT_UPGRADE_TIMEOUT"])
def test_so_is_one_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str],
                                        variable: str) -> None:
    monkeypatch.setenv(variable, "inf")
    with pytest.raises(SystemExit) as ended:
        main(["agent"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "'inf' is not a positive number of seconds" in err, err
