"""Names and labels of the objects `parallax k8s` renders, and the label syntax its flags
take (KEY=VALUE for node selectors, tolerations, ServiceMonitor labels, metrics scrapers):
one owner for `parallax.launch.k8s` and `parallax.launch.k8s_security`."""
from __future__ import annotations

import re
from typing import Any

from parallax.errors import ConfigError

LABEL_JOB = "parallax.io/job"
LABEL_ROLE = "parallax.io/role"
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
# label keys and values (nodeSelector, tolerations, ServiceMonitor labels): name parts
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def labels(config, role: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "parallax", LABEL_JOB: config.name, LABEL_ROLE: role}


def meta(config, name: str, role: str) -> dict[str, Any]:
    return {"name": name, "namespace": config.namespace, "labels": labels(config, role)}


def pod_host(config, role: str, index: int) -> str:
    """Pod `index` of `role` ("ps" or "worker") as <hostname>.<subdomain>, the stable name
    its headless Service gives it (append .<namespace>.svc[.<domain>]). --format job: an
    indexed Job's or a StatefulSet's pod <name>-<index> under the role's own Service;
    --format jobset: <jobset>-<replicated job>-<job index>-<pod index> under the JobSet's
    Service (named after it: network.subdomain), one Job per replicated job (index 0)."""
    if config.format == "jobset":
        return f"{config.name}-{role}-0-{index}.{subdomain(config, role)}"
    return f"{config.name}-{role}-{index}.{subdomain(config, role)}"


def subdomain(config, role: str) -> str:
    """The headless Service whose DNS names the pods of `role` get (pod_host)."""
    if config.format == "jobset":
        return config.name
    return f"{config.name}-ps" if role == "ps" else f"{config.name}-workers"


def key_problem(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _SUBDOMAIN.match(prefix)):
        return f"the key's prefix {prefix!r} is not a lower-case DNS name"
    if len(name) > 63 or not _NAME_PART.match(name):
        return (f"the key {key!r} is not a label key (an optional DNS prefix and '/', then at "
                f"most 63 letters, digits, '-', '_' or '.', starting and ending with a letter "
                f"or digit)")
    return None


def value_problem(value: str) -> str | None:
    if value and (len(value) > 63 or not _NAME_PART.match(value)):
        return (f"the value {value!r} is not a label value (empty, or at most 63 letters, "
                f"digits, '-', '_' or '.', starting and ending with a letter or digit)")
    return None


def parse_selector(text: str, flag: str) -> tuple[str, str]:
    """"KEY=VALUE" as (key, value); ConfigError names the flag, the text and the form."""
    key, equals, value = text.partition("=")
    problem = "no '='" if not equals else key_problem(key) or value_problem(value)
    if problem:
        raise ConfigError(f"{flag} {text!r}: {problem}; the form is KEY=VALUE, e.g. {flag} "
                          f"cloud.google.com/gke-nodepool=pool-1")
    return key, value
