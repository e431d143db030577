"""Typed control messages: every op round-trips through real frames with the same JSON the
free-form dicts had, and every malformed request is a clean ``bad_request`` answer from a
real node process over a real keyed connection, after which the node keeps serving."""

from __future__ import annotations

import pytest
from tinygguf import make_tiny_gguf

from edgespec.errors import RingError
from edgespec.head.formation import form_ring
from edgespec.head.local import LocalNodes
from edgespec.head.remote import head_identity
from edgespec.node.daemon import Node
from edgespec.wire import FieldTag, Kind, Message, control_message, decode_payload, encode_frame
from edgespec.wire import control as ctl
from edgespec.wire.auth import load_key, write_key
from edgespec.wire.server import FrameServer
from edgespec.wire.transport import RemoteError, connect

HEAD = head_identity("a test head")
HOLD = {"head": HEAD, "take_over": False}
SHARD = {"fingerprint": "ab12", "start": 0, "stop": 2}

# One request per op, as the head sends it (ring.py, transfer.py), and its BLOB.
REQUESTS: dict[str, tuple[dict, bytes | None]] = {
    "ping": ({}, None),
    "health": ({}, None),
    "echo": ({}, b"\x00probe"),
    "profile": ({"model_path": "/m.gguf", "fingerprint": "ab12", "batch_sizes": [1, 8]}, None),
    "probe_rtt": ({"addresses": [["10.0.0.2", 7654], ["10.0.0.3", 7654]]}, None),
    "load": ({"model_path": "", "fingerprint": "ab12", "windows": [[0, 0, 12, False],
              [2, 12, 24, True]], "n_ctx": 4096, "n_seq_max": 256, "encoding": "q8",
              "shard_paths": {"0": "/s/a.gguf", "2": "/s/b.gguf"}, **HOLD}, None),
    "connect": ({"links": {"0": {"host": "10.0.0.2", "port": 7654, "stage": 1},
                           "1": {"local": 2, "stage": 2}, "2": "head"}, **HOLD}, None),
    "reset": ({"head": HEAD}, None),
    "unload": ({**HOLD, "take_over": True}, None),
    "shutdown": ({}, None),
    "shard_status": ({**SHARD, "size": 10, "sha256": "00" * 32}, None),
    "shard_chunk": ({**SHARD, "offset": 4}, b"chunk"),
    "shard_finish": ({**SHARD, "size": 10, "sha256": "00" * 32}, None),
}

# One answer per op, as the node sends it.
REPLIES: dict[str, dict] = {
    "ping": {}, "echo": {}, "reset": {}, "shutdown": {},
    "health": {"node_id": "0123abcd", "name": "box", "version": "0.1.0", "proto": 2,
               "backend": "cpu", "free_ram": 8 << 30, "free_vram": None, "rss": 1 << 28,
               "holder": HEAD, "time": 1.5e9,
               "stages": {"0": {"range": [0, 12], "batches": 3, "busy_s": 0.25, "queued": 0,
                                "next": "10.0.0.2:7654", "next_stage": 1, "is_last": False}}},
    "profile": {"ms_per_layer": {"1": 0.5, "4": 1.25}, "layers_profiled": 2,
                "free_ram": 1 << 30, "free_vram": None, "n_layer": 24},
    "probe_rtt": {"rtt_ms": [0.42, None]},
    "load": {"need_shards": True},
    "connect": {"connected": [0, 2]},
    "unload": {"unloaded": [0]},
    "shard_status": {"complete": False, "have": 4, "path": "/s/x.gguf"},
    "shard_chunk": {"have": 9},
    "shard_finish": {"path": "/s/x.gguf"},
}


def _through_a_frame(msg: Message) -> Message:
    header, chunks = encode_frame(msg)
    return decode_payload(header, b"".join(bytes(c) for c in chunks))


def test_the_node_serves_exactly_the_typed_ops():
    assert set(Node.CONTROL) == set(ctl.REQUESTS) == set(ctl.REPLIES) == set(REQUESTS)
    for op, (kind, handler) in Node.CONTROL.items():
        assert kind is ctl.REQUESTS[op] and kind.op == op and callable(handler)


