"""The fabric a plan's engines cross: the KV transfer of a prefill/decode plan whose connector
moves the KV over UCX (NIXL), and the RDMA fabric.rdma names (Deployment.rdma) for an engine over
nodes (NCCL). For the KV: each device UCX_NET_DEVICES names is on this host (an RDMA port ACTIVE),
an RDMA transport in UCX_TLS has an ACTIVE RDMA port and the verbs device nodes, a GPU transport
matches the plan's GPUs, and UCX's own version where `ucx_info` is here (information only: UCX
comes with the image). With fabric.rdma, every engine it applies to needs the HCA ports it names
ACTIVE (or, naming none, some ACTIVE port) and the verbs device nodes, whatever UCX_TLS says.

UCX's syntax (openucx/ucx docs/source/faq.md, "Which network devices does UCX use?" and "Which
transports does UCX use?"): UCX_NET_DEVICES is a comma list of devices, `eth2` a network
interface (TCP), `mlx5_2:1` an RDMA device and its port; unset or `all`, UCX picks among all.
UCX_TLS is a comma list of transports and aliases (`rc`, `cuda`, ...); `^` first makes it a deny
list, and `ud:aux` names a transport used for bootstrap only.

The host is read through HostFabric, under a root (/ here, a tree in tests): network interfaces in
/sys/class/net, RDMA ports' states in /sys/class/infiniband/DEV/ports/PORT/state ("4: ACTIVE"),
and /dev/infiniband/uverbs*, which the engine (and a container it runs in) opens for RDMA.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome
from m31ctl.doctor.checks.image import SEVERITY
from m31ctl.engine.adapter import build_invocation
from m31ctl.hardware import Platform
from m31ctl.plan.disaggregation import UCX_TRANSPORTS
from m31ctl.plan.layers import Source
from m31ctl.plan.rdma import SETTING as RDMA_SETTING
from m31ctl.probe.snapshot import ProbeUnavailable

# UCX's own variables (the adapter sets them from the plan: m31ctl/engine/adapter.py kv_transfer_env).
TRANSPORTS_VAR = "UCX_TLS"
DEVICES_VAR = "UCX_NET_DEVICES"
ACTIVE = "ACTIVE"  # an RDMA port's state file reads "4: ACTIVE" when its link is up


class UcxTransport(NamedTuple):
    """What a UCX transport (or alias) needs of the host."""

    rdma: bool = False  # an RDMA port and the verbs devices
    gpus: Platform | None = None  # the GPUs whose memory it moves


_RDMA = UcxTransport(rdma=True)
_CUDA = UcxTransport(gpus=Platform.CUDA)
_ROCM = UcxTransport(gpus=Platform.ROCM)
# UCX's transports and aliases with a need (faq.md's table; the rest, tcp, sm, self, ..., need
# nothing a host lacks). rc_mlx5, ud_verbs, ... are the names `ucx_info -d` lists.
TRANSPORTS: dict[str, UcxTransport] = {
    **dict.fromkeys(("rc", "ud", "dc", "rc_x", "ud_x", "dc_x", "rc_v", "ud_v", "ib"), _RDMA),
    **dict.fromkeys(("rc_mlx5", "ud_mlx5", "dc_mlx5", "rc_verbs", "ud_verbs"), _RDMA),
    **dict.fromkeys(("cuda", "cuda_copy", "cuda_ipc", "gdr_copy"), _CUDA),
    **dict.fromkeys(("rocm", "rocm_copy", "rocm_ipc", "rocm_gdr"), _ROCM),
}
_GPU_MAKER = {Platform.CUDA: "NVIDIA", Platform.ROCM: "AMD"}


@dataclasses.dataclass(frozen=True)
class HostFabric:
    """What this host offers UCX, read under `root` (the one seam to the filesystem)."""

    root: Path = Path("/")

    def _names(self, folder: str) -> tuple[str, ...]:
        path = self.root / folder
        return tuple(sorted(p.name for p in path.iterdir())) if path.is_dir() else ()

    def net_devices(self) -> tuple[str, ...]:
        return self._names("sys/class/net")

    def rdma_devices(self) -> tuple[str, ...]:
        return self._names("sys/class/infiniband")

    def rdma_ports(self, device: str) -> tuple[str, ...]:
        return self._names(f"sys/class/infiniband/{device}/ports")

    def port_state(self, device: str, port: str) -> str | None:
        """The port's state as the kernel writes it ("4: ACTIVE"), or None where there is no such port."""
        path = self.root / "sys/class/infiniband" / device / "ports" / port / "state"
        return path.read_text().strip() if path.is_file() else None

    def active_ports(self) -> tuple[str, ...]:
        """Every ACTIVE RDMA port, in UCX's spelling (mlx5_0:1)."""
        return tuple(
            f"{device}:{port}"
            for device in self.rdma_devices()
            for port in self.rdma_ports(device)
            if ACTIVE in (self.port_state(device, port) or "")
        )

    def uverbs(self) -> tuple[str, ...]:
        return tuple(
            f"/dev/infiniband/{name}" for name in self._names("dev/infiniband") if name.startswith("uverbs")
        )


