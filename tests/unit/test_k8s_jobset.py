"""`parallax k8s --format jobset` (issue 31): the job as one JobSet (jobset.x-k8s.io/v1alpha2)
whose controller ends the servers and reports the outcome, checked on what `render` returns:

- the JobSet's shape: the servers' and the workers' indexed Jobs as replicated jobs, the
  workers after the servers are Ready, success when the workers complete, failurePolicy
  from --max-restarts; no job watcher, ServiceAccount, Role, RoleBinding or Service of ours;
- the names the workers are given (servers, rendezvous, TensorFlow's collective servers)
  are those the JobSet's own headless Service gives its pods, and the TLS certificates
  cover them;
- the security objects are still there and select the JobSet's pods;
- what cannot work with a JobSet is refused, naming the way out; `--format job` is still
  the default and renders as before.

No cluster and no JobSet CRD here: each Job template in the JobSet passes Kubernetes' own
batch/v1 Job schema (kubernetes-validate, offline, strict), the other objects theirs, and the
JobSet's own fields are checked against `JOBSET_FIELDS`, written from the v1alpha2 API types
(api/jobset/v1alpha2/jobset_types.go, JobSet v0.8.0 and later) by hand.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml
from cryptography import x509

from parallax.errors import ConfigError
from parallax.launch import k8s
from parallax.launch import k8s_render
from parallax.launch import k8s_security as secure
from parallax.launch.k8s import MIN_KUBERNETES, K8sConfig, render

K8S_VERSIONS = (f"{MIN_KUBERNETES}.0", "1.37.0")  # as tests/integration/test_deploy.py
CONFIG = K8sConfig(name="ctr", image="parallax", command=("python", "t.py"), workers=3,
                   servers=2, namespace="ml", max_restarts=2, format="jobset",
                   metrics_namespaces=("monitoring",))

# The JobSet's fields (v1alpha2) and the values its enums take: what the CRD's schema admits.
JOBSET_FIELDS = {
    "spec": {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy",
             "suspend", "coordinator", "managedBy", "ttlSecondsAfterFinished"},
    "replicatedJob": {"name", "groupName", "template", "replicas", "dependsOn"},
    "network": {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"},
    "successPolicy": {"operator", "targetReplicatedJobs"},
    "failurePolicy": {"maxRestarts", "restartStrategy", "rules"},
    "rule": {"name", "action", "onJobFailureReasons", "onJobFailureMessagePatterns",
             "targetReplicatedJobs"},
    "dependsOn": {"name", "status"},
}
OPERATORS = {"All", "Any"}
RESTART_STRATEGIES = {"Recreate", "BlockingRecreate"}
ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"}
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _jobset(objects: list[dict]) -> dict:
    (jobset,) = [o for o in objects if o["kind"] == "JobSet"]
    return jobset


def _replicated(jobset: dict) -> dict[str, dict]:
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def _pod(jobset: dict, name: str) -> dict:
    return _replicated(jobset)[name]["template"]["spec"]["template"]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def _container(pod_spec: dict, name: str) -> dict:
    (container,) = [c for c in pod_spec["containers"] if c["name"] == name]
    return container


def _hostname(jobset: dict, replicated: str, index: int) -> str:
    """Pod `index` of the replicated job's only Job as JobSet names it:
    <jobset>-<replicated job>-<job index>-<pod index>.<subdomain>.<namespace>.svc.<domain>"""
    return (f"{jobset['metadata']['name']}-{replicated}-0-{index}."
            f"{jobset['spec']['network']['subdomain']}.{jobset['metadata']['namespace']}"
            f".svc.cluster.local")


def check_jobset_fields(jobset: dict) -> None:
    """The JobSet against JOBSET_FIELDS and the rules the CRD and its webhook enforce."""
    spec = jobset["spec"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert set(spec) <= JOBSET_FIELDS["spec"]
    assert set(spec["network"]) <= JOBSET_FIELDS["network"]
    names = [r["name"] for r in spec["replicatedJobs"]]
    assert len(set(names)) == len(names) and all(DNS_LABEL.match(n) for n in names)
    for i, replicated in enumerate(spec["replicatedJobs"]):
        assert set(replicated) <= JOBSET_FIELDS["replicatedJob"]
        assert isinstance(replicated.get("replicas", 1), int) and replicated["replicas"] >= 1
        depends = replicated.get("dependsOn", [])
        assert len(depends) <= 1 and (i > 0 or not depends)  # not the first; one at most
        for dep in depends:
            assert set(dep) == JOBSET_FIELDS["dependsOn"] and dep["name"] in names[:i]
            assert dep["status"] in ("Ready", "Complete")
        assert not (depends and spec.get("startupPolicy"))  # mutually exclusive
    success = spec["successPolicy"]
    assert set(success) <= JOBSET_FIELDS["successPolicy"] and success["operator"] in OPERATORS
    assert set(success.get("targetReplicatedJobs", [])) <= set(names)
    failure = spec["failurePolicy"]
    assert set(failure) <= JOBSET_FIELDS["failurePolicy"]
    assert isinstance(failure["maxRestarts"], int) and failure["maxRestarts"] >= 0
    assert failure.get("restartStrategy", "Recreate") in RESTART_STRATEGIES
    for rule in failure.get("rules", []):
        assert set(rule) <= JOBSET_FIELDS["rule"] and RULE_NAME.match(rule["name"])
        assert rule["action"] in ACTIONS
        assert set(rule.get("targetReplicatedJobs", [])) <= set(names)


def _as_job(jobset: dict, replicated: dict) -> dict:
    """A replicated job's template as the batch/v1 Job the controller creates from it."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
                         "namespace": jobset["metadata"]["namespace"],
                         **replicated["template"].get("metadata", {})},
            "spec": replicated["template"]["spec"]}


