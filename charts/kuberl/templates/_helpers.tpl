{{- define "kuberl.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kuberl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kuberl.labels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "kuberl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kuberl.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The namespaced rules the operator needs, in a Role (per namespace) or the ClusterRole. */}}
{{- define "kuberl.rules" -}}
# Exactly what the operator asks for (tests/test_operator.py, a tour of everything it does, compares
# its requests with these rules both ways). It reads what its watches deliver (list, watch) and
# gets an object only when its create answered 409 (the name is taken: whose is it?). It reads
# experiments and writes only their status (and, for spec.inference.autoscale, their scale).
- apiGroups: [kuberl.io]
  resources: [rlexperiments]
  verbs: [list, watch]
- apiGroups: [kuberl.io]
  resources: [inferencepools, trainerjobs]
  verbs: [get, list, watch, create, patch]
- apiGroups: [kuberl.io]
  resources: [rlexperiments/status, inferencepools/status, trainerjobs/status]
  verbs: [patch]
# spec.inference.autoscale: the operator resizes an experiment's pool as an HPA would, through /scale.
- apiGroups: [kuberl.io]
  resources: [rlexperiments/scale]
  verbs: [patch]
# Children carry blockOwnerDeletion: under OwnerReferencesPermissionEnforcement (OpenShift's default)
# setting it needs update on the owner's finalizers.
- apiGroups: [kuberl.io]
  resources: [rlexperiments/finalizers, inferencepools/finalizers, trainerjobs/finalizers]
  verbs: [update]
# Pods: created, deleted (suspend, scale-down, gang restart, template change), labelled with their
# node's topology, watched.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The run config: created, kept in line with the spec (watched: the operator reads from its cache).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
# Headless Services and the gateway's (deleted when spec.agent is removed).
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, delete]
# The API token Secrets of each experiment: created once, read back only to check their owner and
# version (a recreated one rolls the pods); the agent's is deleted when spec.agent is removed.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch]
# spec.agent: the user's agent runs as a Deployment (garbage-collected with its experiment, deleted
# when spec.agent is removed).
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
# kopf's Events (a failure that will not heal by itself); listed once when an experiment fails, for
# its post-mortem (kuberl_operator.postmortem), with its pods' last log lines.
- apiGroups: [""]
  resources: [events]
  verbs: [create, list]
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
{{- if .Values.integrations.kubeflowTraining }}
- apiGroups: [kubeflow.org]
  resources: [pytorchjobs]
  verbs: [get, list, watch, create, delete]
{{- end }}
{{- if .Values.integrations.kubeflowTrainer }}
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [get, list, watch, create, delete]
{{- end }}
# A gang's PodGroup: created with the experiment, its minMember patched when the experiment resizes.
{{- if .Values.integrations.volcano }}
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- end }}
{{- if .Values.integrations.coscheduling }}
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [get, create, patch]
{{- end }}
{{- end -}}

{{/* The namespaces the operator watches and holds Roles in, as a JSON list; [] when clusterWide. */}}
{{- define "kuberl.namespaces" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces -}}
{{- fail "clusterWide and watchNamespaces exclude each other: set one" -}}
{{- end -}}
{{- if .Values.clusterWide -}}
[]
{{- else -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson -}}
{{- end -}}
{{- end -}}
