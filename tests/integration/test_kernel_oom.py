"""A rank the kernel's OOM killer ends is told apart from one killed by SIGKILL for another reason: the
SDK's ``oom_kernel`` fault puts a real process under a real memory cgroup limit, the kernel kills it, and the
agent's kernel-log reader names the pid (needs root and a memory cgroup controller, as CI has)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from keel.agent.inspector import classify_exit
from keel.agent.oom_kills import KernelOomLog, oom_killed_pids
from keel.agent.supervisor import remove_injected_oom_cgroup
from keel.protocol.processes import injected_oom_cgroup_name, memory_cgroup_path

RANK = 7

OOM_CHILD = f"""
import os
from keel.protocol.processes import injected_oom_cgroup_name
from keel.sdk.session import _injected_kernel_oom
_injected_kernel_oom(injected_oom_cgroup_name({RANK}, os.getpid()))
"""


def test_the_kernel_oom_line_names_the_pid_system_wide_or_in_a_cgroup() -> None:
    lines = ["6,2311,177069766,-;Memory cgroup out of memory: Killed process 5866 (python3) total-vm:229608kB",
             "3,12,5,-;Out of memory: Killed process 17 (pt_main_thread) total-vm:1kB",
             "6,1,1,-;oom-kill:constraint=CONSTRAINT_MEMCG,task=python3,pid=5866"]
    assert oom_killed_pids(lines) == {5866, 17}


def test_a_rank_over_its_cgroup_memory_limit_is_killed_by_the_kernel_and_named_an_oom_kill() -> None:
    kernel_log = KernelOomLog()
    assert kernel_log.readable, "/dev/kmsg must be readable (root) for the agent to see OOM kills"
    child = subprocess.run([sys.executable, "-c", OOM_CHILD], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert "now runs in" in child.stderr and "limit 64 MiB" in child.stderr
    # the pid: the child printed its cgroup's path, which ends in keel-oom-r7-<pid>
    line = next(x for x in child.stderr.splitlines() if "now runs in" in x)
    pid = int(line.split(f"keel-oom-r{RANK}-")[1].split()[0])
    assert kernel_log.was_oom_killed(pid, wait_s=2.0) is True
    classification, error_type, reason = classify_exit(None, "SIGKILL", child.stderr, oom_killed=True)
    assert (classification, error_type) == ("infrastructure", "OOM killed") and "OOM killer" in reason
    path = memory_cgroup_path(injected_oom_cgroup_name(RANK, pid))
    assert os.path.isdir(path)
    remove_injected_oom_cgroup(RANK, pid)  # what the supervisor does when the rank is gone
    assert not os.path.exists(path)
    kernel_log.close()


def test_a_plain_sigkill_is_not_an_oom_kill() -> None:
    kernel_log = KernelOomLog()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.kill()
    assert child.wait(10) == -signal.SIGKILL
    assert kernel_log.was_oom_killed(child.pid, wait_s=0.3) is False
    remove_injected_oom_cgroup(RANK, child.pid)  # nothing there: nothing done, no error
    kernel_log.close()


def test_an_unreadable_kernel_log_says_unknown(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kernel_log = KernelOomLog(str(tmp_path / "no-kmsg"))
    assert not kernel_log.readable and kernel_log.was_oom_killed(1) is None
