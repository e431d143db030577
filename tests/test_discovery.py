"""Discovery over real mDNS across real network namespaces, plus TXT record rules."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from netns import NetnsLab, skip_reason

from edgespec.wire import PROTOCOL_VERSION, auth
from edgespec.wire.discovery import TXT_KEYS, NodeInfo, _service_info

REPO = Path(__file__).resolve().parents[1]

# A stand-in node daemon: authenticated frame server + mDNS record, clean exit on SIGTERM.
NODE_SCRIPT = textwrap.dedent(
    """
    import logging, signal, sys, threading
    from edgespec import wire
    from edgespec.wire import auth, discovery, server, transport
    from edgespec.node.info import describe_this_node
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    name, addr, keyfile = sys.argv[1:4]
    key = auth.load_key(keyfile)
    srv = server.FrameServer(key, node_id=name, host=addr)
    srv.register(wire.Kind.CONTROL, lambda conn, frame: wire.Message(
        wire.Kind.REPLY, {wire.FieldTag.META: {"op": frame.decode().meta["op"], "node": name}}))
    srv.start()
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *a: stop.set())
    info = describe_this_node(name, srv.address[1], node_id=name * 4, addresses=[addr])
    with discovery.advertise(info):
        print("READY", flush=True)
        stop.wait()
    srv.close()
    print("STOPPED", flush=True)
    """
)

# The head: browse, then talk to every node found with the ring key, and try a wrong key.
HEAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from edgespec import wire
    from edgespec.wire import auth, discovery, transport
    keyfile, wrongfile, expect = sys.argv[1], sys.argv[2], int(sys.argv[3])
    key, wrong = auth.load_key(keyfile), auth.load_key(wrongfile)
    nodes = discovery.browse(timeout=30, expect=expect)
    out = {"nodes": [], "health": {}, "refused": {}}
    for n in nodes:
        out["nodes"].append({"name": n.name, "id": n.node_id, "addresses": list(n.addresses),
                             "port": n.port, "proto": n.proto, "backend": n.backend, "ram": n.free_ram_mb})
        host = [a for a in n.addresses if a.startswith("10.")][0]
        try:
            with transport.connect(host, n.port, key, node_id="head") as c:
                out["health"][n.name] = c.request(wire.control_message("health")).meta
        except auth.AuthError as e:
            out["refused"][n.name] = str(e)
    good = [n for n in nodes if n.name in out["health"]]
    target = good[0]
    host = [a for a in target.addresses if a.startswith("10.")][0]
    try:
        transport.connect(host, target.port, wrong, node_id="intruder")
        out["intruder"] = "joined"
    except auth.AuthError as e:
        out["intruder"] = str(e)
    with transport.connect(host, target.port, key, node_id="head") as c:
        out["after_intruder"] = c.request(wire.control_message("health")).meta
    out["intruder_target"] = target.name
    print(json.dumps(out))
    """
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.netns
def test_nodes_found_over_mdns_across_namespaces(tmp_path: Path) -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    keyfile = auth.write_key(tmp_path / "ring.key")
    wrongfile = auth.write_key(tmp_path / "other.key")
    names = ["head", "n1", "n2", "n3", "rogue"]
    with NetnsLab(len(names), names=names) as lab:
        hosts = {h.name: h for h in lab.hosts}
        procs = {}
        for name in ["n1", "n2", "n3", "rogue"]:
            kf = wrongfile if name == "rogue" else keyfile
            procs[name] = hosts[name].popen([sys.executable, "-c", NODE_SCRIPT, name, hosts[name].address, str(kf)], env=_env(), cwd=REPO)
        for name, p in procs.items():
            line = p.stdout.readline().strip()
            assert line == "READY", f"{name} did not start: {line!r}\n{p.stderr.read() if p.poll() is not None else ''}"

        head = hosts["head"].run([sys.executable, "-c", HEAD_SCRIPT, str(keyfile), str(wrongfile), "4"], env=_env(), cwd=REPO, timeout=120)
        result = json.loads(head.stdout.strip().splitlines()[-1])

        # Every node in its own namespace was found over multicast, with its own address.
        found = {n["name"]: n for n in result["nodes"]}
        assert sorted(found) == ["n1", "n2", "n3", "rogue"], head.stderr
        for name in ["n1", "n2", "n3"]:
            assert hosts[name].address in found[name]["addresses"]
            assert found[name]["id"] == name * 4
            assert found[name]["proto"] == PROTOCOL_VERSION
            assert found[name]["backend"] == "cpu"
            assert found[name]["ram"] > 0
            # Members answer over the authenticated transport.
            assert result["health"][name] == {"op": "health", "node": name}
        # A node holding another key is advertised but cannot be joined...
        assert "rogue" not in result["health"]
        assert "ring key mismatch" in result["refused"]["rogue"]
        # ...and a peer with the wrong key is refused while the node keeps serving.
        assert "ring key mismatch" in result["intruder"]
        target = result["intruder_target"]
        assert result["after_intruder"] == {"op": "health", "node": target}

        # SIGTERM: unregister, close, exit 0; the refusal was logged clearly.
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        logs = {}
        for name, p in procs.items():
            out, err = p.communicate(timeout=30)
            assert p.returncode == 0, f"{name} exit {p.returncode}: {err}"
            assert "STOPPED" in out
            logs[name] = err
        assert "refused peer" in logs[target] and "ring key mismatch" in logs[target], logs[target]

        # After the goodbyes nobody answers any more.
        head2 = hosts["head"].run(
            [sys.executable, "-c", "from edgespec.wire import discovery; print(len(discovery.browse(timeout=3)))"],
            env=_env(),
            cwd=REPO,
            timeout=60,
        )
        assert head2.stdout.strip() == "0"


