"""Lock files: the same deployment every time.

`m31ctl lock` records what a working deployment used: m31ctl's version, the plan (hash and every
setting), a hash of each file that fed it, the engine image (reference, ID, registry digest, the
vLLM inside) and the hardware fingerprint. `--locked FILE` resolves as usual, compares, and lists
every difference (what, old -> new, where it came from); launch and render refuse on drift and
pin the image by digest (or ID). `build`, `drift` and `pin` are pure; `current` and `compare`
read the image's facts from the Docker Engine and the commit from the Hugging Face cache. They take
the Deployment the caller derived: a lock is applied without deriving it again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from m31ctl import __version__
from m31ctl.checkpoint import cached_commit, hub_dir
from m31ctl.deployment import Deployment
from m31ctl.errors import ConflictError, DockerUnreachable, InputError
from m31ctl.inputs import read_bytes, read_json
from m31ctl.plan import Plan
from m31ctl.plan.layers import Source
from m31ctl.redact import redact, redact_setting
from m31ctl.resources import recipes_dir
from m31ctl.runtime import images  # the module: tests replace images.image_facts
from m31ctl.runtime.images import ImageFacts

LOCK_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class LockedImage(_Strict):
    reference: str
    id: str | None = None
    digest: str | None = None
    vllm_version: str | None = None
    schema_version: str


class LockedCheckpoint(_Strict):
    """The checkpoint a deployment reads: the hub repo and the commit its cache holds (what
    `m31ctl pull` downloaded, refs/main), so a later deploy that would read other weights drifts."""

    repo: str
    commit: str | None


class LockFile(_Strict):
    lock_version: StrictInt = Field(ge=1)
    m31ctl_version: str
    plan_hash: str = Field(pattern=r"^[0-9a-f]{12}$")
    recipe: str
    variant: str
    profile: str
    settings: dict[str, Any]  # dotted key -> value
    inputs: dict[str, str]  # file -> sha256:HEX
    image: LockedImage
    hardware: dict[str, Any]
    # None for a local checkpoint directory (its files are the user's to pin); absent in older locks.
    checkpoint: LockedCheckpoint | None = None


class Drift(NamedTuple):
    """One difference. `drift()` returns its values redacted (m31ctl.redact): a lock that holds a
    secret by value (edited by hand, or older than a guard) must not print it back, in the lines
    of `lock --check`, `--locked` and doctor's lock check, nor in their JSON."""

    what: str
    old: Any
    new: Any
    source: str  # where the new value came from

    def line(self) -> str:
        return redact(f"{self.what}: {_show(self.old)} -> {_show(self.new)} ({self.source})")

    def redacted(self) -> Drift:
        key = self.what.split(" ", 1)[-1]  # "setting runtime.env.HF_TOKEN": the setting's key
        return self._replace(old=redact_setting(key, self.old), new=redact_setting(key, self.new))


def _show(value: Any) -> str:
    return "(none)" if value is None else json.dumps(value) if not isinstance(value, str) else value


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(read_bytes(path, "input file")).hexdigest()


def _inputs(plan: Plan, files: tuple[Path, ...]) -> dict[str, str]:
    """Every file that fed the plan, hashed: the recipe, the shared defaults and model facts, and
    the -f override files in order."""
    shipped = recipes_dir()
    recipe_file = Path(plan.recipe.path)
    if not recipe_file.is_absolute():
        recipe_file = shipped.parent / recipe_file
    found = {
        f"recipe {plan.recipe.path}": _sha256(recipe_file),
        "recipes/defaults.yaml": _sha256(shipped / "defaults.yaml"),
        "recipes/models.yaml": _sha256(shipped / "models.yaml"),
    }
    for index, path in enumerate(files, start=1):
        found[f"-f #{index} {path}"] = _sha256(path)
    return found


def fingerprint(plan: Plan) -> dict[str, Any]:
    hw = plan.hardware
    return {
        "vendor": hw.vendor,
        "product": hw.product,
        "count": hw.count,
        "arch": hw.arch,
        "driver_version": hw.driver_version,
        "cuda_driver_version": hw.cuda_driver_version,
        "rocm_version": hw.rocm_version,
        "source": hw.source,
    }


