{{/*
Names, labels, images, the state URL and the checks that fail a render early.
Every container runs the image's `kvgate` command (command: [kvgate]) with a subcommand in args, so a
test can parse each container's arguments with kvgate's own argument parser.
*/}}

{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kvgate.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kvgate.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* A component's object name: <fullname>-<component>, at most 52 characters. A StatefulSet's pods carry a
controller-revision-hash label <name>-<10-character hash> that must fit a label's 63, and "<name>-headless" must
fit a DNS label; the fullname is cut, never the component, so two components never collapse into one name. */}}
{{- define "kvgate.componentName" -}}
{{- $room := sub 51 (len .component) | int }}
{{- printf "%s-%s" (include "kvgate.fullname" .root | trunc $room | trimSuffix "-") .component }}
{{- end }}

{{- define "kvgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvgate
{{- end }}

{{/* The kvgate cluster name (`kvgate autoscaler --cluster`): engine Deployments and node claims carry it. */}}
{{- define "kvgate.cluster" -}}
{{- default .Release.Name .Values.cluster }}
{{- end }}

{{/* The key prefix in Redis, shared by gateways and autoscaler (--key-prefix). */}}
{{- define "kvgate.keyPrefix" -}}
{{- default (printf "kvgate:%s:" (include "kvgate.cluster" .)) .Values.stateKeyPrefix }}
{{- end }}

{{/* An image reference from {repository, tag, digest} with a default tag; a digest pins it. */}}
{{- define "kvgate.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .defaultTag .image.tag) }}
{{- end }}
{{- end }}

{{/* The gateway and autoscaler image: the torch-free `gateway` target of the Dockerfile. */}}
{{- define "kvgate.image" -}}
{{- include "kvgate.imageRef" (dict "image" .Values.image "defaultTag" (printf "%s-gateway" .Chart.AppVersion)) }}
{{- end }}

{{/* The engine image: the Dockerfile's `cuda` target unless engine.image says otherwise. */}}
{{- define "kvgate.engineImage" -}}
{{- $image := dict "repository" (default .Values.image.repository .Values.engine.image.repository) "tag" .Values.engine.image.tag "digest" .Values.engine.image.digest }}
{{- include "kvgate.imageRef" (dict "image" $image "defaultTag" (printf "%s-cuda" .Chart.AppVersion)) }}
{{- end }}

{{/* Secrets: the chart's own, or the ones values name. */}}
{{- define "kvgate.adminTokenSecret" -}}
{{- default (include "kvgate.componentName" (dict "root" . "component" "admin-token")) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "kvgate.metricsTokenSecret" -}}
{{- default (include "kvgate.componentName" (dict "root" . "component" "metrics-token")) .Values.metricsToken.existingSecret }}
{{- end }}

{{/*
A Secret the chart makes when values name none: one random value of 40 letters and digits under `key`. On
`helm upgrade` the value is read back with `lookup`, so it stays the same. Args: root, name, key, component.
*/}}
{{- define "kvgate.generatedSecret" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
apiVersion: v1
kind: Secret
metadata:
  name: {{ .name }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvgate.labels" (dict "root" .root "component" .component) | nindent 4 }}
type: Opaque
data:
  {{- if and $existing $existing.data (hasKey $existing.data .key) }}
  {{ .key }}: {{ get $existing.data .key }}
  {{- else }}
  {{ .key }}: {{ randAlphaNum 40 | b64enc }}
  {{- end }}
{{- end }}

{{- define "kvgate.redisSecret" -}}
{{- if .Values.redis.enabled }}
{{- default (include "kvgate.componentName" (dict "root" . "component" "redis")) .Values.redis.auth.existingSecret }}
{{- else }}
{{- .Values.externalRedis.existingSecret }}
{{- end }}
{{- end }}

{{- define "kvgate.redisSecretKey" -}}
{{- if .Values.redis.enabled }}{{ .Values.redis.auth.existingSecretKey }}{{ else }}{{ .Values.externalRedis.existingSecretKey }}{{ end }}
{{- end }}

{{/*
The --state URL, without the password: the container gets that from a Secret as $KVGATE_REDIS_PASSWORD,
which kvgate reads itself, so it is in no value, no rendered manifest and no process argument (`ps`).
*/}}
{{- define "kvgate.stateURL" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:6379/0" (include "kvgate.componentName" (dict "root" . "component" "redis")) }}
{{- else }}
{{- .Values.externalRedis.url }}
{{- end }}
{{- end }}

{{/* Env of every container that reads the state store: the Redis password, when there is one. */}}
{{- define "kvgate.stateEnv" -}}
{{- if include "kvgate.redisSecret" . }}
- name: KVGATE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.redisSecret" . }}
      key: {{ include "kvgate.redisSecretKey" . }}
{{- end }}
{{- end }}

{{/* The registry ConfigMap: the chart's own from registry.files, or registry.existingConfigMap. */}}
{{- define "kvgate.registryConfigMap" -}}
{{- default (include "kvgate.componentName" (dict "root" . "component" "registry")) .Values.registry.existingConfigMap }}
{{- end }}

{{/*
Refuses values that cannot work, at render time, with the key and what to do. Included by every
template that needs them, so `helm template` and `helm install` stop before anything is applied.
*/}}
{{- define "kvgate.checks" -}}
{{- if and (not .Values.registry.files) (not .Values.registry.existingConfigMap) }}
{{- fail "registry: kvgate needs a registry. Pass its files with --set-file 'registry.files.models\\.yaml=./registry/models.yaml' (one per file), set registry.files in a values file, or name a ConfigMap you manage in registry.existingConfigMap" }}
{{- end }}
{{- if and .Values.registry.files .Values.registry.existingConfigMap }}
{{- fail "registry: set registry.files or registry.existingConfigMap, not both" }}
{{- end }}
{{- if and .Values.redis.enabled .Values.externalRedis.url }}
{{- fail "externalRedis.url is set while redis.enabled is true: set redis.enabled=false to use the external Redis, or unset externalRedis.url" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.externalRedis.url) }}
{{- fail "redis.enabled is false and externalRedis.url is empty: gateways and autoscalers need a shared Redis (set one of them)" }}
{{- end }}
{{- range $key := list "requests" "limits" }}
{{- if hasKey ((get $.Values.engine.resources $key) | default dict) "nvidia.com/gpu" }}
{{- fail (printf "engine.resources.%s.nvidia.com/gpu: the GPU count of an engine comes from its Model's resources.gpu_count in the registry (what the autoscaler plans for); remove it here" $key) }}
{{- end }}
{{- end }}
{{- with .Values.gateway.usageLog }}
{{- if and .enabled (or (eq .mountPath "/tmp") (eq .mountPath $.Values.registry.mountPath) (hasPrefix (printf "%s/" $.Values.registry.mountPath) .mountPath)) }}
{{- fail (printf "gateway.usageLog.mountPath: %s is, or is inside, a volume the gateway already mounts (/tmp, or the read-only registry at %s); give the usage log a directory of its own, such as /var/lib/kvgate/usage" .mountPath $.Values.registry.mountPath) }}
{{- end }}
{{- end }}
{{- if and .Values.prometheusRule.enabled (not .Values.gateway.serviceMonitor.enabled) }}
{{- fail "prometheusRule.enabled needs gateway.serviceMonitor.enabled: the alerts read the gateways', autoscalers' and engines' series, which that option's monitors scrape (without them KvgateAutoscalerLeaseNotHeld fires for good)" }}
{{- end }}
{{- include "kvgate.registryChecks" . }}
{{- end }}

{{/*
What Helm can check of the registry files: each is YAML, and each document is a kvgate/v1 Model,
Adapter, Pool or Tenant with a name. The full validation (schema, cross-references, with file:line)
is `kvgate registry validate`, which runs in each pod's init container before kvgate starts.
*/}}
{{- define "kvgate.registryChecks" -}}
{{- range $file, $text := .Values.registry.files }}
{{- if not (regexMatch "^[-_a-zA-Z0-9][-._a-zA-Z0-9]*\\.ya?ml$" $file) }}
{{- fail (printf "registry.files.%s: a registry file's name must end in .yaml or .yml and hold only letters, digits, '-', '_' and '.' (kvgate loads only *.yaml and *.yml files)" $file) }}
{{- end }}
{{- if not (trim $text) }}
{{- fail (printf "registry.files.%s is empty: pass the file's content (--set-file 'registry.files.%s=PATH')" $file ($file | replace "." "\\.")) }}
{{- end }}
{{- range $index, $part := splitList "\n---" (printf "\n%s" $text) }}
{{- $doc := fromYaml $part }}
{{- if hasKey $doc "Error" }}
{{- fail (printf "registry.files.%s, document %d: not valid YAML: %s" $file $index (get $doc "Error")) }}
{{- end }}
{{- if $doc }}
{{- if ne (toString (get $doc "apiVersion")) "kvgate/v1" }}
{{- fail (printf "registry.files.%s, document %d: apiVersion is %q; registry documents are apiVersion: kvgate/v1" $file $index (toString (get $doc "apiVersion"))) }}
{{- end }}
{{- if not (has (toString (get $doc "kind")) (list "Model" "Adapter" "Pool" "Tenant")) }}
{{- fail (printf "registry.files.%s, document %d: kind is %q; allowed: Model, Adapter, Pool, Tenant" $file $index (toString (get $doc "kind"))) }}
{{- end }}
{{- if not (get ((get $doc "metadata") | default dict) "name") }}
{{- fail (printf "registry.files.%s, document %d: metadata.name is missing" $file $index) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* The registry volume and mount, and the init container that refuses a registry that does not validate. */}}
{{- define "kvgate.registryVolume" -}}
- name: registry
  configMap:
    name: {{ include "kvgate.registryConfigMap" . }}
{{- end }}

{{- define "kvgate.registryMount" -}}
# Not a subPath mount: the kubelet updates a mounted ConfigMap in place (a `..data` symlink swapped
# to a new directory) only for whole-volume mounts, and kvgate's watcher reloads on that swap.
- name: registry
  mountPath: {{ .Values.registry.mountPath }}
  readOnly: true
{{- end }}

{{- define "kvgate.validateRegistryInit" -}}
# Refuses to start kvgate on a registry that does not validate: the pod stays in Init:Error and
# `kubectl logs POD -c validate-registry` shows `kvgate registry validate`'s FILE:LINE problems.
- name: validate-registry
  image: {{ include "kvgate.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["kvgate"]
  args: ["registry", "validate", {{ .Values.registry.mountPath | quote }}]
  {{- with .Values.registry.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 128Mi}
    limits: {memory: 256Mi}
  volumeMounts:
    {{- include "kvgate.registryMount" . | nindent 4 }}
{{- end }}
