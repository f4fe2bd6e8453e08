"""Process names and places shared by the node agent (which sets them), the SDK and local tooling."""

import os

ZYGOTE_NAME = "keel-zygote"
"""The process name of an agent's warm-interpreter zygote (``/proc/PID/comm``); its forks are ranks."""

MEMORY_CGROUP_ROOT = "/sys/fs/cgroup"


def injected_oom_cgroup_name(rank: int, pid: int) -> str:
    """The memory cgroup an injected ``oom_kernel`` fault puts rank ``rank`` (process ``pid``) in; the
    agent removes it once the rank is gone."""
    return f"keel-oom-r{rank}-{pid}"


def memory_cgroup_path(name: str, root: str = MEMORY_CGROUP_ROOT, pid: str = "self") -> str:
    """Where cgroup ``name`` lies under process ``pid``'s memory cgroup (the v1 ``memory`` controller's
    hierarchy, else the v2 unified one). The agent passes its own pid: its ranks start in its cgroup."""
    current, v2 = "", False
    with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                current, v2 = path, False
                break
            if controllers == "":
                current, v2 = path, True
    base = os.path.join(root, "memory") if not v2 and os.path.isdir(os.path.join(root, "memory")) else root
    return os.path.join(base, current.lstrip("/"), name)
