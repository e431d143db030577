"""Node processes on this one machine: N `edgespec node` processes on loopback, the same
code path as a LAN ring. ``Ring.local`` (``edgespec.head.build.open_local_ring``), ``edgespec
demo`` and tests start them."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from edgespec.holder import PARENT_ENV

_LISTEN = re.compile(r"edgespec node \S+ \((\S+)\) on ([\d.]+):(\d+)")


class LocalNodes:
    """``n`` `edgespec node` processes on 127.0.0.1, one llama.cpp thread each."""

    def __init__(self, n: int, key_file: Path, *, threads: int = 1, verbose: bool = False,
                 cache_dir: Path | None = None, startup_timeout: float = 60.0) -> None:
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[tuple[str, int]] = []
        env = dict(os.environ)
        # Several contexts share the cores: passive OpenMP waiting (busy-waiting threads of
        # several processes starve each other).
        env.setdefault("OMP_WAIT_POLICY", "passive")
        # The node asks the kernel for SIGTERM when this process dies (see
        # edgespec.node.die_with_parent), so a killed head leaves no node behind.
        env[PARENT_ENV] = str(os.getpid())
        try:
            for i in range(n):
                cmd = [sys.executable, "-m", "edgespec"] + (["-v"] if verbose else []) + [
                    "node", "--port", "0", "--bind", "127.0.0.1", "--no-mdns",
                    "--name", f"local{i}", "--key-file", str(key_file),
                    "--threads", str(threads)]
                if cache_dir is not None:
                    cmd += ["--cache", str(cache_dir)]
                # A session of their own: Ctrl-C in the head's terminal (the chat CLI stops the
                # current answer with it) must not reach the nodes, which would stop them.
                p = _spawn(cmd, stdout=subprocess.PIPE, stderr=None if verbose else
                           subprocess.DEVNULL, text=True, env=env, start_new_session=True)
                self.procs.append(p)
            deadline = time.monotonic() + startup_timeout
            for p in self.procs:
                line = ""
                while time.monotonic() < deadline:
                    line = p.stdout.readline() if p.stdout else ""
                    if not line and p.poll() is not None:
                        raise RuntimeError(f"local node exited with code {p.returncode}")
                    m = _LISTEN.search(line)
                    if m:
                        self.addresses.append((m.group(2), int(m.group(3))))
                        break
                else:
                    raise RuntimeError("local node did not start in time")
                # Keep draining stdout so the node never blocks on a full pipe.
                threading.Thread(target=_drain, args=(p,), daemon=True).start()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn(cmd: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen from one long-lived thread of this process. Linux ties a child's death signal
    (PR_SET_PDEATHSIG, asked for by the node) to the *thread* that forked it: a ring opened
    in a short-lived thread (a worker of some script or server) would otherwise see its nodes
    stopped when that thread ends."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="edgespec-spawner")
    return _spawner.submit(subprocess.Popen, cmd, **kwargs).result()


def _drain(p: subprocess.Popen) -> None:
    with contextlib.suppress(Exception):
        for _ in p.stdout:  # type: ignore[union-attr]
            pass
