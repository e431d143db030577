"""`edgespec chat` driven as a user would: in a pseudo-terminal, over a local ring of two node
processes with the real Qwen2.5-Coder-0.5B.

Checked: the streamed answers are the model's greedy answers (the unsplit model as reference),
`/stats` prints the last answer's statistics as JSON, and a second turn computes only its own
new tokens (the earlier turns stay in the ring's KV cache). Ctrl-C stops an answer and keeps
both the session and the ring's node processes alive.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from proc_helpers import alive, children
from ring_fixtures import assert_same_greedy, unsplit_greedy

pytestmark = pytest.mark.real_model

# Short code answers (about 15 tokens, ending on their own); the second repeats most of the
# first, so retrieval drafting gets accepted in turn 2.
TURN1 = "Give a Python expression that reverses a string s. Reply with the code only."
TURN2 = "Now one that makes s upper case. Code only."
PROMPT = re.compile(r"\n> $")
STATS_LINE = re.compile(r"\n\[(\d+) tokens in [\d.]+ s: [\d.]+ tok/s, [\d.]+ tokens/step "
                        r"\((\w+)\), prompt (\d+) tokens, (\d+) computed\]\n")


class PtyProcess:
    """A child on a pseudo-terminal of its own (its controlling terminal: Ctrl-C written to it
    becomes SIGINT for the child's foreground process group, as in a real terminal)."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the command
            try:
                # A wide terminal: readline on a dumb 80-column one scrolls long lines
                # sideways, and the echo of a typed turn would not read as typed.
                fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 250, 0, 0))
                os.execve(argv[0], argv, env)
            finally:
                os._exit(127)
        self.buf = ""
        self.log = ""  # everything read, for failure messages

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: re.Pattern[str], timeout: float = 120.0) -> str:
        """Read until ``pattern`` matches; return everything up to the end of the match
        (newlines normalised: the terminal writes \\r\\n)."""
        deadline = time.monotonic() + timeout
        while True:
            m = pattern.search(self.buf)
            if m:
                out, self.buf = self.buf[: m.end()], self.buf[m.end():]
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern.pattern!r} in time; output:\n{self.log[-3000:]}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            if not data:
                raise AssertionError(f"chat exited while waiting for {pattern.pattern!r}; "
                                     f"output:\n{self.log[-3000:]}")
            text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
            self.buf += text
            self.log += text

    def wait(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            # Keep the terminal drained so the child never blocks on a full pty buffer.
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.log += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.pid = 0
                return os.waitstatus_to_exitcode(status)
        raise AssertionError(f"chat did not exit; output:\n{self.log[-3000:]}")

    def close(self) -> None:
        if self.pid:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.wait(30)
            except AssertionError:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture(scope="module")
def tokenizer(real_model_path):
    from edgespec.llm.llamacpp import load_model
    from edgespec.llm.tokenizer import Tokenizer

    model = load_model(real_model_path, vocab_only=True)
    yield Tokenizer(model)
    model.close()


def assert_greedy_answer(answer: str, model_path: Path, tokenizer,
                         messages: list[dict[str, str]], what: str) -> None:
    """``answer`` (streamed text) must be the unsplit model's greedy answer to ``messages``, or
    part from it only at a near-tie of the model (ring_fixtures.assert_same_greedy: batch
    shapes differ between the ring and the reference). The terminal shows text, not token
    ids, so the answer is re-tokenized only when the texts differ, to find where they part."""
    prompt = tokenizer.chat_tokens(messages, add_generation_prompt=True)
    ref = unsplit_greedy(model_path, prompt, 40)
    end = next((i for i, t in enumerate(ref) if tokenizer.is_eog(t)), None)
    assert end is not None, "reference answer did not end within 40 tokens: pick a shorter turn"
    if answer == tokenizer.decode(ref[:end]):
        return
    got = tokenizer.encode(answer, add_special=False) + [ref[end]]
    assert_same_greedy(got, ref[: end + 1], model_path, prompt, what)


def _start_chat(*args: str) -> PtyProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="passive", TERM="dumb", PYTHONUNBUFFERED="1")
    exe = str(Path(sys.executable).with_name("edgespec"))
    return PtyProcess([exe, "chat", "--local", "2", *args], env)


