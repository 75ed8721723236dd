"""TLS and the shared cluster token: job credentials, the server's token check, the client's
token metadata, and the environment contract between `parallax run --secure` and workers.

Servers bind to loopback unless given `--host`. For cluster use a server takes
`--tls-cert FILE --tls-key FILE` (TLS), `--tls-client-ca FILE` (mutual TLS: client
certificates required and verified against that CA) and `--token-file FILE` (every RPC,
health checks included, must carry `authorization: Bearer <token>` metadata). The server
reads the token from a file only, never from its environment (visible in /proc).

`generate_job_credentials` (what `parallax run --secure` uses) makes a job's CA, server and
client certificates and token in Python, with the `cryptography` package (no `openssl`
command); the CA's key never touches the disk.

Workers (the strategy, `tests/helpers/launch_probe.py`) build their client options from:
  PARALLAX_TLS_CA      CA certificate that signed the servers' certificates (TLS on)
  PARALLAX_TLS_CERT    client certificate, for servers with --tls-client-ca
  PARALLAX_TLS_KEY     its private key
  PARALLAX_TOKEN_FILE  file holding the cluster token
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import hmac
import ipaddress
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import grpc

from parallax.env import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_FILE_ENV
from parallax.errors import ConfigError

TOKEN_HEADER = "authorization"
TOKEN_SCHEME = "Bearer "
CERT_DAYS = 30


def read_file(path: str | os.PathLike, what: str) -> bytes:
    """A credential file's bytes; a missing, unreadable or empty file is a ConfigError."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r} cannot be read ({exc.strerror}); check the "
                          f"path and its permissions") from None
    if not data.strip():
        raise ConfigError(f"{what} {str(path)!r} is empty; give the file that holds it")
    return data


def read_pem(path: str | os.PathLike, what: str) -> bytes:
    data = read_file(path, what)
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{what} {str(path)!r} is not a PEM file (no '-----BEGIN' line); "
                          f"give a PEM certificate or key")
    return data


def read_token(path: str | os.PathLike) -> str:
    token = read_file(path, "token file").decode("utf-8", "replace").strip()
    if any(c.isspace() or not c.isprintable() or not c.isascii() for c in token):
        raise ConfigError(f"token file {str(path)!r} must hold one token: printable ASCII "
                          f"characters without spaces (it travels in HTTP and gRPC headers)")
    return token


# ---- server side -------------------------------------------------------------------------
def _deny(code: grpc.StatusCode, message: str):
    def abort(request, context):
        context.abort(code, message)
    return abort


def denying_handler(handler, message: str,
                    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED):
    """A handler of the same shape (streaming or not) as `handler` that only rejects."""
    deny = _deny(code, message)
    requests = handler is not None and handler.request_streaming
    responses = handler is not None and handler.response_streaming
    if requests and responses:
        return grpc.stream_stream_rpc_method_handler(deny)
    if requests:
        return grpc.stream_unary_rpc_method_handler(deny)
    if responses:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


