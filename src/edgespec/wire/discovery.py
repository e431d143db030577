"""Finding ring nodes on the LAN over mDNS / DNS-SD (zeroconf), service ``_edgespec._tcp.local.``.

A node advertises its address and port plus public facts in TXT fields:

=========  ==========================================================
``id``     node id (stable, random)
``ver``    edgespec version
``proto``  wire protocol version (``edgespec.wire.PROTOCOL_VERSION``)
``backend``cpu / cuda / metal / vulkan / rocm / gpu
``ram``    free RAM, MiB
``vram``   free discrete GPU memory, MiB ("" when none is detectable)
``models`` comma-separated fingerprints of cached models (sha256 prefixes)
=========  ==========================================================

Only these keys are ever written (``NodeInfo.txt``), so no secret can leak into mDNS: the ring
key is proven on the TCP connection (``edgespec.wire.auth``), never announced.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from zeroconf import (
    InterfaceChoice,
    IPVersion,
    ServiceBrowser,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    get_all_addresses,
)

from edgespec.wire.header import PROTOCOL_VERSION

log = logging.getLogger("edgespec.discovery")

SERVICE_TYPE = "_edgespec._tcp.local."
TXT_KEYS = ("id", "ver", "proto", "backend", "ram", "vram", "models")
_TXT_ENTRY_MAX = 255  # DNS character-string limit for one "key=value"
_MIB = 1024 * 1024


class DiscoveryError(RuntimeError):
    """A node could not be advertised, or a record is malformed."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("edgespec")
    except Exception:
        return "0+unknown"


@dataclass(frozen=True)
class NodeInfo:
    """A node as seen on the LAN (what its mDNS record says)."""

    name: str
    node_id: str
    port: int
    addresses: tuple[str, ...] = ()
    version: str = field(default_factory=_version)
    proto: int = PROTOCOL_VERSION
    backend: str = "cpu"
    free_ram_mb: int = 0
    free_vram_mb: int | None = None
    models: tuple[str, ...] = ()

    @property
    def compatible(self) -> bool:
        """Whether this node speaks our wire protocol."""
        return self.proto == PROTOCOL_VERSION

    def txt(self) -> dict[str, str]:
        """The TXT fields; fingerprints that would overflow a record are left out (logged)."""
        fields = {
            "id": self.node_id,
            "ver": self.version,
            "proto": str(self.proto),
            "backend": self.backend,
            "ram": str(int(self.free_ram_mb)),
            "vram": "" if self.free_vram_mb is None else str(int(self.free_vram_mb)),
        }
        models: list[str] = []
        for fp in self.models:
            if len("models=" + ",".join([*models, fp])) > _TXT_ENTRY_MAX:
                log.warning("%s: %d model fingerprints do not fit one TXT entry; advertising %d", self.name, len(self.models), len(models))
                break
            models.append(fp)
        fields["models"] = ",".join(models)
        for k, v in fields.items():
            if len(f"{k}={v}".encode()) > _TXT_ENTRY_MAX:
                raise DiscoveryError(f"TXT field {k!r} longer than {_TXT_ENTRY_MAX} bytes")
            if "," in v and k != "models":
                raise DiscoveryError(f"TXT field {k!r} may not contain ','")
        return fields

    @classmethod
    def from_service(cls, info: ServiceInfo) -> NodeInfo:
        """Parse a resolved zeroconf record; raise DiscoveryError if fields are missing/bad."""
        props = {
            (k.decode("utf-8", "replace") if isinstance(k, bytes) else str(k)): (v.decode("utf-8", "replace") if isinstance(v, bytes) else "")
            for k, v in (info.properties or {}).items()
        }
        missing = [k for k in ("id", "proto") if not props.get(k)]
        if missing:
            raise DiscoveryError(f"{info.name}: TXT record lacks {missing}")
        try:
            proto = int(props["proto"])
            ram = int(props.get("ram") or 0)
            vram = int(props["vram"]) if props.get("vram") else None
        except ValueError as e:
            raise DiscoveryError(f"{info.name}: bad numeric TXT field: {e}") from None
        if info.port is None or not 0 < info.port < 65536:
            raise DiscoveryError(f"{info.name}: no valid port")
        name = info.name[: -len("." + SERVICE_TYPE)] if info.name.endswith("." + SERVICE_TYPE) else info.name
        return cls(
            name=name,
            node_id=props["id"],
            port=int(info.port),
            addresses=tuple(info.parsed_scoped_addresses(IPVersion.All)),
            version=props.get("ver", ""),
            proto=proto,
            backend=props.get("backend", ""),
            free_ram_mb=ram,
            free_vram_mb=vram,
            models=tuple(m for m in props.get("models", "").split(",") if m),
        )