@pytest.mark.parametrize("op", sorted(REQUESTS))
def test_every_request_round_trips_with_the_same_json(op):
    body, blob = REQUESTS[op]
    req = ctl.make_request(op, blob, **body)
    assert type(req) is ctl.REQUESTS[op]
    msg = _through_a_frame(ctl.request_message(req, blob=blob, request_id=9))
    # The same JSON the free-form dicts were (so no protocol version bump).
    assert msg.kind == Kind.CONTROL and msg.request_id == 9 and msg.meta == {"op": op, **body}
    assert msg.fields.get(FieldTag.BLOB) == blob
    assert ctl.parse_request(msg.meta, msg.fields.get(FieldTag.BLOB)) == req


@pytest.mark.parametrize("op", sorted(REPLIES))
def test_every_answer_round_trips_with_the_same_json(op):
    reply = ctl.REPLIES[op].model_validate(REPLIES[op])
    msg = _through_a_frame(ctl.reply_message(reply))
    assert msg.kind == Kind.REPLY and msg.meta == {"ok": True, **REPLIES[op]}
    assert ctl.parse_reply(op, msg) == reply


def test_typed_fields_read_as_their_types():
    load = ctl.make_request("load", **REQUESTS["load"][0])
    assert load.windows[1] == (2, 12, 24, True) and load.shard_paths == {0: "/s/a.gguf", 2: "/s/b.gguf"}
    assert load.head is not None and load.head.id == HEAD["id"] and not load.take_over
    links = ctl.make_request("connect", **REQUESTS["connect"][0]).links
    assert links[0] == ctl.NextNode(host="10.0.0.2", port=7654, stage=1)
    assert links[1] == ctl.NextLocal(local=2, stage=2) and links[2] == "head"
    health = ctl.parse_reply("health", _through_a_frame(ctl.reply_message(
        ctl.HealthReply.model_validate(REPLIES["health"]))))
    assert health.stages[0].range == (0, 12) and health.holder.what == "a test head"
    assert ctl.make_request("profile", model_path="/m").batch_sizes == [1, 4, 16]


@pytest.mark.parametrize(("op", "meta", "field"), [
    ("health", {"ok": True, "name": "box"}, "node_id"),  # a field missing
    ("connect", {"ok": True, "connected": ["0"]}, "connected.0"),  # a wrong type
    ("ping", {"ok": True, "extra": 1}, "extra"),  # a field the answer does not have
    ("ping", {}, '"ok"'),
])
def test_malformed_answers_are_refused_naming_the_field(op, meta, field):
    with pytest.raises(ctl.ControlError, match=field) as exc:
        ctl.parse_reply(op, Message(Kind.REPLY, {FieldTag.META: meta}))
    assert exc.value.code == "bad_request"


def test_the_head_refuses_to_send_a_malformed_request():
    with pytest.raises(ctl.ControlError, match="'windows'"):
        ctl.make_request("load", model_path="/m", fingerprint="ab12")


