"""The operator's control key and the tokens made from it (control.py)."""

from __future__ import annotations

import pytest

from elastrain_operator.control import job_token, load_key


def test_the_key_comes_from_the_environment_and_a_token_opens_one_job() -> None:
    key = load_key({"ELASTRAIN_CONTROL_KEY": "k" * 64})
    assert key == b"k" * 64
    assert job_token(key, "uid-1") == job_token(load_key({"ELASTRAIN_CONTROL_KEY": "k" * 64}),
                                                "uid-1")  # the same after a restart
    assert job_token(key, "uid-1") != job_token(key, "uid-2")
    assert job_token(key, "uid-1") != job_token(b"l" * 64, "uid-1")


def test_a_short_key_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="ELASTRAIN_CONTROL_KEY has 8 characters"):
        load_key({"ELASTRAIN_CONTROL_KEY": "tooshort"})


def test_without_a_key_the_process_makes_one_and_says_what_that_costs(
        caplog: pytest.LogCaptureFixture) -> None:
    first, second = load_key({}), load_key({})
    assert len(first) >= 32 and first != second
    assert "will not match after it restarts" in caplog.text
