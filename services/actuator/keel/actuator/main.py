"""``keel service actuator``: carry out evictions and standby refills where the machines are
(``actuator.kind``: a local cluster, or Slurm)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from keel.actuator.adapter import ActuatorService
from keel.actuator.kubernetes import SERVICE_ACCOUNT, HttpKubeApi, KubernetesActuator
from keel.actuator.local import LocalActuator
from keel.actuator.slurm import SlurmActuator, SlurmCommands
from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main

log = logging.getLogger(__name__)


async def serve(settings: Settings, nats_url: str, cluster_dir: Path, stop: asyncio.Event,
                on_ready: Callable[[], None] = lambda: None) -> None:
    """Carry out commands on the local cluster in ``cluster_dir`` until ``stop`` is set."""
    await serve_service("actuator", lambda bus, _store: ActuatorService(bus, LocalActuator(cluster_dir)), settings,
                        nats_url, None, stop, on_ready, describe=lambda _: f"local cluster in {cluster_dir}")


def slurm_actuator(settings: Settings, job_id: str | None) -> SlurmActuator:
    """The ``slurm`` actuator from ``actuator.slurm`` (its bookkeeping under ``<home>/actuator``)."""
    slurm = settings.actuator.slurm
    return SlurmActuator(SlurmCommands(slurm.conf, timeout_s=slurm.command_timeout.total_seconds()),
                         keel_job_id=job_id or "default", state_dir=settings.home / "actuator",
                         partition=slurm.partition, allocation_job_id=slurm.job_id, workers=slurm.workers,
                         standby_command=slurm.standby_command)


def kubernetes_actuator(settings: Settings, job_id: str | None) -> KubernetesActuator:
    """The ``kubernetes`` actuator from ``actuator.kubernetes``: in the cluster by default (its service account)."""
    kube = settings.actuator.kubernetes
    timeout_s = kube.request_timeout.total_seconds()
    if kube.server:
        token_file = kube.token_file or SERVICE_ACCOUNT / "token"
        api: HttpKubeApi = HttpKubeApi(kube.server, token=lambda: token_file.read_text().strip(), ca_file=kube.ca_file,
                                       timeout_s=timeout_s)
    else:
        api = HttpKubeApi.in_cluster()
        api.timeout_s = timeout_s
    return KubernetesActuator(api, keel_job_id=job_id or "default", namespace=kube.namespace,
                              standby_deployment=kube.standby_deployment)


async def serve_scheduler(settings: Settings, nats_url: str, stop: asyncio.Event,
                      on_ready: Callable[[], None] = lambda: None, job_id: str | None = None) -> None:
    """Carry out commands on Slurm's or Kubernetes' nodes (``actuator.kind``) until ``stop`` is set."""
    actuator: SlurmActuator | KubernetesActuator
    if settings.actuator.kind == "kubernetes":
        actuator = kubernetes_actuator(settings, job_id)
        where = f"Kubernetes (standbys: {settings.actuator.kubernetes.namespace}/{settings.actuator.kubernetes.standby_deployment})"
    else:
        actuator = slurm_actuator(settings, job_id)
        where = f"Slurm (partition {settings.actuator.slurm.partition or 'default'})"
    await serve_service("actuator", lambda bus, _store: ActuatorService(bus, actuator, job_id=job_id), settings,
                        nats_url, None, stop, on_ready, describe=lambda _: where)


def main() -> int:
    """``keel-actuator``: by ``actuator.kind``, the local actuator over the cluster in ``$KEEL_CLUSTER_DIR``
    (default ``<home>/cluster``; it starts standby agents with ``keel run``, so the ``keel`` command must be
    installed beside it), or the Slurm actuator (Slurm's client commands on its host; ``$KEEL_JOB_ID``
    names the job whose standbys it keeps)."""
    import os

    from keel.cluster.local import cluster_dir

    def serve_local(settings: Settings, nats_url: str, _database_url: str, stop: asyncio.Event,
                    on_ready: Callable[[], None]) -> Coroutine[Any, Any, None]:
        if settings.actuator.kind in ("slurm", "kubernetes"):
            return serve_scheduler(settings, nats_url, stop, on_ready, job_id=os.environ.get("KEEL_JOB_ID") or None)
        return serve(settings, nats_url, cluster_dir(settings, os.environ.get("KEEL_CLUSTER_DIR")), stop, on_ready)

    return service_main("actuator", serve_local, needs_database=False)


if __name__ == "__main__":
    raise SystemExit(main())
