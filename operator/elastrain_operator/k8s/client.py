"""The operator's one Kubernetes client: plain JSON requests over the official client's transport.

Everything the operator reads or writes is a camelCase dict, exactly as the apiserver speaks
it and as the pure core renders it, so the typed models of the official client are skipped:
its configuration, authentication and connection pool are reused, nothing else.
"""

from __future__ import annotations

import json
import os
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config

Manifest = dict[str, Any]
REQUEST_TIMEOUT_SECONDS = 15


class KubeError(Exception):
    """A non-2xx answer from the apiserver."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            message = str(json.loads(body).get("message", body))
        except (ValueError, AttributeError):
            message = body
        super().__init__(f"{status}: {message}")

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


def load_api_client(pool_size: int | None = None) -> client.ApiClient:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config. `pool_size`:
    connections kept open, as many as threads that make requests (the client's default is 10)."""
    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),  # type: ignore[no-untyped-call]
                                client_configuration=configuration)
    if pool_size is not None:
        configuration.connection_pool_maxsize = pool_size
    return client.ApiClient(configuration)


class Kube:
    """JSON verbs on API paths; raises KubeError."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api = api_client

    def request(self, method: str, path: str, *, body: Any = None,
                query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Manifest:
        if query:
            path = f"{path}?{urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        serialized = self.api.param_serialize(method=method, resource_path=path,
                                              header_params=headers, body=body,
                                              auth_settings=["BearerToken"])
        response = self.api.call_api(*serialized, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        response.read()  # type: ignore[no-untyped-call]
        text = response.data.decode("utf-8") if response.data else ""
        if not 200 <= response.status < 300:
            raise KubeError(response.status, text)
        return dict(json.loads(text)) if text else {}

    def get(self, path: str) -> Manifest | None:
        try:
            return self.request("GET", path)
        except KubeError as err:
            if err.not_found:
                return None
            raise

    def list(self, path: str, *, labels: str | None = None) -> list[Manifest]:
        found = self.request("GET", path, query={"labelSelector": labels} if labels else None)
        return list(found.get("items") or [])

    def create(self, path: str, body: Manifest) -> Manifest | None:
        """None when it already exists (creation is idempotent for the planner)."""
        try:
            return self.request("POST", path, body=body)
        except KubeError as err:
            if err.conflict:
                return None
            raise

    def delete(self, path: str, *, body: Manifest | None = None) -> bool:
        """False when it was already gone."""
        try:
            self.request("DELETE", path, body=body)
            return True
        except KubeError as err:
            if err.not_found:
                return False
            raise

    def patch(self, path: str, body: Any, *, kind: str = "merge") -> Manifest | None:
        content = {"merge": "application/merge-patch+json",
                   "json": "application/json-patch+json"}[kind]
        try:
            return self.request("PATCH", path, body=body, content_type=content)
        except KubeError as err:
            if err.not_found:
                return None
            raise


def namespaced(group_version: str, namespace: str, plural: str, name: str = "") -> str:
    """An API path: core ("v1") under /api, every other group under /apis."""
    root = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    path = f"{root}/namespaces/{quote(namespace)}/{plural}"
    return f"{path}/{quote(name)}" if name else path
