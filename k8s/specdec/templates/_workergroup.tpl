{{/* One worker group (args: root, role = "draft" | "target"): its pods offer the role's custom Ray
     resource (1 per pod: one pool replica per pod) and `gpus` GPUs, prepare the role's pack, and
     run KubeRay's `ray start` in the Ray container. */}}
{{- define "specdec.workerGroup" -}}
{{- $v := .root.Values -}}
{{- $g := get $v .role -}}
{{- $pool := get $v.serve .role -}}
{{- $packs := include "specdec.packs" (dict "pools" (list $pool)) -}}
- groupName: {{ $g.groupName }}
  replicas: {{ $g.replicas }}
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
      securityContext:
        {{- include "specdec.podSecurity" .root | nindent 8 }}
      {{- with $v.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $packs }}
      initContainers:
        {{- include "specdec.prepareModels" (dict "root" .root "packs" $packs "resources" $g.initResources) | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "specdec.image" .root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          ports:
            - {name: metrics, containerPort: 8080}     # Ray's own metrics, named as KubeRay expects
          env:
            {{- include "specdec.env" .root | nindent 12 }}
          {{- $res := deepCopy $g.resources }}
          {{- if gt (int $g.gpus) 0 }}
          {{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (toString (int $g.gpus))) ($res.limits | default dict)) }}
          {{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (toString (int $g.gpus))) ($res.requests | default dict)) }}
          {{- end }}
          resources:
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- include "specdec.containerSecurity" .root | nindent 12 }}
          {{- if $packs }}
          volumeMounts:
            {{- include "specdec.modelsMount" .root | nindent 12 }}
      volumes:
        {{- include "specdec.modelsVolume" .root | nindent 8 }}
      {{- end }}
{{- end }}