class Value(NamedTuple):
    """A UCX variable a role's engine gets, and the plan setting it came from."""

    text: str | None
    setting: str  # the key a --set moves it with
    source: str  # where the plan took it from
    var: str = DEVICES_VAR  # the variable it is


class RoleFabric(NamedTuple):
    """What one role's engine asks of the fabric; roles with equal ones are judged once."""

    transports: Value
    devices: Value
    gpus: Platform


def moves_kv_over_ucx(deployment: Deployment | None) -> bool:
    """Whether some engine of the deployment moves its KV over UCX."""
    return deployment is not None and any(
        engine.kv_transfer is not None and engine.kv_transfer.connector.uses_ucx
        for engine in deployment.engines
    )


def crosses_a_fabric(deployment: Deployment | None) -> bool:
    """Whether the fabric check applies: KV over UCX, or an engine with RDMA (fabric.rdma)."""
    return moves_kv_over_ucx(deployment) or (
        deployment is not None and any(engine.rdma is not None for engine in deployment.engines)
    )


def fabric(ctx: CheckContext) -> Outcome:
    """Every role's UCX devices and transports, and every engine's RDMA, against this host
    (module docstring)."""
    deployment = ctx.require_deployment()
    host = HostFabric(ctx.host_root)
    roles: dict[RoleFabric, list[str]] = {}
    rdma: dict[RdmaFabric, list[str]] = {}
    for engine in deployment.engines:
        kv = engine.kv_transfer
        ucx = role_fabric(engine) if kv is not None and kv.connector.uses_ucx else None
        if ucx is not None and kv is not None:
            roles.setdefault(ucx, []).append(kv.role.value)
        # RDMA a role's UCX_TLS names is judged with its UCX devices; the rest on its own.
        if engine.rdma is not None and not (ucx is not None and _rdma_transports(ucx)):
            rdma.setdefault(rdma_fabric(engine), []).append(kv.role.value if kv else "the engine")
    outcomes = [(" and ".join(names), judge(facts, host)) for facts, names in roles.items()]
    outcomes += [
        (f"{' and '.join(names)} over RDMA", judge_rdma(facts, host)) for facts, names in rdma.items()
    ]
    version = ucx_version(ctx)
    worst = max((o for _who, o in outcomes), key=lambda o: SEVERITY[o.status])
    if len(outcomes) == 1:
        said = f"{outcomes[0][0]}: {outcomes[0][1].message}"
    else:
        said = "; ".join(f"{who}: {o.message}" for who, o in outcomes)
    return dataclasses.replace(worst, message=said + (f"; {version}" if version else ""))


def role_fabric(engine: Deployment) -> RoleFabric:
    """The UCX variables the role's engine runs with (the adapter's environment) and their sources."""
    assert engine.kv_transfer is not None
    env = build_invocation(engine).env_dict
    provenance, role = engine.plan.provenance, engine.kv_transfer.role.value
    platform = engine.vendor.platform
    # The adapter writes UCX_TLS from the role's KvTransfer, over any env.
    default = f"the {platform.value} default (m31ctl/plan/disaggregation.py UCX_TRANSPORTS)"
    # UCX_TLS: the setting, else RDMA's (fabric.rdma), else the platform's.
    keys: tuple[str, ...] = ("disaggregation.ucx_transports", RDMA_SETTING)
    transports = _value(env.get(TRANSPORTS_VAR), provenance, keys, default)._replace(var=TRANSPORTS_VAR)
    # UCX_NET_DEVICES: the setting, else fabric.rdma's ports, else the role's env, else the plan's.
    keys = (
        "disaggregation.ucx_net_devices",
        f"{RDMA_SETTING}.devices",
        f"disaggregation.{role}.env.{DEVICES_VAR}",
        f"runtime.env.{DEVICES_VAR}",
    )
    devices = _value(env.get(DEVICES_VAR), provenance, keys, "unset")
    return RoleFabric(transports, devices, platform)


