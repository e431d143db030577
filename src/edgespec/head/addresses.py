"""Which nodes a head talks to: ``host:port`` lists, and mDNS discovery (docs/design.md 5.5)
with the choice of the address to dial among those a node advertises. The zeroconf browsing
itself is ``edgespec.discovery``'s; this is the head's use of it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from edgespec.errors import RingError
from edgespec.head.remote import CONNECT_TIMEOUT_S, Address, dial
from edgespec.wire import control as ctl

log = logging.getLogger("edgespec.ring")


def _local_networks() -> list[Any]:
    """The IPv4 networks this host has an interface on (the head's own LAN segments)."""
    import ipaddress

    import ifaddr  # a zeroconf dependency

    nets = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}",
                                                     strict=False))
    return nets


def pick_address(addresses: Sequence[str]) -> str | None:
    """The address of a node's mDNS record to connect to.

    A node bound to every interface advertises all its addresses (LAN, VPN, container
    bridges...), in no useful order. Prefer one on a network the head itself is on, then any
    other routable IPv4 address, then IPv6; skip unspecified and IPv6 link-local addresses
    (the latter need a scope the transport does not carry). Loopback is kept last: it is right
    only for a node on this very host.
    """
    import ipaddress

    nets = _local_networks()
    ranked = []
    for i, text in enumerate(addresses):
        try:
            ip = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            continue
        if ip.is_unspecified or (ip.version == 6 and ip.is_link_local):
            continue
        if ip.is_loopback:
            rank = 3
        elif ip.version == 4 and any(ip in net for net in nets if not net.is_loopback):
            rank = 0
        else:
            rank = 1 if ip.version == 4 else 2
        ranked.append((rank, i, text))  # ties keep the record's order
    return min(ranked)[2] if ranked else None


def discover(expect: int | None, timeout: float, key: bytes | None = None,
             log_fn: Callable[[str], None] = log.warning) -> list[Address]:
    """Node addresses found over mDNS (compatible protocol only).

    With ``key``, only nodes that prove it (and answer a ping) count: an advertiser that fails
    the handshake or stalls is skipped, named in the log, and does not count toward
    ``expect``; browsing goes on for real nodes until ``timeout``.
    """
    from edgespec.wire.discovery import browse

    deadline = time.monotonic() + timeout
    good: list[Address] = []
    skipped: dict[Address, str] = {}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        want = None if expect is None else expect + len(skipped)
        for n in browse(timeout=left, expect=want):
            if not n.compatible:
                if (n.name, n.port) not in skipped:
                    log_fn(f"ignoring {n.name}: protocol {n.proto} (we speak another)")
                skipped[(n.name, n.port)] = "incompatible protocol"
                continue
            host = pick_address(n.addresses)
            if host is None:
                log_fn(f"ignoring {n.name}: its mDNS record has no usable address "
                       f"({', '.join(n.addresses) or 'none'})")
                skipped[(n.name, n.port)] = "no usable address"
                continue
            addr = (host, n.port)
            if addr in good or addr in skipped:
                continue
            if key is not None:
                try:
                    conn = dial(addr, key, "head-probe",
                                 timeout=max(1.0, min(CONNECT_TIMEOUT_S, left)))
                    try:
                        conn.request(ctl.request_message(ctl.Ping()), timeout=5.0)
                    finally:
                        conn.close()
                except Exception as e:
                    skipped[addr] = str(e)
                    log_fn(f"skipping {n.name} at {host}:{n.port}: {e}")
                    continue
            good.append(addr)
        if expect is None or len(good) >= expect:
            break
    if expect is not None and len(good) < expect:
        extra = (f"; skipped {len(skipped)} that failed: "
                 + "; ".join(f"{a[0]}:{a[1]} ({why})" for a, why in skipped.items())
                 if skipped else "")
        raise RingError(f"found {len(good)} usable node(s) over mDNS within {timeout:.0f} s, "
                        f"expected {expect}{extra}: is `edgespec node` running on each device, "
                        f"on this LAN, with this ring key?")
    return good[:expect] if expect is not None else good


def parse_nodes(spec: str) -> list[Address]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RingError(f"bad node address {part!r}: expected host:port")
        out.append((host, int(port)))
    if not out:
        raise RingError("no node addresses given")
    return out
