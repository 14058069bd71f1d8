{{/* One worker group (args: root, role = "draft" | "target"): its pods offer the role's custom Ray
     resource (1 per pod: one pool replica per pod) and `gpus` GPUs, prepare the role's pack, and
     run KubeRay's `ray start` in the Ray container. */}}
{{- define "specdec.workerGroup" -}}
{{- $v := .root.Values -}}
{{- $g := get $v .role -}}
{{- $pool := get $v.serve .role -}}
{{- $packs := include "specdec.packs" (dict "pools" (list $pool)) -}}
- groupName: {{ $g.groupName }}
  # No `replicas`: the autoscaler owns the count between these bounds, and a rendered one would
  # reset it on every `helm upgrade` (k8s/README.md, "Upgrades").
  minReplicas: {{ $g.minReplicas }}
  maxReplicas: {{ $g.maxReplicas }}
  idleTimeoutSeconds: {{ $g.idleTimeoutSeconds }}
  resources:
    {{ $g.rayResource }}: "1"
  rayStartParams: {}
  template:
    metadata:
      labels:
        {{- include "specdec.labels" .root | nindent 8 }}
        {{- include "specdec.selector" (dict "root" .root "component" .role) | nindent 8 }}
      annotations:                 # Ray's own metrics (node, GPU and actor figures)
        prometheus.io/scrape: "true"
        prometheus.io/port: "8080"
        prometheus.io/path: /metrics
    spec:
      automountServiceAccountToken: false   # Ray workers never call the Kubernetes API
      securityContext:
        {{- include "specdec.podSecurity" .root | nindent 8 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- include "specdec.podHooks" $g | nindent 6 }}
      {{- if $packs }}
      initContainers:
        {{- include "specdec.prepareModels" (dict "root" .root "packs" $packs "resources" $g.initResources "group" $g) | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "specdec.image" .root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - {name: metrics, containerPort: 8080}     # Ray's own metrics, named as KubeRay expects
          env:
            {{- include "specdec.env" .root | nindent 12 }}
            {{- with $g.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $res := deepCopy $g.resources }}
          {{- if gt (int $g.gpus) 0 }}
          {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (toString (int $g.gpus))) ($res.limits | default dict)) }}
          {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (toString (int $g.gpus))) ($res.requests | default dict)) }}
          {{- end }}
          resources:
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- include "specdec.containerSecurity" .root | nindent 12 }}
          volumeMounts:
            {{- include "specdec.tmpMount" .root | nindent 12 }}
            {{- include "specdec.shmMount" $g | nindent 12 }}
            {{- if $packs }}
            {{- include "specdec.modelsMount" .root | nindent 12 }}
            {{- end }}
            {{- with $g.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "specdec.tmpVolume" .root | nindent 8 }}
        {{- include "specdec.shmVolume" $g | nindent 8 }}
        {{- if $packs }}
        {{- include "specdec.modelsVolume" .root | nindent 8 }}
        {{- end }}
        {{- with $g.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end }}
