"""The servers' watcher (`parallax k8s watch-job`), beside each server: ends them with the
Job. It reads the worker Job through the API server with the pod's service account (HTTPS,
no kubectl or client library) and deletes the servers' StatefulSet once the Job finished or
was deleted."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import ssl
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping

from parallax.errors import ConfigError
from parallax.runtime import logs

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
WATCH_POLL_S = 15.0                     # how often the servers' watcher reads the Job
log = logging.getLogger("parallax")


class KubeAPI:
    """The API server as a pod's service account reaches it, without kubectl or a client
    library: HTTPS to $KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT, verified with the
    account's ca.crt, the account's token read at every request (the kubelet rotates it)."""

    def __init__(self, url: str, token_file: str, ca_file: str, timeout: float = 10.0):
        self.url, self.token_file, self.timeout = url.rstrip("/"), token_file, timeout
        self.context = ssl.create_default_context(cafile=ca_file)

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None,
                   directory: str = SERVICE_ACCOUNT_DIR) -> "KubeAPI":
        environ = os.environ if environ is None else environ
        host = environ.get("KUBERNETES_SERVICE_HOST")
        if not host:
            raise ConfigError("KUBERNETES_SERVICE_HOST is not set: `parallax k8s watch-job` "
                              "runs in a server pod that `parallax k8s` rendered")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{environ.get('KUBERNETES_SERVICE_PORT', '443')}",
                   f"{directory}/token", f"{directory}/ca.crt")

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, dict]:
        """(HTTP status, JSON answer or {}); OSError when the API server cannot be reached."""
        token = Path(self.token_file).read_text().strip()
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method,
            headers={"Authorization": f"Bearer {token}", "Accept": "application/json",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout,
                                        context=self.context) as answer:
                return answer.status, _json(answer.read())
        except urllib.error.HTTPError as err:
            return err.code, _json(err.read())


def _json(data: bytes) -> dict:
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def job_finished(job: Mapping[str, Any]) -> str | None:
    """"Complete" or "Failed" once the Job has that condition, else None."""
    for condition in job.get("status", {}).get("conditions") or []:
        if condition.get("type") in ("Complete", "Failed") and condition.get("status") == "True":
            return condition["type"]
    return None


class JobWatch:
    """Ends the servers with the Job: `check()` reads the Job once; once it has finished, or
    is gone after it was seen, `end_servers()` deletes the StatefulSet. A Job not created yet
    is waited for; a recreated one (another uid) is followed. Problems (unreachable API
    server, missing RBAC) are logged once each, and the watch goes on."""

    def __init__(self, api: KubeAPI, namespace: str, job: str, servers: str):
        self.api, self.job, self.servers = api, job, servers
        self.job_path = f"/apis/batch/v1/namespaces/{namespace}/jobs/{job}"
        self.servers_path = f"/apis/apps/v1/namespaces/{namespace}/statefulsets/{servers}"
        self.uid: str | None = None
        self._told: set[str] = set()

    def _once(self, key: str, message: str) -> None:
        if key not in self._told:
            self._told.add(key)
            log.warning("%s", message)

    def _refused(self, status: int, what: str) -> None:
        fix = (f"apply the Role and RoleBinding {self.servers} rendered with the servers"
               if status in (401, 403) else "the watch goes on")
        self._once(f"{what}-{status}", f"cannot {what}: the API server answered HTTP "
                                       f"{status}; {fix}")

    def check(self) -> str | None:
        """Why the servers should end now, or None."""
        try:
            status, job = self.api.request("GET", self.job_path)
        except OSError as err:
            self._once("unreachable", f"cannot reach the API server at {self.api.url} "
                                      f"({err}); the watch goes on")
            return None
        if status == 404:
            return f"Job {self.job} was deleted" if self.uid else None
        if status != 200:
            self._refused(status, f"read Job {self.job}")
            return None
        uid = job.get("metadata", {}).get("uid")
        if self.uid is None or uid != self.uid:
            log.info("watching Job %s (uid %s): the servers end with it", self.job, uid)
            self.uid = uid
        state = job_finished(job)
        return f"Job {self.job} finished ({state})" if state else None

    def end_servers(self) -> bool:
        """Delete the StatefulSet (its pods stop gracefully, its claims stay); True once
        it is deleted or gone."""
        try:
            status, _ = self.api.request("DELETE", self.servers_path, {
                "apiVersion": "v1", "kind": "DeleteOptions",
                "propagationPolicy": "Background"})
        except OSError as err:
            self._once("unreachable-delete", f"cannot reach the API server at "
                                             f"{self.api.url} ({err}); trying again")
            return False
        if status in (200, 202, 404):
            return True
        self._refused(status, f"delete StatefulSet {self.servers}")
        return False


def watch_job(watch: JobWatch, stop: threading.Event, poll_s: float = WATCH_POLL_S) -> bool:
    """Poll until the servers should end, then end them; False when `stop` came first."""
    while not stop.is_set():
        reason = watch.check()
        if reason:
            log.info("%s: deleting StatefulSet %s (its volume claims stay)", reason,
                     watch.servers)
            while not watch.end_servers():
                if stop.wait(poll_s):
                    return False
            return True
        stop.wait(poll_s)
    return False


def _watch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallax k8s watch-job",
        description="Inside a server pod: delete the servers' StatefulSet once the worker "
                    "Job has finished or was deleted (the manifests of `parallax k8s` run "
                    "it beside each server).")
    p.add_argument("--namespace", required=True, help="the job's namespace")
    p.add_argument("--job", required=True, help="the worker Job's name (JOB-worker)")
    p.add_argument("--servers", required=True, help="the servers' StatefulSet (JOB-ps)")
    p.add_argument("--poll-seconds", type=float, default=WATCH_POLL_S,
                   help=f"how often to read the Job (default {WATCH_POLL_S:g})")
    return p


def watch_main(argv: list[str]) -> int:
    args = logs.parse(_watch_parser(), argv)
    try:
        watch = JobWatch(KubeAPI.in_cluster(), args.namespace, args.job, args.servers)
    except (ConfigError, OSError) as err:
        print(f"parallax k8s watch-job: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    watch_job(watch, stop, args.poll_seconds)
    stop.wait()  # exiting would only restart this container (restartPolicy Always)
    return 0
