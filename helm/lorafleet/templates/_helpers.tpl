{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "lorafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: "<release>-lorafleet", or the release name when it already contains the chart name. */}}
{{- define "lorafleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Names of the components' resources. Kept short: StatefulSet pod names get "-N" and a controller hash label. */}}
{{- define "lorafleet.controlPlane.fullname" -}}
{{- printf "%s-control-plane" (include "lorafleet.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- define "lorafleet.dataPlane.fullname" -}}
{{- printf "%s-data-plane" (include "lorafleet.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- define "lorafleet.dataPlane.headless" -}}
{{- printf "%s-pods" (include "lorafleet.dataPlane.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "lorafleet.router.fullname" -}}
{{- printf "%s-router" (include "lorafleet.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- define "lorafleet.redis.fullname" -}}
{{- printf "%s-redis" (include "lorafleet.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "lorafleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ include "lorafleet.chart" . }}
{{ include "lorafleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorafleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "lorafleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Selector labels of one component: include "lorafleet.componentSelector" (list $ "data-plane"). */}}
{{- define "lorafleet.componentSelector" -}}
{{ include "lorafleet.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* All labels of one component's resources. */}}
{{- define "lorafleet.componentLabels" -}}
{{ include "lorafleet.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "lorafleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lorafleet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag or repository@digest; refuses an unpinned tag. Call with (list $ .Values.x.image "name"). */}}
{{- define "lorafleet.image" -}}
{{- $image := index . 1 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- $tag := toString $image.tag }}
{{- if or (eq $tag "") (eq $tag "latest") }}
{{- fail (printf "%s.image.tag must be a pinned version (got %q); set a version tag or a digest" (index . 2) $tag) }}
{{- end }}
{{- printf "%s:%s" $image.repository $tag }}
{{- end }}
{{- end }}

{{/* The admin token Secret: its name and key. */}}
{{- define "lorafleet.tokenSecretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-admin-token" (include "lorafleet.fullname" .) }}
{{- end }}
{{- end }}
{{- define "lorafleet.tokenSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{/* Where the admin token is mounted (the control plane only). */}}
{{- define "lorafleet.tokenDir" -}}/etc/lorafleet/token{{- end }}
{{- define "lorafleet.tokenFile" -}}/etc/lorafleet/token/token{{- end }}

{{/* The reader's and the pod's token (list . "reader"|"pod"): each from its own Secret, mounted in its own
directory. */}}
{{- define "lorafleet.roleSecretName" -}}
{{- $root := index . 0 }}{{- $role := index . 1 }}
{{- $auth := index $root.Values.auth $role }}
{{- if $auth.existingSecret }}{{ $auth.existingSecret }}{{ else }}{{ printf "%s-%s-token" (include "lorafleet.fullname" $root) $role }}{{ end }}
{{- end }}
{{- define "lorafleet.roleSecretKey" -}}
{{- $auth := index (index . 0).Values.auth (index . 1) }}
{{- if $auth.existingSecret }}{{ $auth.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}
{{- define "lorafleet.roleTokenDir" -}}/etc/lorafleet/{{ . }}-token{{- end }}
{{- define "lorafleet.roleTokenFile" -}}/etc/lorafleet/{{ . }}-token/token{{- end }}
{{/* The volume of one role's token (list . role). */}}
{{- define "lorafleet.roleTokenVolume" -}}
- name: {{ index . 1 }}-token
  secret:
    secretName: {{ include "lorafleet.roleSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ include "lorafleet.roleSecretKey" . }}
        path: token
{{- end }}
{{- define "lorafleet.roleTokenMount" -}}
- name: {{ . }}-token
  mountPath: {{ include "lorafleet.roleTokenDir" . }}
  readOnly: true
{{- end }}

{{/* The REDIS_URL (and REDIS_PASSWORD) environment of the containers that talk to Redis: the control plane,
and the router when it counts tenants' limits there. */}}
{{- define "lorafleet.redisEnv" -}}
{{- if .Values.redis.enabled }}
{{- $host := printf "%s:%d" (include "lorafleet.redis.fullname" .) (int .Values.redis.port) }}
{{- if .Values.redis.auth.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "lorafleet.redis.secretName" . }}
      key: {{ include "lorafleet.redis.secretKey" . }}
- name: REDIS_URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s/%d" $host (int .Values.redis.database) | quote }}
{{- else }}
- name: REDIS_URL
  value: {{ printf "redis://%s/%d" $host (int .Values.redis.database) | quote }}
{{- end }}
{{- else }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "lorafleet.externalRedis.secretName" . }}
      key: {{ include "lorafleet.externalRedis.secretKey" . }}
{{- end }}
{{- end }}

{{/* Where the router's tenants file is mounted (router.tenants.existingSecret). */}}
{{- define "lorafleet.router.tenantsDir" -}}/etc/lorafleet/tenants{{- end }}
{{- define "lorafleet.router.tenantsFile" -}}/etc/lorafleet/tenants/tenants.json{{- end }}

{{/* Where the router's HTTP API keys are mounted (router.apiKeys.existingSecret). */}}
{{- define "lorafleet.router.apiKeyDir" -}}/etc/lorafleet/api-keys{{- end }}
{{- define "lorafleet.router.apiKeyFile" -}}/etc/lorafleet/api-keys/keys{{- end }}

{{/* The Redis password Secret (in-release Redis with auth). */}}
{{- define "lorafleet.redis.secretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else }}
{{- include "lorafleet.redis.fullname" . }}
{{- end }}
{{- end }}
{{- define "lorafleet.redis.secretKey" -}}
{{- if .Values.redis.auth.existingSecret }}{{ .Values.redis.auth.existingSecretKey }}{{ else }}password{{ end }}
{{- end }}

{{/* The external Redis URL Secret. */}}
{{- define "lorafleet.externalRedis.secretName" -}}
{{- if .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecret }}
{{- else }}
{{- printf "%s-redis-url" (include "lorafleet.fullname" .) }}
{{- end }}
{{- end }}
{{- define "lorafleet.externalRedis.secretKey" -}}
{{- if .Values.externalRedis.existingSecret }}{{ .Values.externalRedis.existingSecretKey }}{{ else }}url{{ end }}
{{- end }}

{{/* Fails on contradictory values; included once from the control-plane Deployment. */}}
{{- define "lorafleet.validate" -}}
{{- if .Values.redis.enabled }}
{{- if or .Values.externalRedis.url .Values.externalRedis.existingSecret }}
{{- fail "externalRedis is set but redis.enabled is true: set redis.enabled=false to use an external Redis" }}
{{- end }}
{{- if not (has .Values.redis.persistence.appendfsync (list "always" "everysec" "no")) }}
{{- fail (printf "redis.persistence.appendfsync must be always, everysec or no (got %q)" .Values.redis.persistence.appendfsync) }}
{{- end }}
{{- else if not (or .Values.externalRedis.url .Values.externalRedis.existingSecret) }}
{{- fail "redis.enabled is false: set externalRedis.url or externalRedis.existingSecret" }}
{{- end }}
{{- if and .Values.externalRedis.url (not (regexMatch "^(redis|rediss|unix)://" .Values.externalRedis.url)) }}
{{- fail "externalRedis.url must start with redis://, rediss:// or unix://" }}
{{- end }}
{{- if not (has .Values.model.fetch (list "demo" "custom" "none")) }}
{{- fail (printf "model.fetch must be demo, custom or none (got %q)" .Values.model.fetch) }}
{{- end }}
{{- if and (eq .Values.model.fetch "demo") (ne .Values.model.name "SmolLM2-135M-Instruct") }}
{{- fail "model.fetch=demo writes /data/models/SmolLM2-135M-Instruct: leave model.name at SmolLM2-135M-Instruct, or use fetch=custom or none" }}
{{- end }}
{{- if and (eq .Values.model.fetch "custom") (not .Values.model.custom.command) }}
{{- fail "model.fetch=custom needs model.custom.command" }}
{{- end }}
{{- if not (regexMatch "^[A-Za-z0-9._-]+$" .Values.model.name) }}
{{- fail (printf "model.name %q must be a plain directory name ([A-Za-z0-9._-])" .Values.model.name) }}
{{- end }}
{{- if not (has .Values.dataPlane.device (list "cuda" "cpu")) }}
{{- fail (printf "dataPlane.device must be cuda or cpu (got %q)" .Values.dataPlane.device) }}
{{- end }}
{{- if and (eq .Values.dataPlane.device "cuda") (lt (int .Values.dataPlane.gpus) 1) }}
{{- fail "dataPlane.device=cuda needs dataPlane.gpus >= 1" }}
{{- end }}
{{- $as := .Values.router.autoscaling }}
{{- if and $as.enabled (or (lt (int $as.minReplicas) 1) (gt (int $as.minReplicas) (int $as.maxReplicas))) }}
{{- fail (printf "router.autoscaling needs 1 <= minReplicas <= maxReplicas (got %v and %v)" $as.minReplicas $as.maxReplicas) }}
{{- end }}
{{- if not (has .Values.dataPlane.dtype (list "bfloat16" "float16" "float32")) }}
{{- fail (printf "dataPlane.dtype must be bfloat16, float16 or float32 (got %q)" .Values.dataPlane.dtype) }}
{{- end }}
{{- end }}

{{/* Mutual TLS between components (values tls). The Secret of one component (list . "controlPlane"|"dataPlane"|
"router"), its volume and mount, the flags that name its files, and the port its gRPC probes use. */}}
{{- define "lorafleet.tls.secretName" -}}
{{- $root := index . 0 }}
{{- $name := index $root.Values.tls (printf "%sSecret" (index . 1)) | default $root.Values.tls.existingSecret }}
{{- if not $name }}
{{- fail (printf "tls.enabled needs tls.existingSecret (or tls.%sSecret): a Secret with tls.crt, tls.key and ca.crt" (index . 1)) }}
{{- end }}
{{- $name }}
{{- end }}
{{- define "lorafleet.tls.args" -}}
- --tls-cert
- /etc/lorafleet/tls/tls.crt
- --tls-key
- /etc/lorafleet/tls/tls.key
- --tls-ca
- /etc/lorafleet/tls/ca.crt
{{- end }}
{{/* Mounted whole (no subPath), so that a renewed certificate reaches the files; servers re-read them. */}}
{{- define "lorafleet.tls.volume" -}}
- name: tls
  secret:
    secretName: {{ include "lorafleet.tls.secretName" . }}
    defaultMode: 0440
    items:
      - key: tls.crt
        path: tls.crt
      - key: tls.key
        path: tls.key
      - key: ca.crt
        path: ca.crt
{{- end }}
{{- define "lorafleet.tls.mount" -}}
- name: tls
  mountPath: /etc/lorafleet/tls
  readOnly: true
{{- end }}
{{/* The port the gRPC probes of a TLS-serving component use (list . grpcPort): the plaintext health port while
tls.enabled (the kubelet's gRPC probes cannot speak TLS), else the gRPC port. */}}
{{- define "lorafleet.probePort" -}}
{{- $root := index . 0 }}
{{- if $root.Values.tls.enabled }}{{ $root.Values.tls.healthPort }}{{ else }}{{ index . 1 }}{{ end }}
{{- end }}

{{/* Address of the control plane for data-plane pods. */}}
{{- define "lorafleet.controlPlane.address" -}}
{{- printf "%s:%d" (include "lorafleet.controlPlane.fullname" .) (int .Values.controlPlane.port) }}
{{- end }}

{{/* The model directory inside data-plane pods. */}}
{{- define "lorafleet.modelDir" -}}
{{- printf "/data/models/%s" .Values.model.name }}
{{- end }}

{{/* NetworkPolicy peer: this release's pods of one component. Call with (list $ "control-plane"). */}}
{{- define "lorafleet.componentPeer" -}}
- podSelector:
    matchLabels:
      {{- include "lorafleet.componentSelector" . | nindent 6 }}
{{- end }}

{{/* A gRPC health probe: (list .Values.x.startupProbe port) checks readiness, Kubernetes' native grpc probe
calling grpc.health.v1.Health/Check with service ""; (list .Values.x.livenessProbe port "lorafleet.liveness")
checks that health service instead (see conventions/health.py). */}}
{{- define "lorafleet.grpcProbe" -}}
grpc:
  port: {{ index . 1 }}
  {{- if gt (len .) 2 }}
  service: {{ index . 2 }}
  {{- end }}
{{ toYaml (index . 0) }}
{{- end }}
