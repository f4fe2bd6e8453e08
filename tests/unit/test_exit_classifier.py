"""Exit classification on real traceback texts (tests/fixtures/inspector/tracebacks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from keel.agent.inspector.exits import classify_exit, is_user_file, parse_traceback

TRACEBACKS = Path(__file__).parents[1] / "fixtures" / "inspector" / "tracebacks"
USER = ["/home/alice/llm", "/work/job"]


def tb(name: str) -> str:
    return (TRACEBACKS / name).read_text()


def test_success() -> None:
    assert classify_exit(0, None, "", USER)[0] == "success"


def test_user_typeerror_in_train_code_is_user_code() -> None:
    cls, error_type, reason = classify_exit(1, None, tb("user_typeerror.txt"), USER)
    assert (cls, error_type) == ("user_code", "TypeError")
    assert "/home/alice/llm/data.py:33" in reason and "collate" in reason


def test_error_raised_inside_torch_distributed_is_not_blamed_on_the_user() -> None:
    cls, error_type, reason = classify_exit(1, None, tb("torch_internal_valueerror.txt"), USER)
    assert (cls, error_type) == ("unknown", "ValueError")
    assert "distributed_c10d.py" in reason and "called from /home/alice/llm/train.py:150" in reason


def test_gloo_connectfullmesh_with_rank_prefixes_is_infrastructure() -> None:
    cls, error_type, reason = classify_exit(1, None, tb("gloo_connectfullmesh.txt"), USER)
    assert (cls, error_type) == ("infrastructure", "Gloo connectFullMesh failed")
    assert "RuntimeError" in reason


def test_nccl_error_is_infrastructure() -> None:
    cls, error_type, _ = classify_exit(1, None, tb("nccl_system_error.txt"), USER)
    assert (cls, error_type) == ("infrastructure", "NCCL error")


def test_memoryerror_even_in_user_code_is_infrastructure() -> None:
    cls, error_type, _ = classify_exit(1, None, tb("memoryerror.txt"), USER)
    assert (cls, error_type) == ("infrastructure", "MemoryError")


def test_cuda_oom_is_infrastructure() -> None:
    assert classify_exit(1, None, tb("cuda_oom.txt"), USER)[:2] == ("infrastructure", "CUDA out of memory")


def test_user_exception_chained_on_an_nccl_timeout_is_still_infrastructure() -> None:
    cls, error_type, reason = classify_exit(1, None, tb("chained_nccl_timeout.txt"), USER)
    assert (cls, error_type) == ("infrastructure", "ProcessGroup timeout")
    assert "raised as TrainingStepError" in reason


def test_chained_user_errors_use_the_last_exception() -> None:
    parsed = parse_traceback(tb("chained_user_keyerror.txt"))
    assert [e.type for e in parsed.chain] == ["KeyError", "AttributeError"]
    assert parsed.final is not None and parsed.final.innermost is not None
    assert parsed.final.innermost.file == "/home/alice/llm/config.py" and parsed.final.innermost.line == 22
    assert classify_exit(1, None, tb("chained_user_keyerror.txt"), USER)[:2] == ("user_code", "AttributeError")


def test_two_unrelated_tracebacks_only_the_last_counts() -> None:
    text = tb("nccl_system_error.txt") + "\nrestarting...\n" + tb("user_typeerror.txt")
    assert classify_exit(1, None, text, USER)[:2] == ("user_code", "TypeError")


def test_device_side_assert_is_user_code() -> None:
    assert classify_exit(1, None, tb("device_side_assert.txt"), USER)[:2] == ("user_code", "CUDA device-side assert")


def test_c10_abort_without_python_traceback() -> None:
    cls, error_type, reason = classify_exit(-6, None, tb("c10_abort_no_traceback.txt"), USER)
    assert (cls, error_type) == ("infrastructure", "NCCL error")
    assert "SIGABRT" in reason


@pytest.mark.parametrize("code,sig", [(-9, None), (None, "SIGKILL"), (137, None), (None, 9), (None, "KILL")])
def test_sigkill_is_infrastructure(code: int | None, sig: str | int | None) -> None:
    cls, error_type, reason = classify_exit(code, sig, "", USER)
    assert (cls, error_type) == ("infrastructure", "SIGKILL")
    assert "OOM killer" in reason


def test_oom_killed_flag_and_sigbus() -> None:
    assert classify_exit(-9, None, "", USER, oom_killed=True)[:2] == ("infrastructure", "OOM killed")
    assert classify_exit(None, "SIGBUS", "Bus error (core dumped)", USER)[:2] == ("infrastructure", "SIGBUS")


def test_segfault_and_bare_exit_are_unknown() -> None:
    assert classify_exit(-11, None, "", USER)[:2] == ("unknown", "SIGSEGV")
    cls, error_type, reason = classify_exit(3, None, "bye\n", USER)
    assert (cls, error_type) == ("unknown", "") and "exit code 3" in reason


def test_user_file_rules() -> None:
    assert is_user_file("train.py", [])
    assert is_user_file("/home/alice/llm/train.py", USER)
    assert not is_user_file("/home/bob/other.py", USER)
    assert not is_user_file("/opt/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", [])
    assert not is_user_file("/usr/lib/python3.11/json/decoder.py", [])
    assert not is_user_file("<frozen runpy>", [])
