"""The pure parts of the bring-your-own-script API (elastrain_trainer.api)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from elastrain_trainer import api


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def test_state_wraps_modules_and_optimizers_by_name_and_keeps_other_statefuls() -> None:
    model, optimizer = _model_and_optimizer()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    state = api.build_state({"model": model, "optim": optimizer, "sched": scheduler})
    assert list(state) == ["model", "optim", "sched"]
    assert isinstance(state["model"], api.ModelState) and state["model"].model is model
    assert isinstance(state["optim"], api.OptimizerState)
    assert state["optim"].model is model and state["optim"].optimizer is optimizer
    assert state["sched"] is scheduler


def test_model_state_round_trips_by_parameter_name() -> None:
    model, _ = _model_and_optimizer()
    plain = api.ModelState(model).state_dict()
    assert set(plain) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    api.ModelState(other).load_state_dict(plain)
    assert torch.equal(other.state_dict()["0.weight"], model.state_dict()["0.weight"])


def test_optimizer_state_round_trips_by_parameter_name() -> None:
    model, optimizer = _model_and_optimizer()
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    saved = api.OptimizerState(model, optimizer).state_dict()
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    fresh_model, fresh_opt = _model_and_optimizer()
    api.OptimizerState(fresh_model, fresh_opt).load_state_dict(saved)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"],
                       optimizer.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(("objects", "message"), [
    ({"data": [1, 2, 3]}, "a list has no state_dict"),
    ({"elastrain": nn.Linear(1, 1)}, "'elastrain' is reserved"),
    ({"optim": torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)},
     "needs exactly one nn.Module beside it"),
])
def test_state_refuses_what_it_cannot_checkpoint(objects: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        api.build_state(objects)


def test_two_modules_and_an_optimizer_are_refused() -> None:
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    opt = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=1)
    with pytest.raises(ValueError, match="got 2"):
        api.build_state({"a": a, "b": b, "opt": opt})
    assert set(api.build_state({"a": a, "b": b})) == {"a", "b"}  # without one, fine


def test_progress_round_trips_its_step() -> None:
    progress = api.Progress(step=41)
    other = api.Progress()
    other.load_state_dict(progress.state_dict())
    assert other.step == 41


def test_session_reads_the_step_count_and_refuses_a_bad_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_STEPS", "17")
    assert api.Session(model=nn.Linear(1, 1)).total_steps == 17
    assert api.Session(steps=5).total_steps == 5
    with pytest.raises(ValueError, match="steps=0"):
        api.Session(steps=0)
    with pytest.raises(RuntimeError, match="outside"):
        next(api.Session(steps=5).steps())


def test_main_results_become_exit_codes() -> None:
    from elastrain_trainer.session.process import exit_code

    assert [exit_code(r) for r in (None, 0, 75, 3, True, "x")] == [0, 0, 75, 3, 0, 0]


def test_sidecar_says_where_the_checkpoint_came_from() -> None:
    sidecar = api.build_sidecar(12, 0.5, 3, "byo")
    assert {k: sidecar[k] for k in ("step", "loss", "world_size", "job_name")} == {
        "step": 12, "loss": 0.5, "world_size": 3, "job_name": "byo"}


def test_an_ema_module_beside_the_model_is_checkpointed_and_names_no_optimizer_parameter() -> None:
    model, optimizer = _model_and_optimizer()
    ema = torch.optim.swa_utils.AveragedModel(model)
    state = api.build_state({"model": model, "optimizer": optimizer, "ema": ema})
    assert isinstance(state["ema"], api.ModelState) and state["ema"].model is ema
    assert isinstance(state["optimizer"], api.OptimizerState)
    assert state["optimizer"].model is model  # the module that holds its parameters


def test_in_process_a_rank_read_before_the_session_planned_the_node_in_is_refused() -> None:
    from elastrain_trainer.inprocess.session import LiveDistEnv, WorldNotKnownError
    from elastrain_trainer.parallel import read_dist_env

    base = read_dist_env({"RANK": "0", "WORLD_SIZE": "1"})
    env = LiveDistEnv(**{f: getattr(base, f) for f in base.__dataclass_fields__})
    LiveDistEnv._member = None
    for name in ("rank", "world_size"):
        with pytest.raises(WorldNotKnownError, match=f"env.{name} is not known before `with "
                                                     r"Session\(\.\.\.\)`"):
            getattr(env, name)
    assert "not planned in" in repr(env)
