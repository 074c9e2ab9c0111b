"""TLS from a gateway to etcd: the files, checked at start, and what a failed
handshake means in words (docs/design/tls.md).

gRPC takes the PEM bytes themselves (`grpc.ssl_channel_credentials`), so the
files are read once, when the settings are checked; a rotated certificate is
picked up by restarting the gateway. Each channel is verified against the
host name the operator wrote (`EtcdEndpoint.host`), not the address it was
resolved to: see app/store/etcd/channel.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]  # no type information shipped

from app.tls import check_pair, client_context


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """PEM bytes for the channel: `ca` None trusts the system's CAs; `cert`
    and `key` (both or neither) answer etcd's `--client-cert-auth`."""

    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None

    def __repr__(self) -> str:
        # Never the key, should this end up in a log line or a traceback.
        return f"EtcdTls(ca={self.ca is not None}, client_cert={self.cert is not None})"

    def credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)


def load(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> EtcdTls:
    """Reads and checks the files; raises ValueError (one line, naming the
    setting) for a missing, unreadable or unparsable file, a key that does
    not match its certificate, or a certificate without its key."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("LLMGW_ETCD_CERT_FILE and LLMGW_ETCD_KEY_FILE go together: "
                         "set both or neither")
    ca = None
    if ca_file is not None:
        # ssl parses what gRPC would only find bad at the first handshake.
        client_context(str(ca_file), "LLMGW_ETCD_CA_FILE")
        ca = ca_file.read_bytes()
    if cert_file is None or key_file is None:
        return EtcdTls(ca)
    check_pair(cert_file, key_file, ("LLMGW_ETCD_CERT_FILE", "LLMGW_ETCD_KEY_FILE"),
               "use a client certificate for etcd")
    return EtcdTls(ca, cert_file.read_bytes(), key_file.read_bytes())


def for_endpoints(endpoints: Sequence[str], ca_file: Path | None, cert_file: Path | None,
                  key_file: Path | None) -> EtcdTls | None:
    """`load` on the files (LLMGW_ETCD_CA_FILE, _CERT_FILE, _KEY_FILE): None
    when none is set; files set for `endpoints` (LLMGW_ETCD_ENDPOINTS, as
    listed) that are not https:// are refused (they would go unused)."""
    if (ca_file, cert_file, key_file) == (None, None, None):
        return None
    tls = load(ca_file, cert_file, key_file)
    if not endpoints or not endpoints[0].strip().lower().startswith("https://"):
        raise ValueError("LLMGW_ETCD_CA_FILE, LLMGW_ETCD_CERT_FILE and LLMGW_ETCD_KEY_FILE "
                         "are for https:// etcd endpoints; LLMGW_ETCD_ENDPOINTS has none")
    return tls


# What gRPC's handshake failures say (its details, in the status) and what
# they mean for the operator. The client-certificate case reaches us only as
# a connection etcd broke off ("Unwrap failed"/TSI_DATA_CORRUPTED after its
# BAD_CERTIFICATE alert), so the hint names the likely cause, not a certainty.
_HINTS = (
    ("Hostname Verification",
     "etcd's certificate does not name the host in LLMGW_ETCD_ENDPOINTS"),
    ("CERTIFICATE_VERIFY_FAILED",
     "etcd's certificate did not verify against LLMGW_ETCD_CA_FILE (or the system's CAs)"),
    ("TSI_DATA_CORRUPTED",
     "etcd ended the TLS connection: it may want a client certificate "
     "(LLMGW_ETCD_CERT_FILE, LLMGW_ETCD_KEY_FILE) issued by a CA it trusts"),
    ("WRONG_VERSION_NUMBER", "etcd does not speak TLS on this port (use http://)"),
    ("Ssl handshake failed", "the TLS handshake with etcd failed"),
    ("Tls handshake failed", "the TLS handshake with etcd failed"),
)


def explained(reason: str) -> str:
    """`reason` with what a TLS failure in it means, if it holds one."""
    for marker, hint in _HINTS:
        if marker in reason:
            return f"TLS: {hint}: {reason}"
    return reason
