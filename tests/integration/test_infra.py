"""The test servers are the real thing: the pinned kube-apiserver stores and serves objects, the
controller-manager runs its controllers (ServiceAccounts, garbage collection, EndpointSlices), the
scheduler binds pods, MinIO checks credentials and assembles multipart uploads, and nothing
listens beyond loopback."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.conftest import S3, Kube, fresh_namespace

MiB = 1024 * 1024


def wait_for(what: str, predicate: Callable[[], Any], timeout: float = 60) -> Any:
    """Polls until predicate() returns something truthy; returns it."""
    deadline = time.monotonic() + timeout
    while (result := predicate()) is None or result is False:
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return result


def read_or_none(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except ApiException as err:
        if err.status == 404:
            return None
        raise


@pytest.fixture(scope="module")
def core(kube: Kube) -> Iterator[client.CoreV1Api]:
    with kube.api_client() as api_client:
        yield client.CoreV1Api(api_client)


def configmap(name: str, data: dict[str, str], owner: client.V1ConfigMap | None = None
              ) -> client.V1ConfigMap:
    refs = None
    if owner is not None:
        refs = [client.V1OwnerReference(api_version="v1", kind="ConfigMap",
                                        name=owner.metadata.name, uid=owner.metadata.uid)]
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, owner_references=refs),
                              data=data)


# ------------------------------------------------------------------------------- kube-apiserver


@pytest.mark.cluster
def test_apiserver_reports_the_pinned_version(kube: Kube) -> None:
    with kube.api_client() as api_client:
        info = client.VersionApi(api_client).get_code()
    assert info.git_version == f"v{kube.version}"
    assert (info.major, info.minor) == tuple(kube.version.split(".")[:2])


@pytest.mark.cluster
def test_namespace_and_configmap_are_stored_and_served(core: client.CoreV1Api,
                                                       kube_namespace: str) -> None:
    assert core.read_namespace(kube_namespace).status.phase == "Active"
    payload = {"blob": base64.b64encode(os.urandom(512)).decode(), "unicode": "ünïcødé ✓"}
    created = core.create_namespaced_config_map(kube_namespace, configmap("settings", payload))

    read = core.read_namespaced_config_map("settings", kube_namespace)
    assert read.data == payload
    assert read.metadata.uid == created.metadata.uid
    names = [cm.metadata.name for cm in core.list_namespaced_config_map(kube_namespace).items]
    assert "settings" in names
    with pytest.raises(ApiException) as conflict:
        core.create_namespaced_config_map(kube_namespace, configmap("settings", {}))
    assert conflict.value.status == 409


@pytest.mark.cluster
def test_kubeconfig_works_with_kubectl_as_admin(kube: Kube) -> None:
    result = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), "auth", "can-i",
                             "*", "*", "--all-namespaces"], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "yes", result.stderr


# ---------------------------------------------------------------------- controller-manager (a+)


@pytest.mark.cluster
def test_new_namespace_gets_default_service_account_and_root_ca(
        kube: Kube, core: client.CoreV1Api, kube_namespace: str) -> None:
    account = wait_for("ServiceAccount default", lambda: read_or_none(
        lambda: core.read_namespaced_service_account("default", kube_namespace)))
    assert account.metadata.namespace == kube_namespace

    root_ca = wait_for("ConfigMap kube-root-ca.crt", lambda: read_or_none(
        lambda: core.read_namespaced_config_map("kube-root-ca.crt", kube_namespace)))
    kubeconfig = yaml.safe_load(Path(kube.kubeconfig).read_text())
    ca = base64.b64decode(kubeconfig["clusters"][0]["cluster"]["certificate-authority-data"])
    assert root_ca.data["ca.crt"].strip() == ca.decode().strip()


@pytest.mark.cluster
def test_garbage_collector_deletes_what_an_owner_owned(core: client.CoreV1Api,
                                                       kube_namespace: str) -> None:
    owner = core.create_namespaced_config_map(kube_namespace, configmap("owner", {"a": "1"}))
    core.create_namespaced_config_map(kube_namespace, configmap("owned", {"b": "2"}, owner))
    core.create_namespaced_config_map(kube_namespace, configmap("bystander", {"c": "3"}))

    core.delete_namespaced_config_map("owner", kube_namespace, propagation_policy="Background")

    wait_for("owned ConfigMap to be collected", lambda: read_or_none(
        lambda: core.read_namespaced_config_map("owned", kube_namespace)) is None)
    assert core.read_namespaced_config_map("bystander", kube_namespace).data == {"c": "3"}


def pending_pod(name: str, labels: dict[str, str] | None = None) -> client.V1Pod:
    """A pod no kubelet will ever run (no node runs anything): its image is never pulled."""
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1PodSpec(containers=[client.V1Container(
            name="main", image="registry.invalid/never-pulled:0",
            resources=client.V1ResourceRequirements(requests={"cpu": "1"}))]))


def wait_until_bound(core: client.CoreV1Api, name: str, namespace: str) -> str:
    return str(wait_for(f"pod {name} to be bound", lambda: core.read_namespaced_pod(
        name, namespace).spec.node_name))


def mark_running(core: client.CoreV1Api, name: str, namespace: str, pod_ip: str) -> None:
    """What a kubelet would report: tests drive pod phase through the pods/status subresource."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(name, namespace, {"status": {
        "phase": "Running", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
        "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


