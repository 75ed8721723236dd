"""What keeps a job rendered by `parallax k8s` to itself: secure by default.

A stranger in the cluster (any pod, in any namespace) reaches nothing of the job:

  token          every server port (gRPC, the data plane, /metrics) and the gang coordinator
                 on worker 0 need the job's token. It is a Secret, generated at render time
                 (JOB-token, key "token") or the user's own (--token-secret NAME, key
                 "token"), mounted read-only as a file (never an environment variable: those
                 show in /proc and `kubectl describe`) into every server and worker container;
                 the servers get `--token-file`, the workers PARALLAX_TOKEN_FILE (the path).
                 The servers answer grpc.health.v1 Check without it (`--health-without-token`:
                 the kubelet's gRPC probe cannot send metadata; it says SERVING, nothing else).
  mTLS           with --secure: a CA, a server certificate for the servers' DNS names and a
                 client certificate, made at render time as `parallax run --secure` makes them
                 (valid CERT_DAYS days); the servers' key in JOB-tls-server, the workers' in
                 JOB-tls-client. The kubelet's gRPC probe cannot speak TLS: probes become
                 tcpSocket probes.
  NetworkPolicy  JOB: the job's pods admit only the job's pods (servers, gang, rendezvous,
                 gloo and TensorFlow's collective ports alike); JOB-metrics, with
                 --metrics-namespace / --metrics-pod-label: those may scrape the servers'
                 metrics port too. (The kubelet's probes come from the node, which a
                 NetworkPolicy always admits.)
  restricted     every pod runs as uid IMAGE_UID, non-root, seccomp RuntimeDefault; every
                 container without privilege escalation and with every capability dropped:
                 the Pod Security Standard "restricted". Worker pods get no service account
                 token (automountServiceAccountToken: false); the servers' job watcher keeps
                 its own, projected into that container alone.

`--insecure` renders none of this (today's open shape) and says so on stderr and at the top
of the YAML. What the Horovod rendezvous (gloo's own HTTP store, which cannot send a token)
and TensorFlow's collective servers accept is bounded by the NetworkPolicy alone.
"""
from __future__ import annotations

import secrets as random_secrets
from pathlib import Path
from typing import Any

from parallax.env import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TOKEN_FILE_ENV
from parallax.launch.k8s_labels import LABEL_JOB, labels, meta, parse_selector, pod_host
from parallax.protocol import security

IMAGE_UID = 10001                 # the Dockerfile's USER: owns the data volume
TOKEN_KEY = "token"               # the Secret's key that holds the token
TOKEN_DIR = "/var/run/secrets/parallax/token"
TLS_DIR = "/var/run/secrets/parallax/tls"
SECRET_MODE = 0o440               # owner and group (fsGroup IMAGE_UID) may read
CERT_DAYS = 365                   # the rendered certificates' validity: re-render yearly
INSECURE_NOTE = ("parallax k8s --insecure: the servers take requests without a token or TLS "
                 "and no NetworkPolicy guards the job; any pod in the cluster can read or "
                 "overwrite its tables and end or restart its workers")


def token_secret(config) -> str:
    """The name of the Secret holding the token: --token-secret, else the generated one."""
    return config.token_secret or f"{config.name}-token"


def token_file() -> str:
    return f"{TOKEN_DIR}/{TOKEN_KEY}"


def secret_objects(config) -> list[dict[str, Any]]:
    """The Secrets to apply before the pods: the generated token (none with --token-secret)
    and, with --secure, the servers' and the workers' TLS material."""
    if config.insecure:
        return []
    objects = []
    if not config.token_secret:
        objects.append(_secret(config, token_secret(config),
                               {TOKEN_KEY: random_secrets.token_urlsafe(32)}))
    if config.secure:
        objects += _tls_secrets(config)
    return objects


def _secret(config, name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta(config, name, "secret"),
            "type": "Opaque", "stringData": data}


def server_names(config) -> list[str]:
    """The DNS names a server's certificate covers: each server pod's, long and short."""
    names = []
    for i in range(config.servers):
        host = pod_host(config, "ps", i)
        names += [f"{host}.{config.namespace}.svc.{config.cluster_domain}",
                  f"{host}.{config.namespace}.svc", host]
    return names


def _tls_secrets(config) -> list[dict[str, Any]]:
    with security.temporary_job_credentials(server_names(config), CERT_DAYS) as made:
        def text(path: Path) -> str:
            return path.read_text()
        ca = text(made.ca_cert)
        return [_secret(config, f"{config.name}-tls-server",
                        {"ca.pem": ca, "server.pem": text(made.server_cert),
                         "server.key": text(made.server_key)}),
                _secret(config, f"{config.name}-tls-client",
                        {"ca.pem": ca, "client.pem": text(made.client_cert),
                         "client.key": text(made.client_key)})]


