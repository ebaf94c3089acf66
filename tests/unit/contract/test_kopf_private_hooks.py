"""The operator's one private kopf API (listed in elastrain_trainer.private_hooks): the per-job
ticker is registered through OperatorRegistry._spawning with requires_finalizer=False, and kopf's
own registry then spawns it for a TrainingJob without asking for a finalizer. A kopf without
the hook stops the operator with a message naming it and the tested kopf versions."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kopf._core.intents.causes import SpawningCause

from elastrain_operator import handlers
from elastrain_operator.model.spec import API_GROUP, API_VERSION, PLURAL


@pytest.fixture
def registry() -> Iterator[kopf.OperatorRegistry]:
    default = kopf.get_default_registry()
    fresh = kopf.OperatorRegistry()
    kopf.set_default_registry(fresh)
    yield fresh
    kopf.set_default_registry(default)


async def ticker(**_: Any) -> None:
    pass


def spawning_cause(resource: kopf.Resource) -> SpawningCause:
    body = kopf.Body({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "TrainingJob",
                      "metadata": {"name": "demo", "namespace": "ml", "uid": "u1"}})
    return SpawningCause(logger=logging.getLogger("contract"), indices={}, memo=kopf.Memo(),  # type: ignore[arg-type]

                         resource=resource, patch=kopf.Patch(), body=body, reset=False)


def test_the_ticker_is_spawned_for_a_job_without_a_finalizer(
        registry: kopf.OperatorRegistry) -> None:
    handlers.daemon_without_finalizer(ticker)
    resource = kopf.Resource(API_GROUP, API_VERSION, PLURAL)
    cause = spawning_cause(resource)

    (handler,) = registry._spawning.get_handlers(cause)
    assert handler.fn is ticker
    assert registry._spawning.has_handlers(resource=resource)
    assert not registry._spawning.requires_finalizer(cause)
    # kopf.daemon itself would ask for one: the hook is what turns it off.
    kopf.daemon(API_GROUP, API_VERSION, PLURAL, registry=registry)(ticker)
    assert registry._spawning.requires_finalizer(cause)


def test_the_operators_own_ticker_is_registered_without_a_finalizer() -> None:
    found = [h for h in kopf.get_default_registry()._spawning.get_all_handlers()
             if h.fn is handlers.job_ticker]
    assert [h.requires_finalizer for h in found] == [False]


def test_a_kopf_without_the_hook_stops_the_operator_with_a_clear_message(
        registry: kopf.OperatorRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(registry, "_spawning")  # as in a kopf that renamed it
    with pytest.raises(RuntimeError) as raised:
        handlers.daemon_without_finalizer(ticker)
    message = str(raised.value)
    assert "OperatorRegistry._spawning" in message
    assert f"kopf{handlers.KOPF_TESTED}" in message
