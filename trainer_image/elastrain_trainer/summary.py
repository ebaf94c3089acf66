"""Summaries of a run from its JSON log records: steps lost, restarts (resumes from a
checkpoint) and in-process regroups, train and validation loss curves and their plot."""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

Record = dict[str, Any]


@dataclass(frozen=True)
class RunSummary:
    finished: bool
    final_step: int
    final_loss: float | None
    resumes: int
    steps_lost: int
    lost_per_resume: list[int] = field(default_factory=list)
    world_sizes: list[int] = field(default_factory=list)
    checkpoints_saved: int = 0
    checkpoints_failed: int = 0
    wall_s: float = 0.0
    # Rank 0's peak memory, from its step records (estimate.measure_peak: resident set on CPU,
    # max allocated on CUDA); None for a run whose records carry none.
    peak_memory_bytes: int | None = None
    # The validation split's loss at the newest step evaluated (None: no validation).
    final_validation_loss: float | None = None
    validation_step: int | None = None
    # In-process recovery: the generations entered after a change (a leave, a failure, a join),
    # in order; the steps each lost (also in steps_lost); the survivors' pause at each (the step
    # across it less the run's median step); and each heal, "<node> from <peer>".
    regroup_reasons: list[str] = field(default_factory=list)
    lost_per_regroup: list[int] = field(default_factory=list)
    regroup_pauses_s: list[float] = field(default_factory=list)
    heals: list[str] = field(default_factory=list)

    @property
    def regroups(self) -> int:
        return len(self.regroup_reasons)


def summarize(records: list[Record], wall_s: float = 0.0) -> RunSummary:
    """Pure: derive the summary from records in any order (sorted by their time)."""
    ordered = sorted(records, key=lambda r: float(r.get("time", 0.0)))
    max_step = 0
    lost: list[int] = []
    worlds: list[int] = []
    final_loss: float | None = None
    for r in ordered:
        if r["event"] == "step":
            max_step = max(max_step, int(r["step"]))
            final_loss = r["loss"] if int(r["step"]) >= max_step else final_loss
            if not worlds or worlds[-1] != r["world_size"]:
                worlds.append(int(r["world_size"]))
        elif r["event"] == "resumed":
            # A fallback past a damaged checkpoint loses the steps back from the skipped one.
            skipped = int(r.get("skipped_step") or 0)
            lost.append(max(0, max(max_step, skipped) - int(r["step"])))
        elif r["event"] == "fresh_start" and r.get("steps_lost"):
            lost.append(int(r["steps_lost"]))
    saved = {r["step"] for r in ordered if r["event"] == "checkpoint_saved"}
    peaks = [int(r["peak_memory"]) for r in ordered
             if r["event"] == "step" and r.get("peak_memory") is not None]
    validation = validation_curve(records)
    last_val = max(validation, default=None)
    regroups = regroup_records(ordered)
    costs = [_regroup_cost(ordered, r) for r in regroups]
    regroup_lost = [lost for lost, _ in costs]
    return RunSummary(
        finished=any(r["event"] == "finished" for r in ordered), final_step=max_step,
        final_loss=final_loss, resumes=sum(r["event"] == "resumed" for r in ordered),
        steps_lost=sum(lost) + sum(regroup_lost), lost_per_resume=lost,
        world_sizes=worlds, checkpoints_saved=len(saved),
        checkpoints_failed=sum(r["event"] == "checkpoint_failed" for r in ordered),
        wall_s=round(wall_s, 2), peak_memory_bytes=max(peaks, default=None),
        final_validation_loss=None if last_val is None else validation[last_val],
        validation_step=last_val,
        regroup_reasons=[str(r["reason"]) for r in regroups], lost_per_regroup=regroup_lost,
        regroup_pauses_s=[pause for _, pause in costs if pause is not None],
        heals=[f"{r['node']} from {r['healed_from']}" for r in ordered
               if r["event"] == "regroup" and r.get("healed_from")])


def regroup_records(records: list[Record]) -> list[Record]:
    """The first record of each generation entered after a change, in time order (the
    coordinator and each healed node announce the same generation)."""
    ordered = sorted(records, key=lambda r: float(r.get("time", 0.0)))
    firsts: dict[int, Record] = {}
    for r in ordered:
        if r["event"] == "regroup" and r.get("reason") != "start":
            firsts.setdefault(int(r["gen"]), r)
    return list(firsts.values())