def build(
    plan: Plan,
    files: tuple[Path, ...],
    image: ImageFacts | None,
    checkpoint: LockedCheckpoint | None = None,
) -> LockFile:
    """The lock for this plan as resolved now. `image`: the engine's facts (None: not asked)."""
    settings = plan.settings
    return LockFile(
        lock_version=LOCK_VERSION,
        m31ctl_version=__version__,
        plan_hash=plan.hash,
        recipe=plan.recipe.recipe,
        variant=plan.variant,
        profile=plan.profile,
        settings={key: value for key, value, _source in plan.explain()},
        inputs=_inputs(plan, files),
        image=LockedImage(
            reference=settings.engine.image,
            id=image.id if image else None,
            digest=image.digest if image else None,
            vllm_version=image.vllm_version if image else None,
            schema_version=settings.engine.schema_version,
        ),
        hardware=fingerprint(plan),
        checkpoint=checkpoint,
    )


def to_text(lock: LockFile) -> str:
    """Stable key order and indentation: lock files are committed and diffed."""
    return json.dumps(lock.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def read(path: Path) -> LockFile:
    """A lock file, or exit 2 naming the file and the problem."""
    data = read_json(path, "lock file")  # bounded in size and depth
    if not isinstance(data, dict):
        raise InputError("not a lock file: expected a JSON object", where=str(path))
    version = data.get("lock_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > LOCK_VERSION:
        raise InputError(
            f"lock_version {version} is newer than this m31ctl understands ({LOCK_VERSION})",
            where=str(path),
            hint=f"it was written by m31ctl {data.get('m31ctl_version', '?')}: upgrade m31ctl, or run `m31ctl lock` again",
        )
    try:
        return LockFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise InputError(
            f"not a valid lock file: {loc}: {err['msg']}",
            where=str(path),
            hint="regenerate it with `m31ctl lock` rather than editing it by hand",
        ) from None


def drift(locked: LockFile, current: LockFile, plan: Plan) -> list[Drift]:
    """Every difference between the lock and the deployment as it would be made now."""
    found: list[Drift] = []
    if locked.m31ctl_version != current.m31ctl_version:
        found.append(
            Drift("m31ctl version", locked.m31ctl_version, current.m31ctl_version, "installed m31ctl")
        )
    for field in ("recipe", "variant", "profile"):
        old, new = getattr(locked, field), getattr(current, field)
        if old != new:
            found.append(Drift(field, old, new, "plan options"))
    for key in sorted(set(locked.settings) | set(current.settings)):
        old, new = locked.settings.get(key), current.settings.get(key)
        if old != new:
            source = plan.provenance.get(key)
            found.append(Drift(f"setting {key}", old, new, str(source) if source else "schema default"))
    for name in sorted(set(locked.inputs) | set(current.inputs)):
        old, new = locked.inputs.get(name), current.inputs.get(name)
        if old != new:
            found.append(Drift(f"input {name}", old, new, "file contents"))
    for field in ("reference", "id", "digest", "vllm_version", "schema_version"):
        old, new = getattr(locked.image, field), getattr(current.image, field)
        # A fact the lock did not record (no engine then) is not drift; one lost now is.
        if old != new and old is not None:
            found.append(Drift(f"image {field}", old, new, "the Docker Engine's image store"))
    old_commit = locked.checkpoint.commit if locked.checkpoint else None
    new_commit = current.checkpoint.commit if current.checkpoint else None
    if old_commit is not None and old_commit != new_commit:  # as the image: not recorded is not drift
        found.append(
            Drift("checkpoint commit", old_commit, new_commit, "the Hugging Face cache (m31ctl pull)")
        )
    for key in sorted(set(locked.hardware) | set(current.hardware)):
        old, new = locked.hardware.get(key), current.hardware.get(key)
        if old != new:
            found.append(
                Drift(
                    f"hardware {key}",
                    old,
                    new,
                    "--hardware" if plan.hardware.simulated else "probe",
                )
            )
    return [d.redacted() for d in found]  # compared in full, reported redacted


def pinned_reference(lock: LockFile) -> str | None:
    """The image by content: repo@sha256 digest where a registry gave one, else the image ID."""
    return lock.image.digest or lock.image.id


def pin(deployment: Deployment, reference: str, lock_path: Path) -> Deployment:
    """The deployment with its engine image pinned to `reference` (the lock's digest or ID). The
    image feeds none of the facts `derive` computes (name, model, layout, timeline, network,
    secrets, vendor, GPUs, draft), so the plan is replaced in place rather than derived again."""
    plan = deployment.plan
    settings = plan.settings
    engine = settings.engine.model_copy(update={"image": reference})
    source = Source("lock", file=str(lock_path), detail=f"--locked {lock_path}")
    provenance = {**plan.provenance, "engine.image": source}
    pinned = plan._replace(settings=settings.model_copy(update={"engine": engine}), provenance=provenance)
    return deployment._replace(plan=pinned)


def checkpoint_of(deployment: Deployment) -> LockedCheckpoint | None:
    """The hub repo and the commit its cache holds (None for a local checkpoint directory)."""
    repo = deployment.model.repo_id
    if repo is None:
        return None
    return LockedCheckpoint(repo=repo, commit=cached_commit(deployment.hf_cache, repo))


def checkpoint_gap(deployment: Deployment, checkpoint: LockedCheckpoint | None) -> str | None:
    """Why the lock records no checkpoint commit, and how to record one; None when it records one
    (or the checkpoint is a local directory). `lock` never asks the hub: the commit is what this
    machine's cache recorded for main, so the remedy is a pull here, then the lock again."""
    if checkpoint is None or checkpoint.commit is not None:
        return None
    return (
        f"checkpoint commit not recorded: {checkpoint.repo}@main is not in this machine's Hugging Face "
        f"cache ({hub_dir(deployment.hf_cache)} has no refs/main for it); `m31ctl pull` then `m31ctl lock` "
        "records it. Until then a render with this lock names main, resolved when its download runs"
    )


def current(deployment: Deployment, files: tuple[Path, ...]) -> tuple[LockFile, str | None]:
    """The lock as it would be written now, and why its image is not pinned (None when it is):
    which of the two it was, so the user is told the one fix that applies. The image's facts come
    from the Docker Engine; when it cannot be reached they are left out (and a lock that
    recorded them does not drift)."""
    plan = deployment.plan
    image = plan.settings.engine.image
    gap = None
    facts: ImageFacts | None
    try:
        facts = images.image_facts(image)
        if facts.id is None:
            gap = f"not recorded: {image} is not in the local Docker Engine (docker pull {image})"
    except DockerUnreachable as exc:
        facts = None
        gap = f"not recorded: the Docker Engine is not reachable ({exc.message})"
    return build(plan, files, facts, checkpoint_of(deployment)), gap


class LockComparison(NamedTuple):
    locked: LockFile  # the lock in the file
    now: LockFile  # the lock as it would be written now
    drift: list[Drift]  # every difference, redacted


def compare(path: Path, deployment: Deployment, files: tuple[Path, ...]) -> LockComparison:
    locked = read(path)
    now, _gap = current(deployment, files)
    return LockComparison(locked, now, drift(locked, now, deployment.plan))


def drift_lines(found: list[Drift]) -> tuple[str, ...]:
    """The printed form of drift: each line redacted (Drift.line), as the JSON forms are."""
    return tuple(f"  {d.line()}" for d in found)


class Applied(NamedTuple):
    deployment: Deployment  # the image pinned where the lock gives a reference
    rewrite: LockFile | None  # with `update` and drift: the lock to write over the file
    differences: list[Drift]


def apply(
    deployment: Deployment, files: tuple[Path, ...], path: Path, update: bool, *, by_id: bool
) -> Applied:
    """Refuse a deployment that drifted from its lock (exit 4) unless `update`, which accepts
    the lock as it is now (the caller writes `rewrite`); then pin the image by the lock's digest
    (or, for launch, `by_id`, its local image ID)."""
    found = compare(path, deployment, files)
    if found.drift and not update:
        count = len(found.drift)
        raise ConflictError(
            f"the deployment drifted from {path} ({count} difference{'s' if count > 1 else ''})",
            hint="review the differences; pass --update-lock to accept them, or restore what changed",
            details=(f"drift from {path}:", *drift_lines(found.drift)),
        )
    held = found.now if found.drift else found.locked
    reference = held.image.digest or (pinned_reference(held) if by_id else None)
    pinned = pin(deployment, reference, path) if reference else deployment
    return Applied(pinned, found.now if found.drift else None, found.drift)
