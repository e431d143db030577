"""The chat's terminal side: the command list, the screen (answers and notices on lines of their
own) and the input line (readline editing and history under the edgespec home)."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

COMMANDS = (
    ("/help", "list these commands"),
    ("/reset", "start a new conversation"),
    ("/stats", "statistics of the last answer (JSON)"),
    ("/exit", "leave the chat (also /quit or Ctrl-D)"),
)
HELP = "commands: " + ", ".join(name for name, _ in COMMANDS) + " (Ctrl-C stops an answer)"
HISTORY_FILE = "chat_history"
HISTORY_LENGTH = 1000


# ---------------------------------------------------------------------------- the screen

class Screen:
    """The answer stream and out-of-band notices share one terminal.

    The screen remembers whether the cursor is in the middle of an answer line; a notice then
    starts a new line first, so it never lands inside the answer text, and the answer goes on
    below it. Safe to call from the generation thread and the logging machinery at once.
    """

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out = out
        self.err = err
        self._lock = threading.Lock()
        self._mid_line = False

    def write(self, text: str) -> None:
        """Answer text or prompts, on ``out``."""
        if not text:
            return
        with self._lock:
            self.out.write(text)
            self.out.flush()
            self._mid_line = not text.endswith("\n")

    def notice(self, text: str) -> None:
        """A status or warning line of its own, on ``err``."""
        with self._lock:
            if self._mid_line:
                self.out.write("\n")
                self.out.flush()
                self._mid_line = False
            self.err.write(text.rstrip("\n") + "\n")
            self.err.flush()


class _NoticeHandler(logging.Handler):
    """Routes log records to ``Screen.notice`` while a chat runs."""

    def __init__(self, screen: Screen, level: int) -> None:
        super().__init__(level)
        self.screen = screen

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.screen.notice(f"[{record.levelname.lower()}] {record.getMessage()}")
        except Exception:  # logging must never break the chat
            self.handleError(record)


@contextlib.contextmanager
def notices_on(screen: Screen) -> Iterator[None]:
    """Send the package's log records to ``screen`` for the duration of the chat.

    Warnings and errors always; lower levels only when the package logger is set to show them
    (``edgespec -v``). The package logger stops propagating meanwhile, so a record is not also
    printed by the root handler in the middle of an answer."""
    logger = logging.getLogger("edgespec")
    level = logging.DEBUG if logger.getEffectiveLevel() <= logging.DEBUG else logging.WARNING
    handler = _NoticeHandler(screen, level)
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved


# ----------------------------------------------------------------------------- input lines

class LineReader:
    """Reads the user's lines: with readline on a terminal, plainly from a pipe."""

    def __init__(self, inp: TextIO, screen: Screen) -> None:
        self.inp = inp
        self.screen = screen
        self.history_path: Path | None = None
        self._readline: Any = None
        self.interactive = (inp is sys.stdin and screen.out is sys.stdout
                            and _isatty(inp) and _isatty(screen.out))
        if self.interactive:
            try:
                import readline  # line editing for input(); absent on some platforms
            except ImportError:
                readline = None  # type: ignore[assignment]
            if readline is not None:
                self._readline = readline
                self._load_history()

    def _load_history(self) -> None:
        from edgespec.llm.models import home

        self.history_path = home() / HISTORY_FILE
        rl = self._readline
        rl.set_history_length(HISTORY_LENGTH)
        with contextlib.suppress(OSError):
            rl.read_history_file(self.history_path)

    def _remember(self, line: str) -> None:
        if self._readline is None or self.history_path is None or not line.strip():
            return
        try:
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            if not self.history_path.exists():
                self.history_path.touch(mode=0o600)
            self._readline.append_history_file(1, self.history_path)
            self._readline.set_history_length(HISTORY_LENGTH)
        except OSError:  # no history is no reason to stop chatting
            self.history_path = None

    def read(self, prompt: str) -> str | None:
        """One line without its newline; None at end of input. Ctrl-C propagates."""
        if self.interactive:
            try:
                line = input(prompt)
            except EOFError:
                return None
            self._remember(line)
            return line
        self.screen.write(prompt)
        line = self.inp.readline()
        if not line:
            return None
        return line.rstrip("\r\n")


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
