{{/*
The operator's permissions: exactly elastrain_operator.rbac.RULES (tests/unit/chart compares the
rendered roles with RULES both ways). Split by scope: namespaced rules are granted per watched
namespace (or cluster-wide when every namespace is watched); cluster-scoped rules always need a
ClusterRoleBinding.
*/}}
{{- define "elastrain.rules.namespaced" -}}
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
# Events of the operator and of kopf (core v1).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# kopf peering in a watched namespace (namespaced operators).
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
{{- end -}}

{{- define "elastrain.rules.cluster" -}}
# kopf peering across the cluster (cluster-wide operators).
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch", "create"]
# kopf discovers the resources it serves and follows namespaces in cluster-wide mode.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end -}}
