"""Shared pydantic configuration and schema helpers for the API models.

Every model speaks camelCase on the wire (as Kubernetes users expect) and snake_case in Python.
`cel()` and `k8s()` attach Kubernetes-only schema keywords (CEL rules, list types, int-or-string)
that JSON Schema has no words for; `render.crd` carries them into the CRD unchanged.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    """Base of every API object: camelCase aliases, unknown fields rejected, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the apiserver would store it: camelCase, None fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def cel(rule: str, message: str, *, field_path: str | None = None,
        reason: str | None = None) -> dict[str, str]:
    """One `x-kubernetes-validations` entry; the message must name the field it is about."""
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    if reason:
        entry["reason"] = reason
    return entry


def k8s(*rules: dict[str, str], **keywords: Any) -> dict[str, Any]:
    """`json_schema_extra` for a field or model: CEL rules plus raw x-kubernetes-* keywords."""
    extra: dict[str, Any] = {}
    if rules:
        extra["x-kubernetes-validations"] = list(rules)
    for key, value in keywords.items():
        extra[key.replace("_", "-")] = value
    return extra


def immutable(field: str) -> dict[str, str]:
    """A transition rule that refuses any change to `field` once the job exists."""
    return cel("self == oldSelf", f"{field} is immutable: changing it mid-run is not supported",
               reason="FieldValueForbidden")
