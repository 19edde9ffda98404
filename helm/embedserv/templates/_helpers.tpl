{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "embedserv.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Release-qualified name. "-headless" is appended to it, so keep 9 characters spare within 63.
*/}}
{{- define "embedserv.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "embedserv.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels never change across upgrades: a Deployment's selector is immutable. */}}
{{- define "embedserv.selectorLabels" -}}
app.kubernetes.io/name: {{ include "embedserv.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "embedserv.labels" -}}
helm.sh/chart: {{ include "embedserv.chart" . }}
{{ include "embedserv.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "embedserv.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "embedserv.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server image: the tag defaults to the app version plus the cpu or cuda variant. */}}
{{- define "embedserv.image" -}}
{{- $variant := ternary "cuda" "cpu" .Values.gpu.enabled }}
{{- $tag := default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Secret the API key comes from, or "" for none. */}}
{{- define "embedserv.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "embedserv.fullname" .) }}
{{- end }}
{{- end }}

{{/* The ClusterIP Service as host:port from its own namespace, whatever the cluster domain. */}}
{{- define "embedserv.serviceTarget" -}}
{{- printf "%s:%d" (include "embedserv.fullname" .) (int .Values.service.grpcPort) }}
{{- end }}

{{/* The headless Service's DNS target for client-side round_robin. */}}
{{- define "embedserv.headlessTarget" -}}
{{- printf "dns:///%s-headless.%s.svc.cluster.local:%d" (include "embedserv.fullname" .) .Release.Namespace (int .Values.service.grpcPort) }}
{{- end }}

{{/* Where the ConfigMap holding `config` is mounted, and the file in it. */}}
{{- define "embedserv.configDir" -}}
/etc/embedserv
{{- end }}

{{/* Where the Secret of apiKeysFile is mounted (beside, not inside, the config's directory). */}}
{{- define "embedserv.apiKeysDir" -}}
/etc/embedserv-api-keys
{{- end }}

{{- define "embedserv.configFile" -}}
{{- printf "%s/config.yaml" (include "embedserv.configDir" .) }}
{{- end }}

{{/*
Server arguments. A null value leaves its flag out so the server's default applies; numbers go
through int because values arrive as floats and large ones would print as 1e+06.
*/}}
{{- define "embedserv.args" -}}
{{- $s := .Values.server }}
{{- $args := list "--host" "0.0.0.0" "--port" (toString (int .Values.service.grpcPort)) "--metrics-port" (toString (int .Values.service.metricsPort)) "--http-port" (toString (int .Values.service.httpPort)) }}
{{- $args = concat $args (list "--device" (ternary "cuda" "cpu" .Values.gpu.enabled)) }}
{{- if .Values.config }}
{{- $args = concat $args (list "--config" (include "embedserv.configFile" .)) }}
{{- end }}
{{- with .Values.apiKeysFile.existingSecret }}
{{- $args = concat $args (list "--api-keys-file" (printf "%s/%s" (include "embedserv.apiKeysDir" $) $.Values.apiKeysFile.secretKey)) }}
{{- end }}
{{- /* config.models lists the models itself; the server refuses --model beside it. */}}
{{- if not (index .Values.config "models") }}
{{- if ne .Values.model.source "bundled" }}
{{- $args = concat $args (list "--model" .Values.model.mountPath) }}
{{- end }}
{{- with .Values.model.name }}
{{- $args = concat $args (list "--served-model-name" .) }}
{{- end }}
{{- range $name, $path := .Values.model.lora }}
{{- $args = concat $args (list "--lora" (printf "%s=%s" $name $path)) }}
{{- end }}
{{- end }}
{{- with index $s "dtype" }}
{{- $args = concat $args (list "--dtype" .) }}
{{- end }}
{{- with index $s "quantization" }}
{{- $args = concat $args (list "--quantization" .) }}
{{- end }}
{{- with index $s "cpuAllocator" }}
{{- $args = concat $args (list "--cpu-allocator" .) }}
{{- end }}
{{- with index $s "cpuFusion" }}
{{- $args = concat $args (list "--cpu-fusion" .) }}
{{- end }}
{{- /* A share of the pod's memory limit: only where there is one (the server reads it from its cgroup). */}}
{{- $memoryLimit := index (default (dict) (index (default (dict) .Values.resources) "limits")) "memory" }}
{{- with index $s "workerMemoryLimit" }}
{{- if or $memoryLimit (not (hasSuffix "%" .)) }}
{{- $args = concat $args (list "--worker-memory-limit" .) }}
{{- end }}
{{- end }}
{{- $intFlags := list (list "maxBatchTokens" "--max-batch-tokens") (list "maxConcurrentRequests" "--max-concurrent-requests") (list "maxClientBatchSize" "--max-client-batch-size") (list "dataParallelSize" "--data-parallel-size") (list "frontends" "--frontends") (list "maxConnectionAge" "--max-connection-age") }}
{{- $intFlags = append $intFlags (list "maxImagesPerRequest" "--max-images-per-request") }}
{{- $intFlags = append $intFlags (list "maxImageBytes" "--max-image-bytes") }}
{{- $intFlags = append $intFlags (list "maxImagePixels" "--max-image-pixels") }}
{{- range $intFlags }}
{{- $v := index $s (index . 0) }}
{{- if not (kindIs "invalid" $v) }}
{{- $args = concat $args (list (index . 1) (toString (int $v))) }}
{{- end }}
{{- end }}
{{- $cache := index $s "embeddingCache" }}
{{- if kindIs "string" $cache }}
{{- $args = concat $args (list "--embedding-cache" $cache) }}
{{- else if not (kindIs "invalid" $cache) }}
{{- $args = concat $args (list "--embedding-cache" (toString (int64 $cache))) }}
{{- end }}
{{- $autoTruncate := index $s "autoTruncate" }}
{{- if kindIs "bool" $autoTruncate }}
{{- $args = append $args (ternary "--auto-truncate" "--no-auto-truncate" $autoTruncate) }}
{{- end }}
{{- with index $s "otlpEndpoint" }}
{{- $args = concat $args (list "--otlp-endpoint" .) }}
{{- end }}
{{- $args = concat $args (list "--drain-timeout" (toString (int $s.drainTimeout))) }}
{{- with index $s "logFormat" }}
{{- $args = concat $args (list "--log-format" .) }}
{{- end }}
{{- with index $s "logLevel" }}
{{- $args = concat $args (list "--log-level" .) }}
{{- end }}
{{- range $s.extraArgs }}
{{- $args = append $args (toString .) }}
{{- end }}
{{- toYaml $args }}
{{- end }}

{{/* Fails the render on combinations the schema cannot express. */}}
{{- define "embedserv.validate" -}}
{{- $m := .Values.model }}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) }}
{{- fail "model.source is pvc: set model.pvc.claimName" }}
{{- end }}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) }}
{{- fail "model.source is hostPath: set model.hostPath.path" }}
{{- end }}
{{- if and (eq $m.source "image") (not $m.image.repository) }}
{{- fail "model.source is image: set model.image.repository" }}
{{- end }}
{{- if and (index .Values.config "models") $m.lora }}
{{- fail "config.models lists the models: leave model.lora empty and give each model's lora: in its entry" }}
{{- end }}
{{- if and (index .Values.config "models") $m.name }}
{{- fail "config.models lists the models: leave model.name empty and set served_name in each entry" }}
{{- end }}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.value }}
{{- fail "set apiKey.existingSecret or apiKey.value, not both" }}
{{- end }}
{{- $a := .Values.autoscaling }}
{{- if and $a.enabled (gt (int $a.minReplicas) (int $a.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- $hasMetric := or (index $a "targetCPUUtilizationPercentage") (index $a "targetMemoryUtilizationPercentage")
    $a.podMetrics $a.extraMetrics }}
{{- if and $a.enabled (not $hasMetric) }}
{{- fail (print "autoscaling.enabled needs a metric: set autoscaling.targetCPUUtilizationPercentage, "
    "targetMemoryUtilizationPercentage, podMetrics or extraMetrics") }}
{{- end }}
{{- include "embedserv.validateKedaAndPool" . }}
{{- end }}

{{- define "embedserv.validateKedaAndPool" -}}
{{- $k := .Values.keda }}
{{- if and $k.enabled .Values.autoscaling.enabled }}
{{- fail (print "keda.enabled and autoscaling.enabled both scale the Deployment (KEDA makes an HPA of its own): "
    "turn one off") }}
{{- end }}
{{- if and $k.enabled (gt (int $k.minReplicas) (int $k.maxReplicas)) }}
{{- fail "keda.minReplicas must not exceed keda.maxReplicas" }}
{{- end }}
{{- if and $k.enabled (eq (int $k.minReplicas) 0) (not $k.prometheus.query) }}
{{- fail (print "keda.minReplicas 0 needs keda.prometheus.query: the default query counts what the pods report, "
    "so nothing would wake a release scaled to zero; set minReplicas 1, or a query on load seen elsewhere "
    "(e.g. the gateway's requests)") }}
{{- end }}
{{- if and $k.enabled $k.prometheus.authModes (not $k.prometheus.authenticationRef) }}
{{- fail (print "keda.prometheus.authModes needs keda.prometheus.authenticationRef "
    "(the TriggerAuthentication holding the credentials)") }}
{{- end }}
{{- if and .Values.inferencePool.enabled (not .Values.service.httpPort) }}
{{- fail "inferencePool.enabled routes HTTP to the pods: set service.httpPort (it is 0, HTTP is off)" }}
{{- end }}
{{- end }}

{{/*
The pods' calls in flight (waiting and running), summed over the release's pods and models. Deployment pods
are <fullname>-<template hash>-<5 characters>, both in the alphabet Kubernetes names them with (no vowels),
so another Deployment's <fullname>-<word>-... pods and the test pod stay out.
*/}}
{{- define "embedserv.kedaDefaultQuery" -}}
{{- $id := "[bcdfghjklmnpqrstvwxz2456789]" }}
{{- $pods := printf "%s-%s+-%s{5}" (include "embedserv.fullname" .) $id $id }}
{{- $matchers := printf "namespace=\"%s\",pod=~\"%s\"" .Release.Namespace $pods }}
{{- printf "sum({__name__=~\"embedserv_requests_(waiting|running)\",%s})" $matchers }}
{{- end }}

{{/*
The --config file's text. JSON, which YAML reads as is: Helm holds numbers as floats, and toYaml writes
1000000 as 1e+06, which YAML 1.1 parsers (PyYAML) read as a string; JSON writes it as 1000000.
*/}}
{{- define "embedserv.configYaml" -}}
{{- toPrettyJson .Values.config }}
{{- end }}

{{/* A number as text without an exponent where it is whole (Helm holds 1000000 as a float: 1e+06). */}}
{{- define "embedserv.number" -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) }}
{{- int64 . }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}
