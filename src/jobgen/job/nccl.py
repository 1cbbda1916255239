"""NCCL's environment variables as a job sets them: what each `launch.network` preset exports and
why, the launch fields that are NCCL variables, and names NCCL never reads. `launch.socket_ifname`
is gloo's interface too (GLOO_SOCKET_IFNAME): CPU jobs and async_save's groups talk over gloo.

A variable has one setting: `environment.variables` may replace a preset's default (a site's RoCE
GID index), but a value that contradicts a launch field or what a preset is for is refused, and
an equal one is exported once (`jobgen.script.render.nccl_variables`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class NcclVariable:
    value: str
    reason: str  # one line: the comment above its export in the script (docs/nccl.md says more)
    default: bool = False  # a site's value in environment.variables replaces it


NETWORK_PRESETS: dict[str, dict[str, NcclVariable]] = {
    "auto": {},  # NCCL's own detection
    "infiniband": {
        "NCCL_IB_DISABLE": NcclVariable("0", "NCCL's InfiniBand transport (RDMA), not TCP sockets"),
    },
    "roce": {
        "NCCL_IB_DISABLE": NcclVariable("0", "NCCL's IB verbs transport over RoCE (RDMA), not TCP sockets"),
        # NVIDIA (Mellanox) NICs list each port's GIDs as RoCE v1/v2 per address: index 3 is RoCE v2
        # over IPv4, the one routed between racks. NCCL before 2.21 takes index 0 (RoCE v1,
        # link-local), which fails or stays within one switch; 2.21 and later choose by themselves.
        "NCCL_IB_GID_INDEX": NcclVariable(
            "3", "RoCE v2 over IPv4 (NCCL before 2.21 takes 0, RoCE v1, not routed); where show_gids "
            "differs, set environment.variables.NCCL_IB_GID_INDEX", default=True,
        ),
    },
    "ethernet": {
        "NCCL_IB_DISABLE": NcclVariable("1", "TCP sockets only: probing for IB devices where there are none hangs or warns"),
    },
}

# Launch fields that are NCCL variables: field -> (variable, what it is for).
LAUNCH_FIELDS = {
    "socket_ifname": ("NCCL_SOCKET_IFNAME", "the interface NCCL's bootstrap and socket transport use"),
    "nccl_debug": ("NCCL_DEBUG", "how much NCCL logs"),
}

# Names people write that NCCL does not read, and what to set instead. A table of every NCCL
# variable would warn about each one a newer NCCL adds; this one stays right for every version.
NOT_NCCL: dict[str, str] = {
    "NCCL_TIMEOUT": "NCCL has no timeout variable: a collective's timeout is the process group's; "
                    "set launch.collective_timeout_minutes",
    "NCCL_SOCKET_IFACE": "set launch.socket_ifname (NCCL_SOCKET_IFNAME)",
    "NCCL_SOCKET_INTERFACE": "set launch.socket_ifname (NCCL_SOCKET_IFNAME)",
    "NCCL_IFNAME": "set launch.socket_ifname (NCCL_SOCKET_IFNAME)",
    "NCCL_IB_GID": "set NCCL_IB_GID_INDEX",
    "NCCL_GID_INDEX": "set NCCL_IB_GID_INDEX",
    "NCCL_IB_HCAS": "set NCCL_IB_HCA",
    "NCCL_HCA": "set NCCL_IB_HCA",
    "NCCL_DEBUG_LEVEL": "set launch.nccl_debug (NCCL_DEBUG)",
    "NCCL_IB_ENABLE": "set launch.network (it sets NCCL_IB_DISABLE)",
    "NCCL_P2P_ENABLE": "set NCCL_P2P_DISABLE",
    "NCCL_NET_GDR": "set NCCL_NET_GDR_LEVEL",
}


GLOO_REASON = "the interface gloo's sockets use (CPU jobs, async_save's process groups)"


def gloo_socket_ifname(socket_ifname: Optional[str]) -> Optional[str]:
    """GLOO_SOCKET_IFNAME for launch.socket_ifname: gloo takes a comma-separated list of names but
    not NCCL's prefixes: '=' (exact names) is dropped; '^' (all but these) has no gloo form, so
    then each node finds its interface toward the master as without the field (node_setup.sh.j2)."""
    if socket_ifname is None or socket_ifname.startswith("^"):
        return None
    return socket_ifname.removeprefix("=")


def field_settings(launch: Any) -> list[tuple[str, str, str, str]]:
    """The variables launch's own fields set, gloo's interface last: (variable, value, field, reason)."""
    found = [(name, value, f"launch.{field}", reason) for field, (name, reason) in LAUNCH_FIELDS.items()
             if (value := getattr(launch, field)) is not None]
    gloo = gloo_socket_ifname(launch.socket_ifname)
    if gloo is not None:
        found.append(("GLOO_SOCKET_IFNAME", gloo, "launch.socket_ifname", GLOO_REASON))
    return found


def launch_settings(launch: Any) -> dict[str, tuple[str, str]]:
    """What the job's launch section sets: variable -> (value, the field that sets it)."""
    settings: dict[str, tuple[str, str]] = {}
    for name, variable in NETWORK_PRESETS[launch.network].items():
        if not variable.default:
            settings[name] = (variable.value, f"launch.network {launch.network}")
    for name, value, field, _ in field_settings(launch):
        settings[name] = (value, field)
    return settings


def nccl_exports(job: Any) -> dict[str, tuple[str, str]]:
    """The NCCL variables the script exports before environment.variables, and gloo's interface:
    name -> (value, a comment line saying which field asks for it and why). No NCCL variable on
    CPUs (gloo). A variable that environment.variables sets too is left to it: equal, or a preset
    default it replaces (the Job refuses a value that contradicts the rest)."""
    launch = job.launch
    exports: dict[str, tuple[str, str]] = {}
    gpus = job.resources.gpus_per_node > 0
    if gpus:
        exports.update({
            name: (variable.value, f"launch.network {launch.network}: {variable.reason}")
            for name, variable in NETWORK_PRESETS[launch.network].items()
        })
    for name, value, field, reason in field_settings(launch):
        if gpus or name == "GLOO_SOCKET_IFNAME":  # gloo's interface matters without GPUs too
            exports[name] = (value, f"{field}: {reason}")
    return {name: item for name, item in exports.items() if name not in job.environment.variables}


def conflict(launch: Any, variables: dict[str, str]) -> Optional[str]:
    """One line for a variable that environment.variables and a launch field set differently."""
    for name, (value, field) in launch_settings(launch).items():
        if name in variables and variables[name] != value:
            instead = (f"set {field}: {variables[name]} instead" if field.startswith("launch.") and " " not in field
                       else "remove it, or choose the launch.network that sets it so")
            return f"environment.variables.{name} is {variables[name]!r} but {field} sets {name} to {value!r}: {instead}"
    return None


def not_nccl_warnings(variables: dict[str, str]) -> list[str]:
    return [
        f"environment.variables.{name} is not a variable NCCL reads: {instead}"
        for name, instead in NOT_NCCL.items() if name in variables
    ]
