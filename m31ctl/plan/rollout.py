"""kubernetes.rollout from the GPUs a cluster declares spare (issue 50).

A surge rollout starts one more copy of every serving engine before the old one stops, so it
needs a second copy's GPUs free; m31ctl cannot see a cluster's free GPUs, so
`kubernetes.spare_gpus` says how many the cluster keeps free for it (None: not said). Where it is
said, the plan decides by it: an unasked rollout is surge when the spare GPUs hold a copy and
recreate when not (the source of the value says which and why), and an asked surge they cannot
hold is refused at plan time, exit 2, instead of a new pod Pending until its progress deadline.
"""

from __future__ import annotations

from m31ctl.errors import InputError
from m31ctl.plan.disaggregation import engine_settings
from m31ctl.plan.layers import Layer, Setting, Source
from m31ctl.plan.settings import PlanSettings

ROLLOUT = "kubernetes.rollout"
SPARE = "kubernetes.spare_gpus"


def copy_gpus(settings: PlanSettings) -> int:
    """The GPUs one more copy takes: every engine's (a P/D pair's roles roll out together)."""
    return sum(engine.parallelism.gpus for _who, engine in engine_settings(settings))


def decide_rollout(settings: PlanSettings, merged: Layer) -> tuple[PlanSettings, Layer]:
    spare = settings.kubernetes.spare_gpus
    if spare is None:
        return settings, merged
    need = copy_gpus(settings)
    asked = merged.get(ROLLOUT)
    if asked is not None and asked.source.layer != "defaults":
        if settings.kubernetes.rollout == "surge" and spare < need:
            raise InputError(
                f"{ROLLOUT}=surge starts a second copy on {need} more GPUs, and {SPARE}={spare} "
                f"declares {spare} free: its pods would stay Pending until the progress deadline",
                where=str(asked.source),
                hint=f"set {ROLLOUT}=recreate, whose cost is a start's downtime, or free {need} GPUs "
                f"and say so with {SPARE}={need}",
            )
        return settings, merged
    rollout = "surge" if spare >= need else "recreate"
    holds = "holds" if spare >= need else "does not hold"
    source = Source("derived", detail=f"{SPARE}={spare} {holds} a second copy's {need} GPUs")
    kubernetes = settings.kubernetes.model_copy(update={"rollout": rollout})
    decided = settings.model_copy(update={"kubernetes": kubernetes})
    return decided, {**merged, ROLLOUT: Setting(rollout, source)}
