{{/* Names and labels shared by the chart's templates. */}}

{{- define "tidal.name" -}}
tidal-operator
{{- end -}}

{{- define "tidal.fullname" -}}
{{- if contains "tidal" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tidal-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels: also what worker NetworkPolicies admit to the control port, so keep them stable. */}}
{{- define "tidal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tidal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tidal.labels" -}}
{{ include "tidal.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tidal
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "tidal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tidal.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The watched namespaces, comma-separated for the operator's TIDAL_OPERATOR_WATCH_NAMESPACES (empty: all), after
checking that they agree with rbac.scope: a namespace list under cluster scope would grant every namespace while
watching a few, and namespaces scope without a list would watch nothing. */}}
{{- define "tidal.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "namespaces" -}}
{{- if not .Values.watchNamespaces -}}
{{- fail "rbac.scope=namespaces needs watchNamespaces: the namespaces whose InferenceModels the operator reconciles" -}}
{{- end -}}
{{- join "," .Values.watchNamespaces -}}
{{- else if .Values.watchNamespaces -}}
{{- fail "watchNamespaces is set but rbac.scope=cluster grants every namespace: set rbac.scope=namespaces" -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs wherever it manages models (ClusterRole, or a Role per watched namespace). */}}
{{- define "tidal.modelRules" -}}
# The custom resource: watched by kopf, which patches its own annotations on it; the operator patches the status.
- apiGroups: ["tidal.dev"]
  resources: ["inferencemodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["tidal.dev"]
  resources: ["inferencemodels/status"]
  verbs: ["get", "patch"]
# Children are created with ownerReferences that set blockOwnerDeletion; clusters that enforce owner-reference
# permissions (admission plugin OwnerReferencesPermissionEnforcement) require this. The operator adds no finalizer.
- apiGroups: ["tidal.dev"]
  resources: ["inferencemodels/finalizers"]
  verbs: ["update"]
# One pod per rank: created and replaced, watched to react to crashes; patched only for its `tidal.dev/serving`
# label (whether the serving Service sends it requests), never its spec. `create` also covers the server-side dry
# run of each new pod, made before any pod is deleted for it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# The headless group Service and the serving Service, read by name and patched when their spec drifts.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The control-API token: created once and read back by name; patched only to write a new token into one that holds
# none it can read (its key removed or emptied). Never listed or deleted (ownerReferences clean up).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# Events on condition flips and failed worker calls, created by the operator (kopf's own posting is off).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}