# (op, META body, BLOB, what the error must name)
MALFORMED = [
    ("load", {}, None, "'model_path'"),
    ("load", {"model_path": "/m", "fingerprint": "f", "windows": [[0, 0, "2", True]]}, None,
     "'windows.0.2'"),
    ("load", {"model_path": "/m", "fingerprint": "f", "windows": [[0, 0, 2]]}, None,
     "'windows.0"),
    ("load", {"model_path": "/m", "fingerprint": "f", "windows": [], "n_ctx": "4096"}, None,
     "'n_ctx'"),
    ("load", {"model_path": "/m", "fingerprint": "f", "windows": [], "encoding": "f8"}, None,
     "'encoding'"),
    ("load", {"model_path": "/m", "fingerprint": "f", "windows": [], "head": {"id": "x"}},
     None, "'head.pid'"),
    ("connect", {}, None, "'links'"),
    ("connect", {"links": [["0", "head"]]}, None, "'links'"),
    ("connect", {"links": {"0": {"host": "10.0.0.2", "port": 7654}}}, None,
     "'links.0.node.stage'"),
    ("connect", {"links": {"0": "tail"}}, None, "'links.0'"),
    ("connect", {"links": {"zero": "head"}}, None, "'links.zero"),
    ("unload", {"take_over": "yes"}, None, "'take_over'"),
    ("shutdown", {"take_over": 1}, None, "'take_over'"),  # malformed: the node must not stop
    ("reset", {"hed": HEAD}, None, "'hed'"),
    ("ping", {"now": 1}, None, "'now'"),
    ("health", {}, b"unasked", "BLOB"),
    ("profile", {"fingerprint": "f"}, None, "'model_path'"),
    ("shard_status", {**SHARD, "size": 10}, None, "'sha256'"),
    ("shard_chunk", {**SHARD, "offset": 0}, None, "BLOB"),
    ("shard_finish", {**SHARD, "start": "0", "size": 10, "sha256": "00"}, None, "'start'"),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One real `edgespec node` process and the ring key."""
    key_file = write_key(tmp_path_factory.mktemp("ctl") / "ring.key")
    nodes = LocalNodes(1, key_file)
    try:
        yield nodes, load_key(key_file)
    finally:
        nodes.close()


def test_malformed_requests_are_bad_request_and_the_node_keeps_serving(node):
    nodes, key = node
    with connect(*nodes.addresses[0], key, node_id="fuzzer") as c:
        for op, body, blob, field in MALFORMED:
            with pytest.raises(RemoteError) as exc:
                c.request(control_message(op, blob=blob, **body), timeout=30)
            assert exc.value.code == "bad_request", (op, body, exc.value)
            assert exc.value.message.startswith(op) and field in exc.value.message, exc.value
        # No op, an op that is not a string, an op the node does not serve.
        for meta, code, text in [({"take_over": True}, "bad_request", "'op'"),
                                 ({"op": 7}, "bad_request", "'op'"),
                                 ({"op": "format_disk"}, "unknown_op", "format_disk")]:
            msg = Message(Kind.CONTROL, {FieldTag.META: meta})
            with pytest.raises(RemoteError) as exc:
                c.request(msg, timeout=30)
            assert exc.value.code == code and text in exc.value.message, exc.value
        # The same connection goes on: nothing of it was taken for a lost link, and no
        # malformed holder op took the node.
        health = ctl.parse_reply("health", c.request(control_message("health"), timeout=30))
        assert health.holder is None and health.stages == {}
        echo = c.request(ctl.request_message(ctl.Echo(), blob=b"still here"), timeout=30)
        assert bytes(echo.fields[FieldTag.BLOB]) == b"still here"
    assert nodes.procs[0].poll() is None  # the malformed shutdown did not stop it
    # A well-formed holder op after all that is served as before.
    with connect(*nodes.addresses[0], key, node_id="head") as c:
        reply = c.request(ctl.request_message(ctl.make_request("unload", **HOLD)), timeout=30)
        assert ctl.parse_reply("unload", reply) == ctl.UnloadReply(unloaded=[])
        health = ctl.parse_reply("health", c.request(control_message("health"), timeout=30))
        assert health.holder is not None and health.holder.id == HEAD["id"]


def test_a_malformed_answer_is_one_line_naming_the_node_and_field(tmp_path):
    """A member whose health answer lacks its node id (an older or foreign build): forming a
    ring over it fails with one RingError line, not a KeyError deep in the planner."""
    model = make_tiny_gguf(tmp_path / "m.gguf", "qwen2", n_layer=2, n_embd=32, seed=3)
    key = load_key(write_key(tmp_path / "ring.key"))

    def answer(conn, frame):
        return Message(Kind.REPLY, {FieldTag.META: {"ok": True, "name": "odd-box"}})

    with (FrameServer(key, node_id="odd", handlers={Kind.CONTROL: answer}) as srv,
          pytest.raises(RingError) as exc):
        form_ring([srv.address], model, key, profile=False)
    text = str(exc.value)
    assert "\n" not in text and text.startswith("odd: malformed answer: health answer"), text
    assert "'node_id'" in text, text
