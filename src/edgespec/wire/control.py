"""Typed control messages: one model per op a node serves, and per answer the head reads
(docs/design.md 5.6).

A CONTROL frame's META is ``{"op": op, **fields}``; its REPLY's META is ``{"ok": true,
**fields}``. The bytes are the same as when both were free-form dicts; what changed is that
both ends now hold them to a schema, with the strictness of the data frames
(``edgespec.wire.codec``): a missing field, a field of the wrong type or a field the op does
not know is a ``ControlError`` naming the field, which the node answers as an ERROR with code
``bad_request`` (an op it does not serve: ``unknown_op``) and goes on serving. A malformed
request never reaches a handler, so it can never look like a lost node.

The models are pydantic models (forbidding extra fields; ints, strings and booleans strict),
because pydantic is made for exactly this: declared types, checked on the way in, a readable
error that names the field, ``model_dump`` on the way out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
)

from edgespec.wire.codec import FieldTag, Message
from edgespec.wire.header import Flag, Kind, WireError

#: Largest batch the profile op times (a tree lap's batch is at most the tree budget).
PROFILE_MAX_BATCH = 256
#: Hidden-state encodings a ring may be loaded with (``edgespec.wire.codec.HIDDEN_ENCODINGS``).
Activations = Literal["f32", "f16", "q8"]


class ControlError(WireError):
    """A control message that does not follow its op's schema. ``code`` is what the node
    answers: ``bad_request`` (malformed), ``unknown_op`` (not served), ``bad_payload`` (a
    value the node cannot serve, as the data frames' refusals)."""

    def __init__(self, message: str, code: str = "bad_request") -> None:
        super().__init__(message)
        self.code = code


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Fields whose wrong values are answered ``bad_payload`` (value checks the node made
    #: before the messages were typed keep their code), not ``bad_request``.
    value_fields: ClassVar[frozenset[str]] = frozenset()

    def body(self) -> dict[str, Any]:
        """The JSON fields that were given (defaults stay off the wire, as they always did)."""
        return self.model_dump(mode="json", exclude_unset=True)


class HeadIdentity(_Model):
    """Who a head is, as a node shows it to a second head it refuses (docs/design.md 5.2)."""

    id: StrictStr
    pid: StrictInt | StrictStr
    host: StrictStr
    what: StrictStr
    since: StrictFloat
    #: Where a serving head answers (`edgespec serve`): `ring rebalance` goes through it.
    url: StrictStr | None = None


# ----------------------------------------------------------------------------- requests


class Request(_Model):
    """A control request. ``op`` names it on the wire; ``blob`` says whether the frame must
    (True), may (None) or must not (False) carry a BLOB field."""

    op: ClassVar[str]
    blob: ClassVar[bool | None] = False


class HolderRequest(Request):
    """A request only the head holding the node may send (docs/design.md 5.2)."""

    head: HeadIdentity | None = None  # None: the node names the holder by its connection
    take_over: StrictBool = False


class Ping(Request):
    """The heartbeat: answered at once, never waiting on a probe."""

    op: ClassVar[str] = "ping"


class Health(Request):
    op: ClassVar[str] = "health"


class Echo(Request):
    """Bandwidth probe: the BLOB comes back."""

    op: ClassVar[str] = "echo"
    blob: ClassVar[bool | None] = None


class Profile(Request):
    op: ClassVar[str] = "profile"
    model_path: StrictStr
    fingerprint: StrictStr | None = None
    # Bounded: a profile context holds 2 x the largest batch; a typo must not ask for GBs.
    batch_sizes: Annotated[list[Annotated[StrictInt, Field(ge=1, le=PROFILE_MAX_BATCH)]],
                           Field(min_length=1)] = [1, 4, 16]
    value_fields: ClassVar[frozenset[str]] = frozenset({"batch_sizes"})


class ProbeRtt(Request):
    """Dial each address (ring members), ping it, and say the round trip: what the head needs
    to order the ring by link latency (docs/design.md 5.3)."""

    op: ClassVar[str] = "probe_rtt"
    addresses: Annotated[list[tuple[StrictStr, Annotated[StrictInt, Field(ge=1, le=65535)]]],
                         Field(max_length=16)]
    value_fields: ClassVar[frozenset[str]] = frozenset({"addresses"})


LoadWindow = tuple[StrictInt, StrictInt, StrictInt, StrictBool]  # stage, first layer, stop, is_last


class Load(HolderRequest):
    """Load windows, cut from ``model_path`` on the node or from shards sent before."""

    op: ClassVar[str] = "load"
    model_path: StrictStr
    fingerprint: StrictStr
    windows: list[LoadWindow]
    n_ctx: StrictInt = 4096
    n_seq_max: StrictInt = 256
    encoding: Activations = "f32"
    shard_paths: dict[int, StrictStr] | None = None


class NextNode(_Model):
    """Link a stage to the next stage on another node."""

    host: StrictStr
    port: Annotated[StrictInt, Field(ge=1, le=65535)]
    stage: StrictInt


class NextLocal(_Model):
    """Link a stage to the next stage on the same node."""

    local: StrictInt
    stage: StrictInt


def _link_kind(v: Any) -> str | None:
    """Which kind of link ``v`` is (a JSON value on the way in, a model on the way out)."""
    if v == "head":
        return "head"
    if isinstance(v, (NextLocal, NextNode)):
        return "local" if isinstance(v, NextLocal) else "node"
    if isinstance(v, Mapping):
        return "local" if "local" in v else "node"
    return None


Link = Annotated[
    Annotated[Literal["head"], Tag("head")] | Annotated[NextLocal, Tag("local")]
    | Annotated[NextNode, Tag("node")],
    Discriminator(_link_kind, custom_error_type="link", custom_error_message=(
        'a link is "head", {"local", "stage"} or {"host", "port", "stage"}')),
]


class Connect(HolderRequest):
    """Wire each hosted stage to its successor (``"head"``: the last stage answers the head)."""

    op: ClassVar[str] = "connect"
    links: dict[int, Link]


class Reset(HolderRequest):
    op: ClassVar[str] = "reset"


class Unload(HolderRequest):
    op: ClassVar[str] = "unload"


class Shutdown(HolderRequest):
    op: ClassVar[str] = "shutdown"


class _ShardId(Request):
    fingerprint: StrictStr
    start: StrictInt
    stop: StrictInt


class ShardStatus(_ShardId):
    op: ClassVar[str] = "shard_status"
    size: StrictInt
    sha256: StrictStr


class ShardChunk(_ShardId):
    op: ClassVar[str] = "shard_chunk"
    blob: ClassVar[bool | None] = True
    offset: StrictInt


class ShardFinish(_ShardId):
    op: ClassVar[str] = "shard_finish"
    size: StrictInt
    sha256: StrictStr


REQUESTS: dict[str, type[Request]] = {r.op: r for r in (
    Ping, Health, Echo, Profile, ProbeRtt, Load, Connect, Reset, Unload, Shutdown,
    ShardStatus, ShardChunk, ShardFinish)}


# ----------------------------------------------------------------------------- answers


class Reply(_Model):
    """An answer's fields (``"ok": true`` is added on the wire)."""


class Done(Reply):
    """An answer without fields (ping, reset, shutdown, echo: its BLOB is the answer)."""


class StageHealth(_Model):
    range: tuple[StrictInt, StrictInt]
    batches: StrictInt
    merged: StrictInt = 0  # decodes that carried more than one batch (node/datapath.py)
    busy_s: StrictFloat
    queued: StrictInt
    next: StrictStr  # "head", "local:<stage>", "<host>:<port>" or "none"
    next_stage: StrictInt
    is_last: StrictBool
    gpu_layers: StrictInt | None = None  # the window's layers on the GPU (n_gpu_layers)
    samplers: StrictInt = 0  # last stage: requests' samplers registered (node/sampler.py)


class HealthReply(Reply):
    node_id: StrictStr
    name: StrictStr
    version: StrictStr
    proto: StrictInt
    backend: StrictStr
    free_ram: StrictInt
    free_vram: StrictInt | None = None  # a discrete device's free memory; None on unified
    total_vram: StrictInt | None = None
    device: StrictStr | None = None  # "Vulkan0: llvmpipe (...)", "CUDA0: NVIDIA ..."; None: CPU
    unified: StrictBool = False  # the device's memory is the RAM in free_ram (one pool)
    gpu_layers: StrictInt | None = None  # --n-gpu-layers; None: as many as fit
    rss: StrictInt
    holder: HeadIdentity | None = None
    stages: dict[int, StageHealth]
    time: StrictFloat


class ProfileReply(Reply):
    ms_per_layer: dict[int, StrictFloat]
    layers_profiled: StrictInt
    free_ram: StrictInt  # for a plan: the windows the node holds now count as free
    free_vram: StrictInt | None = None
    n_layer: StrictInt


class ProbeRttReply(Reply):
    rtt_ms: list[StrictFloat | None]  # per address; None: not reached


class LoadReply(Reply):
    stages: list[StrictInt] | None = None
    need_shards: StrictBool | None = None  # the node lacks the model: send the windows


class ConnectReply(Reply):
    connected: list[StrictInt]


class UnloadReply(Reply):
    unloaded: list[StrictInt]


class ShardStatusReply(Reply):
    complete: StrictBool
    have: StrictInt
    path: StrictStr


class ShardChunkReply(Reply):
    have: StrictInt


class ShardFinishReply(Reply):
    path: StrictStr


REPLIES: dict[str, type[Reply]] = {
    "ping": Done, "health": HealthReply, "echo": Done, "profile": ProfileReply,
    "probe_rtt": ProbeRttReply,
    "load": LoadReply, "connect": ConnectReply, "reset": Done, "unload": UnloadReply,
    "shutdown": Done, "shard_status": ShardStatusReply, "shard_chunk": ShardChunkReply,
    "shard_finish": ShardFinishReply,
}


# ----------------------------------------------------------------------------- to / from


def _why(what: str, e: ValidationError) -> str:
    """One line naming the first offending field, e.g. ``load: windows.0.2: Input should
    be a valid integer``."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "body"
    extra = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{what}: field {where!r}: {err['msg']}{extra}"


def _validated(cls: type[_Model], what: str, fields: Mapping[str, Any]) -> Any:
    try:
        return cls.model_validate(dict(fields))
    except ValidationError as e:
        loc = e.errors()[0]["loc"]
        code = "bad_payload" if loc and loc[0] in cls.value_fields else "bad_request"
        raise ControlError(_why(what, e), code) from None


def op_of(meta: Mapping[str, Any]) -> str:
    """The op a CONTROL frame's META names; ControlError if it names none."""
    op = meta.get("op")
    if not isinstance(op, str):
        raise ControlError("control message needs an 'op' string")
    return op


def parse_as(cls: type[Request], meta: Mapping[str, Any], blob: Any = None) -> Request:
    """``meta`` (and ``blob``) as the typed request ``cls``; ControlError if malformed."""
    if cls.blob is True and blob is None:
        raise ControlError(f"{cls.op}: needs a BLOB field (the data)")
    if cls.blob is False and blob is not None:
        raise ControlError(f"{cls.op}: takes no BLOB field")
    return _validated(cls, cls.op, {k: v for k, v in meta.items() if k != "op"})


def parse_request(meta: Mapping[str, Any], blob: Any = None) -> Request:
    """The typed request of a CONTROL frame's META (and BLOB); ControlError if malformed or
    not an op of ``REQUESTS`` (code ``unknown_op``)."""
    op = op_of(meta)
    cls = REQUESTS.get(op)
    if cls is None:
        raise ControlError(f"unknown control op {op!r}", "unknown_op")
    return parse_as(cls, meta, blob)


def make_request(op: str, blob: Any = None, **fields: Any) -> Request:
    """The typed request ``op`` with ``fields``, to travel with ``blob`` (the head's side:
    refuses, before sending, what the node would refuse)."""
    return parse_request({"op": op, **fields}, blob)


def control_message(op: str, *, request_id: int = 0, blob: bytes | None = None,
                    **body: Any) -> Message:
    """A CONTROL message ``{"op": op, **body}`` that expects a REPLY, unchecked (tests send
    malformed ones on purpose; the head sends ``request_message``)."""
    f: dict[FieldTag, Any] = {FieldTag.META: {"op": op, **body}}
    if blob is not None:
        f[FieldTag.BLOB] = blob
    return Message(Kind.CONTROL, f, request_id=request_id, flags=int(Flag.NEEDS_REPLY))


def request_message(req: Request, *, blob: bytes | None = None, request_id: int = 0) -> Message:
    """The CONTROL message of a typed request."""
    return control_message(req.op, request_id=request_id, blob=blob, **req.body())


def reply_message(reply: Reply, *, blob: bytes | None = None) -> Message:
    """The REPLY message of a typed answer."""
    fields: dict[FieldTag, Any] = {FieldTag.META: {"ok": True, **reply.body()}}
    if blob is not None:
        fields[FieldTag.BLOB] = blob
    return Message(Kind.REPLY, fields)


def parse_reply(op: str, msg: Message) -> Reply:
    """The typed answer to ``op`` from a REPLY message; ControlError if malformed."""
    meta = dict(msg.meta)
    if meta.pop("ok", None) is not True:
        raise ControlError(f"{op}: answer lacks \"ok\": true")
    return _validated(REPLIES[op], f"{op} answer", meta)
