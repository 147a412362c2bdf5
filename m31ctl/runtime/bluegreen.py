"""Blue-green on one host (`launch --blue-green`, issue 50): the pure decisions, tested on
probed-host fakes without a runtime. m31ctl/deploy.py's blue_green acts on them.

A deployment named N has two slots: `N` (blue) and `N-green` (green). The slot that runs is the
live one; a changed plan starts in the other slot, on GPUs the live server leaves free and on
another port, passes the gate (verify's checks), and only then is the live one stopped. The
next change goes back to the first slot, so a deployment never has more than two names.

What counts as the same plan across slots: every setting but the two a slot places (its name and
port); a server in either slot that runs the asked plan so placed leaves the launch unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

from m31ctl.deployment import GpuSelection
from m31ctl.errors import ConflictError, HostPreconditionError
from m31ctl.hardware import GPU, Hardware
from m31ctl.runtime.planrecord import PlanRecord

GREEN = "-green"
# The settings a slot places: they differ between the slots of one plan.
PLACEMENT = (("runtime", "container_name"), ("runtime", "port"))
# How far above the plan's port the other slot looks for a free one.
PORT_SEARCH = 100


def slots(base: str) -> tuple[str, str]:
    """The two names of the deployment named `base`: blue (the plan's own name), then green."""
    return base, f"{base}{GREEN}"


def other_slot(base: str, live: str) -> str:
    blue, green = slots(base)
    return blue if live == green else green


def placement_free(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A plan's settings without what a slot places, for comparing one plan across slots."""
    out = {
        section: dict(value) if isinstance(value, Mapping) else value for section, value in settings.items()
    }
    out.pop("verify", None)  # the gate's marks, not what runs (Plan.hash leaves it out too)
    for section, key in PLACEMENT:
        part = out.get(section)
        if isinstance(part, dict):
            part.pop(key, None)
    return out


class GpuPlacement(NamedTuple):
    """Where a new server's GPUs come from: host GPU indices (the probe's, NVML's or amdsmi's
    numbering), each in one of three piles, and the ones chosen for the new server."""

    need: int
    held: tuple[int, ...]  # the live server's
    busy: tuple[int, ...]  # another process holds more than vLLM lets the new server share
    free: tuple[int, ...]
    chosen: tuple[int, ...]  # the first `need` free ones; () when they do not suffice

    @property
    def fits(self) -> bool:
        return len(self.chosen) == self.need

    def why_not(self) -> str:
        """The one line that says why the new server cannot start beside the live one."""
        piles = [f"{len(self.held)} held by the live server"]
        if self.busy:
            piles.append(f"{len(self.busy)} busy (GPU {', '.join(map(str, self.busy))})")
        return f"the plan needs {self.need} GPUs free beside the live server; {len(self.free)} free ({'; '.join(piles)})"


def held_gpus(hw: Hardware, given: Collection[str], count: int) -> tuple[int, ...]:
    """The live server's GPUs as host indices: the ones it was given by UUID, render node or
    index (a container's device request, a native record), else the host's first `count`, which
    both a count device request and an unpinned CUDA/ROCm process take."""
    if not given:
        return tuple(range(min(count, _host_count(hw))))
    named = set(given)
    if not hw.gpus:
        return tuple(sorted(int(g) for g in named if g.isdigit()))
    return tuple(g.index for g in hw.gpus if named & {g.uuid, g.render_node, str(g.index)})


def _host_count(hw: Hardware) -> int:
    return len(hw.gpus) or hw.count


def _busy(gpu: GPU, utilization: float) -> bool:
    """vLLM refuses to start on a GPU whose free memory is below gpu_memory_utilization of its
    total ("Free memory on device ... is less than desired GPU memory utilization",
    vllm/v1/worker/gpu_worker.py); doctor's GPU memory check applies the same bar."""
    return gpu.memory_free_bytes is not None and gpu.memory_free_bytes < utilization * gpu.memory_total_bytes


def place_gpus(hw: Hardware, held: Collection[int], need: int, utilization: float) -> GpuPlacement:
    """The GPUs a new server of `need` GPUs gets beside a live server holding `held`: the host's
    lowest free indices. A probed host's GPUs are judged by their free memory too (another
    process's GPU is not free); a simulated one's by count alone."""
    if need <= 0:
        return GpuPlacement(0, tuple(sorted(held)), (), (), ())
    if hw.gpus:
        others = [g for g in hw.gpus if g.index not in held]
        busy = tuple(g.index for g in others if _busy(g, utilization))
        free = tuple(g.index for g in others if not _busy(g, utilization))
    else:
        busy, free = (), tuple(i for i in range(hw.count) if i not in held)
    chosen = free[:need] if len(free) >= need else ()
    return GpuPlacement(need, tuple(sorted(held)), busy, free, chosen)


def choose_port(preferred: int, taken: Collection[int], is_free: Callable[[int], bool]) -> int:
    """The new slot's port: `preferred` if nothing listens there, else the next free one above it
    (at most PORT_SEARCH tried), never one in `taken` (the live server's listeners)."""
    for port in range(preferred, min(preferred + PORT_SEARCH, 65536)):
        if port not in taken and is_free(port):
            return port
    raise ConflictError(
        f"no free port in {preferred}..{min(preferred + PORT_SEARCH, 65536) - 1} for the new server",
        hint="pass --port with a free one, or stop what listens there",
    )


class Live(NamedTuple):
    """The deployment's server that serves now, as the blue-green launch sees it."""

    name: str
    runtime: str
    endpoint: str
    plan_hash: str | None
    record: PlanRecord | None  # the plan it was launched with (None: not recorded)
    gpus: tuple[str, ...]  # as its runtime gave them (UUIDs, indices); () where none were named


def live_slot(base: str, running: Mapping[str, Live]) -> Live | None:
    """Which slot serves. Both running is what an interrupted switch leaves: one line, and the
    user chooses which to stop (m31ctl never guesses which of two serving servers to end)."""
    found = [running[name] for name in slots(base) if name in running]
    if len(found) > 1:
        raise ConflictError(
            f"both {found[0].name} and {found[1].name} run (an interrupted blue-green launch?)",
            hint=f"stop the one you do not want: m31ctl stop --name {found[1].name} (or {found[0].name})",
        )
    return found[0] if found else None


def serves(live: Live, asked: PlanRecord) -> bool:
    """Whether the live server runs the asked plan, whatever slot placed it."""
    mine = live.record
    if mine is None:
        return False
    same = (mine.recipe, mine.variant, mine.profile) == (asked.recipe, asked.variant, asked.profile)
    return same and placement_free(mine.settings) == placement_free(asked.settings)


class Cutover(NamedTuple):
    """How the new server replaces the live one: `beside` it (blue-green: on `gpus` free now),
    or after it stops (the GPUs it frees are needed: downtime, asked for first)."""

    beside: bool
    gpus: tuple[int, ...]


def cutover(placement: GpuPlacement) -> Cutover:
    """Beside the live server where its free GPUs suffice; else after it stops, on its GPUs and
    the free ones, which costs the new server's whole start; refused (exit 6) where even those
    are too few (GPUs another process holds are not freed by stopping ours)."""
    if placement.fits:
        return Cutover(True, placement.chosen)
    freed = tuple(sorted((*placement.held, *placement.free)))
    if len(freed) < placement.need:
        raise HostPreconditionError(
            f"{placement.why_not()}, and stopping the live server frees only {len(freed)}",
            hint="free the busy GPUs, or use a plan that needs fewer",
        )
    return Cutover(False, freed[: placement.need])


def selection_of(hw: Hardware, indices: tuple[int, ...]) -> GpuSelection:
    """The deployment's GPUs for host `indices`: by UUID (NVIDIA) or render node (AMD) where the
    probe read them, and by index for the native runtime's visibility variable (and Docker's
    device request on a host without UUIDs)."""
    chosen = [g for g in hw.gpus if g.index in indices]
    uuids = tuple(g.uuid for g in chosen if g.uuid)
    nodes = tuple(g.render_node for g in chosen if g.render_node)
    n = len(indices)
    return GpuSelection(uuids if len(uuids) == n else (), nodes if len(nodes) == n else (), indices)


class GateVerdict(NamedTuple):
    """What the gate (verify's checks, run by the CLI: runtime/ reads no server's answers) said
    of the new server."""

    ok: bool
    checks: tuple[str, ...]  # the ids of the checks that ran
    failed: tuple[str, ...]  # "id: message" of each that failed
    skipped: tuple[str, ...] = ()  # the ids of those the plan does not ask for (or --gate-no-load)