@pytest.mark.cluster
def test_headless_service_endpointslice_lists_a_ready_pod(kube: Kube, core: client.CoreV1Api,
                                                          kube_namespace: str) -> None:
    core.create_namespaced_service(kube_namespace, client.V1Service(
        metadata=client.V1ObjectMeta(name="workers"),
        spec=client.V1ServiceSpec(cluster_ip="None", selector={"app": "w"},
                                  ports=[client.V1ServicePort(name="rdzv", port=29500)])))
    core.create_namespaced_pod(kube_namespace, pending_pod("w-0", {"app": "w"}))
    wait_until_bound(core, "w-0", kube_namespace)
    mark_running(core, "w-0", kube_namespace, "10.244.0.7")

    with kube.api_client() as api_client:
        discovery = client.DiscoveryV1Api(api_client)

        def ready_addresses() -> list[str] | None:
            slices = discovery.list_namespaced_endpoint_slice(
                kube_namespace, label_selector="kubernetes.io/service-name=workers").items
            found = [a for s in slices for e in (s.endpoints or []) if e.conditions.ready
                     for a in e.addresses]
            return found or None

        assert wait_for("EndpointSlice with the ready pod", ready_addresses) == ["10.244.0.7"]


# -------------------------------------------------------------------------- kube-scheduler (a+)


@pytest.mark.cluster
def test_scheduler_binds_a_pod_to_the_fake_node(kube: Kube, core: client.CoreV1Api,
                                               kube_namespace: str) -> None:
    if not kube.nodes:
        pytest.skip("reused cluster: no fake nodes known")
    core.create_namespaced_pod(kube_namespace, pending_pod("sleeper"))

    assert wait_until_bound(core, "sleeper", kube_namespace) in kube.nodes
    pod = core.read_namespaced_pod("sleeper", kube_namespace)
    # The ServiceAccount admission plugin (kept on in tier a+) filled in the default account.
    assert pod.spec.service_account_name == "default"
    assert pod.status.phase == "Pending"  # bound, but nothing runs it


@pytest.mark.cluster
def test_a_test_namespace_leaves_no_pod_on_the_fake_node(kube: Kube, core: client.CoreV1Api,
                                                         request: pytest.FixtureRequest) -> None:
    # No kubelet confirms a graceful delete there: a pod a test left would stay Terminating on
    # the node for the session, until its 110 pods are taken and every test's pods Unschedulable.
    if not kube.nodes:
        pytest.skip("reused cluster: no fake nodes known")
    with fresh_namespace(kube, request.node.name) as namespace:
        core.create_namespaced_pod(namespace, pending_pod("left-behind"))
        assert wait_until_bound(core, "left-behind", namespace) in kube.nodes
    wait_for("the pod gone", lambda: read_or_none(
        lambda: core.read_namespaced_pod("left-behind", namespace)) is None, timeout=30)


# -------------------------------------------------------------------------------------- MinIO


@pytest.fixture(scope="module")
def s3_client(s3: S3) -> Any:
    return boto3.client("s3", **s3.client_kwargs)


@pytest.mark.s3
def test_object_round_trips_byte_for_byte(s3: S3, s3_client: Any) -> None:
    key = f"infra/{os.urandom(4).hex()}/small.bin"
    body = os.urandom(256 * 1024)
    s3_client.put_object(Bucket=s3.bucket, Key=key, Body=body)

    got = s3_client.get_object(Bucket=s3.bucket, Key=key)
    assert got["Body"].read() == body
    assert got["ContentLength"] == len(body)
    listed = s3_client.list_objects_v2(Bucket=s3.bucket, Prefix=key)["Contents"]
    assert [o["Key"] for o in listed] == [key]
    s3_client.delete_object(Bucket=s3.bucket, Key=key)
    with pytest.raises(ClientError) as gone:
        s3_client.get_object(Bucket=s3.bucket, Key=key)
    assert gone.value.response["Error"]["Code"] == "NoSuchKey"


