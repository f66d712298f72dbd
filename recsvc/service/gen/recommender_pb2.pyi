from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodingMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNSPECIFIED: _ClassVar[DecodingMode]
    STRICT_SPECULATIVE: _ClassVar[DecodingMode]
    RELAXED_SPECULATIVE: _ClassVar[DecodingMode]
    PLAIN: _ClassVar[DecodingMode]
    POPULARITY: _ClassVar[DecodingMode]
    SAMPLING: _ClassVar[DecodingMode]
UNSPECIFIED: DecodingMode
STRICT_SPECULATIVE: DecodingMode
RELAXED_SPECULATIVE: DecodingMode
PLAIN: DecodingMode
POPULARITY: DecodingMode
SAMPLING: DecodingMode

class RecommendRequest(_message.Message):
    __slots__ = ("user_id", "history", "k", "mode", "exclude_items", "exclude_history", "temperature", "seed", "rules", "history_keys", "exclude_keys")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_ITEMS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_KEYS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_KEYS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    history: _containers.RepeatedScalarFieldContainer[int]
    k: int
    mode: DecodingMode
    exclude_items: _containers.RepeatedScalarFieldContainer[int]
    exclude_history: bool
    temperature: float
    seed: int
    rules: Rules
    history_keys: _containers.RepeatedScalarFieldContainer[str]
    exclude_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, user_id: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., mode: _Optional[_Union[DecodingMode, str]] = ..., exclude_items: _Optional[_Iterable[int]] = ..., exclude_history: _Optional[bool] = ..., temperature: _Optional[float] = ..., seed: _Optional[int] = ..., rules: _Optional[_Union[Rules, _Mapping]] = ..., history_keys: _Optional[_Iterable[str]] = ..., exclude_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class Rules(_message.Message):
    __slots__ = ("max_per", "allow", "deny", "boosts")
    MAX_PER_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    DENY_FIELD_NUMBER: _ClassVar[int]
    BOOSTS_FIELD_NUMBER: _ClassVar[int]
    max_per: _containers.RepeatedCompositeFieldContainer[MaxPer]
    allow: _containers.RepeatedCompositeFieldContainer[ValueFilter]
    deny: _containers.RepeatedCompositeFieldContainer[ValueFilter]
    boosts: _containers.RepeatedCompositeFieldContainer[Boost]
    def __init__(self, max_per: _Optional[_Iterable[_Union[MaxPer, _Mapping]]] = ..., allow: _Optional[_Iterable[_Union[ValueFilter, _Mapping]]] = ..., deny: _Optional[_Iterable[_Union[ValueFilter, _Mapping]]] = ..., boosts: _Optional[_Iterable[_Union[Boost, _Mapping]]] = ...) -> None: ...

class MaxPer(_message.Message):
    __slots__ = ("attribute", "m")
    ATTRIBUTE_FIELD_NUMBER: _ClassVar[int]
    M_FIELD_NUMBER: _ClassVar[int]
    attribute: str
    m: int
    def __init__(self, attribute: _Optional[str] = ..., m: _Optional[int] = ...) -> None: ...

class ValueFilter(_message.Message):
    __slots__ = ("attribute", "values")
    ATTRIBUTE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    attribute: str
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, attribute: _Optional[str] = ..., values: _Optional[_Iterable[str]] = ...) -> None: ...

class Boost(_message.Message):
    __slots__ = ("attribute", "value", "weight")
    ATTRIBUTE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    attribute: str
    value: str
    weight: float
    def __init__(self, attribute: _Optional[str] = ..., value: _Optional[str] = ..., weight: _Optional[float] = ...) -> None: ...

class RecommendedItem(_message.Message):
    __slots__ = ("item_id", "score", "semantic_id", "key")
    ITEM_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    SEMANTIC_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    item_id: int
    score: float
    semantic_id: _containers.RepeatedScalarFieldContainer[str]
    key: str
    def __init__(self, item_id: _Optional[int] = ..., score: _Optional[float] = ..., semantic_id: _Optional[_Iterable[str]] = ..., key: _Optional[str] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("target_forward_calls", "accepted_steps", "server_ms", "batch_size", "draft_forward_calls", "mode", "requested_mode", "beam_width", "draft_beams", "gamma", "mode_fallback_reason")
    TARGET_FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SERVER_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_MODE_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_BEAMS_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    MODE_FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    target_forward_calls: int
    accepted_steps: int
    server_ms: float
    batch_size: int
    draft_forward_calls: int
    mode: DecodingMode
    requested_mode: DecodingMode
    beam_width: int
    draft_beams: int
    gamma: int
    mode_fallback_reason: str
    def __init__(self, target_forward_calls: _Optional[int] = ..., accepted_steps: _Optional[int] = ..., server_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., draft_forward_calls: _Optional[int] = ..., mode: _Optional[_Union[DecodingMode, str]] = ..., requested_mode: _Optional[_Union[DecodingMode, str]] = ..., beam_width: _Optional[int] = ..., draft_beams: _Optional[int] = ..., gamma: _Optional[int] = ..., mode_fallback_reason: _Optional[str] = ...) -> None: ...

class RecommendResponse(_message.Message):
    __slots__ = ("items", "stats", "fallback_reason")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RecommendedItem]
    stats: Stats
    fallback_reason: str
    def __init__(self, items: _Optional[_Iterable[_Union[RecommendedItem, _Mapping]]] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., fallback_reason: _Optional[str] = ...) -> None: ...

class RecordInteractionsRequest(_message.Message):
    __slots__ = ("user_id", "item_ids", "item_keys")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEM_KEYS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    item_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, user_id: _Optional[str] = ..., item_ids: _Optional[_Iterable[int]] = ..., item_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class RecordInteractionsResponse(_message.Message):
    __slots__ = ("history_length",)
    HISTORY_LENGTH_FIELD_NUMBER: _ClassVar[int]
    history_length: int
    def __init__(self, history_length: _Optional[int] = ...) -> None: ...

class GetHistoryRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class GetHistoryResponse(_message.Message):
    __slots__ = ("item_ids", "item_keys")
    ITEM_IDS_FIELD_NUMBER: _ClassVar[int]
    ITEM_KEYS_FIELD_NUMBER: _ClassVar[int]
    item_ids: _containers.RepeatedScalarFieldContainer[int]
    item_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, item_ids: _Optional[_Iterable[int]] = ..., item_keys: _Optional[_Iterable[str]] = ...) -> None: ...