def _value(text: str | None, provenance: Mapping[str, Source], keys: tuple[str, ...], default: str) -> Value:
    """The value and the first of `keys` (in the adapter's precedence) a layer of the plan set
    (the key itself or one under it: fabric.rdma is set by its fields)."""
    for key in keys:
        found = provenance.get(key) or next(
            (source for name, source in sorted(provenance.items()) if name.startswith(f"{key}.")), None
        )
        if found is not None:
            return Value(text, key, str(found))
    return Value(text, keys[0], default)


class RdmaFabric(NamedTuple):
    """What an engine's RDMA (Deployment.rdma, from fabric.rdma) asks of this host."""

    devices: tuple[str, ...]  # HCA ports; (): any ACTIVE one
    source: str


def rdma_fabric(engine: Deployment) -> RdmaFabric:
    assert engine.rdma is not None
    value = _value(None, engine.plan.provenance, (RDMA_SETTING,), "unset")
    return RdmaFabric(engine.rdma.devices, value.source)


def judge_rdma(facts: RdmaFabric, host: HostFabric) -> Outcome:
    """fabric.rdma on this host: each HCA port it names ACTIVE (naming none: some ACTIVE port),
    and the verbs device nodes the engine's container is given."""
    shown = f"{RDMA_SETTING} ({facts.source})"
    fix = f"name ports this host has (`ibv_devinfo` lists them): --set {RDMA_SETTING}.devices=[...]"
    found = [f for f in (_rdma_port(port, fix, host) for port in facts.devices) if f is not None]
    active = host.active_ports()
    if not facts.devices and not active:
        found.append(
            FabricProblem(
                "this host has no ACTIVE RDMA port (/sys/class/infiniband)",
                f"bring an HCA's link up (`ibstat`), or unset {RDMA_SETTING} where the hosts have no RDMA",
            )
        )
    if not host.uverbs():
        found.append(
            FabricProblem(
                "/dev/infiniband/uverbs* is absent here",
                "load the verbs driver (modprobe ib_uverbs); the containers get /dev/infiniband",
            )
        )
    if found:
        return Outcome(CheckStatus.FAIL, f"{shown}: " + "; ".join(f.problem for f in found), found[0].remedy)
    ports = ", ".join(facts.devices or active)
    return Outcome(CheckStatus.OK, f"{shown}: {ports} ACTIVE, verbs devices present")


def _rdma_transports(facts: RoleFabric) -> list[str]:
    """The RDMA transports (and aliases) the role's UCX_TLS names."""
    transports = sorted({name.split(":", 1)[0] for name in _listed(facts.transports.text)})
    return [name for name in transports if name in TRANSPORTS and TRANSPORTS[name].rdma]


def judge(facts: RoleFabric, host: HostFabric) -> Outcome:
    """One role's fabric: its findings, each under the variable (and its source) it concerns,
    the first one's fix as the remedy; or what it found."""
    named = _listed(facts.devices.text)
    transports = sorted({name.split(":", 1)[0] for name in _listed(facts.transports.text)})
    rdma = _rdma_transports(facts)
    found: list[tuple[Value, FabricProblem]] = [
        (facts.devices, f) for f in _devices(named, facts.devices, host)
    ]
    if rdma:
        found += [(facts.transports, f) for f in _rdma(rdma, facts, named, host)]
    found += [(facts.transports, f) for f in _gpus(transports, facts)]
    if found:
        said = [
            f"{_shown(value)}: " + "; ".join(f.problem for v, f in found if v is value)
            for value in (facts.devices, facts.transports)
            if any(v is value for v, _f in found)
        ]
        return Outcome(CheckStatus.FAIL, "; ".join(said), found[0][1].remedy)
    if named:
        where = f"{_shown(facts.devices)} on this host"
    else:
        where = f"{DEVICES_VAR}={facts.devices.text or '(unset)'}: UCX picks among this host's devices"
    over = f", RDMA over {', '.join(_usable(named, host))}" if rdma else ""
    return Outcome(CheckStatus.OK, f"{_shown(facts.transports)}; {where}{over}")


def _listed(text: str | None) -> list[str]:
    """A UCX list's names; an unset list, `all`, or a deny list (`^...`) names none the host must have."""
    names = [part.strip() for part in (text or "").split(",") if part.strip()]
    if not names or names == ["all"] or names[0].startswith("^"):
        return []
    return names


def _shown(value: Value) -> str:
    """`UCX_TLS=rc,tcp (disaggregation.ucx_transports, --set #1)`: the value and its source."""
    return f"{value.var}={value.text} ({value.setting}, {value.source})"


