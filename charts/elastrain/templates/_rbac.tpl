{{/*
The operator's permissions, exactly elastrain_operator.rbac.RULES (tests/unit/chart compares
them). Split by scope: namespaced rules are granted per watched namespace (or cluster-wide when
every namespace is watched); cluster-scoped rules always need a ClusterRoleBinding.
*/}}
{{- define "elastrain.rules.namespaced" -}}
- apiGroups: ["elastrain.dev"]
  resources: ["trainingjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["elastrain.dev"]
  resources: ["trainingjobs/status"]
  verbs: ["patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}

{{- define "elastrain.rules.cluster" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}
