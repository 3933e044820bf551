"""TLS of every pdserve listener and of the calls between pdserve processes, as vLLM and
llama-server offer it: ``--ssl-certfile`` / ``--ssl-keyfile`` serve HTTPS (a worker's HTTP
API, a prefill's bootstrap port, the router), ``--ssl-ca-certs`` is the bundle the calls this
process makes (router to workers, a worker registering with a router, a decode to a prefill's
bootstrap port) verify their peer against; without it, the system's trust store.

The KV bootstrap channel carries no scheme on the wire (``kv_transfer_params`` names a host and
port): a decode speaks HTTPS to bootstrap ports exactly when it serves TLS itself, so a cluster
turns TLS on for every process or for none.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """PEM file paths; all None: plain HTTP."""

    certfile: str | None = None  # this process's certificate chain (may hold the key too)
    keyfile: str | None = None
    ca_certs: str | None = None  # what the peers this process calls are verified against

    def __post_init__(self) -> None:
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        for flag, path in (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                           ("--ssl-ca-certs", self.ca_certs)):  # fmt: skip
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{flag}: no such file: {path}")

    @property
    def is_enabled(self) -> bool:
        """This process serves HTTPS (and a decode calls bootstrap ports over HTTPS)."""
        return self.certfile is not None

    @property
    def scheme(self) -> str:
        return "https" if self.is_enabled else "http"

    def flags(self) -> list[str]:
        """The command-line flags that give a child process this configuration."""
        given = (("--ssl-certfile", self.certfile), ("--ssl-keyfile", self.keyfile),
                 ("--ssl-ca-certs", self.ca_certs))  # fmt: skip
        return [a for flag, path in given if path is not None for a in (flag, path)]

    def server_context(self) -> ssl.SSLContext | None:
        """The listeners' context (TLS 1.2 or later), or None for plain HTTP."""
        if self.certfile is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(
                f"--ssl-certfile/--ssl-keyfile: cannot load {self.certfile}: {e}"
            ) from None
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The context of calls to https:// peers: certificate and host name verified, against
        ``ca_certs`` where given (http:// calls do not use it)."""
        try:
            return ssl.create_default_context(cafile=self.ca_certs)
        except (ssl.SSLError, OSError) as e:
            raise ValueError(f"--ssl-ca-certs: cannot load {self.ca_certs}: {e}") from None

    def check(self) -> TLSConfig:
        """Load every file once (a bad file fails at start naming its flag); returns self."""
        self.server_context()
        self.client_context()
        return self


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS")
    g.add_argument("--ssl-certfile", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain)")  # fmt: skip
    g.add_argument("--ssl-keyfile", default=None, metavar="PEM",
                   help="the private key of --ssl-certfile (if not in that file)")  # fmt: skip
    g.add_argument(
        "--ssl-ca-certs", default=None, metavar="PEM",
        help="verify the https peers this process calls (workers, routers, bootstrap ports) "
        "against these CA certificates; default: the system's trust store",
    )  # fmt: skip


def tls_config_from_args(args: argparse.Namespace) -> TLSConfig:
    """The TLS flags, every file loaded once (ValueError naming the flag)."""
    return TLSConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs).check()
