"""The job's NetworkPolicy, enforced on the real node (kube-router's firewall, hack/node):
a pod of another namespace, an unlabelled pod and a pod of another job in the job's namespace
cannot reach the job's rendezvous store (through its Service or at its pod IP) nor a worker's
metrics port, while each of them still reaches the node's MinIO (so the probe itself works);
the job's own worker reaches the store, the operator still polls the workers' progress, the
job survives an eviction and trains to completion.

One job for all of it: starting torch workers costs a minute on two cores.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse

from tests.e2e.conftest import NodeCluster, ensure_namespace
from tests.e2e.support import (
    ARTIFACTS,
    RESTART,
    Kubectl,
    LogCollector,
    Training,
    make_job,
    recovery_spec,
    restricted_pod,
    wait_for,
)

JOB = "fenced"
STEPS = 240  # outlasts the probes and an eviction (step ~60 then, on two busy cores)
STORE_PORT = 29400  # spec.rendezvous.port's default
METRICS_PORT = 9400  # spec.metricsPort's default
# Tries each (host, port) once per address its name has; prints {"host:port": "open" | the last
# error's name | "gaierror: why"}.
PROBE = """
import json, socket, sys, time
def addresses(host, port):
    # A lookup can fail once (in a full e2e run the job's own worker got a gaierror for its store's
    # Service while the pod IP answered); the probe judges the policy, not the resolver.
    for attempt in range(5):
        try:
            return [info[4][:2] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
        except socket.gaierror as err:
            failed = err
            time.sleep(1)
    raise failed
def verdict(host, port):
    try:
        found = addresses(host, port)
    except socket.gaierror as err:
        return f"gaierror: {err}"
    for where in found:
        try:
            socket.create_connection(where, timeout=3).close()
            return "open"
        except OSError as err:
            last = type(err).__name__
    return last
print(json.dumps({f"{h}:{p}": verdict(h, p) for h, p in json.loads(sys.argv[1])}), flush=True)
"""


def probe_from(k: Kubectl, probes: dict[str, tuple[str, dict[str, str] | None]], image: str,
               targets: list[tuple[str, int]]) -> dict[str, dict[str, str]]:
    """Runs PROBE in a pod of its own per entry, name -> (namespace, labels), all at once
    (restricted, as the namespace demands); each one's verdicts."""
    for name, (namespace, labels) in probes.items():
        k.apply(restricted_pod(name, namespace, image=image, labels=labels,
                               command=["python3", "-c", PROBE, json.dumps(targets)]))
    verdicts: dict[str, dict[str, str]] = {}
    for name, (namespace, _) in probes.items():
        wait_for(f"probe pod {namespace}/{name} to finish",
                 lambda name=name, namespace=namespace: k.json(  # type: ignore[misc]
                     "get", "pod", name, "-n", namespace)["status"].get("phase")
                 in ("Succeeded", "Failed"), timeout=120)
        out = k("logs", name, "-n", namespace).stdout.strip().splitlines()
        k("delete", "pod", name, "-n", namespace, "--wait=false", check=False)
        verdicts[name] = dict(json.loads(out[-1]))
    return verdicts


def pod_ip(k: Kubectl, namespace: str, name: str) -> str:
    return str(k.json("get", "pod", name, "-n", namespace)["status"]["podIP"])


def read_policy(k: Kubectl, namespace: str) -> dict[str, Any] | None:
    done = k("get", "networkpolicy", f"{JOB}-network", "-n", namespace, "-o", "json",
             check=False)
    return dict(json.loads(done.stdout)) if done.returncode == 0 else None


def progress_step(t: Training) -> int:
    return int((t.status().get("progress") or {}).get("step", 0))


def test_only_the_jobs_workers_reach_its_store_and_it_trains_through_an_eviction(
        operator: NodeCluster, job_namespace: str) -> None:
    k, ns = operator.kubectl, job_namespace
    s3 = urlparse(operator.s3.endpoint_url)
    job = make_job(JOB, ns, image=operator.images["trainer"], steps=STEPS, replicas=2,
                   s3_endpoint=operator.s3.endpoint_url, bucket=operator.s3.bucket,
                   **recovery_spec(RESTART))
    k.apply(job)
    with LogCollector(k, ns, Training.worker_selector(JOB),
                      ARTIFACTS / "network-policy") as logs:
        t = Training(k, ns, JOB, logs)
        uid = k.json("get", "trainingjob", JOB, "-n", ns)["metadata"]["uid"]
        policy = wait_for("the job's NetworkPolicy", lambda: read_policy(k, ns))
        (owner,) = policy["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] is True
        t.settle(replicas=2)

        store = f"{JOB}-rdzv"
        worker = t.worker(0)
        closed = [(f"{store}.{ns}.svc", STORE_PORT), (pod_ip(k, ns, store), STORE_PORT),
                  (pod_ip(k, ns, worker), METRICS_PORT)]
        targets = [*closed, (str(s3.hostname), int(s3.port or 80))]
        control = f"{s3.hostname}:{s3.port or 80}"
        other_ns = f"{ns}-other"
        ensure_namespace(operator, other_ns)
        wait_for(f"default ServiceAccount in {other_ns}", lambda: k(
            "get", "serviceaccount", "default", "-n", other_ns, check=False).returncode == 0)
        image = operator.images["operator"]  # python3, and nothing of the job's
        roles = {"stranger": "another namespace", "unlabelled": "an unlabelled pod",
                 "other-job": "another job's worker"}
        found = probe_from(k, {"stranger": (other_ns, None), "unlabelled": (ns, None),
                               "other-job": (ns, {"elastrain.dev/job-name": "other",
                                                  "elastrain.dev/role": "worker"})},
                           image, targets)
        strangers = {roles[name]: verdicts for name, verdicts in found.items()}
        k("delete", "namespace", other_ns, "--wait=false", check=False)
        for who, verdicts in strangers.items():
            assert verdicts[control] == "open", f"{who}: the probe reaches nothing: {verdicts}"
            opened = [f"{h}:{p}" for h, p in closed if verdicts[f"{h}:{p}"] == "open"]
            assert not opened, f"{who} reached {opened}: {verdicts}"
            # Refused by the policy, not unnamed: a name that never resolved would pass the above.
            unresolved = [v for v in verdicts.values() if v.startswith("gaierror")]
            assert not unresolved, f"{who}: {verdicts}"

        # The job's own worker reaches its store; the operator still reads the workers' progress.
        reached = k("exec", worker, "-n", ns, "-c", "trainer", "--", "python3", "-c", PROBE,
                    json.dumps(closed[:2])).stdout
        assert set(json.loads(reached).values()) == {"open"}, reached
        step = progress_step(t)
        wait_for("the operator polling progress through the policy",
                 lambda: progress_step(t) > step, timeout=60)

        # An eviction still recovers: the replacement worker joins the store again.
        preemptions = t.counters()[0]
        at = t.evict(t.worker(1))
        t.resumed_after(at)
        wait_for("the preemption counted", lambda: t.counters()[0] == preemptions + 1)
        wait_for("the job Succeeded", lambda: t.status().get("phase") == "Succeeded",
                 timeout=600)
        assert t.status()["progress"]["step"] == STEPS
