{{/*
The operator's permissions: exactly elastrain_operator.rbac.rules_for(mode, peering=...)
(tests/unit/chart compares the rendered roles with it both ways, in every mode). Split by scope:
namespaced rules go into a Role in each watched namespace (or one ClusterRole when every
namespace is watched); cluster-scoped rules always need a ClusterRole.
*/}}
{{- define "elastrain.rules.namespaced" -}}
{{- $namespaces := include "elastrain.watchNamespaces" . | fromJsonArray -}}
# The jobs: watched by kopf, read by every reconcile, deleted by the TTL, annotated by kopf.
- apiGroups: ["elastrain.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["elastrain.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["get", "update", "patch"]
# Workers and rendezvous stores; patch removes the worker-accounting finalizer.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create"]
# The per-job NetworkPolicy around the store and the workers.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Events of the operator and of kopf (core v1).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Each in-process job's control Secret: created, never read or changed.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- if .Values.kueue.enabled }}
# Kueue: each queued job's Workload (created, its status and finalizer kept), the LocalQueues.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["list", "watch"]
{{- end }}
{{- if and $namespaces .Values.peering.enabled }}
# kopf peering in each watched namespace.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end }}
{{- end -}}

{{- define "elastrain.rules.cluster" -}}
{{- $namespaces := include "elastrain.watchNamespaces" . | fromJsonArray -}}
# kopf watches CRDs to notice the resources it serves (re)appear.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if $namespaces }}
# A namespaced kopf lists and watches namespaces to serve them as they come and go.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- else if .Values.peering.enabled }}
# kopf peering across the cluster.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end }}
{{- if .Values.notices.enabled }}
# Node notices: a cordon or a listed taint on a worker's node (read only).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
{{- end }}
{{- if .Values.kueue.enabled }}
# Kueue: the flavors an admission names and the classes a Workload is ordered by (read only).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["get", "list", "watch"]
# Shrink to yield (kueue.yieldQuota): whether Kueue preempts within a ClusterQueue.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["clusterqueues"]
  verbs: ["list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloadpriorityclasses"]
  verbs: ["get"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}
{{- end -}}