HEALTH_CHECK = "/grpc.health.v1.Health/Check"  # what a kubelet's gRPC probe calls


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every RPC (every service, generic handlers included) that does not carry the
    cluster token, with UNAUTHENTICATED; the comparison takes constant time. `open_methods`
    (full method names, e.g. HEALTH_CHECK for `parallax server --health-without-token`)
    answer without it."""

    def __init__(self, token: str, open_methods: Sequence[str] = ()) -> None:
        if not token:
            raise ConfigError("the cluster token is empty; put a token in the token file")
        self._expected = (TOKEN_SCHEME + token).encode()
        self._open = frozenset(open_methods)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in self._open:
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_HEADER)
        if given is not None and hmac.compare_digest(
                given.encode() if isinstance(given, str) else given, self._expected):
            return continuation(handler_call_details)
        if given is None:
            message = ("this server requires the cluster token: send 'authorization: Bearer "
                       "<token>' metadata (ClientOptions.token, or PARALLAX_TOKEN_FILE for "
                       "workers)")
        else:
            message = ("wrong cluster token: the 'authorization' metadata does not match this "
                       "server's --token-file; use the job's token")
        return denying_handler(continuation(handler_call_details), message)


def server_credentials(cert: Path, key: Path, client_ca: Path | None) -> grpc.ServerCredentials:
    """TLS with the server's certificate; with `client_ca`, client certificates are required
    and must be signed by it (mutual TLS)."""
    pair = (read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))
    if client_ca is None:
        return grpc.ssl_server_credentials([pair])
    return grpc.ssl_server_credentials([pair], root_certificates=read_pem(
        client_ca, "--tls-client-ca"), require_client_auth=True)


# ---- client side -------------------------------------------------------------------------
class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call made through the channel."""

    def __init__(self, token: str) -> None:
        self._pair = (TOKEN_HEADER, TOKEN_SCHEME + token)

    def _details(self, details):
        metadata = [*(details.metadata or ()), self._pair]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def channel_credentials(tls_ca: str, tls_cert: str | None,
                        tls_key: str | None) -> grpc.ChannelCredentials:
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError(f"client certificate {tls_cert!r} and key {tls_key!r}: give both "
                          f"ClientOptions.tls_cert and tls_key ({TLS_CERT_ENV} and "
                          f"{TLS_KEY_ENV}), or neither")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca, "TLS CA certificate"),
        private_key=read_pem(tls_key, "client key") if tls_key else None,
        certificate_chain=read_pem(tls_cert, "client certificate") if tls_cert else None)


def channel(address: str, options, channel_options: list) -> grpc.Channel:
    """A channel to one server as `options` (a ClientOptions) says: TLS when `tls_ca` is set,
    the token on every call when `token` is set."""
    if options.tls_ca:
        made = grpc.secure_channel(address, channel_credentials(
            options.tls_ca, options.tls_cert, options.tls_key), options=channel_options)
    elif options.tls_cert or options.tls_key:
        raise ConfigError(f"ClientOptions.tls_cert/tls_key are set but tls_ca is not: a "
                          f"client certificate needs TLS; set tls_ca ({TLS_CA_ENV}) to the "
                          f"CA that signed the servers' certificates")
    else:
        made = grpc.insecure_channel(address, options=channel_options)
    return grpc.intercept_channel(made, TokenMetadata(options.token)) if options.token else made


# ---- job credentials ---------------------------------------------------------------------
@dataclass(frozen=True)
class JobCredentials:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    token_file: Path

    def server_args(self) -> list[str]:
        return ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key),
                "--tls-client-ca", str(self.ca_cert), "--token-file", str(self.token_file)]

    def worker_env(self) -> dict[str, str]:
        return {TLS_CA_ENV: str(self.ca_cert), TLS_CERT_ENV: str(self.client_cert),
                TLS_KEY_ENV: str(self.client_key), TOKEN_FILE_ENV: str(self.token_file)}


