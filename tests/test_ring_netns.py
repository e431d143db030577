"""A multi-host ring over real mDNS: three `edgespec node` daemons, each in its own network
namespace on one bridge, found by `edgespec ring up --nodes auto` from a fourth (head)
namespace; the ring's greedy output must equal the unsplit model's.

Every host has its own EDGESPEC_HOME (node id, shard cache, ring state), as separate devices
would; only the model file is shared, because the namespaces share one filesystem. Nodes bind
0.0.0.0, so what they advertise over mDNS is whatever addresses their namespace has: the head
must find and use the bridge addresses, and the nodes must reach each other on them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from netns import SUBNET_PREFIX, Host, NetnsLab, skip_reason
from ring_fixtures import unsplit_greedy

from edgespec.wire import auth

pytestmark = [pytest.mark.netns, pytest.mark.real_model]

REPO = Path(__file__).resolve().parents[1]
PORT = 7654
N_TOKENS = 32
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"

# The head's generation: attach to the ring `ring up` saved, greedy, mode "none".
HEAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from edgespec.api import Ring
    prompt, n = sys.argv[1], int(sys.argv[2])
    with Ring.attach(spec="none") as ring:
        ids = ring.tokenizer.encode(prompt)
        gen = ring.generate(prompt, max_tokens=n, spec="none")
        print(json.dumps({"prompt_ids": ids, "tokens": gen.tokens}))
    """
)

# What a node holds, asked over the authenticated transport (used after `ring down`).
HEALTH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from edgespec import wire
    from edgespec.wire import auth, transport
    key, port = auth.load_key(sys.argv[1]), int(sys.argv[2])
    out = {}
    for addr in sys.argv[3:]:
        with transport.connect(addr, port, key, node_id="probe") as c:
            out[addr] = c.request(wire.control_message("health")).meta["stages"]
    print(json.dumps(out))
    """
)


def _edgespec() -> list[str]:
    """The `edgespec` console script of this interpreter's environment (or -m edgespec)."""
    script = Path(sys.executable).with_name("edgespec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "edgespec"]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["EDGESPEC_HOME"] = str(home)
    env.pop("EDGESPEC_KEY_FILE", None)  # every command names its key file explicitly
    # Four llama.cpp contexts share the cores: passive OpenMP waiting (docs/design.md 3.7).
    env["OMP_WAIT_POLICY"] = "passive"
    return env


def _wait_for_line(path: Path, pattern: str, proc: subprocess.Popen, timeout: float) -> str:
    """The first line of ``path`` matching ``pattern`` (the process writes it there)."""
    rx = re.compile(pattern)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines():
            if rx.search(line):
                return line
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r} in {path} (exit {proc.poll()}):\n"
                         f"{path.read_text()}")


def _run(host: Host, argv: list[str], env: dict[str, str], timeout: float) -> str:
    res = host.run(argv, env=env, cwd=REPO, timeout=timeout, check=False)
    assert res.returncode == 0, (f"{host.name}: {' '.join(argv)} exited {res.returncode}\n"
                                 f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}")
    return res.stdout


@pytest.fixture(scope="module")
def netns_ok() -> None:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


def test_ring_over_mdns_across_namespaces(netns_ok, real_model_path, tmp_path: Path) -> None:
    model = Path(real_model_path).resolve()
    key_file = auth.write_key(tmp_path / "ring.key")
    names = ["head", "n1", "n2", "n3"]
    homes = {n: tmp_path / f"home-{n}" for n in names}
    for h in homes.values():
        h.mkdir()
    with NetnsLab(len(names), names=names) as lab:
        hosts = {h.name: h for h in lab.hosts}
        logs: dict[str, tuple[Path, Path]] = {}
        procs: dict[str, subprocess.Popen] = {}
        for n in names[1:]:
            out, err = tmp_path / f"{n}.out", tmp_path / f"{n}.err"
            logs[n] = (out, err)
            # Files, not pipes: a node logs for as long as it lives and must never block.
            with open(out, "w") as fo, open(err, "w") as fe:
                procs[n] = hosts[n].popen(
                    [*_edgespec(), "node", "--key-file", str(key_file), "--name", n,
                     "--bind", "0.0.0.0", "--port", str(PORT), "--threads", "1"],
                    env=_env(homes[n]), cwd=REPO, stdout=fo, stderr=fe)
        for n, p in procs.items():
            _wait_for_line(logs[n][0], rf"edgespec node {n} \(\w+\) on 0\.0\.0\.0:{PORT}", p, 60)
            # The mDNS record names the namespace's own bridge address, not 0.0.0.0.
            _wait_for_line(logs[n][1], rf"advertising {n}\..*{re.escape(hosts[n].address)}", p,
                           60)

        head, head_env = hosts["head"], _env(homes["head"])
        up = _run(head, [*_edgespec(), "ring", "up", "--model", str(model), "--nodes", "auto",
                         "--expect", "3", "--timeout", "60", "--key-file", str(key_file)],
                  head_env, timeout=900)
        print(up)
        assert "ring is up: 3 stages on 3 node(s)" in up, up
        state = json.loads((homes["head"] / "ring.json").read_text())
        assert [(m["name"], m["host"], m["port"]) for m in state["nodes"]] == [
            (n, hosts[n].address, PORT) for n in ("n1", "n2", "n3")]
        windows = state["plan"]["windows"]
        assert [w[1] for w in windows] == [0, 1, 2]
        assert windows[0][2] == 0 and windows[-1][3] == 24
        assert all(a[3] == b[2] for a, b in zip(windows, windows[1:], strict=False))

        status = _run(head, [*_edgespec(), "ring", "status", "--key-file", str(key_file)],
                      head_env, timeout=120)
        print(status)
        rows = {}
        for line in status.splitlines():
            m = re.match(r"(n[123])\s+(\S+)\s+(\S+)\s+([\d.]+)GB\s+(.+?)\s+([\d.]+)\s+(\S.*)$",
                         line)
            if m:
                rows[m.group(1)] = m.groups()[1:]
        assert sorted(rows) == ["n1", "n2", "n3"], status
        for i, n in enumerate(("n1", "n2", "n3")):
            addr, layers, ram, device, rtt, what = rows[n]
            assert device == "cpu", status
            assert addr == f"{hosts[n].address}:{PORT}", status
            assert layers == f"{windows[i][2]}:{windows[i][3]}", status
            assert float(ram) > 0 and float(rtt) > 0, status
            assert what == "loaded", status

        gen = _run(head, [sys.executable, "-c", HEAD_SCRIPT, PROMPT, str(N_TOKENS)], head_env,
                   timeout=600)
        result = json.loads(gen.strip().splitlines()[-1])
        assert len(result["tokens"]) == N_TOKENS
        ref = unsplit_greedy(model, result["prompt_ids"], N_TOKENS)
        assert result["tokens"] == ref

        down = _run(head, [*_edgespec(), "ring", "down", "--key-file", str(key_file)],
                    head_env, timeout=120)
        for n in ("n1", "n2", "n3"):
            assert f"{n}: windows unloaded" in down, down
        assert not (homes["head"] / "ring.json").exists()
        held = json.loads(_run(head, [sys.executable, "-c", HEALTH_SCRIPT, str(key_file), str(PORT),
                                      *(hosts[n].address for n in ("n1", "n2", "n3"))],
                               head_env, timeout=60).strip().splitlines()[-1])
        assert held == {hosts[n].address: {} for n in ("n1", "n2", "n3")}

        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for n, p in procs.items():
            assert p.wait(timeout=60) == 0, logs[n][1].read_text()
            err = logs[n][1].read_text()
            # Each node cut and loaded its own window, and talked to its neighbour directly.
            assert re.search(r"loaded stage \d \(layers \d+-\d+\)", err), err
        assert all(h.address.startswith(SUBNET_PREFIX) for h in lab.hosts)