class FabricProblem(NamedTuple):
    problem: str
    remedy: str


def _devices(named: list[str], value: Value, host: HostFabric) -> list[FabricProblem]:
    """Each device UCX_NET_DEVICES names: a network interface here, or an RDMA port here and ACTIVE."""
    fix = f"name devices this host has (`ucx_info -d` lists them): --set {value.setting}=..."
    found = []
    for device in named:
        finding = _rdma_port(device, fix, host) if ":" in device else _interface(device, value, fix, host)
        if finding is not None:
            found.append(finding)
    return found


def _interface(device: str, value: Value, fix: str, host: HostFabric) -> FabricProblem | None:
    if device in host.net_devices():
        return None
    if device in host.rdma_devices():
        ports = host.rdma_ports(device)
        return FabricProblem(
            f"{device} is an RDMA device, which UCX names with its port",
            f"--set {value.setting}={device}:{ports[0] if ports else 1}",
        )
    listed = ", ".join(host.net_devices()) or "none"
    return FabricProblem(f"no network interface {device} on this host (/sys/class/net: {listed})", fix)


def _rdma_port(device: str, fix: str, host: HostFabric) -> FabricProblem | None:
    """`mlx5_0:1`: the device's port is here and its link ACTIVE."""
    name, port = device.split(":", 1)
    state = host.port_state(name, port)
    if state is not None and ACTIVE in state:
        return None
    if state is not None:
        return FabricProblem(
            f"{device} is {state!r}, not ACTIVE",
            f"bring the link up (`ibstat {name}` shows it: cable, switch, subnet manager), or {fix}",
        )
    if name in host.rdma_devices():
        ports = ", ".join(host.rdma_ports(name)) or "none"
        return FabricProblem(f"{name} has no port {port} (its ports: {ports})", fix)
    listed = ", ".join(host.rdma_devices()) or "none"
    return FabricProblem(f"no RDMA device {name} on this host (/sys/class/infiniband: {listed})", fix)


def _rdma(rdma: list[str], facts: RoleFabric, named: list[str], host: HostFabric) -> list[FabricProblem]:
    """An RDMA transport needs an ACTIVE port UCX may use, and the verbs devices to open it."""
    found: list[FabricProblem] = []
    what = f"RDMA transport{'s' if len(rdma) > 1 else ''} {', '.join(rdma)}"
    need = "need" if len(rdma) > 1 else "needs"
    drop = f"drop {what} (--set {facts.transports.setting}=...) or run where RDMA is up"
    if not _usable(named, host):
        listed = ", ".join(host.active_ports()) or "none"
        where = f"{DEVICES_VAR} names none" if named else "this host has none"
        found.append(
            FabricProblem(f"{what} {need} an ACTIVE RDMA port, and {where} (ACTIVE: {listed})", drop)
        )
    if not host.uverbs():
        found.append(
            FabricProblem(
                f"{what} {need} /dev/infiniband/uverbs*, absent here",
                "load the verbs driver (modprobe ib_uverbs) and hand /dev/infiniband to the engine's "
                f"container (--device /dev/infiniband), or {drop}",
            )
        )
    return found


def _usable(named: list[str], host: HostFabric) -> list[str]:
    """The ACTIVE RDMA ports UCX may use: those UCX_NET_DEVICES names, else all."""
    return [port for port in host.active_ports() if port in named or not named]


def _gpus(transports: list[str], facts: RoleFabric) -> list[FabricProblem]:
    """A GPU transport moves that vendor's GPU memory: the plan's GPUs must be that vendor's."""
    found = []
    for name in transports:
        need = TRANSPORTS.get(name)
        if need is None or need.gpus is None or need.gpus is facts.gpus:
            continue
        found.append(
            FabricProblem(
                f"{name} moves {_GPU_MAKER[need.gpus]} GPU memory, but the plan runs on {facts.gpus.value}",
                f"--set {facts.transports.setting}={UCX_TRANSPORTS[facts.gpus]} (the {facts.gpus.value} default)",
            )
        )
    return found


_VERSION = re.compile(r"version\s*[:=]?\s*(\d+\.\d+(?:\.\d+)?)", re.IGNORECASE)


def ucx_version(ctx: CheckContext) -> str:
    """UCX's version from `ucx_info -v`, where the host has it; "" where not (UCX is the image's)."""
    try:
        result = ctx.run(["ucx_info", "-v"])
    except ProbeUnavailable:
        return ""
    found = _VERSION.search(result.stdout) if result.returncode == 0 else None
    return f"this host's ucx_info reports UCX {found.group(1)}" if found else ""
