"""Soak: a ring serving six clients for ``--minutes`` while its devices fail on a schedule.

    .venv/bin/python -m bench.soak                 # as root: 10 minutes
    .venv/bin/python -m bench.soak --minutes 30 --out bench/results/soak.json
    .venv/bin/python -m bench.soak --smoke         # one minute: the default test run's size
    .venv/bin/python -m bench.soak --requests 500  # at most 500 requests (faults: 10 minutes)

The lab of ``tests/lab.py``: three devices, each a network namespace with its own
EDGESPEC_HOME and an ``edgespec node``; the head's namespace runs ``edgespec ring up --nodes
auto`` (mDNS) and then ``edgespec serve --parallel 7``; one more namespace on the LAN runs the
users (``bench/soak_clients.py``: six clients through every door, and a probe). No CPU shares:
the soak is about what holds, not how fast, and shares only slow its clock. Every plan is an
even split (``--no-profile``), so once the ring is whole again each node holds the window it
held after its warm-up and its memory then and at the end compare.

Faults, one after another from the end of the warm-up, in this order and again (all but the
head restart) while time is left, each followed by ``edgespec ring rebalance`` where the ring
lost a device, as its user would once the device is back, then a quiet gap. The head restarts
once, first, and only n2 is killed and restarted, so the head that serves the rest of the run
and the nodes n1 and n3 live through it and are judged for memory:

- ``head_restart``: the serving head is stopped (SIGTERM) and started again while clients retry;
- ``node_kill``: a node is SIGKILLed and started again;
- ``sigstop``: a node is frozen for 8 s (SIGSTOP, SIGCONT), a laptop that sleeps;
- ``link_down``: a device's link is down for 10 s (``ip link set eth0 down`` in its namespace);
- ``disk_full``: a node restarts with a 48 MiB disk and without the model, so its shards must
  arrive over the wire, and the rebalance that sends them meets a full disk; then it restarts
  with its own disk and the ring is rebalanced over it again;
- ``two_at_once``: one node frozen and another's link down, 10 s.

What it checks (``checks`` in the JSON; exit 1 if one fails): every request ended with an
answer or an error saying whether to retry within ``BOUND_S``; schema and tool answers valid;
every greedy answer of a prompt equal to its fault-free answer, through every door, or parted
at a near-tie (the logit gap under ``NEAR_TIE`` in the chat answer's log probabilities); the
ring served again within ``RECOVERY_S`` of each fault's end (a probe's one-token answer);
resident memory of the head and every node grew under 5% from the end of its warm-up to the
end, with open file descriptors and threads no more; /metrics' request counts of the last
head equal the clients' own count of their requests to it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from bench import soak_checks  # noqa: E402
from bench.ring_bench import machine_info  # noqa: E402
from bench.soak_clients import REQUEST_BOUND_S  # noqa: E402
from bench.testbed import REPO, homelab  # noqa: E402

PORT = 8080
PARALLEL = 7
FAULTS = ["head_restart", "node_kill", "sigstop", "link_down", "disk_full", "two_at_once"]
SAMPLE_EVERY_S = 5.0


def proc_sample(pid: int) -> dict[str, int] | None:
    """Resident memory (KiB), open file descriptors and threads of ``pid`` now."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    f = {k: v.split()[0] for k, v in (ln.split(":", 1) for ln in status.splitlines())
         if k in ("VmRSS", "RssAnon", "RssFile", "Threads")}
    if "VmRSS" not in f:  # a zombie: it has exited
        return None
    return {"rss_kib": int(f["VmRSS"]), "anon_kib": int(f["RssAnon"]),
            "file_kib": int(f["RssFile"]), "fds": fds, "threads": int(f["Threads"])}