# cryptography is imported by the functions that make credentials, not at module level: it
# costs about 60 ms, which servers and workers (they only read credentials) need not pay.
def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """`data` to `path` through a new file in the same directory (created with `mode`,
    written, synced) renamed over it: readers see the whole file or none."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exactly `mode`, whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _subject_alt_names(hosts: Sequence[str]) -> list:
    """IP or DNS names of `hosts` (brackets of IPv6 literals dropped, duplicates once)."""
    from cryptography import x509
    names = []
    for host in dict.fromkeys(h.strip("[]") for h in hosts if h):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            try:
                names.append(x509.DNSName(host))
            except ValueError:
                raise ConfigError(f"host {host!r} cannot be a certificate's DNS name (not "
                                  f"ASCII): give its IDNA form (xn--...) or its IP "
                                  f"address") from None
    return names


def _key_pem(key) -> bytes:
    """An unencrypted PKCS#8 PEM private key (what `openssl genpkey` writes)."""
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _sign(subject: str, key, issuer, issuer_key, extensions: list, days: int = CERT_DAYS):
    """A certificate for `key`'s public half, CN=`subject`, valid from now for `days` days,
    with `extensions` ((extension, critical) pairs) and the subject and authority key
    identifiers, signed with ECDSA-SHA256 by `issuer_key` (`issuer`: its certificate, None
    for a self-signed one)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    aki = (x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key())
           if issuer is None else x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
               issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value))
    builder = (x509.CertificateBuilder()
               .subject_name(name).issuer_name(name if issuer is None else issuer.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days)))
    for extension, critical in [*extensions, (ski, False), (aki, False)]:
        builder = builder.add_extension(extension, critical)
    return builder.sign(issuer_key, hashes.SHA256())


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())  # P-256


def _make_ca(days: int = CERT_DAYS):
    """The job's CA: a P-256 key (kept in memory only) and its self-signed certificate."""
    from cryptography import x509
    key = _new_key()
    usage = x509.KeyUsage(digital_signature=False, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          key_cert_sign=True, crl_sign=True, encipher_only=False,
                          decipher_only=False)
    cert = _sign("parallax-job-ca", key, None, key,
                 [(x509.BasicConstraints(ca=True, path_length=None), True), (usage, True)],
                 days)
    return cert, key


def _issue(directory: Path, name: str, ca, ca_key, sans: list,
           days: int = CERT_DAYS) -> tuple[Path, Path]:
    """A P-256 key and a certificate for it (CN=parallax-<name>, serverAuth for "server",
    clientAuth for "client", `sans` if any) signed by the job's CA, written as <name>.pem
    and <name>.key (0600)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID
    usage = {"server": ExtendedKeyUsageOID.SERVER_AUTH,
             "client": ExtendedKeyUsageOID.CLIENT_AUTH}[name]
    extensions = [(x509.BasicConstraints(ca=False, path_length=None), True),
                  (x509.ExtendedKeyUsage([usage]), False)]
    if sans:
        extensions.append((x509.SubjectAlternativeName(sans), False))
    key = _new_key()
    cert = _sign(f"parallax-{name}", key, ca, ca_key, extensions, days)
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
    _write_atomic(key_path, _key_pem(key), 0o600)
    _write_atomic(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert_path, key_path


def generate_job_credentials(directory: str | os.PathLike,
                             hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                             days: int = CERT_DAYS) -> JobCredentials:
    """A fresh CA, a server certificate for `hosts` (IP or DNS names) and a client
    certificate, both signed by it and valid for `days`, and a random token, written to
    `directory` (created mode 0700; keys and token 0600; each file written whole, then
    renamed into place). The CA's key never leaves memory: once this returns, no more
    certificates can be signed.
    Made with the `cryptography` package (no `openssl` command needed)."""
    from cryptography.hazmat.primitives import serialization
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    sans = _subject_alt_names(hosts)
    ca, ca_key = _make_ca(days)
    ca_cert = directory / "ca.pem"
    _write_atomic(ca_cert, ca.public_bytes(serialization.Encoding.PEM), 0o644)
    server_cert, server_key = _issue(directory, "server", ca, ca_key, sans, days)
    client_cert, client_key = _issue(directory, "client", ca, ca_key, [], days)
    token_file = directory / "token"
    _write_atomic(token_file, (secrets.token_urlsafe(32) + "\n").encode(), 0o600)
    return JobCredentials(ca_cert, server_cert, server_key, client_cert, client_key, token_file)


@contextlib.contextmanager
def temporary_job_credentials(hosts: Sequence[str],
                              days: int = CERT_DAYS) -> Iterator[JobCredentials]:
    """Credentials in a private temporary directory, removed on exit."""
    directory = tempfile.mkdtemp(prefix="parallax-credentials-")
    try:
        yield generate_job_credentials(directory, hosts, days)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
