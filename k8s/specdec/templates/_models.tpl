{{- /*
Models (k8s/README.md, "Models"). A pool's `model` value is a SOURCE, passed verbatim to
`specdec models prepare` in an init container before anything loads it:
- a pack name (the offline demo catalog),
- a path to a Hugging Face folder or a .gguf file on the read-only source volume (models.source),
- a hub id ORG/NAME@REVISION, pulled with HF_TOKEN from a Secret (models.hfToken).
What is prepared goes to the writable cache volume at models.mountPath (SPECDEC_CACHE): an emptyDir
per pod or a shared claim, so a node (or the whole cluster) prepares a model once.
*/ -}}

{{/* The cache volume: a shared PVC, or an emptyDir per pod; and the read-only source volume. */}}
{{- define "specdec.modelsVolume" -}}
- name: models
{{- if .Values.models.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.models.sizeLimit }}
{{- end }}
{{- with .Values.models.source }}
{{- $kinds := compact (list .existingClaim .hostPath .image) }}
{{- if gt (len $kinds) 1 }}
{{- fail "models.source: set one of existingClaim, hostPath, image" }}
{{- end }}
{{- if .existingClaim }}
- name: model-source
  persistentVolumeClaim: {claimName: {{ .existingClaim }}, readOnly: true}
{{- else if .hostPath }}
- name: model-source             # not allowed under Pod Security baseline or restricted
  hostPath: {path: {{ .hostPath }}, type: Directory}
{{- else if .image }}
- name: model-source             # an image volume (Kubernetes >= 1.33): an OCI image or artifact's files
  image: {reference: {{ .image }}, pullPolicy: {{ .pullPolicy }}}
{{- end }}
{{- end }}
{{- end }}

{{- define "specdec.modelsMount" -}}
- name: models
  mountPath: {{ .Values.models.mountPath }}
{{- with .Values.models.source }}
{{- if or .existingClaim .hostPath .image }}
- {name: model-source, mountPath: {{ .mountPath }}, readOnly: true}
{{- end }}
{{- end }}
{{- end }}

{{/* The SOURCEs a pod needs: its pool's model (and the target's tokenizer), never "ngram". */}}
{{- define "specdec.packs" -}}
{{- $packs := list -}}
{{- range .pools -}}
{{- if and . .model (ne (lower .model) "ngram") -}}{{- $packs = append $packs .model -}}{{- end -}}
{{- if and . .tokenizer -}}{{- $packs = append $packs .tokenizer -}}{{- end -}}
{{- end -}}
{{- $packs | uniq | join " " -}}
{{- end }}

{{/* "true" when a SOURCE is a hub id (ORG/NAME@REVISION): the init container then reaches the hub. */}}
{{- define "specdec.fromHub" -}}
{{- range splitList " " . -}}
{{- if regexMatch "^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+@[A-Za-z0-9._/-]+$" . -}}true{{- end -}}
{{- end -}}
{{- end }}

{{/* Init container: prepare the SOURCEs into the cache volume before anything loads them.
     Args: root, packs (space-separated SOURCEs), resources, group (its values: extra env and mounts).
     Idempotent: a prepared model is skipped. */}}
{{- define "specdec.prepareModels" -}}
{{- $m := .root.Values.models -}}
- name: prepare-models
  image: {{ include "specdec.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["specdec", "models", "prepare", "--quiet"]
  args: {{ splitList " " .packs | toJson }}
  env:
    - name: HF_HUB_OFFLINE         # the hub only for a hub id
      value: {{ ternary "0" "1" (eq (include "specdec.fromHub" .packs) "true") | quote }}
    {{- include "specdec.baseEnv" .root | nindent 4 }}
    {{- with $m.hfToken.secretName }}
    - name: HF_TOKEN               # this container only: nothing else talks to the hub
      valueFrom:
        secretKeyRef: {name: {{ . }}, key: {{ $m.hfToken.key }}}
    {{- end }}
    {{- with $m.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with .group.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- include "specdec.containerSecurity" .root | nindent 4 }}
  volumeMounts:
    {{- include "specdec.tmpMount" .root | nindent 4 }}
    {{- include "specdec.modelsMount" .root | nindent 4 }}
    {{- with .group.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}