# --------------------------------------------------------------------------- its shape

def test_the_job_is_one_jobset_with_no_watcher_rights_or_services_of_ours():
    objects = render(CONFIG)
    assert [o["kind"] for o in objects] == ["ConfigMap", "Secret", "NetworkPolicy",
                                            "NetworkPolicy", "JobSet"]
    jobset = _jobset(objects)
    assert jobset["metadata"]["name"] == "ctr" and jobset["metadata"]["namespace"] == "ml"
    check_jobset_fields(jobset)
    text = json.dumps(objects)
    for absent in ("watch-job", "job-watch", "serviceAccountName", "api-token"):
        assert absent not in text
    replicated = _replicated(jobset)
    assert list(replicated) == ["ps", "worker"]
    for name, size in (("ps", CONFIG.servers), ("worker", CONFIG.workers)):
        job = replicated[name]["template"]["spec"]
        assert replicated[name]["replicas"] == 1 and job["completionMode"] == "Indexed"
        assert job["parallelism"] == job["completions"] == size
        pod = job["template"]["spec"]
        assert pod["subdomain"] == jobset["spec"]["network"]["subdomain"] == "ctr"
        assert pod["automountServiceAccountToken"] is False  # no API access in any pod
    servers = replicated["ps"]["template"]["spec"]
    assert servers["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert servers["backoffLimit"] == max(CONFIG.max_restarts,
                                          k8s_render.SERVER_RESTARTS * CONFIG.servers)
    assert [c["name"] for c in servers["template"]["spec"]["containers"]] == ["server"]
    assert replicated["worker"]["dependsOn"] == [{"name": "ps", "status": "Ready"}]
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert jobset["spec"]["successPolicy"] == {"operator": "All",
                                               "targetReplicatedJobs": ["worker"]}


