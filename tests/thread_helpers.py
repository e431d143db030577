"""Racing threads in unit tests: shared state fed from several threads at once."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any


def race(target: Callable[[Any], None], args: Iterable[Any]) -> None:
    """``target(arg)`` in one thread per ``arg``, all at once, switching threads as often as
    the interpreter can (where a missing lock shows); re-raises what any thread raised."""
    errors: list[BaseException] = []

    def run(arg: Any) -> None:
        try:
            target(arg)
        except BaseException as e:  # re-raised below, never lost in a thread
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(a,)) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    if errors:
        raise errors[0]
