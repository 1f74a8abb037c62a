from specdec.rpc.v1 import gateway_pb2 as _gateway_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    INLINE: _ClassVar[Transport]
    SHM: _ClassVar[Transport]
    CUDA_IPC: _ClassVar[Transport]
TRANSPORT_UNSPECIFIED: Transport
INLINE: Transport
SHM: Transport
CUDA_IPC: Transport

class DrafterInfoRequest(_message.Message):
    __slots__ = ("max_drafts", "hidden_size", "dtype", "vocab_size", "transports", "host_id", "gpu_uuid", "model_type", "vocab_fingerprint")
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    max_drafts: int
    hidden_size: int
    dtype: str
    vocab_size: int
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    host_id: str
    gpu_uuid: str
    model_type: str
    vocab_fingerprint: str
    def __init__(self, max_drafts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., host_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ...) -> None: ...

class DrafterInfoResponse(_message.Message):
    __slots__ = ("kind", "max_drafts", "hidden_size", "dtype", "vocab_size", "needs_hidden_states", "needs_shared_weights", "transports", "host_id", "gpu_uuid", "model_type", "vocab_fingerprint", "local_lane", "device_steps", "device_step_changes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    NEEDS_SHARED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LANE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_STEP_CHANGES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    max_drafts: int
    hidden_size: int
    dtype: str
    vocab_size: int
    needs_hidden_states: bool
    needs_shared_weights: bool
    transports: _containers.RepeatedScalarFieldContainer[Transport]
    host_id: str
    gpu_uuid: str
    model_type: str
    vocab_fingerprint: str
    local_lane: str
    device_steps: bool
    device_step_changes: bool
    def __init__(self, kind: _Optional[str] = ..., max_drafts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., needs_hidden_states: _Optional[bool] = ..., needs_shared_weights: _Optional[bool] = ..., transports: _Optional[_Iterable[_Union[Transport, str]]] = ..., host_id: _Optional[str] = ..., gpu_uuid: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_fingerprint: _Optional[str] = ..., local_lane: _Optional[str] = ..., device_steps: _Optional[bool] = ..., device_step_changes: _Optional[bool] = ...) -> None: ...

class TensorRef(_message.Message):
    __slots__ = ("transport", "shape", "dtype", "data", "buffer", "offset_bytes")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    data: bytes
    buffer: str
    offset_bytes: int
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., buffer: _Optional[str] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class SharedBuffer(_message.Message):
    __slots__ = ("name", "transport", "shm_path", "size_bytes", "dtype", "shape", "cuda_mem_handle", "cuda_storage_size_bytes", "cuda_storage_offset_bytes", "cuda_ref_counter_handle", "cuda_ref_counter_offset", "cuda_event_handle", "gpu_uuid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CUDA_MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    name: str
    transport: Transport
    shm_path: str
    size_bytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    cuda_mem_handle: bytes
    cuda_storage_size_bytes: int
    cuda_storage_offset_bytes: int
    cuda_ref_counter_handle: bytes
    cuda_ref_counter_offset: int
    cuda_event_handle: bytes
    gpu_uuid: str
    def __init__(self, name: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., shm_path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., cuda_mem_handle: _Optional[bytes] = ..., cuda_storage_size_bytes: _Optional[int] = ..., cuda_storage_offset_bytes: _Optional[int] = ..., cuda_ref_counter_handle: _Optional[bytes] = ..., cuda_ref_counter_offset: _Optional[int] = ..., cuda_event_handle: _Optional[bytes] = ..., gpu_uuid: _Optional[str] = ...) -> None: ...

class Setup(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[SharedBuffer]
    def __init__(self, buffers: _Optional[_Iterable[_Union[SharedBuffer, _Mapping]]] = ...) -> None: ...

class SeqInput(_message.Message):
    __slots__ = ("seq_id", "start_pos", "token_ids", "num_drafts", "grammar", "output_start")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_START_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_pos: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: int
    grammar: _gateway_pb2.Grammar
    output_start: int
    def __init__(self, seq_id: _Optional[int] = ..., start_pos: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[int] = ..., grammar: _Optional[_Union[_gateway_pb2.Grammar, _Mapping]] = ..., output_start: _Optional[int] = ...) -> None: ...

class StepInput(_message.Message):
    __slots__ = ("step", "seqs", "hidden", "release_seq_ids", "device", "prefixes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PREFIXES_FIELD_NUMBER: _ClassVar[int]
    step: int
    seqs: _containers.RepeatedCompositeFieldContainer[SeqInput]
    hidden: TensorRef
    release_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    device: DeviceStep
    prefixes: _containers.RepeatedCompositeFieldContainer[PrefixBlocks]
    def __init__(self, step: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SeqInput, _Mapping]]] = ..., hidden: _Optional[_Union[TensorRef, _Mapping]] = ..., release_seq_ids: _Optional[_Iterable[int]] = ..., device: _Optional[_Union[DeviceStep, _Mapping]] = ..., prefixes: _Optional[_Iterable[_Union[PrefixBlocks, _Mapping]]] = ...) -> None: ...

class PrefixBlocks(_message.Message):
    __slots__ = ("seq_id", "hashes", "block_size", "resumed", "checkpoint")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    resumed: int
    checkpoint: int
    def __init__(self, seq_id: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., resumed: _Optional[int] = ..., checkpoint: _Optional[int] = ...) -> None: ...

class DeviceStep(_message.Message):
    __slots__ = ("seq_ids", "start_pos", "max_shift", "chunk_lens", "num_drafts", "changes_only", "removed", "placed")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    MAX_SHIFT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_LENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    CHANGES_ONLY_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    start_pos: _containers.RepeatedScalarFieldContainer[int]
    max_shift: _containers.RepeatedScalarFieldContainer[int]
    chunk_lens: _containers.RepeatedScalarFieldContainer[int]
    num_drafts: _containers.RepeatedScalarFieldContainer[int]
    changes_only: bool
    removed: _containers.RepeatedScalarFieldContainer[int]
    placed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., start_pos: _Optional[_Iterable[int]] = ..., max_shift: _Optional[_Iterable[int]] = ..., chunk_lens: _Optional[_Iterable[int]] = ..., num_drafts: _Optional[_Iterable[int]] = ..., changes_only: _Optional[bool] = ..., removed: _Optional[_Iterable[int]] = ..., placed: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftStepRequest(_message.Message):
    __slots__ = ("setup", "step")
    SETUP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    setup: Setup
    step: StepInput
    def __init__(self, setup: _Optional[_Union[Setup, _Mapping]] = ..., step: _Optional[_Union[StepInput, _Mapping]] = ...) -> None: ...

class SeqDrafts(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftStepResponse(_message.Message):
    __slots__ = ("step", "drafts", "drafter_ms", "missing_seq_ids", "draft_counts")
    STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MS_FIELD_NUMBER: _ClassVar[int]
    MISSING_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    drafts: _containers.RepeatedCompositeFieldContainer[SeqDrafts]
    drafter_ms: float
    missing_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[SeqDrafts, _Mapping]]] = ..., drafter_ms: _Optional[float] = ..., missing_seq_ids: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
