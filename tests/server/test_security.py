"""TLS, mutual TLS and the cluster token, against real server processes on loopback and real
gRPC: who gets in, who is refused and how it is said; `parallax run --secure`; the strategy
training against a secure cluster; bad configuration."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from ipaddress import ip_address
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parallax import SGD, TableSpec
from parallax.client import ClientOptions, PSClient
from parallax.client.connection import client_options_from_env
from parallax.client.local_cluster import LocalCluster
from parallax.errors import ConfigError, ServerError
from parallax.launch.run import LaunchConfig, validate
from parallax.protocol.security import TOKEN_FILE_ENV, generate_job_credentials, read_token

PARALLAX = str(Path(sys.executable).parent / "parallax")
ROOT = Path(__file__).resolve().parents[2]
FAST = dict(timeout=5, retries=0)


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    return generate_job_credentials(tmp_path_factory.mktemp("creds"))


@pytest.fixture(scope="module")
def token(creds):
    return read_token(creds.token_file)


def _cluster(args):
    cluster = LocalCluster(1, extra_args=args).start()
    yield cluster
    assert cluster.stop() == [0]


@pytest.fixture(scope="module")
def tls_token_cluster(creds):
    """TLS (no client certificates) and the token."""
    yield from _cluster(["--tls-cert", str(creds.server_cert), "--tls-key",
                         str(creds.server_key), "--token-file", str(creds.token_file)])


@pytest.fixture(scope="module")
def mtls_cluster(creds):
    """What `parallax run --secure` starts: mutual TLS and the token."""
    yield from _cluster(creds.server_args())


@pytest.fixture(scope="module")
def token_cluster(creds):
    yield from _cluster(["--token-file", str(creds.token_file)])


def _spec(name: str) -> TableSpec:
    return TableSpec(name=name, vocabulary_size=100, dim=4, optimizer=SGD(0.5), num_workers=1)


def _round_trip(client: PSClient, name: str) -> None:
    client.wait_ready(5)
    table = client.create_table(_spec(name))
    assert table.pull([3, 7]).shape == (2, 4)
    table.push(np.array([3, 3]), np.ones((2, 4)), step=0)
    np.testing.assert_allclose(table.pull([3], min_step=1), -np.ones((1, 4)))


def _refused(options: ClientOptions, address: str) -> ServerError:
    with PSClient([address], options) as client, pytest.raises(ServerError) as info:
        client.stats()
    return info.value


def test_tls_and_token_client_creates_pulls_and_pushes(tls_token_cluster, creds, token):
    options = ClientOptions(tls_ca=str(creds.ca_cert), token=token, **FAST)
    with PSClient(tls_token_cluster.addresses, options) as client:
        _round_trip(client, "tls")
    assert token not in repr(options)


@pytest.mark.parametrize("given, says", [(None, "requires the cluster token"),
                                         ("not-the-token", "wrong cluster token")])
def test_missing_or_wrong_token_is_unauthenticated_on_every_method(
        tls_token_cluster, creds, token, given, says):
    address = tls_token_cluster.addresses[0]
    good = ClientOptions(tls_ca=str(creds.ca_cert), token=token, **FAST)
    bad = ClientOptions(tls_ca=str(creds.ca_cert), token=given, **FAST)
    name = f"guarded-{given is None}"
    with PSClient([address], good) as client:
        client.create_table(_spec(name))
    with PSClient([address], bad) as client:
        table = client.table(_spec(name))
        calls = [lambda: client.create_table(_spec(name)), client.stats,  # unary
                 lambda: table.pull([1]),                                # generic, bulk codec
                 lambda: table.push([1], np.ones((1, 4)), step=0),
                 lambda: table.assign([1], np.ones((1, 4))),             # client streaming
                 lambda: client.wait_ready(5)]                           # health service
        for call in calls:
            t0 = time.monotonic()
            with pytest.raises(ServerError) as info:
                call()
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED, info.value
            assert says in str(info.value) and token not in str(info.value)
            assert time.monotonic() - t0 < 3  # refused at once, not waited out
    with PSClient([address], good) as client:  # nothing the refused calls sent was applied
        np.testing.assert_array_equal(client.table(_spec(name)).pull([1]), np.zeros((1, 4)))


def test_health_check_needs_the_token(tls_token_cluster, creds):
    credentials = grpc.ssl_channel_credentials(creds.ca_cert.read_bytes())
    with grpc.secure_channel(tls_token_cluster.addresses[0], credentials) as channel:
        with pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plain_text_client_fails_fast_against_tls_server(tls_token_cluster, token):
    t0 = time.monotonic()
    error = _refused(ClientOptions(token=token, **FAST), tls_token_cluster.addresses[0])
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "agree on TLS" in str(error) and time.monotonic() - t0 < 5
    with PSClient(tls_token_cluster.addresses, ClientOptions(token=token, **FAST)) as client, \
            pytest.raises(ServerError, match="TLS setting"):
        client.wait_ready(1)


def test_client_that_does_not_trust_the_ca_fails(tls_token_cluster, token, tmp_path):
    other = generate_job_credentials(tmp_path / "other")
    error = _refused(ClientOptions(tls_ca=str(other.ca_cert), token=token, **FAST),
                     tls_token_cluster.addresses[0])
    assert error.code == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(mtls_cluster, creds, token, tmp_path):
    address = mtls_cluster.addresses[0]
    no_cert = ClientOptions(tls_ca=str(creds.ca_cert), token=token, **FAST)
    assert _refused(no_cert, address).code == grpc.StatusCode.UNAVAILABLE
    other = generate_job_credentials(tmp_path / "other")  # a certificate from another CA
    foreign = ClientOptions(tls_ca=str(creds.ca_cert), tls_cert=str(other.client_cert),
                            tls_key=str(other.client_key), token=token, **FAST)
    assert _refused(foreign, address).code == grpc.StatusCode.UNAVAILABLE
    options = client_options_from_env(ClientOptions(**FAST), creds.worker_env())
    with PSClient([address], options) as client:
        _round_trip(client, "mtls")


def test_token_only_server(token_cluster, token):
    address = token_cluster.addresses[0]
    with PSClient([address], ClientOptions(token=token, **FAST)) as client:
        _round_trip(client, "token-only")
    assert _refused(ClientOptions(**FAST), address).code == grpc.StatusCode.UNAUTHENTICATED


def test_client_options_from_env(creds, token, tmp_path):
    env = creds.worker_env()
    options = client_options_from_env(ClientOptions(timeout=7), env)
    assert (options.tls_ca, options.tls_cert, options.tls_key, options.token, options.timeout) \
        == (str(creds.ca_cert), str(creds.client_cert), str(creds.client_key), token, 7)
    assert client_options_from_env(ClientOptions(token="mine"), env).token == "mine"  # wins
    assert client_options_from_env(None, {}) == ClientOptions()
    with pytest.raises(ConfigError, match="PARALLAX_TLS_CA is not"):
        client_options_from_env(None, {"PARALLAX_TLS_CERT": "c", "PARALLAX_TLS_KEY": "k"})
    with pytest.raises(ConfigError, match="token file .*cannot be read"):
        client_options_from_env(None, {TOKEN_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="TLS CA certificate .*cannot be read"):
        PSClient(["127.0.0.1:1"], ClientOptions(tls_ca=str(tmp_path / "missing.pem")))


def test_credentials_files(creds):
    for path in (creds.server_key, creds.client_key, creds.token_file):
        assert path.stat().st_mode & 0o777 == 0o600
    assert creds.ca_cert.parent.stat().st_mode & 0o777 == 0o700
    assert not (creds.ca_cert.parent / "ca.key").exists()  # no more certificates can be signed
    text = subprocess.run(["openssl", "x509", "-in", str(creds.server_cert), "-noout",
                           "-ext", "subjectAltName"], capture_output=True, text=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:localhost" in text


def test_credentials_need_no_openssl_and_carry_mutual_tls(tmp_path, monkeypatch):
    """The certificates are made in Python (the cryptography package): with no `openssl` on
    PATH they still carry a mutual-TLS round trip with a real server on loopback."""
    (tmp_path / "empty").mkdir()
    with monkeypatch.context() as patched:
        patched.setenv("PATH", str(tmp_path / "empty"))
        assert shutil.which("openssl") is None
        made = generate_job_credentials(tmp_path / "creds", hosts=(
            "127.0.0.1", "localhost", "::1", "[::1]", "ps-0.example"))
    assert sorted(p.name for p in made.ca_cert.parent.iterdir()) == [
        "ca.pem", "client.key", "client.pem", "server.key", "server.pem", "token"]
    for path in (made.server_key, made.client_key, made.token_file):
        assert path.stat().st_mode & 0o777 == 0o600
    sans = x509.load_pem_x509_certificate(made.server_cert.read_bytes()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ip_address("127.0.0.1"),
                                                        ip_address("::1")]
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "ps-0.example"]
    with LocalCluster(1, extra_args=made.server_args()) as cluster:
        options = client_options_from_env(ClientOptions(**FAST), made.worker_env())
        with PSClient(cluster.addresses, options) as client:
            _round_trip(client, "no-openssl")
        no_cert = ClientOptions(tls_ca=str(made.ca_cert), token=read_token(made.token_file),
                                **FAST)
        assert _refused(no_cert, cluster.addresses[0]).code == grpc.StatusCode.UNAVAILABLE


def test_credentials_for_a_host_name_that_is_not_ascii_fail_clearly(tmp_path):
    with pytest.raises(ConfigError, match="host 'b\u00fccher.example' cannot be a .*IDNA"):
        generate_job_credentials(tmp_path, hosts=("127.0.0.1", "b\u00fccher.example"))


def test_parallax_run_secure(tmp_path):
    """The probe reaches servers that demand client certificates and the token, with only the
    environment the launcher gave it; a worker without the token is refused; the
    credentials are gone afterwards."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    probe = str(ROOT / "tests" / "helpers" / "launch_probe.py")
    ok = subprocess.run([PARALLAX, "run", "-np", "1", "--servers", "1", "--secure", "--",
                         sys.executable, probe], capture_output=True, text=True, env=env,
                        timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout.strip().splitlines()[-1])["probe"] == 1
    refused = subprocess.run([PARALLAX, "run", "-np", "1", "--servers", "1", "--secure", "--",
                              "env", "-u", TOKEN_FILE_ENV, sys.executable, probe],
                             capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
    assert not list(tmp_path.glob("parallax-credentials-*"))


STRATEGY_SCRIPT = textwrap.dedent("""
    import keras, numpy as np, parallax
    strategy = parallax.ParallaxStrategy(log_plan=False)
    with strategy.scope():
        inputs = keras.Input((3,), dtype="int64")
        h = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ids = np.random.default_rng(0).integers(0, 50, size=(64, 3))
    history = model.fit(ids, (ids.sum(1) % 5 / 5.0)[:, None], batch_size=16, epochs=3,
                        verbose=0)
    print("PLAN", [v.placement for v in strategy.plan.variables])
    print("LOSS", history.history["loss"][0], history.history["loss"][-1])
""")


def test_strategy_trains_against_a_secure_cluster(mtls_cluster, creds):
    env = {**os.environ, **creds.worker_env(), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PARALLAX_PS_ADDRESSES": mtls_cluster.addresses[0],
           "PARALLAX_RUN_ID": f"secure-{int(time.time())}"}
    result = subprocess.run([sys.executable, "-c", STRATEGY_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines()
                 if line.startswith(("PLAN", "LOSS")))
    assert "'ps'" in lines["PLAN"]
    first, last = map(float, lines["LOSS"].split())
    assert last < first
    env.pop(TOKEN_FILE_ENV)  # the same job without the token is refused
    result = subprocess.run([sys.executable, "-c", STRATEGY_SCRIPT], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode != 0 and "UNAUTHENTICATED" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--tls-cert", "c.pem"], "--tls-cert needs --tls-key"),
    (["--tls-key", "k.pem"], "--tls-key needs --tls-cert"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "--tls-key '/nonexistent/k.pem' cannot be read"),
    (["--token-file", "/nonexistent/token"], "token file '/nonexistent/token' cannot be read"),
])
def test_bad_security_arguments_fail_clearly(args, message):
    result = subprocess.run([PARALLAX, "server", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_certificate_that_is_not_pem_fails_clearly(creds, tmp_path):
    bogus = tmp_path / "bogus.pem"
    bogus.write_text("not a certificate\n")
    result = subprocess.run([PARALLAX, "server", "--tls-cert", str(bogus), "--tls-key",
                             str(creds.server_key)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "is not a PEM file" in result.stderr, result.stderr


def test_secure_launch_config_is_checked():
    with pytest.raises(ConfigError, match="--secure makes credentials"):
        validate(LaunchConfig(num_servers=0, ps_addresses=("127.0.0.1:7000",), secure=True,
                              command=("true",)))
    with pytest.raises(ConfigError, match="--secure sets the servers' credentials"):
        validate(LaunchConfig(server_args=("--token-file=x",), secure=True,
                              command=("true",)))


def test_key_that_is_not_the_certificates_fails_clearly(creds, tmp_path):
    other = generate_job_credentials(tmp_path / "other")
    result = subprocess.run([PARALLAX, "server", "--tls-cert", str(creds.server_cert),
                             "--tls-key", str(other.server_key)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "gRPC refused --tls-cert" in result.stderr, result.stderr
