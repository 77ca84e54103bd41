"""The engine adapters refuse an engine outside their tested range at startup, by name."""

from __future__ import annotations

import pytest

from kamera_agent.engines.versions import ALLOW_VARIABLE, SUPPORTED, EngineVersionError, check_engine_version
from kamera_agent.errors import KameraWarning


@pytest.mark.parametrize("engine", sorted(SUPPORTED))
def test_the_tested_versions_pass_and_others_are_refused_naming_both(engine: str) -> None:
    low, high = SUPPORTED[engine]
    check_engine_version(engine, low)
    for outside in ("0.0.1", high, "99.0", "not-a-version"):
        with pytest.raises(EngineVersionError, match=f"{engine} {outside} is installed") as info:
            check_engine_version(engine, outside)
        assert low in str(info.value) and high in str(info.value) and ALLOW_VARIABLE in str(info.value)


def test_an_allowed_version_runs_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOW_VARIABLE, "0.99.1")
    with pytest.warns(KameraWarning, match="running anyway"):
        check_engine_version("vllm", "0.99.1")
    with pytest.raises(EngineVersionError):
        check_engine_version("vllm", "0.98.0")  # the variable names one version, not every one