def _regroup_cost(ordered: list[Record], regroup: Record) -> tuple[int, float | None]:
    """(steps lost, survivors' pause) of a regroup. The survivors go on from the step they were
    at, so a leave or a join loses what was trained past it (none, unless a step were trained
    twice); the pause is how much longer than the run's median step the step across it took."""
    at = float(regroup["time"])
    steps = [r for r in ordered if r["event"] == "step"]
    before = [r for r in steps if float(r["time"]) <= at]
    after = [r for r in steps if float(r["time"]) > at]
    lost = max(0, max((int(r["step"]) for r in before), default=0) - int(regroup["step"]))
    if not before or not after:
        return lost, None
    usual = statistics.median(float(b["time"]) - float(a["time"])
                              for a, b in itertools.pairwise(steps))
    pause = float(after[0]["time"]) - float(before[-1]["time"]) - usual
    return lost, round(max(0.0, pause), 3)


def loss_curve(records: list[Record]) -> dict[int, float]:
    """step -> loss; a step trained again after a restart keeps its latest value."""
    ordered = sorted(records, key=lambda r: float(r.get("time", 0.0)))
    return {int(r["step"]): float(r["loss"]) for r in ordered if r["event"] == "step"}


def validation_curve(records: list[Record]) -> dict[int, float]:
    """step -> validation loss, for the steps that evaluated the validation split."""
    ordered = sorted(records, key=lambda r: float(r.get("time", 0.0)))
    return {int(r["step"]): float(r["val_loss"]) for r in ordered
            if r["event"] == "step" and r.get("val_loss") is not None}


def plot_loss(records: list[Record], path: Path) -> Path | None:
    """Train (and validation) loss vs step, with world-size changes marked; None when there is
    nothing to plot."""
    curve = loss_curve(records)
    validation = validation_curve(records)
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = sorted(curve)
    ax.plot(steps, [curve[s] for s in steps], lw=1.2, label="train loss")
    if validation:
        at = sorted(validation)
        ax.plot(at, [validation[s] for s in at], "o-", lw=1.2, ms=3, color="tab:orange",
                label="validation loss")
        ax.legend(loc="upper right")
    marks = [(r, "resume", "tab:red") for r in records if r["event"] == "resumed"]
    marks += [(r, str(r["reason"]), "tab:green") for r in regroup_records(records)]
    for r, what, color in marks:
        ax.axvline(int(r["step"]), color=color, ls="--", lw=0.8)
        ax.annotate(f"{what} -> world {r['world_size']}", (int(r["step"]), curve[steps[0]]),
                    rotation=90, fontsize=7, color=color, va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("elastrain local run")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_summary(summary: RunSummary, exit_codes: dict[str, int | None], out_dir: Path) -> None:
    doc = {**asdict(summary), "regroups": summary.regroups, "exit_codes": exit_codes}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2))
    lines = [f"finished: {summary.finished}  final step: {summary.final_step}  "
             f"final loss: {summary.final_loss}",
             f"resumes: {summary.resumes}  steps lost: {summary.steps_lost} "
             f"{summary.lost_per_resume}",
             f"world sizes: {' -> '.join(map(str, summary.world_sizes))}",
             f"regroups: {summary.regroups} {summary.regroup_reasons}  steps lost: "
             f"{summary.lost_per_regroup}  pauses: {summary.regroup_pauses_s} s  heals: "
             f"{summary.heals}",
             f"checkpoints saved: {summary.checkpoints_saved}  failed: "
             f"{summary.checkpoints_failed}  wall: {summary.wall_s} s",
             f"peak memory (rank 0): {_gib(summary.peak_memory_bytes)}",
             f"validation loss: {summary.final_validation_loss} (step "
             f"{summary.validation_step})",
             f"agent exit codes: {exit_codes}"]
    (out_dir / "summary.txt").write_text("\n".join(lines) + "\n")


def _gib(n: int | None) -> str:
    return "not measured" if n is None else f"{n / (1 << 30):.2f} GiB"
