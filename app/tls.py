"""TLS on the gateway's own port, and the contexts its clients verify it with.

docs/design/tls.md: clients and agents -> gateway are encrypted and
verified; there is no setting that turns verification off.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def check_pair(cert_file: Path, key_file: Path, settings: tuple[str, str] = (
        "LLMGW_TLS_CERT_FILE", "LLMGW_TLS_KEY_FILE"), doing: str = "serve TLS") -> None:
    """Raises ValueError (one line) unless the certificate and key load and
    match: found at start, not at the first client's handshake. `settings`
    name the two files in the message (the gateway's own pair, or its
    client certificate for etcd)."""
    for what, path in zip(settings, (cert_file, key_file), strict=True):
        try:
            path.read_bytes()
        except OSError as exc:
            raise ValueError(f"{what} {path}: {exc.strerror or exc}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # No pass phrase: OpenSSL would otherwise ask for one on the terminal
        # (and uvicorn again), so an encrypted key fails here instead.
        ctx.load_cert_chain(cert_file, key_file, password=_no_pass_phrase)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ValueError(
            f"cannot {doing} with certificate {cert_file} and key {key_file} (a PEM "
            f"certificate chain and its unencrypted private key are needed): {exc}") from None


def _no_pass_phrase() -> bytes:
    raise ValueError("the key is encrypted")


def client_context(ca_file: str | None, setting: str = "LLMGW_CA_FILE") -> ssl.SSLContext:
    """Verifies the gateway against `ca_file` (a PEM bundle), or the
    system's CAs when None. Raises ValueError (one line, naming `setting`)
    for a bad file."""
    try:
        return ssl.create_default_context(cafile=ca_file or None)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"{setting} {ca_file}: {getattr(exc, 'strerror', None) or exc}"
                         ) from None


def pinned_context(cert_file: Path) -> ssl.SSLContext:
    """Trusts exactly the gateway's own certificate: for the all-in-one
    gateway's in-process agent, which reaches its own gateway on loopback.

    The certificate is its own trust anchor (VERIFY_X509_PARTIAL_CHAIN, so a
    leaf signed by a CA this host does not know still verifies), and the
    host name is not checked: the certificate names the public host, the
    agent dials 127.0.0.1. Safe because only a peer holding this very
    certificate's key passes, and that is our own process. Only the file's
    first certificate (the leaf) is trusted: a full-chain file also holds
    its CA, and trusting that without a host name check would let any
    certificate that CA issued pass."""
    pem = cert_file.read_text()
    begin = pem.find(_BEGIN)
    end = pem.find(_END, begin)
    if begin < 0 or end < 0:
        raise ValueError(f"LLMGW_TLS_CERT_FILE {cert_file}: no PEM certificate in it")
    ctx = ssl.create_default_context(cadata=pem[begin:end + len(_END)])
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.check_hostname = False
    return ctx


_BEGIN = "-----BEGIN CERTIFICATE-----"
_END = "-----END CERTIFICATE-----"


def verify_message(exc: BaseException) -> str:
    """One line for a certificate that did not verify: what failed, and
    the setting that fixes it."""
    detail = getattr(exc, "verify_message", "") or str(exc)
    return (f"certificate verify failed: {detail} (LLMGW_CA_FILE must name the CA "
            "that signed the gateway's certificate)")
