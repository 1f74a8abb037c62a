from specdec.rpc.v1 import gateway_pb2 as _gateway_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _gateway_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_gateway_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TokenResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage", "forced_acceptance", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FORCED_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: _gateway_pb2.Usage
    forced_acceptance: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_gateway_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[_gateway_pb2.Usage, _Mapping]] = ..., forced_acceptance: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_gateway_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("free_kv_blocks", "total_kv_blocks", "free_gdn_slots", "total_gdn_slots", "running", "waiting", "drafter_connected", "drafter_kind", "drafter_fallbacks", "mean_acceptance_length", "verify_steps", "draft_tokens", "accepted_tokens", "transport", "in_flight", "engine_alive", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_checkpoints", "prefix_cache_blocks")
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_GDN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_GDN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KIND_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    free_kv_blocks: int
    total_kv_blocks: int
    free_gdn_slots: int
    total_gdn_slots: int
    running: int
    waiting: int
    drafter_connected: bool
    drafter_kind: str
    drafter_fallbacks: int
    mean_acceptance_length: float
    verify_steps: int
    draft_tokens: int
    accepted_tokens: int
    transport: str
    in_flight: int
    engine_alive: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_checkpoints: int
    prefix_cache_blocks: int
    def __init__(self, free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., free_gdn_slots: _Optional[int] = ..., total_gdn_slots: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., drafter_connected: _Optional[bool] = ..., drafter_kind: _Optional[str] = ..., drafter_fallbacks: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., verify_steps: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., transport: _Optional[str] = ..., in_flight: _Optional[int] = ..., engine_alive: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_checkpoints: _Optional[int] = ..., prefix_cache_blocks: _Optional[int] = ...) -> None: ...
