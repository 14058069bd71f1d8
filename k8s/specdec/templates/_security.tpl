{{- /*
The router's public API: TLS and bearer tokens from Secrets you create (values router.tls,
router.tokensSecretName), mounted into the router container; the serve config names the files
(specdec.apiSecurity) and the probes go through them when they have to (specdec.routerProbe).
*/ -}}

{{- define "specdec.tlsDir" -}}/etc/specdec-tls{{- end }}
{{- define "specdec.clientCADir" -}}/etc/specdec-client-ca{{- end }}
{{- define "specdec.tokensDir" -}}/etc/specdec-tokens{{- end }}

{{/* The serve config's `security` keys for the mounted files (merged over serve.security). */}}
{{- define "specdec.apiSecurity" -}}
{{- $r := .Values.router -}}
{{- if and $r.tls.clientCASecretName (not $r.tls.secretName) -}}
{{- fail "router.tls.clientCASecretName (mTLS) needs router.tls.secretName (TLS on)" -}}
{{- end -}}
{{- $sec := deepCopy (.Values.serve.security | default dict) -}}
{{- if $r.tls.secretName -}}
{{- $_ := set $sec "tls_cert" (printf "%s/tls.crt" (include "specdec.tlsDir" .)) -}}
{{- $_ := set $sec "tls_key" (printf "%s/tls.key" (include "specdec.tlsDir" .)) -}}
{{- end -}}
{{- if $r.tls.clientCASecretName -}}
{{- $_ := set $sec "tls_client_ca" (printf "%s/ca.crt" (include "specdec.clientCADir" .)) -}}
{{- end -}}
{{- if $r.tokensSecretName -}}
{{- $_ := set $sec "tokens_file" (printf "%s/tokens" (include "specdec.tokensDir" .)) -}}
{{- end -}}
{{- /* The router binds 0.0.0.0 in its pod, which `specdec serve` refuses without TLS and tokens
unless told: here the chart's Service (ClusterIP unless changed) is what exposes the port. */ -}}
{{- if not (and $r.tls.secretName $r.tokensSecretName) -}}
{{- $_ := set $sec "allow_insecure" (hasKey $sec "allow_insecure" | ternary $sec.allow_insecure true) -}}
{{- end -}}
{{- toJson $sec -}}
{{- end }}

{{- define "specdec.apiSecretVolumes" -}}
{{- $r := .Values.router -}}
{{- range $vol := list (list "api-tls" $r.tls.secretName) (list "api-client-ca" $r.tls.clientCASecretName) (list "api-tokens" $r.tokensSecretName) }}
{{- if index $vol 1 }}
- name: {{ index $vol 0 }}
  secret:
    secretName: {{ index $vol 1 }}
    defaultMode: 0440            # group-readable: the pod's fsGroup is the router's group
{{- end }}
{{- end }}
{{- end }}

{{- define "specdec.apiSecretMounts" -}}
{{- $r := .Values.router -}}
{{- if $r.tls.secretName }}
- {name: api-tls, mountPath: {{ include "specdec.tlsDir" . }}, readOnly: true}
{{- end }}
{{- if $r.tls.clientCASecretName }}
- {name: api-client-ca, mountPath: {{ include "specdec.clientCADir" . }}, readOnly: true}
{{- end }}
{{- if $r.tokensSecretName }}
- {name: api-tokens, mountPath: {{ include "specdec.tokensDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{/* "true" when the kubelet's plaintext gRPC probe cannot check the router: TLS, or a token on health. */}}
{{- define "specdec.execProbe" -}}
{{- $sec := .Values.serve.security | default dict -}}
{{- $exempt := ternary $sec.exempt (list "health") (hasKey $sec "exempt") -}}
{{- if or .Values.router.tls.secretName (and .Values.router.tokensSecretName (not (has "health" ($exempt | default list)))) -}}
true
{{- end -}}
{{- end }}

{{/* A probe's action. Args: root, service ("" = the server as a whole). */}}
{{- define "specdec.routerProbe" -}}
{{- $r := .root.Values.router -}}
{{- if include "specdec.execProbe" .root -}}
exec:
  command:
    - python
    - -m
    - specdec.rpc.health_probe
    - --address=127.0.0.1:{{ $r.port }}
    {{- with .service }}
    - --service={{ . }}
    {{- end }}
    {{- if $r.tls.secretName }}
    - --ca={{ include "specdec.tlsDir" .root }}/ca.crt
    - --ca={{ include "specdec.tlsDir" .root }}/tls.crt
    - --server-name={{ $r.tls.serverName | default (printf "%s.%s.svc" (include "specdec.name" .root) .root.Release.Namespace) }}
    {{- end }}
    {{- if $r.tls.clientCASecretName }}
    - --cert={{ include "specdec.tlsDir" .root }}/tls.crt
    - --key={{ include "specdec.tlsDir" .root }}/tls.key
    {{- end }}
    {{- if $r.tokensSecretName }}
    - --token-file={{ include "specdec.tokensDir" .root }}/tokens
    {{- end }}
{{- else -}}
grpc: {port: {{ $r.port }}{{ with .service }}, service: {{ . }}{{ end }}}
{{- end -}}
{{- end }}
