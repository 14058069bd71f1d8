{{- /*
What every pod and container of the chart shares: Pod Security "restricted" (k8s/README.md,
"Hardening"; tests/unit/test_k8s_pod_security.py checks every overlay against the profile), a
read-only root filesystem with the writable places on volumes, and the per-group hooks
(scheduling, service account, extra env and volumes).
*/ -}}

{{- define "specdec.podSecurity" -}}
runAsNonRoot: true
runAsUser: 1000                  # the image's user (Dockerfile)
runAsGroup: 1000
fsGroup: 1000                    # the models volume is writable by it
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{- define "specdec.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
runAsNonRoot: true
readOnlyRootFilesystem: true     # what is written goes to volumes: /tmp (tmp), the models volume
seccompProfile: {type: RuntimeDefault}
{{- end }}

{{/* The writable scratch space of a read-only container: /tmp (Ray's temp dir /tmp/ray below it,
     HOME points here for the caches libraries keep under ~). */}}
{{- define "specdec.tmpVolume" -}}
- name: tmp
  emptyDir: {}
{{- end }}

{{- define "specdec.tmpMount" -}}
- {name: tmp, mountPath: /tmp}
{{- end }}

{{/* Shared memory for NCCL and torch's inter-process tensors: the container runtime's /dev/shm is
     64 MiB, too small for tensor-parallel collectives. Args: the group's values. */}}
{{- define "specdec.shmVolume" -}}
{{- if .shmSize }}
- name: dshm
  emptyDir: {medium: Memory, sizeLimit: {{ .shmSize }}}
{{- end }}
{{- end }}

{{- define "specdec.shmMount" -}}
{{- if .shmSize }}
- {name: dshm, mountPath: /dev/shm}
{{- end }}
{{- end }}

{{/* Pod-level hooks of a group (head, gateway, draft, target): scheduling and service account.
     Args: the group's values. */}}
{{- define "specdec.podHooks" -}}
{{- with .serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
