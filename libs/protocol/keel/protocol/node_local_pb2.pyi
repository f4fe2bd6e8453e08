from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_SETUP: _ClassVar[Phase]
    PHASE_STEP: _ClassVar[Phase]
    PHASE_CHECKPOINT: _ClassVar[Phase]
    PHASE_EVAL: _ClassVar[Phase]
    PHASE_DONE: _ClassVar[Phase]
    PHASE_FAILED: _ClassVar[Phase]
PHASE_UNSPECIFIED: Phase
PHASE_SETUP: Phase
PHASE_STEP: Phase
PHASE_CHECKPOINT: Phase
PHASE_EVAL: Phase
PHASE_DONE: Phase
PHASE_FAILED: Phase

class RankReport(_message.Message):
    __slots__ = ("job_id", "node_id", "rank", "local_rank", "pid", "generation", "seq", "sent_at_unix_s", "phase", "step", "step_time_s", "loss", "grad_norm", "tokens_per_s", "error", "checkpoint_step", "checkpoint_groups_json", "compute_time_s", "collective_seq", "collective_wait_s", "collective", "collective_wait_max_s", "checkpoint_blocking_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_GROUPS_JSON_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_SEQ_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAIT_MAX_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_BLOCKING_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node_id: str
    rank: int
    local_rank: int
    pid: int
    generation: int
    seq: int
    sent_at_unix_s: float
    phase: Phase
    step: int
    step_time_s: float
    loss: float
    grad_norm: float
    tokens_per_s: float
    error: str
    checkpoint_step: int
    checkpoint_groups_json: str
    compute_time_s: float
    collective_seq: int
    collective_wait_s: float
    collective: str
    collective_wait_max_s: float
    checkpoint_blocking_s: float
    def __init__(self, job_id: _Optional[str] = ..., node_id: _Optional[str] = ..., rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., generation: _Optional[int] = ..., seq: _Optional[int] = ..., sent_at_unix_s: _Optional[float] = ..., phase: _Optional[_Union[Phase, str]] = ..., step: _Optional[int] = ..., step_time_s: _Optional[float] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., error: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., checkpoint_groups_json: _Optional[str] = ..., compute_time_s: _Optional[float] = ..., collective_seq: _Optional[int] = ..., collective_wait_s: _Optional[float] = ..., collective: _Optional[str] = ..., collective_wait_max_s: _Optional[float] = ..., checkpoint_blocking_s: _Optional[float] = ...) -> None: ...
