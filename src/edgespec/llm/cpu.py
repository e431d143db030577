"""What this host's CPU offers llama.cpp: its physical cores (so the threads of a context),
and whether weight repacking ("extra buffer types") is safe here (docs/design.md 3.6, 3.7).
Reads ``/proc/cpuinfo`` and the environment only; ``edgespec.llm.llamacpp`` applies it."""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical cores usable by this process (hyper-threads counted once)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        cores: set[tuple[str, str]] = set()
        cpu = phys = core = None
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu, phys, core = int(value), "0", None
                elif key == "physical id":
                    phys = value
                elif key == "core id":
                    core = value
                elif not key and cpu is not None:
                    if allowed is None or cpu in allowed:
                        cores.add((phys or "0", core if core is not None else str(cpu)))
                    cpu = None
        if cpu is not None and (allowed is None or cpu in allowed):
            cores.add((phys or "0", core if core is not None else str(cpu)))
        if cores:
            return len(cores)
    except OSError:
        pass
    return len(allowed) if allowed else (os.cpu_count() or 1)


def default_threads(contexts_on_host: int = 1) -> int:
    """Threads for one llama.cpp context.

    One thread per context when several contexts share this host (they would otherwise fight
    over the cores), else all physical cores. ``EDGESPEC_THREADS`` overrides both.
    """
    env = os.environ.get("EDGESPEC_THREADS")
    if env:
        try:
            value = int(env)
        except ValueError as e:
            raise ValueError(f"EDGESPEC_THREADS must be an integer, got {env!r}") from e
        if value < 1:
            raise ValueError(f"EDGESPEC_THREADS must be >= 1, got {value}")
        return value
    if contexts_on_host > 1:
        return 1
    return max(1, physical_cores())


def cpu_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU reports AMX tiles (Linux ``/proc/cpuinfo`` flags; False where unknown)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def extra_bufts_default() -> bool:
    """CPU extra buffer types unless the CPU has AMX (the crash of docs/design.md 3.6).

    ``EDGESPEC_EXTRA_BUFTS=1`` / ``=0`` overrides. Measured on the 2-core AMD EPYC (1 thread, ms
    per decode of 1 token): Qwen2.5-Coder-1.5B Q4_K_M 61.0 off / 49.7 on; a Q4_0 0.5B 31.1 / 18.1.
    """
    env = os.environ.get("EDGESPEC_EXTRA_BUFTS", "")
    if env not in ("", "auto"):
        return env != "0"
    return not cpu_has_amx()
