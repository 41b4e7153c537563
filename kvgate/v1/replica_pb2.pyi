from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WatchStateRequest(_message.Message):
    __slots__ = ("include_kv_events", "min_interval_ms", "max_interval_ms")
    INCLUDE_KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    include_kv_events: bool
    min_interval_ms: int
    max_interval_ms: int
    def __init__(self, include_kv_events: _Optional[bool] = ..., min_interval_ms: _Optional[int] = ..., max_interval_ms: _Optional[int] = ...) -> None: ...

class GetStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("replica_id", "model", "seq", "wall_time_unix_ns", "process_start_unix_ns", "num_requests_waiting", "num_requests_running", "num_kv_blocks_free", "num_kv_blocks_total", "block_size_tokens", "adapters_loaded", "prefix_cache_queried_tokens_total", "prefix_cache_hit_tokens_total", "draining", "kv_events")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_START_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    model: str
    seq: int
    wall_time_unix_ns: int
    process_start_unix_ns: int
    num_requests_waiting: int
    num_requests_running: int
    num_kv_blocks_free: int
    num_kv_blocks_total: int
    block_size_tokens: int
    adapters_loaded: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_queried_tokens_total: int
    prefix_cache_hit_tokens_total: int
    draining: bool
    kv_events: _containers.RepeatedCompositeFieldContainer[KvBlockEvent]
    def __init__(self, replica_id: _Optional[str] = ..., model: _Optional[str] = ..., seq: _Optional[int] = ..., wall_time_unix_ns: _Optional[int] = ..., process_start_unix_ns: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., num_requests_running: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., adapters_loaded: _Optional[_Iterable[str]] = ..., prefix_cache_queried_tokens_total: _Optional[int] = ..., prefix_cache_hit_tokens_total: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_events: _Optional[_Iterable[_Union[KvBlockEvent, _Mapping]]] = ...) -> None: ...

class KvBlockEvent(_message.Message):
    __slots__ = ("stored", "removed", "all_cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KvBlocksStored
    removed: KvBlocksRemoved
    all_cleared: KvBlocksAllCleared
    def __init__(self, stored: _Optional[_Union[KvBlocksStored, _Mapping]] = ..., removed: _Optional[_Union[KvBlocksRemoved, _Mapping]] = ..., all_cleared: _Optional[_Union[KvBlocksAllCleared, _Mapping]] = ...) -> None: ...

class KvBlocksStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "adapter", "block_size_tokens")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    adapter: str
    block_size_tokens: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., adapter: _Optional[str] = ..., block_size_tokens: _Optional[int] = ...) -> None: ...

class KvBlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvBlocksAllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files", "block_size_tokens")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    block_size_tokens: int
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ..., block_size_tokens: _Optional[int] = ...) -> None: ...
