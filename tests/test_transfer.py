"""Shard transfer over a real authenticated connection: resumable, verified, never resent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from edgespec.wire import FieldTag, Kind, Message, control_message
from edgespec.wire.auth import load_key, write_key
from edgespec.wire.server import FrameServer
from edgespec.wire.transfer import ShardStore, TransferError, handle, send_shard
from edgespec.wire.transport import RemoteError, connect


@pytest.fixture
def node(tmp_path):
    key = load_key(write_key(tmp_path / "ring.key"))
    store = ShardStore(tmp_path / "node-shards")

    def on_control(conn, frame):
        msg = frame.decode()
        body = handle(store, msg.meta, msg.fields.get(FieldTag.BLOB))
        return Message(Kind.REPLY, {FieldTag.META: {"ok": True, **body}})

    server = FrameServer(key, node_id="node", handlers={Kind.CONTROL: on_control}).start()
    conn = connect(*server.address, key, node_id="head")
    yield store, conn
    conn.close()
    server.close()


def _requester(conn, fail_after: int | None = None):
    calls = {"chunks": 0}

    def request(op, blob=None, **body):
        if op == "shard_chunk":
            if fail_after is not None and calls["chunks"] >= fail_after:
                raise ConnectionError("link cut")
            calls["chunks"] += 1
        return conn.request(control_message(op, blob=blob, **body), timeout=30)

    return request, calls


def test_interrupted_transfer_resumes_and_verifies(node, tmp_path):
    store, conn = node
    shard = tmp_path / "w.gguf"
    shard.write_bytes(os.urandom(10 * 1024 + 123))
    chunk = 1024
    request, _ = _requester(conn, fail_after=4)
    with pytest.raises(ConnectionError):
        send_shard(request, shard, "abc123", 0, 8, progress=False, chunk=chunk)
    request, calls = _requester(conn)
    remote, sent = send_shard(request, shard, "abc123", 0, 8, progress=False, chunk=chunk)
    assert sent == shard.stat().st_size - 4 * chunk  # finished chunks were not sent again
    assert calls["chunks"] == 7
    assert Path(remote).read_bytes() == shard.read_bytes()
    # Cached by fingerprint and range: a second transfer sends nothing.
    assert send_shard(request, shard, "abc123", 0, 8, progress=False, chunk=chunk)[1] == 0


def test_corrupted_partial_is_detected_and_discarded(node, tmp_path):
    store, conn = node
    shard = tmp_path / "w.gguf"
    shard.write_bytes(os.urandom(5000))
    request, _ = _requester(conn, fail_after=2)
    with pytest.raises(ConnectionError):
        send_shard(request, shard, "abc124", 0, 4, progress=False, chunk=1000)
    part = store.path_for("abc124", 0, 4).with_name(store.path_for("abc124", 0, 4).name + ".part")
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    request, _ = _requester(conn)
    with pytest.raises(RemoteError, match="sha256 mismatch"):
        send_shard(request, shard, "abc124", 0, 4, progress=False, chunk=1000)
    assert not part.exists()
    # The next attempt starts clean and succeeds.
    remote, sent = send_shard(request, shard, "abc124", 0, 4, progress=False, chunk=1000)
    assert sent == 5000 and Path(remote).read_bytes() == shard.read_bytes()


def test_out_of_order_chunk_is_refused(tmp_path):
    store = ShardStore(tmp_path)
    store.write("fp1", 0, 2, 0, b"abc")
    with pytest.raises(TransferError, match="resume from 3"):
        store.write("fp1", 0, 2, 10, b"zzz")
    with pytest.raises(TransferError, match="bad fingerprint"):
        store.path_for("../../etc", 0, 1)


def test_ring_over_nodes_without_the_model(tmp_path, caplog):
    """Nodes that lack the model get their windows sent; a second ring sends nothing."""
    import logging

    from tinygguf import make_tiny_gguf

    from edgespec.api import Ring
    from edgespec.head.formation import form_ring
    from edgespec.head.local import LocalNodes
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    model = make_tiny_gguf(tmp_path / "m.gguf", "qwen2", n_layer=4, n_embd=64, seed=5)
    key_file = write_key(tmp_path / "ring.key")
    key = load_key(key_file)
    prompt = [5, 6, 7, 8, 9]
    with Ring.local(model, stages=2, processes=False, spec="none") as ref_ring:
        expected = ref_ring.generate(prompt, max_tokens=12).tokens
    nodes = LocalNodes(2, key_file, cache_dir=tmp_path / "nodecache")
    tok = load_model(model, vocab_only=True)
    try:
        for attempt in range(2):
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="edgespec.ring"):
                chain = form_ring(nodes.addresses, model, key, ranges=[(0, 2), (2, 4)],
                                  n_ctx=256, send_shards=True)
            sent = [r.getMessage() for r in caplog.records if "bytes sent" in r.getMessage()]
            assert len(sent) == 2
            if attempt == 0:
                assert all(" 0 bytes sent" not in m for m in sent)
            else:
                assert all(m.endswith(" 0 bytes sent") for m in sent)  # cached on the nodes
            ring = Ring(chain, Tokenizer(tok), model_name="tiny", spec="none")
            assert ring.generate(prompt, max_tokens=12).tokens == expected
            ring.close()
    finally:
        tok.close()
        nodes.close()