def test_restarts_are_the_jobsets_and_a_gang_that_gave_up_fails_it():
    jobset = _jobset(render(CONFIG))
    failure = jobset["spec"]["failurePolicy"]
    assert failure["maxRestarts"] == CONFIG.max_restarts
    assert failure["restartStrategy"] == "BlockingRecreate"  # old pods gone before new ones
    (rule,) = failure["rules"]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    workers = _replicated(jobset)["worker"]["template"]["spec"]
    assert workers["backoffLimit"] == 0  # a failed worker pod fails its Job: the set restarts
    fail_job = [r for r in workers["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail_job and rule["targetReplicatedJobs"] == ["worker"]
    assert _env(_container(_pod(jobset, "worker")["spec"], "worker"))[
        "PARALLAX_K8S_MAX_RESTARTS"] == str(CONFIG.max_restarts)  # the in-place gang stays
    once = _jobset(render(dataclasses.replace(CONFIG, max_restarts=0)))
    assert once["spec"]["failurePolicy"] == {"maxRestarts": 0}
    assert "podFailurePolicy" not in _replicated(once)["worker"]["template"]["spec"]


def test_allreduce_without_servers_is_a_jobset_of_workers_alone():
    config = dataclasses.replace(CONFIG, servers=0, mode="allreduce", max_restarts=0,
                                 metrics_namespaces=())
    jobset = _jobset(render(config))
    check_jobset_fields(jobset)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["name"] == "worker" and "dependsOn" not in replicated
    assert "PARALLAX_PS_ADDRESSES" not in _env(
        _container(_pod(jobset, "worker")["spec"], "worker"))


# --------------------------------------------------------------------------- names

@pytest.mark.parametrize("collectives", ["horovod", "tensorflow"])
def test_workers_reach_servers_and_each_other_by_the_jobsets_dns_names(collectives):
    config = dataclasses.replace(CONFIG, collectives=collectives)
    objects = render(config)
    jobset = _jobset(objects)
    env = _env(_container(_pod(jobset, "worker")["spec"], "worker"))
    servers = [f"{_hostname(jobset, 'ps', i)}:{config.server_port}"
               for i in range(config.servers)]
    assert env["PARALLAX_PS_ADDRESSES"].split(",") == servers
    assert servers[0] == "ctr-ps-0-0.ctr.ml.svc.cluster.local:7000"
    config_map = _by_kind(objects)["ConfigMap", "ctr-config"]
    assert json.loads(config_map["data"]["job.json"])["ps_addresses"] == servers
    assert env["PARALLAX_RENDEZVOUS"] == \
        f"{_hostname(jobset, 'worker', 0)}:{config.rendezvous_port}"  # rank 0's pod
    if collectives == "tensorflow":
        assert env["PARALLAX_WORKERS"].split(",") == [
            f"{_hostname(jobset, 'worker', i)}:{config.collective_port}"
            for i in range(config.workers)]
    longest = _hostname(jobset, "worker", config.workers - 1).split(".")[0]
    assert len(longest) <= 63  # a pod hostname is a DNS label
    long_name = dataclasses.replace(config, name="a" * k8s.MAX_NAME, workers=100)
    host = k8s.worker_host(long_name, 99).split(".")[0]
    assert len(host) <= 63 and DNS_LABEL.match(host)


def test_secure_certificates_cover_the_servers_jobset_names():
    config = dataclasses.replace(CONFIG, secure=True)
    objects = render(config)
    jobset = _jobset(objects)
    pem = _by_kind(objects)["Secret", "ctr-tls-server"]["stringData"]["server.pem"]
    names = x509.load_pem_x509_certificate(pem.encode()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    for i in range(config.servers):
        assert _hostname(jobset, "ps", i) in names
    assert k8s.ps_service_host(config, 0) == _hostname(jobset, "ps", 0)


# --------------------------------------------------------------------------- security

def test_security_objects_are_kept_and_select_the_jobsets_pods():
    objs = _by_kind(render(CONFIG))
    jobset = objs["JobSet", "ctr"]
    pods = {name: _pod(jobset, name) for name in ("ps", "worker")}
    policy = objs["NetworkPolicy", "ctr"]["spec"]
    own = policy["podSelector"]["matchLabels"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
    for pod in pods.values():  # the pods carry their template's labels (and JobSet's own)
        assert own.items() <= pod["metadata"]["labels"].items()
    metrics = objs["NetworkPolicy", "ctr-metrics"]["spec"]["podSelector"]["matchLabels"]
    assert metrics.items() <= pods["ps"]["metadata"]["labels"].items()
    assert not metrics.items() <= pods["worker"]["metadata"]["labels"].items()
    token = objs["Secret", "ctr-token"]["stringData"]["token"]
    for name, container in (("ps", "server"), ("worker", "worker")):
        spec = pods[name]["spec"]
        (mount,) = [m for m in _container(spec, container)["volumeMounts"]
                    if m["name"] == "parallax-token"]
        assert mount["readOnly"] and mount["mountPath"] == secure.TOKEN_DIR
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert _container(spec, container)["securityContext"] == {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        assert token not in json.dumps(spec)
    server = _container(pods["ps"]["spec"], "server")["command"]
    assert server[server.index("--token-file") + 1] == secure.token_file()


def test_insecure_jobset_is_the_open_shape():
    config = dataclasses.replace(CONFIG, insecure=True, metrics_namespaces=())
    objects = render(config)
    assert [o["kind"] for o in objects] == ["ConfigMap", "JobSet"]
    assert "automountServiceAccountToken" not in json.dumps(_pod(_jobset(objects), "ps"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("changes", [{}, {"secure": True, "collectives": "tensorflow"},
                                     {"servers": 0, "mode": "allreduce", "max_restarts": 0,
                                      "metrics_namespaces": ()},
                                     {"insecure": True, "metrics_namespaces": ()}])
def test_every_object_and_each_jobs_template_pass_the_kubernetes_schemas(changes, version):
    from kubernetes_validate import validate  # the test extra installs it: never skipped
    for obj in render(dataclasses.replace(CONFIG, **changes)):
        if obj["kind"] != "JobSet":
            validate(obj, version, strict=True)
            continue
        check_jobset_fields(obj)
        for replicated in obj["spec"]["replicatedJobs"]:
            validate(_as_job(obj, replicated), version, strict=True)


def test_the_field_check_refuses_what_the_crd_would():
    good = _jobset(render(CONFIG))
    check_jobset_fields(good)
    for path, value in ((("spec", "startupPolicy"), {"startupPolicyOrder": "InOrder"}),
                        (("spec", "successPolicy", "operator"), "Most"),
                        (("spec", "failurePolicy", "restartStrategy"), "Later"),
                        (("spec", "network", "hostnames"), True)):
        bad = json.loads(json.dumps(good))
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        with pytest.raises(AssertionError):
            check_jobset_fields(bad)


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("changes, words", [
    ({"keep_servers": True}, ["--keep-servers with --format jobset", "--format job"]),
    ({"data_volume_size": "10Gi"}, ["--data-volume-size 10Gi with --format jobset",
                                    "volumeClaimTemplates", "--format job", "--patch"]),
    ({"service_monitor": True}, ["--service-monitor with --format jobset", "--format job",
                                 "PodMonitor"]),
    ({"format": "helm"}, ["--format 'helm'", "job, jobset", "v0.8.0"]),
])
def test_what_a_jobset_cannot_do_is_refused_with_the_way_out(changes, words):
    with pytest.raises(ConfigError) as err:
        render(dataclasses.replace(CONFIG, **changes))
    for word in words:
        assert word in str(err.value), str(err.value)
    if changes.get("format") is None:  # the same settings render as a StatefulSet and Job
        render(dataclasses.replace(CONFIG, **changes, format="job"))


# --------------------------------------------------------------------------- the command

def test_the_format_flag_renders_a_jobset_and_job_stays_the_default(capsys):
    argv = ["--name", "ctr", "--image", "parallax", "--namespace", "ml", "--workers", "3",
            "--max-restarts", "2", "--metrics-namespace", "monitoring"]
    assert k8s.main([*argv, "--format", "jobset", "--", "python", "t.py"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert _jobset(objects) == _jobset(render(CONFIG))
    config, _ = k8s.config_from_args([*argv, "--", "python", "t.py"])
    assert config.format == "job"
    kinds = {o["kind"] for o in render(config)}
    assert {"StatefulSet", "Job", "Role", "Service"} <= kinds and "JobSet" not in kinds
    assert k8s.main([*argv, "--format", "jobset", "--keep-servers", "--", "t"]) == 2
    assert "--keep-servers with --format jobset" in capsys.readouterr().err


def test_a_patch_merges_into_a_replicated_job_by_name(tmp_path):
    patch = tmp_path / "p.yaml"
    patch.write_text(yaml.safe_dump({
        "kind": "JobSet", "metadata": {"name": "ctr"},
        "spec": {"replicatedJobs": [{"name": "worker", "template": {"spec": {"template": {
            "spec": {"priorityClassName": "high",
                     "containers": [{"name": "worker",
                                     "env": [{"name": "WANDB_MODE", "value": "off"}]}]}}}}}]}}))
    plain = _jobset(render(CONFIG))
    patched = _jobset(render(dataclasses.replace(CONFIG, patches=(str(patch),))))
    assert _replicated(patched)["ps"] == _replicated(plain)["ps"]
    worker = _pod(patched, "worker")["spec"]
    assert worker["priorityClassName"] == "high"
    env = _env(_container(worker, "worker"))
    assert env["WANDB_MODE"] == "off" and env["PARALLAX_RUN_ID"] == "ctr"
