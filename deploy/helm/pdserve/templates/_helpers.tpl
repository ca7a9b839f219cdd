{{/*
Names. The RayCluster is named <fullname>; KubeRay derives its own objects from it
(<fullname>-head-svc, pods <fullname>-<group>-worker-xxxxx), and a Service name is at most
63 characters, hence 40 here.
*/}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The router's gRPC address as the worker pods dial it (a TLS certificate must name it). */}}
{{- define "pdserve.routerAddress" -}}
{{- printf "%s.%s.svc:%v" (include "pdserve.fullname" .) .Release.Namespace .Values.grpc.port }}
{{- end }}

{{/* One argument for a bash command line: bare when safe, else single-quoted. */}}
{{- define "pdserve.shq" -}}
{{- if regexMatch "^[A-Za-z0-9_./:=@%+,-]+$" . }}{{ . }}{{ else }}{{ printf "'%s'" (replace "'" "'\\''" .) }}{{ end }}
{{- end }}

{{/*
The Ray custom resource a worker pod's node declares and its pdserve worker requests, as
JSON: {"pdserve_prefill":1}. Called with the role name.
*/}}
{{- define "pdserve.rayResourceJSON" -}}
{{- dict (printf "pdserve_%s" .) 1 | toJson }}
{{- end }}

{{/* GPUs per pod of a worker group: its nvidia.com/gpu limit (0 without). */}}
{{- define "pdserve.gpus" -}}
{{- dig "limits" "nvidia.com/gpu" 0 (default dict .resources) | int }}
{{- end }}

{{/*
`pdserve drain` and `pdserve serve` speak TLS with the Secret mounted here:
tls.crt, tls.key, ca.crt.
*/}}
{{- define "pdserve.tlsDir" -}}/etc/pdserve/tls{{- end }}

{{/* The client TLS flags of `pdserve drain` (empty without TLS). */}}
{{- define "pdserve.clientTLSArgs" -}}
{{- if .Values.tls.enabled }}
{{- $d := include "pdserve.tlsDir" . }}
{{- printf " --tls-ca %s/ca.crt" $d }}
{{- if .Values.tls.clientAuth }}{{ printf " --tls-cert %s/tls.crt --tls-key %s/tls.key" $d $d }}{{ end }}
{{- end }}
{{- end }}

{{/*
Python that exits 0 once the Ray cluster holds every worker pod's custom resource
(pdserve_prefill: prefill.replicas, pdserve_decode: decode.replicas).
*/}}
{{- define "pdserve.waitForNodes" -}}
import ray, sys; ray.init(address="auto", logging_level="ERROR", log_to_driver=False);
{{- printf " r = ray.cluster_resources(); sys.exit(r.get(\"pdserve_prefill\", 0) < %v or r.get(\"pdserve_decode\", 0) < %v)" .Values.prefill.replicas .Values.decode.replicas }}
{{- end }}

{{/* The head container's script: Ray's head, then the router and its workers. */}}
{{- define "pdserve.headScript" -}}
{{- $v := .Values }}
{{- $d := include "pdserve.tlsDir" . }}
{{- $args := list "--address" "auto" "--host" "0.0.0.0"
      "--port" (toString $v.grpc.port) "--metrics-port" (toString $v.metrics.port)
      "--kv-host" "auto"
      "--prefill-workers" (toString $v.prefill.replicas)
      "--decode-workers" (toString $v.decode.replicas)
      "--routers" (toString (default 1 $v.head.routers))
      "--prefill-resources" (include "pdserve.rayResourceJSON" "prefill")
      "--decode-resources" (include "pdserve.rayResourceJSON" "decode")
      "--gpus-per-worker" (include "pdserve.gpus" $v.prefill)
      "--transport" $v.transport
      "--model" $v.model }}
{{- if $v.http.enabled }}
{{- $args = concat $args (list "--http-port" (toString $v.http.port)) }}
{{- end }}
{{- if $v.planner.enabled }}
{{- $args = concat $args (list "--planner" "slo" "--slo-ttft-ms" (toString $v.planner.sloTtftMs)
      "--slo-itl-ms" (toString $v.planner.sloItlMs)
      "--planner-interval-s" (toString $v.planner.intervalSeconds)) }}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $v $role }}
{{- if lt (include "pdserve.replicaBound" (dict "group" $g "bound" "minReplicas") | int) 1 }}
{{- fail (printf "planner.enabled: %s.minReplicas must be >= 1 (the planner keeps a worker of each role)" $role) }}
{{- end }}
{{- $args = concat $args (list (printf "--min-%s-workers" $role) (include "pdserve.replicaBound" (dict "group" $g "bound" "minReplicas"))
      (printf "--max-%s-workers" $role) (include "pdserve.replicaBound" (dict "group" $g "bound" "maxReplicas"))) }}
{{- end }}
{{- if not (kindIs "invalid" $v.planner.maxWorkers) }}
{{- if lt (int $v.planner.maxWorkers) (add $v.prefill.replicas $v.decode.replicas | int) }}
{{- fail (printf "planner.maxWorkers (%v) is below prefill.replicas + decode.replicas (%v): the planner starts with those" $v.planner.maxWorkers (add $v.prefill.replicas $v.decode.replicas)) }}
{{- end }}
{{- $args = concat $args (list "--max-workers" (toString $v.planner.maxWorkers)) }}
{{- end }}
{{- end }}
{{- if $v.tracing.otlpEndpoint }}
{{- $args = concat $args (list "--otlp-traces-endpoint" $v.tracing.otlpEndpoint
      "--otlp-traces-sample-ratio" (toString $v.tracing.sampleRatio)
      "--otlp-traces-client-sample-ratio" (toString $v.tracing.clientSampleRatio)) }}
{{- end }}
{{- if $v.threadsPerWorker }}
{{- $args = concat $args (list "--threads-per-worker" (toString $v.threadsPerWorker)) }}
{{- end }}
{{- if $v.tls.enabled }}
{{- $args = concat $args (list "--tls-cert" (printf "%s/tls.crt" $d) "--tls-key" (printf "%s/tls.key" $d)) }}
{{- if $v.tls.clientAuth }}
{{- $args = concat $args (list "--tls-client-ca" (printf "%s/ca.crt" $d)) }}
{{- end }}
{{- end }}
{{- $args = concat $args (default (list) $v.extraArgs) -}}
ulimit -n 65536
# KubeRay's generated `ray start --head ... --block`, in the background. eval, not a bare
# $KUBERAY_GEN_RAY_START_CMD: its quoted arguments must survive (ray-project/kuberay#3756).
eval "$KUBERAY_GEN_RAY_START_CMD" &
# `pdserve serve` gives its workers 300 s to start; a GPU pod's image pull can take longer,
# so first wait until every worker pod's Ray node has joined (this also waits for Ray).
echo "waiting for {{ $v.prefill.replicas }} prefill and {{ $v.decode.replicas }} decode pods to join Ray"
until python -c '{{ include "pdserve.waitForNodes" . }}' >/dev/null 2>&1; do sleep 10; done
# pdserve becomes PID 1: a pod deletion's SIGTERM reaches it and it shuts down cleanly.
exec pdserve serve
{{- range $args }}
{{- if hasPrefix "--" . }} \
    {{ include "pdserve.shq" . }}{{ else }} {{ include "pdserve.shq" . }}{{ end }}
{{- end }}
{{- end }}

