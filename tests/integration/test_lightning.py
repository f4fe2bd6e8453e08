"""PyTorch Lightning under Keel (issue 19, item 4), with the real Lightning on CPU: ``KeelCallback`` snapshots the
whole Lightning checkpoint every step into shared-memory slots, and a job SIGKILLed at a random step resumes from
them bitwise (every later step's loss and the final weights equal an uninterrupted run's, across epoch
boundaries and validations, with a loader that augments from the global RNG in the main process or in worker
processes, and with a stream without a length, which Lightning fetches one batch ahead of the one it trains), and a
DDP job of two ranks under ``keel run`` resumes bitwise after one rank is SIGKILLed. What the callback cannot capture is refused with a ``CheckpointError`` that says what to do."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keel.infra.embedded import free_port

pytestmark = pytest.mark.integration

pl = pytest.importorskip("lightning.pytorch", reason="the tests' environment installs lightning (make install)")

_ROOT = Path(__file__).resolve().parents[2]
_JOB = _ROOT / "tests" / "fixtures" / "lightning_job.py"
_STEPS = 20  # 8 batches an epoch: two epoch ends, each with a validation


def _env(ckpt_dir: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(_ROOT)})
    if ckpt_dir is not None:
        env["KEEL_CKPT_DIR"] = str(ckpt_dir)
    return env


def _run(args: list[str], ckpt_dir: Path | None) -> list[str]:
    done = subprocess.run([sys.executable, str(_JOB), "--steps", str(_STEPS), *args], env=_env(ckpt_dir),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.splitlines()


def _marked(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith(("STEP ", "FINAL "))]


@pytest.mark.parametrize("args", [["--workers", "0"], ["--workers", "2"], ["--iterable"]],
                         ids=["main-process augmentation", "2 loader workers", "a stream Lightning fetches ahead"])
def test_a_lightning_job_sigkilled_at_a_random_step_resumes_bitwise(shm: Path, args: list[str]) -> None:
    kill_after = random.Random().randint(1, _STEPS - 3)  # a different step every run; printed on failure
    reference = _marked(_run([*args, "--no-keel"], None))
    assert len(reference) == _STEPS + 1

    # Keel changes nothing in a run without faults: the same losses and weights as Lightning alone.
    assert _marked(_run(args, shm / "clean")) == reference

    slots = shm / "killed"
    proc = subprocess.Popen([sys.executable, str(_JOB), "--steps", str(_STEPS), "--step-delay-ms", "100", *args],
                            env=_env(slots),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    before: list[str] = []
    for line in proc.stdout:
        before.append(line.strip())
        if line.startswith(f"STEP {kill_after} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the job ended before step {kill_after}: {before[-5:]}"

    resumed = _run(args, slots)
    [resume] = [line for line in resumed if line.startswith("RESUME ")]
    restored = int(resume.rpartition("step-")[2])
    assert kill_after - 2 <= restored <= kill_after, (kill_after, resume)  # the newest complete slot
    after = _marked(resumed)
    assert after[0].startswith(f"STEP {restored + 1} "), (kill_after, after[:2])
    assert after == reference[restored + 1:], f"killed after step {kill_after}, restored {restored}"


def _tiny_trainer(tmp: Path, callback: pl.Callback, **kwargs: object) -> tuple[pl.Trainer, pl.LightningModule, object]:
    sys.path.insert(0, str(_JOB.parent))
    try:
        import lightning_job
    finally:
        sys.path.remove(str(_JOB.parent))
    from torch.utils.data import DataLoader

    import keel.sdk

    model = lightning_job.Regressor()
    loader = keel.sdk.ResumableLoader(DataLoader(lightning_job.NoisyPoints(0), batch_size=8))
    options = {"max_steps": 3, "accelerator": "cpu", "devices": 1, "logger": False, "enable_checkpointing": False,
               "enable_progress_bar": False, "enable_model_summary": False, "limit_val_batches": 0,
               "default_root_dir": str(tmp), **kwargs}
    return pl.Trainer(callbacks=[callback], **options), model, loader


def test_what_the_callback_cannot_capture_is_refused_and_a_forgotten_resume_path_is_named(
        shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from keel.sdk.checkpoint import CheckpointError
    from keel.sdk.lightning import KeelCallback

    for key in [k for k in os.environ if k.startswith("KEEL_")]:
        monkeypatch.delenv(key)
    # Gradients accumulated over batches are not in a snapshot: refused before the first step.
    callback = KeelCallback(ckpt_dir=str(shm / "accumulate"))
    trainer, model, loader = _tiny_trainer(tmp_path, callback, accumulate_grad_batches=2)
    with pytest.raises(CheckpointError, match="accumulate_grad_batches=2"):
        trainer.fit(model, train_dataloaders=loader, ckpt_path=callback.resume_path())
    assert not any((shm / "accumulate").glob("rank0.slot*")) or all(
        p.stat().st_size == 0 for p in (shm / "accumulate").glob("rank0.slot*"))

    # A run that snapshots, then a second fit over the same slots that forgets resume_path(): named, not silently
    # started over.
    first = KeelCallback(ckpt_dir=str(shm / "resume"))
    trainer, model, loader = _tiny_trainer(tmp_path, first)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=first.resume_path())
    assert sorted(p.name for p in (shm / "resume").glob("rank0.slot*")) == ["rank0.slot0", "rank0.slot1"]
    second = KeelCallback(ckpt_dir=str(shm / "resume"))
    trainer, model, loader = _tiny_trainer(tmp_path, second)
    with pytest.raises(CheckpointError, match=r"pass ckpt_path=keel_callback.resume_path\(\)"):
        trainer.fit(model, train_dataloaders=loader)
    # And a path that is not the restored one is refused by the checkpoint IO, naming what to do.
    third = KeelCallback(ckpt_dir=str(shm / "resume"))
    assert third.resume_path() == "keel-restore:step-2"
    trainer, model, loader = _tiny_trainer(tmp_path, third, max_steps=5)
    with pytest.raises(CheckpointError, match="no Keel snapshot was restored for it"):
        trainer.fit(model, train_dataloaders=loader, ckpt_path="keel-restore:step-1")


def _keel_run(agent_dir: Path, *job_args: str) -> subprocess.Popen[str]:
    env = {**_env(None), "KEEL_HOME": str(agent_dir.parent / "home")}
    return subprocess.Popen([sys.executable, "-m", "keel.cli.main", "run", "--nproc-per-node", "2", "--master-port",
                             str(free_port()), "--max-restarts", "1", "--keel-agent-dir", str(agent_dir), str(_JOB),
                             "--steps", str(_STEPS), "--ddp", *job_args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _rank_lines(agent_dir: Path, rank: int, generation: int) -> list[str]:
    return _marked((agent_dir / "logs" / f"rank{rank}.g{generation}.stdout").read_text().splitlines())


def test_a_ddp_lightning_job_under_keel_run_resumes_bitwise_after_a_rank_is_sigkilled(scratch_dir: Path) -> None:
    """Two DDP ranks on gloo under ``keel run`` (no control plane: it restarts the node's ranks itself and plans the
    restore from the newest step both hold in memory); rank 1 SIGKILLed at a random step."""
    kill_after = random.Random().randint(1, _STEPS - 4)
    reference_dir = scratch_dir / "reference"
    reference = _keel_run(reference_dir, "--no-keel")
    _, stderr = reference.communicate(timeout=300)
    assert reference.returncode == 0, stderr[-3000:]

    agent_dir = scratch_dir / "killed"
    proc = _keel_run(agent_dir, "--step-delay-ms", "100")
    log = agent_dir / "logs" / "rank1.g0.stdout"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (log.exists() and f"STEP {kill_after} " in log.read_text()):
        time.sleep(0.05)
    pid = int(next(line for line in log.read_text().splitlines() if line.startswith("PID ")).split()[1])
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    assert "restarting" in stderr.lower() or (agent_dir / "logs" / "rank0.g1.stdout").exists(), stderr[-3000:]
    for rank in (0, 1):
        expected = _rank_lines(reference_dir, rank, 0)
        assert len(expected) == _STEPS + 1
        resumed = _rank_lines(agent_dir, rank, 1)
        restored = int(resumed[0].split()[1]) - 1
        assert kill_after - 2 <= restored <= kill_after, (rank, kill_after, resumed[:1])
        assert resumed == expected[restored + 1:], f"rank {rank}: killed after step {kill_after}, restored {restored}"
