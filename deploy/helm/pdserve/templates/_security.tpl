{{/*
Who holds which secret:

  secret                   head pod                 worker pods
  apiKey                   $PDSERVE_API_KEY         -
  adminApiKey              $PDSERVE_ADMIN_API_KEY   $PDSERVE_ADMIN_API_KEY (preStop drain)
  rayAuth token            $RAY_AUTH_TOKEN          $RAY_AUTH_TOKEN
  tls Secret               tls.crt tls.key ca.crt   ca.crt (tls.crt, tls.key: clientAuth)
*/}}

{{/* The image's home (the pdserve user's, uid 1000): its .cache is an emptyDir. */}}
{{- define "pdserve.home" -}}/home/pdserve{{- end }}

{{/* The Secret holding the admin key: adminApiKey.existingSecret, the chart's own, or "". */}}
{{- define "pdserve.adminApiKeySecret" -}}
{{- with .Values.adminApiKey }}
{{- if .existingSecret }}{{ .existingSecret }}
{{- else if .create }}{{ include "pdserve.fullname" $ }}-admin-api-key
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret holding Ray's auth token ("" with rayAuth off). */}}
{{- define "pdserve.rayAuthSecret" -}}
{{- with .Values.rayAuth }}
{{- if .enabled }}{{ default (printf "%s-ray-auth-token" (include "pdserve.fullname" $)) .existingSecret }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A generated Secret's value, base64: the live Secret's on an upgrade, so the key survives
it; a new random one on install (and wherever lookup sees no cluster: helm template).
Call with (dict "root" $ "name" secretName "key" dataKey "length" n).
*/}}
{{- define "pdserve.generatedKey" -}}
{{- $live := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- $old := dig "data" .key "" (default dict $live) }}
{{- if $old }}{{ $old }}{{ else }}{{ randAlphaNum (int .length) | b64enc }}{{ end }}
{{- end }}

{{/* RAY_AUTH_MODE and RAY_AUTH_TOKEN (nothing with rayAuth off). */}}
{{- define "pdserve.rayAuthEnv" -}}
{{- with include "pdserve.rayAuthSecret" . }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.rayAuth.key }}
{{- end }}
{{- end }}

{{/* Environment of a Ray container: call with (dict "root" $ "role" "head"|<group>). */}}
{{- define "pdserve.env" -}}
{{- $v := .root.Values -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if and (eq .role "head") $v.apiKey.existingSecret }}
- name: PDSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.apiKey.existingSecret }}
      key: {{ $v.apiKey.key }}
{{- end }}
{{- with include "pdserve.adminApiKeySecret" .root }}
- name: PDSERVE_ADMIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $v.adminApiKey.key }}
{{- end }}
{{- include "pdserve.rayAuthEnv" .root }}
# The root filesystem is read-only: caches that default outside the emptyDirs.
- name: TRITON_CACHE_DIR
  value: {{ include "pdserve.home" .root }}/.cache/triton
- name: CUDA_CACHE_PATH
  value: {{ include "pdserve.home" .root }}/.cache/nv
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The writable emptyDirs' mounts (KubeRay's autoscaler container mounts them too). */}}
{{- define "pdserve.writableMounts" -}}
- name: pdserve-tmp
  mountPath: /tmp
- name: pdserve-cache
  mountPath: {{ include "pdserve.home" . }}/.cache
{{- end }}

{{/* A Ray container's mounts: call with (dict "root" $ "role" "head"|<group>). */}}
{{- define "pdserve.volumeMounts" -}}
{{- include "pdserve.writableMounts" .root }}
{{- if .root.Values.tls.enabled }}
- name: pdserve-tls
  mountPath: {{ include "pdserve.tlsDir" .root }}
  readOnly: true
{{- end }}
{{- with .root.Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A pod's volumes: call with (dict "root" $ "role" "head"|<group>). The TLS Secret's key
goes to the head only; a worker's drain hook needs ca.crt to check the router, and with
clientAuth its own certificate, which is the Secret's tls.crt / tls.key.
*/}}
{{- define "pdserve.volumes" -}}
{{- $v := .root.Values -}}
- name: pdserve-tmp
  emptyDir: {}
- name: pdserve-cache
  emptyDir: {}
{{- if $v.tls.enabled }}
- name: pdserve-tls
  secret:
    secretName: {{ required "tls.existingSecret: name the Secret holding tls.crt, tls.key and ca.crt" $v.tls.existingSecret }}
    {{- if and (ne .role "head") (not $v.tls.clientAuth) }}
    items:
      - key: ca.crt
        path: ca.crt
    {{- end }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Values the router would refuse, or a Service that the NetworkPolicy would cut off. */}}
{{- define "pdserve.checkSecurity" -}}
{{- $v := .Values }}
{{- if and $v.apiKey.existingSecret (eq $v.apiKey.existingSecret $v.adminApiKey.existingSecret)
      (eq $v.apiKey.key $v.adminApiKey.key) }}
{{- fail "adminApiKey names the same Secret key as apiKey: the router refuses an admin key equal to the api key; give the admin role its own key" }}
{{- end }}
{{- if and $v.networkPolicy.enabled (ne $v.service.type "ClusterIP") (empty $v.networkPolicy.routerFrom) }}
{{- fail (printf "service.type %s: the NetworkPolicy admits the router's ports only from this namespace; list the Service's clients in networkPolicy.routerFrom (e.g. [{ipBlock: {cidr: 0.0.0.0/0}}]) or set networkPolicy.enabled=false" $v.service.type) }}
{{- end }}
{{- end }}