class Soak:
    def __init__(self, workdir: Path, model: Path, minutes: float, log=print,
                 max_requests: int | None = None) -> None:
        self.workdir = workdir
        self.model = model
        self.run_s = minutes * 60
        self.max_requests = max_requests
        self.warmup_s = min(120.0, max(15.0, 0.15 * self.run_s))
        self.log = log
        self.key_file = workdir / "ring.key"
        self.lab = homelab.HomeLab(["n1", "n2", "n3"], workdir, plain=("lan",))
        self.faults: list[dict[str, Any]] = []
        self.restores: list[dict[str, Any]] = []
        self.samples: dict[str, list] = {}  # process label -> [[t, sample], ...]
        self.settled: list[list] = []  # [t, {label: sample}] while whole, between faults
        self.procs: dict[str, int] = {}  # process label -> pid, for those alive now
        self.heads: list[dict[str, float]] = []  # each serve's {started, ready}
        self.serve: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # --- the lab's processes ---------------------------------------------------------------

    def _track(self, label: str, pid: int) -> None:
        with self._lock:
            for old in [k for k in self.procs if k.split("#")[0] == label]:
                del self.procs[old]
            n = sum(1 for k in self.samples if k.split("#")[0] == label) + 1
            self.procs[f"{label}#{n}"] = pid
            self.samples[f"{label}#{n}"] = []

    def start_node(self, name: str, **kw: Any) -> None:
        d = self.lab.device(name)
        d.start_node(self.key_file, self.workdir, **kw)
        self._track(name, d.node.pid)

    def head_env(self) -> dict[str, str]:
        env = homelab.env_for(self.lab.head_home)
        env["EDGESPEC_KEY_FILE"] = str(self.key_file)
        return env

    def edgespec(self, *args: str, timeout: float = 300, check: bool = True
                 ) -> subprocess.CompletedProcess[str]:
        res = self.lab.head.run([*homelab.edgespec(), *args], env=self.head_env(), cwd=REPO,
                                timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise RuntimeError(f"edgespec {' '.join(args[:2])} exited {res.returncode}:\n"
                               f"{res.stderr[-3000:]}")
        return res

    def url(self) -> str:
        return f"http://{self.lab.head.address}:{PORT}"

    def lan_get(self, path: str, timeout: float = 5) -> str | None:
        """GET ``path`` of the server from the users' namespace (None: no answer)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            res = self.lab.hosts["lan"].run(["curl", "-sf", "-m", str(timeout),
                                             self.url() + path], timeout=timeout + 5,
                                            check=False)
            return res.stdout if res.returncode == 0 else None
        return None

    def start_serve(self) -> None:
        t0 = time.time()
        argv = [*homelab.edgespec(), "serve", "--host", "0.0.0.0", "--port", str(PORT),
                "--parallel", str(PARALLEL)]
        with open(self.workdir / "serve.err", "a") as fe:
            self.serve = self.lab.head_popen(argv, env=self.head_env(),
                                             stdout=subprocess.DEVNULL, stderr=fe)
        deadline = time.monotonic() + 120
        while self.lan_get("/health") is None:
            if self.serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("serve did not start: " + (self.workdir / "serve.err")
                                   .read_text(errors="replace")[-3000:])
            time.sleep(0.3)
        self._track("head", self.serve.pid)
        self.heads.append({"started": t0, "ready": time.time()})

    def stop_serve(self) -> None:
        assert self.serve is not None
        homelab.stop_process(self.serve, timeout=60)

    def stages(self) -> int | None:
        text = self.lan_get("/metrics")
        for line in (text or "").splitlines():
            if line.startswith("edgespec_stages "):
                return int(float(line.split()[1]))
        return None

    def sampler(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            self.sample()

    def settle(self) -> None:
        """A sample of every process at a quiet point between faults, where the ring is
        whole again (every node holds the window it holds in every whole ring)."""
        if self.stages() == 3:
            with self._lock:
                snap = {k: proc_sample(pid) for k, pid in self.procs.items()}
            self.settled.append([time.time(), {k: v for k, v in snap.items() if v}])

    def sample(self) -> None:
        with self._lock:
            for label, pid in self.procs.items():
                s = proc_sample(pid)
                if s is not None:
                    self.samples[label].append([time.time(), s])

    # --- faults ----------------------------------------------------------------------------

    def link(self, name: str, up: bool) -> None:
        self.lab.device(name).host.run(["ip", "link", "set", "eth0", "up" if up else "down"])

    def signal_node(self, name: str, sig: int) -> None:
        node = self.lab.device(name).node
        assert node is not None
        os.kill(node.pid, sig)

    def fault(self, kind: str) -> dict[str, Any]:
        """Inject one fault; returns its record (start, end: when the fault itself ended)."""
        rec: dict[str, Any] = {"kind": kind, "start": time.time()}
        self.log(f"fault {kind}")
        if kind == "head_restart":
            self.stop_serve()
            rec["end"] = time.time()
            self.start_serve()
            rec["head_ready_s"] = round(time.time() - rec["end"], 2)
        elif kind == "node_kill":
            self.signal_node("n2", signal.SIGKILL)
            self.lab.device("n2").node.wait(10)
            self.start_node("n2")
            rec["end"] = time.time()
        elif kind == "sigstop":
            self.signal_node("n1", signal.SIGSTOP)
            time.sleep(8)
            self.signal_node("n1", signal.SIGCONT)
            rec["end"] = time.time()
        elif kind == "link_down":
            self.link("n3", up=False)
            time.sleep(10)
            self.link("n3", up=True)
            rec["end"] = time.time()
        elif kind == "two_at_once":
            self.signal_node("n1", signal.SIGSTOP)
            self.link("n3", up=False)
            time.sleep(10)
            self.signal_node("n1", signal.SIGCONT)
            self.link("n3", up=True)
            rec["end"] = time.time()
        elif kind == "disk_full":
            rec.update(self.disk_full("n2"))
        else:
            raise ValueError(kind)
        return rec

    def disk_full(self, name: str) -> dict[str, Any]:
        """The node restarted on a small disk without the model; a rebalance sends it shards
        until the disk is full. Then it comes back as it was."""
        d = self.lab.device(name)
        d.stop_node()
        small = self.workdir / f"small-disk-{name}"
        small.mkdir(exist_ok=True)
        from edgespec.llm import models

        # A mount namespace of its own: an empty tmpfs over the models (the node has no copy
        # of the model) and a 48 MiB one as its cache, where arriving shards are written.
        mounts = (f"mount -t tmpfs -o size=1m tmpfs {models.models_dir()} && "
                  f"mount -t tmpfs -o size=48m tmpfs {small} && exec \"$@\"")
        try:
            self.start_node(name, prefix=("unshare", "-m", "--propagation", "private", "sh",
                                          "-c", mounts, "sh"), extra=("--cache", str(small)))
        except AssertionError as e:  # no mount namespace here: the fault cannot be made
            d.stop_node()
            self.start_node(name)
            return {"end": time.time(), "skipped": str(e)[-400:]}
        res = self.rebalance()
        out = {"end": None, "rebalance_rc": res.returncode,
               "rebalance_said": (res.stderr.strip().splitlines() or [""])[-1][:400]}
        d.stop_node()
        self.start_node(name)
        out["end"] = time.time()
        return out

    def rebalance(self) -> subprocess.CompletedProcess[str]:
        """``edgespec ring rebalance`` as the user runs it (it goes through the server),
        with the even split every plan of the soak uses."""
        return self.edgespec("ring", "rebalance", "--no-profile", "--key-file",
                             str(self.key_file), timeout=300, check=False)

    def restore(self) -> None:
        """Bring every device back into the ring (a rebalance through the server) where the
        ring lost one."""
        t0 = time.time()
        n = self.stages()
        if n == 3:
            return
        res = self.rebalance()
        self.restores.append({"t": t0, "stages_before": n, "rc": res.returncode,
                              "s": round(time.time() - t0, 2), "stages_after": self.stages(),
                              "said": (res.stderr.strip().splitlines() or [""])[-1][:400]})

    # --- the run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from edgespec.llm import models
        from edgespec.wire import auth

        auth.write_key(self.key_file)
        with self.lab:
            (self.lab.head_home / "models").symlink_to(models.models_dir())
            for n in self.lab.names:
                self.start_node(n)
            self.log("ring up")
            self.edgespec("ring", "up", "--model", str(self.model), "--nodes", "auto",
                          "--expect", "3", "--timeout", "60", "--ctx", "8192", "--no-profile",
                          "--key-file",
                          str(self.key_file), timeout=600)
            self.start_serve()
            events = self.workdir / "requests.jsonl"
            t_start = time.time()
            until = t_start + self.run_s
            drv_err = open(self.workdir / "clients.err", "w")  # noqa: SIM115
            driver = subprocess.Popen(homelab.enter(self.lab.hosts["lan"], None, [
                sys.executable, "-m", "bench.soak_clients", "--url", self.url(), "--until",
                str(until), "--out", str(events)] + (
                    ["--requests", str(self.max_requests)] if self.max_requests else [])),
                cwd=REPO, env=homelab.env_for(
                self.lab.head_home), stdout=subprocess.DEVNULL, stderr=drv_err)
            sampler = threading.Thread(target=self.sampler, daemon=True)
            sampler.start()
            try:
                self.sample()
                time.sleep(self.warmup_s)
                i = 0
                gap = min(20.0, max(5.0, self.run_s / 60))
                while time.time() < until - 20:
                    self.settle()
                    # The head restarts once, first: the head that then serves the rest of
                    # the run is judged for memory like the nodes that are never restarted.
                    kind = FAULTS[i] if i < len(FAULTS) else FAULTS[1 + i % (len(FAULTS) - 1)]
                    rec = self.fault(kind)
                    self.faults.append(rec)
                    i += 1
                    time.sleep(3)  # the ring's own recovery first, then the user's rebalance
                    self.restore()
                    time.sleep(gap)
                self.log("faults done; waiting for the clients")
                driver.wait(REQUEST_BOUND_S + max(0, until - time.time()) + 120)
            finally:
                if driver.poll() is None:
                    driver.kill()
                drv_err.close()
                time.sleep(2)
                self.sample()
                self.settle()
                self._stop.set()
            records = [json.loads(ln) for ln in events.read_text().splitlines() if ln]
            final = {"stages": self.stages(), "plan": self.edgespec(
                "ring", "status", "--json", "--key-file", str(self.key_file),
                check=False).stdout[-4000:]}
            self.stop_serve()
        report = soak_checks.judge(records, self.faults, self.samples, self.settled,
                                   self.heads, warmup_s=self.warmup_s, t_start=t_start)
        report["restores"] = self.restores
        report["final"] = final
        return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long clients run")
    ap.add_argument("--requests", type=int, default=None,
                    help="clients start at most this many requests in all (default: as many "
                         "as --minutes allows); the faults still run for --minutes")
    ap.add_argument("--smoke", action="store_true",
                    help="one minute (the size the default test run uses)")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="registry name or .gguf")
    ap.add_argument("--out", default=None, help="write the JSON report here too")
    ap.add_argument("--workdir", default=None, help="keep the lab's logs here")
    args = ap.parse_args()
    if args.smoke:
        args.minutes = 1.0
    reason = homelab.skip_reason()
    if reason:
        print(f"soak: no lab here: {reason}", file=sys.stderr)
        return 2
    from edgespec.llm import models

    model = models.resolve(args.model)
    import tempfile

    with contextlib.ExitStack() as stack:
        workdir = Path(args.workdir) if args.workdir else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="edgespec-soak-")))
        workdir.mkdir(parents=True, exist_ok=True)
        report = Soak(workdir, model, args.minutes, max_requests=args.requests,
                      log=lambda m: print(f"[{time.strftime('%H:%M:%S')}] {m}",
                                          file=sys.stderr, flush=True)).run()
    report["machine"] = machine_info()
    report["command"] = " ".join([Path(sys.executable).name, "-m", "bench.soak",
                                  *sys.argv[1:]])
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all(c["ok"] for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