@pytest.mark.s3
def test_multipart_upload_is_assembled_in_order(s3: S3, s3_client: Any) -> None:
    key = f"infra/{os.urandom(4).hex()}/large.bin"
    parts_data = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(MiB + 123)]
    upload = s3_client.create_multipart_upload(Bucket=s3.bucket, Key=key)
    parts = []
    for number, data in enumerate(parts_data, start=1):
        etag = s3_client.upload_part(Bucket=s3.bucket, Key=key, UploadId=upload["UploadId"],
                                     PartNumber=number, Body=data)["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    done = s3_client.complete_multipart_upload(Bucket=s3.bucket, Key=key,
                                               UploadId=upload["UploadId"],
                                               MultipartUpload={"Parts": parts})
    assert done["ETag"].strip('"').endswith("-3")

    body = s3_client.get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(b"".join(parts_data)).digest()


@pytest.mark.s3
def test_part_smaller_than_5_mib_is_refused_unless_last(s3: S3, s3_client: Any) -> None:
    key = f"infra/{os.urandom(4).hex()}/bad.bin"
    upload = s3_client.create_multipart_upload(Bucket=s3.bucket, Key=key)
    parts = [{"PartNumber": n, "ETag": s3_client.upload_part(
        Bucket=s3.bucket, Key=key, UploadId=upload["UploadId"], PartNumber=n,
        Body=os.urandom(MiB))["ETag"]} for n in (1, 2)]
    with pytest.raises(ClientError) as refused:
        s3_client.complete_multipart_upload(Bucket=s3.bucket, Key=key,
                                            UploadId=upload["UploadId"],
                                            MultipartUpload={"Parts": parts})
    assert refused.value.response["Error"]["Code"] == "EntityTooSmall"
    s3_client.abort_multipart_upload(Bucket=s3.bucket, Key=key, UploadId=upload["UploadId"])


@pytest.mark.s3
def test_wrong_secret_key_is_refused(s3: S3) -> None:
    wrong = boto3.client("s3", **{**s3.client_kwargs, "aws_secret_access_key": "not-the-secret"})
    with pytest.raises(ClientError) as refused:
        wrong.head_bucket(Bucket=s3.bucket)
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403


# ----------------------------------------------------------------------------------- listeners


def listening_addresses(pid: int) -> set[str]:
    """host:port of every TCP socket in LISTEN state the process holds (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                found.add(f"{decode_address(address, width)}:{int(port, 16)}")
    return found


def decode_address(hex_address: str, width: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp* print each 32-bit word in host (little-endian) byte order.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if width == 8:
        return ".".join(str(b) for b in words)
    return "[" + ":".join(words[i:i + 2].hex() for i in range(0, 16, 2)) + "]"


LOOPBACK = ("127.", "[0000:0000:0000:0000:0000:0000:0000:0001]",
            "[0000:0000:0000:0000:0000:ffff:7f")


@pytest.mark.cluster
@pytest.mark.s3
def test_servers_listen_on_loopback_only(kube: Kube, s3: S3) -> None:
    pids = {**kube.pids, **s3.pids}
    if not pids:
        pytest.skip("reused servers: their processes are not ours to inspect")
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                         "minio"}
    for name, pid in pids.items():
        addresses = listening_addresses(pid)
        assert addresses, f"{name} listens nowhere?"
        exposed = sorted(a for a in addresses if not a.startswith(LOOPBACK))
        assert not exposed, f"{name} listens beyond loopback: {exposed}"



# ------------------------------------------------------------------------- hack/cluster.py CLI


@pytest.mark.cluster
def test_cluster_cli_up_env_down(kube: Kube, tmp_path: Path) -> None:
    """`up` starts a second, independent tier-a cluster beside the session's; `down` stops it."""
    script = Path(__file__).resolve().parents[2] / "hack" / "cluster.py"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *args, "--dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=180)

    try:
        started = cli("up", "--tier", "a", "--no-s3")
        assert started.returncode == 0, started.stderr
        assert cli("env").stdout == started.stdout
        kubeconfig = tmp_path / "kubeconfig"
        assert f"export KUBECONFIG={kubeconfig}\n" in started.stdout
        ready = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "get", "--raw",
                                "/readyz"], capture_output=True, text=True, timeout=60)
        assert ready.stdout == "ok"
        assert _server_url(kubeconfig) != kube.server
        pids = [p["pid"] for p in json.loads((tmp_path / "state.json").read_text())["procs"]]
        data_dirs = json.loads((tmp_path / "state.json").read_text())["data_dirs"]
        assert len(pids) == 2 and all(Path(d).is_dir() for d in data_dirs)
    finally:
        stopped = cli("down")
    assert stopped.returncode == 0, stopped.stderr
    assert not any(_running(pid) for pid in pids)
    assert not any(Path(d).exists() for d in data_dirs)
    assert cli("env").returncode == 1


def _server_url(kubeconfig: Path) -> str:
    return str(yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"])


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"