def _turn(chat: PtyProcess, text: str) -> tuple[str, dict[str, int | str]]:
    """Send a user turn; return the streamed answer and the parsed statistics line."""
    chat.send(text + "\n")
    out = chat.expect(STATS_LINE)
    chat.expect(PROMPT)
    echo = out.index(text) + len(text) + 1  # the terminal echoes the typed line
    m = STATS_LINE.search(out)
    assert m is not None
    stats = {"tokens": int(m.group(1)), "mode": m.group(2), "prompt_tokens": int(m.group(3)),
             "prefill_tokens": int(m.group(4))}
    return out[echo: m.start()], stats


def _stats_json(chat: PtyProcess) -> dict:
    chat.send("/stats\n")
    out = chat.expect(PROMPT)
    return json.loads(out[out.index("{"): out.rindex("}") + 1])


@pytest.mark.parametrize("spec", ["none", "auto"])
def test_two_turns_stream_stats_and_kv_reuse(spec, real_model_path, tokenizer):
    chat = _start_chat("--spec", spec, "--max-tokens", "40")
    try:
        banner = chat.expect(PROMPT, timeout=180)
        assert "over 2 stage(s)" in banner and "/stats" in banner

        answer1, line1 = _turn(chat, TURN1)
        msgs = [{"role": "user", "content": TURN1}]
        assert_greedy_answer(answer1, real_model_path, tokenizer, msgs, "turn 1")
        assert line1["mode"] == ("none" if spec == "none" else "flow")
        assert line1["prompt_tokens"] == len(tokenizer.chat_tokens(msgs))
        assert line1["prefill_tokens"] == line1["prompt_tokens"]  # a fresh ring computes all

        answer2, line2 = _turn(chat, TURN2)
        msgs += [{"role": "assistant", "content": answer1}, {"role": "user", "content": TURN2}]
        assert_greedy_answer(answer2, real_model_path, tokenizer, msgs, "turn 2")

        stats = _stats_json(chat)
        assert stats["tokens"] == line2["tokens"] > 0
        assert stats["prompt_tokens"] == line2["prompt_tokens"]
        assert stats["prefill_tokens"] == line2["prefill_tokens"]
        assert stats["mode"] == line2["mode"]
        # The new turn's template tokens: what follows answer 1's end-of-turn token.
        new_turn = tokenizer.encode(f"\n<|im_start|>user\n{TURN2}<|im_end|>\n"
                                    "<|im_start|>assistant\n", add_special=False,
                                    parse_special=True)
        # Turn 2's prompt is the whole conversation: turn 1's prompt, answer 1, its
        # end-of-turn token, the new turn.
        assert stats["prompt_tokens"] == (line1["prompt_tokens"] + line1["tokens"] + 1
                                          + len(new_turn))
        if spec == "none":
            # Only the new turn is computed, plus answer 1's end-of-turn token: it was
            # generated but, being the last token, never fed back into the ring.
            assert stats["prefill_tokens"] == len(new_turn) + 1
        else:
            # Speculation may have accepted tokens past the end-of-turn token in its last
            # round (the template's own continuation): KV that the new turn reuses too.
            assert 1 <= stats["prefill_tokens"] <= len(new_turn) + 1

        chat.send("/exit\n")
        assert chat.wait() == 0
    finally:
        chat.close()


def test_ctrl_c_stops_the_answer_and_keeps_the_session(tokenizer):
    chat = _start_chat("--max-tokens", "300")
    try:
        chat.expect(PROMPT, timeout=180)
        nodes = children(chat.pid)
        assert len(nodes) == 2, f"expected 2 node processes under chat, found {nodes}"
        request = "Write a Python class for a bank account with deposit, withdraw and history."
        chat.send(request + "\n")
        # The answer streams: a line of its text is out (the main thread reads pieces, so
        # the Ctrl-C below cancels the answer rather than clearing the prompt's line).
        chat.expect(re.compile(re.escape(request) + r"\r?\n[^\n]{20}", re.S))
        chat.send("\x03")  # Ctrl-C on the terminal
        out = chat.expect(STATS_LINE)
        chat.expect(PROMPT)
        assert " [stopped]" in out
        m = STATS_LINE.search(out)
        assert m is not None and 0 < int(m.group(1)) < 300
        # Terminal signals reach only the chat: the ring's nodes keep running and answer.
        assert all(alive(p) for p in nodes)
        answer, line = _turn(chat, "Thanks. Reply with just: OK")
        assert answer.strip() and line["tokens"] > 0
        assert line["prefill_tokens"] < line["prompt_tokens"]  # earlier turns reused
        chat.send("/reset\n")
        assert "(conversation cleared)" in chat.expect(PROMPT)
        chat.send("/nonsense\n")
        assert "unknown command /nonsense" in chat.expect(PROMPT)
        chat.send("/exit\n")
        assert chat.wait() == 0
        deadline = time.monotonic() + 30
        while any(alive(p) for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in nodes), "node processes outlived the chat"
    finally:
        chat.close()