def local_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses (what a node advertises by default)."""
    return sorted(a for a in get_all_addresses() if not ipaddress.ip_address(a).is_loopback)


def _service_info(info: NodeInfo, addresses: Sequence[str]) -> ServiceInfo:
    if not 0 < info.port < 65536:
        raise DiscoveryError(f"port {info.port} out of range")
    if not info.name or "." in info.name:
        raise DiscoveryError(f"node name {info.name!r} must be non-empty and contain no '.'")
    if not addresses:
        raise DiscoveryError("no address to advertise (no non-loopback interface; pass addresses=)")
    packed = [socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a) for a in addresses]
    host = "".join(c if c.isalnum() or c == "-" else "-" for c in f"{info.name}-{info.node_id[:8]}")
    return ServiceInfo(
        SERVICE_TYPE,
        f"{info.name}.{SERVICE_TYPE}",
        addresses=packed,
        port=info.port,
        properties=info.txt(),
        server=f"{host}.local.",
    )


@contextlib.contextmanager
def advertise(
    info: NodeInfo,
    *,
    addresses: Sequence[str] | None = None,
    zeroconf: Zeroconf | None = None,
    interfaces: InterfaceChoice | Sequence[str] = InterfaceChoice.All,
) -> Iterator[ServiceInfo]:
    """Announce ``info`` while the block runs; unregister (goodbye packets) on exit.

    ``addresses`` defaults to ``info.addresses``, else every non-loopback IPv4 address. If the
    name is taken by another node, zeroconf picks a free variant (see the yielded record's name).
    """
    addrs = list(addresses or info.addresses or local_addresses())
    record = _service_info(info, addrs)
    zc = zeroconf or Zeroconf(interfaces=interfaces)
    try:
        zc.register_service(record, allow_name_change=True)
        log.info("advertising %s on %s port %d", record.name, ",".join(addrs), info.port)
        try:
            yield record
        finally:
            with contextlib.suppress(Exception):
                zc.unregister_service(record)
    finally:
        if zeroconf is None:
            zc.close()


def browse(
    timeout: float = 3.0,
    expect: int | None = None,
    *,
    zeroconf: Zeroconf | None = None,
    interfaces: InterfaceChoice | Sequence[str] = InterfaceChoice.All,
    resolve_timeout: float = 1.5,
) -> list[NodeInfo]:
    """Nodes answering on the LAN, sorted by name.

    Returns as soon as ``expect`` nodes are resolved, else after ``timeout`` seconds. Records
    that cannot be parsed are skipped with a log line; nodes speaking another protocol version
    are returned (see ``NodeInfo.compatible``) so the caller can say why it ignores them.
    """
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    zc = zeroconf or Zeroconf(interfaces=interfaces)
    seen: dict[str, ServiceStateChange] = {}

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        seen[name] = state_change  # resolving here would block zeroconf's own thread

    browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[on_change])
    found: dict[str, NodeInfo] = {}
    bad: set[str] = set()
    deadline = time.monotonic() + timeout
    try:
        while True:
            for name, state in list(seen.items()):
                if state == ServiceStateChange.Removed:
                    found.pop(name, None)
                    continue
                if name in found or name in bad:
                    continue
                rec = ServiceInfo(SERVICE_TYPE, name)
                left = deadline - time.monotonic()
                if left <= 0 or not rec.request(zc, int(1000 * min(resolve_timeout, left))):
                    continue
                try:
                    found[name] = NodeInfo.from_service(rec)
                except DiscoveryError as e:
                    bad.add(name)
                    log.warning("ignoring %s", e)
            if (expect is not None and len(found) >= expect) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
    finally:
        browser.cancel()
        if zeroconf is None:
            zc.close()
    return sorted(found.values(), key=lambda n: n.name)