def network_policies(config, metrics_port: int | None) -> list[dict[str, Any]]:
    """JOB: the job's pods admit the job's pods only; JOB-metrics: the named scrapers may
    reach the servers' metrics port."""
    if config.insecure:
        return []
    own = {"podSelector": {"matchLabels": {LABEL_JOB: config.name}}}
    policies = [{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                 "metadata": meta(config, config.name, "policy"),
                 "spec": {**own, "policyTypes": ["Ingress"], "ingress": [{"from": [own]}]}}]
    scrapers = metrics_peers(config)
    if scrapers and metrics_port and config.servers:
        policies.append({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(config, f"{config.name}-metrics", "policy"),
            "spec": {"podSelector": {"matchLabels": labels(config, "ps")},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": scrapers,
                                  "ports": [{"protocol": "TCP", "port": metrics_port}]}]}})
    return policies


def metrics_peers(config) -> list[dict[str, Any]]:
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}}
             for ns in config.metrics_namespaces]
    peers += [{"podSelector": {"matchLabels": dict([parse_selector(t, "--metrics-pod-label")])}}
              for t in config.metrics_pod_labels]
    return peers


# ---- what the pods carry -----------------------------------------------------------------

def server_args(config) -> list[str]:
    """The `parallax server` arguments that require the token (and TLS with --secure)."""
    if config.insecure:
        return []
    args = ["--token-file", token_file()]
    if config.secure:
        return args + ["--tls-cert", f"{TLS_DIR}/server.pem", "--tls-key",
                       f"{TLS_DIR}/server.key", "--tls-client-ca", f"{TLS_DIR}/ca.pem"]
    return args + ["--health-without-token"]


def worker_env(config) -> dict[str, str]:
    """Where the worker finds the token (and its TLS files): paths, never the secrets."""
    if config.insecure:
        return {}
    env = {TOKEN_FILE_ENV: token_file()}
    if config.secure:
        env.update({TLS_CA_ENV: f"{TLS_DIR}/ca.pem", TLS_CERT_ENV: f"{TLS_DIR}/client.pem",
                    TLS_KEY_ENV: f"{TLS_DIR}/client.key"})
    return env


def mount_credentials(config, pod: dict[str, Any], container: dict[str, Any],
                      side: str) -> None:
    """Mount the token (and `side`'s TLS Secret: "server" or "client") into `container`."""
    if config.insecure:
        return
    sources = [("parallax-token", token_secret(config), TOKEN_DIR)]
    if config.secure:
        sources.append(("parallax-tls", f"{config.name}-tls-{side}", TLS_DIR))
    for volume, secret, path in sources:
        container.setdefault("volumeMounts", []).append(
            {"name": volume, "mountPath": path, "readOnly": True})
        pod.setdefault("volumes", []).append(
            {"name": volume, "secret": {"secretName": secret, "defaultMode": SECRET_MODE}})


def scrape_auth(config) -> dict[str, Any]:
    """What a ServiceMonitor's endpoint needs to scrape a secure job's servers: the token
    from its Secret and, with --secure, HTTPS with the workers' client certificate."""
    if config.insecure:
        return {}
    auth: dict[str, Any] = {"authorization": {"type": "Bearer", "credentials": {
        "name": token_secret(config), "key": TOKEN_KEY}}}
    if config.secure:
        client = f"{config.name}-tls-client"
        auth.update({"scheme": "https", "tlsConfig": {
            "ca": {"secret": {"name": client, "key": "ca.pem"}},
            "cert": {"secret": {"name": client, "key": "client.pem"}},
            "keySecret": {"name": client, "key": "client.key"},
            "serverName": server_names(config)[0]}})
    return auth


def server_probe(config) -> dict[str, Any]:
    """How the kubelet asks a server whether it serves: gRPC health (open to it without the
    token), or a TCP connect where the port speaks TLS (the gRPC probe cannot)."""
    if config.secure:
        return {"tcpSocket": {"port": config.server_port}}
    return {"grpc": {"port": config.server_port}}


def restrict(config, pod: dict[str, Any]) -> None:
    """Pod Security "restricted" for `pod` and each of its containers."""
    if config.insecure:
        return
    context = pod.setdefault("securityContext", {})
    context.update({"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID,
                    "fsGroup": IMAGE_UID, "seccompProfile": {"type": "RuntimeDefault"}})
    for container in pod["containers"]:
        container["securityContext"] = {"allowPrivilegeEscalation": False,
                                        "capabilities": {"drop": ["ALL"]}}