def _chat_in(home: Path, model: Path, *args: str) -> PtyProcess:
    """A chat on a local ring whose edgespec home (history file) is ``home``."""
    env = dict(os.environ, OMP_WAIT_POLICY="passive", TERM="dumb", PYTHONUNBUFFERED="1",
               EDGESPEC_HOME=str(home))
    exe = str(Path(sys.executable).with_name("edgespec"))
    return PtyProcess([exe, "chat", "--model", str(model), *args], env)


def test_line_editing_history_and_help(real_model_path, tokenizer, tmp_path):
    chat = _chat_in(tmp_path, real_model_path, "--local", "2", "--max-tokens", "8")
    try:
        chat.expect(PROMPT, timeout=180)
        chat.send("/help\n")
        listing = chat.expect(PROMPT)
        for command in ("/help", "/reset", "/stats", "/exit"):
            assert re.search(rf"\n  {command} +\w", listing), listing
        # Type "helo", one step left, insert "l", Enter: readline sends "hello".
        chat.send("helo")
        chat.send("\x1b[D")
        chat.send("l\r")
        m = STATS_LINE.search(chat.expect(STATS_LINE))
        chat.expect(PROMPT)
        assert m is not None
        assert int(m.group(3)) == len(tokenizer.chat_tokens([{"role": "user",
                                                              "content": "hello"}]))
        chat.send("/exit\n")
        assert chat.wait() == 0
    finally:
        chat.close()
    # The history file under the edgespec home keeps the edited line for the next session.
    assert (tmp_path / "chat_history").read_text().splitlines() == ["/help", "hello", "/exit"]


def test_a_ring_recovery_is_reported_outside_the_answer(real_model_path, tmp_path):
    chat = _chat_in(tmp_path, real_model_path, "--local", "3", "--spec", "none",
                    "--max-tokens", "200")
    try:
        chat.expect(PROMPT, timeout=180)
        nodes = sorted(children(chat.pid))
        assert len(nodes) == 3, nodes
        request = "Write a Python function that checks whether a number is prime."
        chat.send(request + "\n")
        chat.expect(re.compile(re.escape(request) + r"\n.{20}", re.S))  # the answer streams
        os.kill(nodes[1], signal.SIGKILL)  # the middle stage dies mid-answer
        out = chat.expect(STATS_LINE, timeout=240)
        chat.expect(PROMPT)
        # Each notice is a line of its own: the answer text around it stays intact.
        assert re.search(r"\n\[warning\] ring failure: [^\n]+\n", out), out
        assert re.search(r"\n\[warning\] ring recovered in [\d.]+ s with 2 stage\(s\)\n",
                         out), out
        chat.send("/exit\n")
        assert chat.wait() == 0
    finally:
        chat.close()


