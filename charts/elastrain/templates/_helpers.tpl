{{/* Chart name, overridable with nameOverride. */}}
{{- define "elastrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name prefix of every resource: <release>-<chart>, or fullnameOverride. */}}
{{- define "elastrain.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Recommended labels on every resource. */}}
{{- define "elastrain.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "elastrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: elastrain
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels selecting the operator pods; never change them after a release (selectors are immutable). */}}
{{- define "elastrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elastrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "elastrain.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "elastrain.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image reference: repository@digest or repository:tag (tag defaults to appVersion). */}}
{{- define "elastrain.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Watched namespaces (sorted names whose value is true); empty means all namespaces. */}}
{{- define "elastrain.watchNamespaces" -}}
{{- $names := list -}}
{{- range $ns, $on := .Values.operator.watchNamespaces -}}
{{- if $on }}{{ $names = append $names $ns }}{{ end -}}
{{- end -}}
{{- toJson (sortAlpha $names) -}}
{{- end -}}

{{/* Refuse settings that would run two operators on the same objects. */}}
{{- define "elastrain.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.peering.enabled) -}}
{{- fail "replicaCount > 1 requires peering.enabled=true: without kopf peering every replica would reconcile every TrainingJob" -}}
{{- end -}}
{{- end -}}

{{/* NetworkPolicyPeer (JSON) selecting this release's operator pods, wherever they run. */}}
{{- define "elastrain.operatorPeer" -}}
{{- $ns := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) -}}
{{- $pods := dict "matchLabels" (include "elastrain.selectorLabels" . | fromYaml) -}}
{{- toJson (dict "namespaceSelector" $ns "podSelector" $pods) -}}
{{- end -}}

{{/* networkPolicy.scrapers as a JSON list of NetworkPolicyPeers, by name; null/false entries dropped. */}}
{{- define "elastrain.scraperPeers" -}}
{{- $peers := list -}}
{{- range $name, $peer := .Values.networkPolicy.scrapers -}}
{{- if $peer }}{{ $peers = append $peers $peer }}{{ end -}}
{{- end -}}
{{- toJson $peers -}}
{{- end -}}