def test_txt_record_carries_only_public_fields() -> None:
    info = NodeInfo(name="box", node_id="0123456789abcdef", port=7000, addresses=("10.0.0.2",), free_ram_mb=1024, free_vram_mb=None, models=("a" * 16, "b" * 16))
    txt = info.txt()
    assert set(txt) == set(TXT_KEYS)
    assert txt["models"] == "a" * 16 + "," + "b" * 16
    assert txt["vram"] == ""
    rec = _service_info(info, ["10.0.0.2"])
    back = NodeInfo.from_service(rec)
    assert back.node_id == info.node_id and back.models == info.models and back.free_vram_mb is None
    assert back.addresses == ("10.0.0.2",) and back.port == 7000 and back.name == "box"


def test_txt_record_drops_fingerprints_that_do_not_fit() -> None:
    many = tuple(f"{i:016x}" for i in range(40))
    txt = NodeInfo(name="box", node_id="x", port=1, models=many).txt()
    kept = txt["models"].split(",")
    assert 0 < len(kept) < 40 and kept == list(many[: len(kept)])
    assert len("models=" + txt["models"]) <= 255


def test_bad_names_and_ports_are_refused() -> None:
    from edgespec.wire.discovery import DiscoveryError

    with pytest.raises(DiscoveryError, match="name"):
        _service_info(NodeInfo(name="a.b", node_id="x", port=1), ["10.0.0.1"])
    with pytest.raises(DiscoveryError, match="port"):
        _service_info(NodeInfo(name="a", node_id="x", port=0), ["10.0.0.1"])
    with pytest.raises(DiscoveryError, match="address"):
        _service_info(NodeInfo(name="a", node_id="x", port=1), [])


def test_netns_lab_cleans_up_after_itself() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with NetnsLab(2) as lab:
        names = [h.netns for h in lab.hosts] + [lab.switch]
        a, b = lab.hosts
        r = a.run(["ping", "-c", "1", "-W", "2", b.address], check=False) if _have("ping") else None
        if r is not None:
            assert r.returncode == 0, r.stdout + r.stderr
        sleeper = a.popen(["sleep", "600"])
    assert sleeper.poll() is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)


def _have(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


def test_nodeinfo_fingerprints_free_ram_and_backend(tmp_path: Path) -> None:
    import hashlib

    from edgespec.node import info as nodeinfo

    m = tmp_path / "models" / "a.gguf"
    m.parent.mkdir()
    m.write_bytes(b"GGUF" + b"\1" * 1000)
    want = hashlib.sha256(m.read_bytes()).hexdigest()
    assert nodeinfo.model_fingerprints([tmp_path]) == [want[:16]]
    assert (m.parent / "a.gguf.sha256").exists()  # cached for the next announcement
    m.write_bytes(b"GGUF" + b"\2" * 1001)  # changed file: size differs, hashed again
    assert nodeinfo.model_fingerprints([tmp_path]) == [hashlib.sha256(m.read_bytes()).hexdigest()[:16]]
    assert nodeinfo.free_ram_bytes() > 0
    assert nodeinfo.detect_backend() in {"cpu", "cuda", "metal", "vulkan", "rocm", "gpu"}
    nid = nodeinfo.load_or_create_node_id(tmp_path / "state")
    assert nodeinfo.load_or_create_node_id(tmp_path / "state") == nid and len(nid) == 16
