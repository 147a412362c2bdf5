"""Every label key m31ctl puts on what it makes, in one table: containers, images, networks and
volumes in the Docker Engine, Kubernetes annotations and pod labels, native state files. status,
stop, converge, launch's plan record and the cleanups (throwaway check containers, a rehearsal's
session) read them back. No imports: the runtimes, doctor, the renderers and the rehearsal all
read it."""

from __future__ import annotations


class Label:
    # What a launch or a render puts on the server (container.labels_for).
    OWNER = "io.m31ctl.owner"
    PLAN_HASH = "io.m31ctl.plan-hash"
    RECIPE = "io.m31ctl.recipe"
    VARIANT = "io.m31ctl.variant"
    PROFILE = "io.m31ctl.profile"
    SERVED_MODEL = "io.m31ctl.served-model"
    VERSION = "io.m31ctl.version"
    # The plan a server was launched with (runtime/planrecord.py); only launch sets it: the
    # launch directory is no part of what the render targets describe.
    PLAN = "io.m31ctl.plan"
    # A container created for a check (runtime/engine_api.throwaway): `docker ps -a --filter
    # label=io.m31ctl.throwaway` finds any that a killed m31ctl (SIGKILL) left.
    THROWAWAY = "io.m31ctl.throwaway"
    # A P/D group run by the docker runtime (runtime/docker_group.py), as the native records'
    # `group` and `parts`: each part's container and the pair's network carry the group's name
    # (GROUP); the group's endpoint (its router's front), under the group's name, lists its parts (PARTS).
    GROUP = "io.m31ctl.group"
    PARTS = "io.m31ctl.parts"
    # Everything a rehearsal makes carries its session (the label's value), so its cleanup finds
    # it all by label, even what a Ctrl-C left half made.
    REHEARSAL = "io.m31ctl.rehearsal"
    # On the rehearsal's derived image: the engine image it was built from.
    REHEARSAL_BASE = "io.m31ctl.rehearsal-base"
    # Kubernetes: the pod label the default NetworkPolicy admits to the API port (plan/settings.py
    # api_clients); a user puts it on the pods that may call the server.
    API_CLIENT = "m31ctl.io/api-client"


# The owner label's value: only what carries it is ever changed or removed.
OWNER = "m31ctl"