{{/*
Pod-level settings shared by every group: call with
(dict "root" $ "group" $values "role" "head"|"prefill"|"decode").
*/}}
{{- define "pdserve.podScheduling" -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .group.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  {{- include "pdserve.volumes" . | trim | nindent 2 }}
{{- end }}

{{/* A worker group's minReplicas or maxReplicas ("bound"), its replicas when unset. */}}
{{- define "pdserve.replicaBound" -}}
{{- $b := index .group .bound }}
{{- if kindIs "invalid" $b }}{{ .group.replicas }}{{ else }}{{ $b }}{{ end }}
{{- end }}

{{/*
A worker group of the RayCluster: call with (dict "root" $ "role" "prefill"). Each pod's
Ray node declares pdserve_<role>: 1, so exactly one pdserve worker of that role lands on it.
*/}}
{{- define "pdserve.workerGroup" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $g := index $v .role }}
{{- $min := include "pdserve.replicaBound" (dict "group" $g "bound" "minReplicas") | int }}
{{- $max := include "pdserve.replicaBound" (dict "group" $g "bound" "maxReplicas") | int }}
{{- if or (gt (int $min) (int $g.replicas)) (lt (int $max) (int $g.replicas)) }}
{{- fail (printf "%s: want minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" .role $min $g.replicas $max) }}
{{- end }}
{{- $res := deepCopy (default dict $g.resources) }}
{{- if $v.rdma.enabled }}
{{- range $part := list "requests" "limits" }}
{{- $list := default dict (get $res $part) }}
{{- $_ := set $list $v.rdma.resourceName $v.rdma.count }}
{{- $_ := set $res $part $list }}
{{- end }}
{{- end -}}
- groupName: {{ .role }}
  replicas: {{ $g.replicas }}
  minReplicas: {{ $min }}
  maxReplicas: {{ $max }}
  rayStartParams:
    # KubeRay's format: a JSON string inside a quoted string, backslashes included.
    resources: {{ include "pdserve.rayResourceJSON" .role | toJson | squote }}
    num-gpus: {{ include "pdserve.gpus" $g | quote }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ .role }}
    spec:
      # Outlasts the preStop drain, so Kubernetes never kills a draining worker.
      terminationGracePeriodSeconds: {{ add $v.drainTimeoutSeconds 30 }}
      containers:
        - name: ray-worker
          image: {{ include "pdserve.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["/bin/bash", "-lc", "--"]
          args:
            - ulimit -n 65536; eval "exec $KUBERAY_GEN_RAY_START_CMD"
          env:
            {{- include "pdserve.env" (dict "root" $root "role" .role) | nindent 12 }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          lifecycle:
            preStop:
              exec:
                # The router stops sending this node's workers new requests and waits
                # for their running ones; then Ray leaves the cluster. Drain needs the
                # admin key, $PDSERVE_ADMIN_API_KEY (adminApiKey).
                command:
                  - /bin/bash
                  - -lc
                  - >-
                    pdserve drain --server {{ include "pdserve.routerAddress" $root }}
                    --node-ip "$POD_IP" --timeout-s {{ $v.drainTimeoutSeconds }}{{ include "pdserve.clientTLSArgs" $root }};
                    ray stop
          {{- with $v.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            {{- include "pdserve.volumeMounts" (dict "root" $root "role" .role) | trim | nindent 12 }}
      {{- with include "pdserve.podScheduling" (dict "root" $root "group" $g "role" .role) | trim }}
      {{- . | nindent 6 }}
      {{- end }}
{{- end }}

{{/*
A probe of the router's gRPC port: grpc.health.v1 where kubelet can speak it (plaintext),
else a TCP connect (kubelet's gRPC probe has no TLS).
*/}}
{{- define "pdserve.routerProbe" -}}
{{- if .Values.tls.enabled }}
tcpSocket:
  port: grpc
{{- else }}
grpc:
  port: {{ .Values.grpc.port }}
{{- end }}
{{- end }}
