"""The `edgespec` command line as a user meets it: the real CLI in a subprocess.

A failure the user can cause (nothing listening at a node address, a node holding another ring
key, a port already taken, a model name the command did not know) ends in one line that names
what failed and the fix, and a non-zero exit; the traceback only with -v, which works at every
level of the command. Registry names work in `shard`; progress bars stay out of files; `--help`
prints no empty defaults.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinygguf import make_tiny_gguf

EXE = str(Path(sys.executable).with_name("edgespec"))


def run(*argv: str, env: dict[str, str] | None = None, timeout: float = 120,
        ) -> subprocess.CompletedProcess:
    """Run the CLI; its output decoded as written (text mode would turn \r into \n)."""
    proc = subprocess.run([EXE, *argv], capture_output=True, env=env, timeout=timeout)
    proc.stdout = proc.stdout.decode(errors="replace")
    proc.stderr = proc.stderr.decode(errors="replace")
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The failure's single stderr line (asserting there is exactly that, and no traceback)."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("edgespec: "), proc.stderr
    return lines[0]


@pytest.fixture()
def home(tmp_path) -> dict[str, str]:
    """An environment with its own edgespec home and ring key."""
    env = dict(os.environ, EDGESPEC_HOME=str(tmp_path / "home"),
               EDGESPEC_KEY_FILE=str(tmp_path / "ring.key"), OMP_WAIT_POLICY="passive")
    assert run("keygen", env=env).returncode == 0
    return env


@pytest.fixture()
def tiny_model(tmp_path) -> Path:
    return make_tiny_gguf(tmp_path / "tiny.gguf", n_layer=2)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket is: nothing listens there


class NodeProcess:
    """A real `edgespec node` on loopback; its port is read from its first line."""

    def __init__(self, env: dict[str, str], *extra: str) -> None:
        self.proc = subprocess.Popen([EXE, "node", "--bind", "127.0.0.1", "--port", "0",
                                      "--no-mdns", *extra], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        line = self.proc.stdout.readline()
        m = re.search(r" on 127\.0\.0\.1:(\d+)", line)
        assert m, line + self.proc.stderr.read()
        self.port = int(m.group(1))

    def stop(self) -> str:
        """Stop it (SIGTERM); its log."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


# ------------------------------------------------------------------------------- failures

def test_ring_up_with_nothing_listening_names_the_address(home, tiny_model):
    port = closed_port()
    line = one_line_error(run("ring", "up", "--nodes", f"127.0.0.1:{port}", "--model",
                              str(tiny_model), env=home))
    assert f"127.0.0.1:{port}" in line and "edgespec node" in line


@pytest.mark.parametrize("where", ["top", "sub"])
def test_verbose_works_at_every_level_and_shows_the_traceback(home, tiny_model, where):
    port = closed_port()
    argv = ["ring", "up", "--nodes", f"127.0.0.1:{port}", "--model", str(tiny_model)]
    argv = ["-v", *argv] if where == "top" else [*argv, "-v"]
    proc = run(*argv, env=home)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConnectionRefusedError" in proc.stderr
    # The explanation still ends it.
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("edgespec: ") and f"127.0.0.1:{port}" in last, last


def test_ring_up_against_a_node_with_another_key(home, tiny_model, tmp_path):
    other = dict(home, EDGESPEC_KEY_FILE=str(tmp_path / "other.key"))
    assert run("keygen", env=other).returncode == 0
    node = NodeProcess(other)
    try:
        line = one_line_error(run("ring", "up", "--nodes", f"127.0.0.1:{node.port}",
                                  "--model", str(tiny_model), env=home))
    finally:
        log = node.stop()
    assert f"127.0.0.1:{node.port}" in line
    assert "ring key" in line and home["EDGESPEC_KEY_FILE"] in line  # the key to copy
    assert "ring key mismatch" in log  # and the node says why it refused