def test_piped_chat_exits_non_zero_after_a_failed_answer(real_model_path, tmp_path):
    long_turn = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 40
    exe = str(Path(sys.executable).with_name("edgespec"))
    env = dict(os.environ, OMP_WAIT_POLICY="passive", EDGESPEC_HOME=str(tmp_path))
    proc = subprocess.run([exe, "chat", "--local", "2", "--model", str(real_model_path),
                           "--ctx", "256", "--max-tokens", "8"],
                          input=f"{long_turn}\nSay hi.\n", capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "(error: the prompt has" in proc.stderr and "context" in proc.stderr  # one line
    assert "Traceback" not in proc.stderr
    assert STATS_LINE.search(proc.stdout)  # the chat went on to answer the next line


class ServeProcess:
    """`edgespec serve --local 2 --port 0`; its address comes from uvicorn's startup line."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.log_path = tmp / "serve.log"
        env = dict(os.environ, OMP_WAIT_POLICY="passive", PYTHONUNBUFFERED="1",
                   EDGESPEC_HOME=str(tmp))
        exe = str(Path(sys.executable).with_name("edgespec"))
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([exe, "serve", "--local", "2", "--port", "0",
                                          "--model", str(model)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while True:
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                break
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        nodes = children(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            for pid in nodes:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_chat_with_a_running_server(real_model_path, tokenizer, tmp_path):
    server = ServeProcess(tmp_path, real_model_path)
    try:
        exe = str(Path(sys.executable).with_name("edgespec"))
        proc = subprocess.run([exe, "chat", "--server", server.url, "--max-tokens", "40"],
                              input=f"{TURN1}\n/stats\n", capture_output=True, text=True,
                              timeout=300, env=dict(os.environ, EDGESPEC_HOME=str(tmp_path)))
    finally:
        server.stop()
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert f"on the server at {server.url}" in out
    m = re.search(r"\n> (.*?)\n\[(\d+) tokens in [\d.]+ s: [\d.]+ tok/s, prompt (\d+) tokens",
                  out, re.S)
    assert m is not None, out
    msgs = [{"role": "user", "content": TURN1}]
    assert_greedy_answer(m.group(1), real_model_path, tokenizer, msgs, "answer via server")
    assert int(m.group(3)) == len(tokenizer.chat_tokens(msgs))  # usage from the stream
    stats = json.loads(out[out.index("{"): out.rindex("}") + 1])
    assert stats["completion_tokens"] == int(m.group(2)) > 0
    assert stats["finish_reason"] == "stop"
    # The request went through the server's ring (its log shows the streamed POST).
    assert "POST /v1/chat/completions" in server.log()


def test_banner_names_the_draft_model(real_model_path, tmp_path):
    exe = str(Path(sys.executable).with_name("edgespec"))
    env = dict(os.environ, OMP_WAIT_POLICY="passive", EDGESPEC_HOME=str(tmp_path))
    proc = subprocess.run([exe, "chat", "--local", "2", "--model", str(real_model_path),
                           "--draft", str(real_model_path), "--draft-quant", "none"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    banner = proc.stdout.splitlines()[0]
    assert f"drafting with draft model {real_model_path.name}" in banner, banner


def _signal_another_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to one of ``pid``'s threads other than the main one: where the kernel
    may put a process-directed signal, and where Python's handler does not run."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    assert tids, "the chat runs threads (node links, heartbeat)"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tids[-1], sig) != 0:  # glibc >= 2.30
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.parametrize("sig,target", [(signal.SIGTERM, "process"), (signal.SIGHUP, "process"),
                                        (signal.SIGHUP, "another thread")])
def test_terminating_the_chat_stops_its_local_ring(real_model_path, tmp_path, sig, target):
    chat = _chat_in(tmp_path, real_model_path, "--local", "2")
    nodes: list[int] = []
    try:
        chat.expect(PROMPT, timeout=180)
        nodes = children(chat.pid)
        assert len(nodes) == 2, nodes
        if target == "process":
            os.kill(chat.pid, sig)  # a service manager, or the terminal window closing
        else:
            _signal_another_thread(chat.pid, sig)
        code = chat.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in nodes), "node processes outlived the chat"
        assert code == 128 + sig  # it ended through its own clean-up
    finally:
        chat.close()
        for p in nodes:  # never leave node processes behind, even on failure
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_max_tokens_beyond_the_context_answers_with_the_cap_reported(real_model_path, tmp_path):
    exe = str(Path(sys.executable).with_name("edgespec"))
    env = dict(os.environ, OMP_WAIT_POLICY="passive", EDGESPEC_HOME=str(tmp_path))
    proc = subprocess.run([exe, "chat", "--local", "2", "--model", str(real_model_path),
                           "--ctx", "256", "--max-tokens", "100000", "--spec", "none"],
                          input="Say hi.\n", capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert re.search(r"max_tokens 100000 capped to \d+", out), out
    assert STATS_LINE.search(proc.stdout), proc.stdout
