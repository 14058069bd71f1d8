{{/* Names: the release name, trimmed to fit the suffixes KubeRay adds (-head-svc, -<group>-worker-<id>). */}}
{{- define "specdec.name" -}}
{{- .Release.Name | trunc 30 | trimSuffix "-" -}}
{{- end }}

{{- define "specdec.labels" -}}
app.kubernetes.io/name: specdec
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* Pod selector labels; component: head (Ray head + router), draft or target. */}}
{{- define "specdec.selector" -}}
app.kubernetes.io/name: specdec
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specdec.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end }}

{{/* Environment shared by every specdec process: the pack cache, no hub access, Ray's auth mode. */}}
{{- define "specdec.env" -}}
# Serving never fetches a model: the init containers have prepared them (_models.tpl).
- name: HF_HUB_OFFLINE
  value: "1"
{{ include "specdec.baseEnv" . }}
{{- end }}

{{/* specdec.env less HF_HUB_OFFLINE, which the init containers set by their sources. */}}
{{- define "specdec.baseEnv" -}}
- name: SPECDEC_CACHE
  value: {{ .Values.models.mountPath | quote }}
- name: HF_HOME
  value: {{ printf "%s/.hf" .Values.models.mountPath | quote }}
# The root filesystem is read-only: caches that libraries keep under ~ go to the tmp volume.
- name: HOME
  value: /tmp
{{- if ne .Values.rayAuth.mode "token" }}
# Ray token auth is off (rayAuth.mode); in token mode KubeRay sets RAY_AUTH_MODE itself.
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- with .Values.tracing.otlpEndpoint }}
# OpenTelemetry traces by OTLP/gRPC: the router and the workers (actors inherit their pod's env).
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- if $.Values.tracing.sampleRatio }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $.Values.tracing.sampleRatio | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The serve config: .Values.serve plus what has to agree with the manifests. */}}
{{- define "specdec.serveConfig" -}}
{{- $cfg := deepCopy .Values.serve -}}
{{- $_ := set $cfg "ray" (merge (dict "address" "auto") ($cfg.ray | default dict)) -}}
{{- $router := $cfg.router | default dict -}}
{{- $_ := set $router "host" "0.0.0.0" -}}
{{- $_ := set $router "port" (int .Values.router.port) -}}
{{- $_ := set $router "metrics_host" "0.0.0.0" -}}
{{- $_ := set $router "metrics_port" (int .Values.router.metricsPort) -}}
{{- $_ := set $router "http_port" 0 -}}{{/* the gateway runs in its own Deployment (gateway.yaml) */}}
{{- $_ := set $cfg "router" $router -}}
{{- $security := include "specdec.apiSecurity" . | fromJson -}}
{{- if $security -}}{{- $_ := set $cfg "security" $security -}}{{- end -}}
{{- range $role := list "target" "draft" -}}
{{- $pool := get $cfg $role -}}
{{- if $pool -}}
{{- $group := get $.Values $role -}}
{{- $placement := dict "resources" (dict $group.rayResource 1) -}}
{{- if gt (int $group.gpus) 0 -}}{{- $_ := set $placement "num_gpus" (int $group.gpus) -}}{{- end -}}
{{- $_ := set $pool "placement" $placement -}}
{{- $_ := set $pool "host" "node" -}}
{{- end -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end }}