def test_node_on_a_port_in_use(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = one_line_error(run("node", "--bind", "127.0.0.1", "--port", str(port),
                                  "--no-mdns", env=home))
    assert f"port {port}" in line and "already in use" in line and "--port" in line


def test_serve_on_a_port_in_use_fails_before_starting_a_ring(home):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run("serve", "--local", "2", "--port", str(port), env=home)
    line = one_line_error(proc)
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line
    assert "starting a local ring" not in proc.stdout + proc.stderr


def test_unknown_model_and_missing_server(home, tmp_path):
    line = one_line_error(run("shard", str(tmp_path / "nope.gguf"), "--stages", "2",
                              "--out", str(tmp_path / "out"), env=home))
    assert "nope.gguf" in line and "qwen2.5-coder-0.5b" in line  # names the known models
    line = one_line_error(run("chat", "--server", f"http://127.0.0.1:{closed_port()}",
                              env=home))
    assert "edgespec serve" in line


# --------------------------------------------------------------------- names and output

@pytest.mark.real_model
def test_shard_takes_a_registry_name_and_writes_no_progress_to_a_file(real_model_path,
                                                                      tmp_path):
    env = dict(os.environ, EDGESPEC_HOME=str(real_model_path.parent.parent))
    out = tmp_path / "shards"
    proc = run("shard", "qwen2.5-coder-0.5b", "--stages", "2", "--out", str(out), env=env,
               timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "manifest.json").is_file() and len(list(out.glob("*.gguf"))) == 2
    assert "\r" not in proc.stderr  # stderr is a pipe here: no progress bar updates


@pytest.mark.real_model
def test_models_verify_writes_no_progress_to_a_file(real_model_path):
    env = dict(os.environ, EDGESPEC_HOME=str(real_model_path.parent.parent))
    proc = run("models", "verify", "qwen2.5-coder-0.5b", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stderr and "ok: " in proc.stdout


@pytest.mark.parametrize("command", [["node"], ["chat"], ["serve"], ["ring", "up"],
                                     ["keygen"], ["demo"], ["shard"]])
def test_help_shows_no_empty_or_doubled_defaults(command):
    proc = run(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "(default: None)" not in text
    assert not re.search(r"\(default:[^()]*\) \(default:", text), text
    assert "-v, --verbose" in text


def test_shard_help_names_the_architectures_that_can_be_cut():
    from edgespec.cli import build_parser
    from edgespec.cli.files import SHARD_ARCHITECTURES
    from edgespec.llm.architectures import SUPPORTED_ARCHITECTURES

    assert sorted(SHARD_ARCHITECTURES) == sorted(SUPPORTED_ARCHITECTURES)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["shard"].description  # before wrapping, which may split "gpt-oss"
    assert all(a in text for a in SUPPORTED_ARCHITECTURES), text


def test_node_help_names_the_real_defaults():
    text = " ".join(run("node", "--help").stdout.split())
    assert "~/.cache/edgespec" in text  # --cache: where the node keeps models and shards
    assert "(default: 7654)" in text


def test_node_logs_with_timestamps(home):
    node = NodeProcess(home)
    time.sleep(0.5)
    log = node.stop()
    first = log.splitlines()[0]
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ INFO edgespec\.node: ", first), log


def test_chat_warns_when_the_ring_that_is_up_runs_another_model(home, tiny_model):
    nodes = [NodeProcess(home), NodeProcess(home)]
    try:
        addrs = ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        up = run("ring", "up", "--nodes", addrs, "--model", str(tiny_model), "--no-profile",
                 env=home)
        assert up.returncode == 0, up.stderr
        asked = subprocess.run([EXE, "chat", "--model", "qwen2.5-coder-0.5b"], env=home,
                               capture_output=True, text=True, stdin=subprocess.DEVNULL,
                               timeout=120)
        plain = subprocess.run([EXE, "chat"], env=home, capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=120)
        assert run("ring", "down", env=home).returncode == 0
    finally:
        for n in nodes:
            n.stop()
    assert asked.returncode == 0 and "edgespec chat: tiny over 2 stage(s)" in asked.stdout
    assert ("warning: --model qwen2.5-coder-0.5b ignored: the ring that is up runs tiny"
            in asked.stderr), asked.stderr
    assert plain.returncode == 0 and "warning" not in plain.stderr, plain.stderr


@pytest.mark.parametrize("argv, option", [
    (["chat", "--ctx", "100"], "--ctx"),  # smaller than a tree's sequences: a node would die
    (["chat", "--local", "0"], "--local"),
    (["chat", "--temperature", "-1"], "--temperature"),
    (["demo", "--max-tokens", "many"], "--max-tokens"),
    (["node", "--port", "99999", "--no-mdns"], "--port"),
])
def test_bad_values_are_refused_in_one_line_before_anything_starts(home, argv, option):
    line = one_line_error(run(*argv, env=home, timeout=60))
    assert option in line