# A stranger on the LAN: advertises itself as an edgespec node, accepts TCP and trickles a
# byte now and then, never proving the ring key.
FAKE_SCRIPT = textwrap.dedent(
    """
    import socket, sys, threading, time
    from edgespec.wire.discovery import advertise
    from edgespec.node.info import describe_this_node
    addr, port = sys.argv[1], int(sys.argv[2])
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port)); srv.listen(16)
    def trickle(c):
        try:
            while True:
                c.sendall(b"E"); time.sleep(2)
        except OSError:
            pass
    def accept():
        while True:
            c, _ = srv.accept()
            threading.Thread(target=trickle, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    info = describe_this_node("aaa-fake", port, node_id="f" * 16)
    with advertise(info, addresses=[addr]):
        print("advertising", flush=True)
        time.sleep(600)
    """
)


def test_ring_up_skips_a_fake_advertiser(netns_ok, tmp_path: Path) -> None:
    """Two real nodes and a fake one that sorts first: `ring up --expect 2` forms the ring
    over the real ones, names the fake it skipped, and does not count it."""
    from tinygguf import make_tiny_gguf

    model = make_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", n_layer=4, n_embd=64, seed=3)
    key_file = auth.write_key(tmp_path / "ring.key")
    names = ["head", "n1", "n2", "fake"]
    homes = {n: tmp_path / f"home-{n}" for n in names}
    for h in homes.values():
        h.mkdir()
    with NetnsLab(len(names), names=names) as lab:
        hosts = {h.name: h for h in lab.hosts}
        procs: dict[str, subprocess.Popen] = {}
        try:
            for n in ("n1", "n2"):
                out, err = tmp_path / f"{n}.out", tmp_path / f"{n}.err"
                with open(out, "w") as fo, open(err, "w") as fe:
                    procs[n] = hosts[n].popen(
                        [*_edgespec(), "node", "--key-file", str(key_file), "--name", n,
                         "--bind", "0.0.0.0", "--port", str(PORT), "--threads", "1"],
                        env=_env(homes[n]), cwd=REPO, stdout=fo, stderr=fe)
                _wait_for_line(out, rf"edgespec node {n} ", procs[n], 60)
            fake_out = tmp_path / "fake.out"
            with open(fake_out, "w") as fo:
                procs["fake"] = hosts["fake"].popen(
                    [sys.executable, "-c", FAKE_SCRIPT, hosts["fake"].address, str(PORT)],
                    env=_env(homes["fake"]), cwd=REPO, stdout=fo, stderr=subprocess.STDOUT)
            _wait_for_line(fake_out, "advertising", procs["fake"], 60)
            res = hosts["head"].run(
                [*_edgespec(), "ring", "up", "--model", str(model), "--nodes", "auto",
                 "--expect", "2", "--timeout", "60", "--key-file", str(key_file),
                 "--no-profile", "--ctx", "256"],
                env=_env(homes["head"]), cwd=REPO, timeout=300, check=False)
            out = res.stdout + res.stderr
            assert res.returncode == 0, out
            assert "ring is up: 2 stages on 2 node(s)" in out, out
            assert re.search(rf"skipping aaa-fake\S* at {re.escape(hosts['fake'].address)}:"
                             rf"{PORT}", out), out
            state = json.loads((homes["head"] / "ring.json").read_text())
            assert sorted(m["name"] for m in state["nodes"]) == ["n1", "n2"]
        finally:
            for p in procs.values():
                p.send_signal(signal.SIGTERM)
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
