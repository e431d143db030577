"""HTTPS for `edgespec serve`: the certificate and key it is given (``--tls-cert``,
``--tls-key``), or a self-signed one (``--tls-self-signed``) made with ``cryptography`` on
first use and kept beside the ring key (``serve-cert.pem``, ``serve-key.pem``, the key
readable by its owner only). The self-signed certificate names localhost, 127.0.0.1, ::1,
this machine's name and the served host; one that lacks a name asked for now, or has expired,
is made anew. Clients trust it through its file (``curl --cacert``, the clients'
``verify``/CA-file options) or its SHA-256 fingerprint, which ``serve`` prints at start.
``exposure_warnings``: what ``serve`` warns of beyond loopback (no key, or a key over plain
HTTP)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CERT_NAME, KEY_NAME = "serve-cert.pem", "serve-key.pem"

#: How long a self-signed certificate lasts.
VALID_DAYS = 3650


def _names(hosts: Iterable[str]) -> tuple[set[str], set[str]]:
    """(DNS names, IP addresses) a certificate for ``hosts`` names, loopback included."""
    dns, ips = {"localhost", socket.gethostname()}, {"127.0.0.1", "::1"}
    for h in hosts:
        h = h.strip("[]")
        if not h or h in ("0.0.0.0", "::"):
            continue  # a wildcard address: clients reach it by this host's name
        try:
            ips.add(str(ipaddress.ip_address(h)))
        except ValueError:
            dns.add(h)
    return dns, ips


def _covers(cert: x509.Certificate, dns: set[str], ips: set[str]) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    have_dns = set(san.get_values_for_type(x509.DNSName))
    have_ips = {str(a) for a in san.get_values_for_type(x509.IPAddress)}
    fresh = cert.not_valid_after_utc > datetime.datetime.now(datetime.timezone.utc) + \
        datetime.timedelta(days=1)
    return fresh and dns <= have_dns and ips <= have_ips


def fingerprint(cert_file: str | os.PathLike[str]) -> str:
    """The certificate's SHA-256 fingerprint, as ``AB:CD:...`` (what browsers show)."""
    cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
    return ":".join(f"{b:02X}" for b in cert.fingerprint(hashes.SHA256()))


def self_signed(directory: str | os.PathLike[str], hosts: Iterable[str] = ()
                ) -> tuple[Path, Path]:
    """(certificate, key) files of a self-signed certificate in ``directory`` naming
    ``hosts`` (and loopback): the one kept there if it still serves, else a new one."""
    where = Path(directory)
    cert_path, key_path = where / CERT_NAME, where / KEY_NAME
    dns, ips = _names(hosts)
    if cert_path.exists() and key_path.exists():
        try:
            if _covers(x509.load_pem_x509_certificate(cert_path.read_bytes()), dns, ips):
                return cert_path, key_path
        except ValueError:
            pass  # not a certificate: made anew below
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"edgespec serve on "
                                         f"{socket.gethostname()}")])
    now = datetime.datetime.now(datetime.timezone.utc)
    public = key.public_key()
    alt = [x509.DNSName(d) for d in sorted(dns)] + \
        [x509.IPAddress(ipaddress.ip_address(a)) for a in sorted(ips)]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(public).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            # Its own authority: clients given the file as their CA trust it.
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=True,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public),
                           critical=False)
            .sign(key, hashes.SHA256()))
    where.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def exposure_warnings(host: str, api_key: str | None, tls: object) -> list[str]:
    """What `serve` warns of when it listens beyond loopback: no API key, or a key sent
    over plain HTTP."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return []
    if not api_key:
        return [f"serving on {host} without --api-key: anyone who can reach this port can "
                "use the ring"]
    if not tls:
        return [f"serving on {host} over plain HTTP with an API key: the key and the "
                "conversations cross the network readable; serve HTTPS with --tls-cert/"
                "--tls-key or --tls-self-signed"]
    return []
