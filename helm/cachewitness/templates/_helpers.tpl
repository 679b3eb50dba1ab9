{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "cachewitness.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name already has it. */}}
{{- define "cachewitness.fullname" -}}
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

{{- define "cachewitness.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (helm.sh / app.kubernetes.io). */}}
{{- define "cachewitness.labels" -}}
helm.sh/chart: {{ include "cachewitness.chart" . }}
{{ include "cachewitness.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference
cachewitness.io/engine: {{ .Values.engine.preset }}
{{- end }}

{{- define "cachewitness.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachewitness.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cachewitness.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cachewitness.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret that holds the admin token, and its key. */}}
{{- define "cachewitness.adminSecretName" -}}
{{- default (printf "%s-admin" (include "cachewitness.fullname" .)) .Values.adminToken.existingSecret }}
{{- end }}

{{- define "cachewitness.evidenceClaimName" -}}
{{- default (printf "%s-evidence" (include "cachewitness.fullname" .)) .Values.evidence.persistence.existingClaim }}
{{- end }}

{{/* The preset's settings, merged over by engine.image when that is set. */}}
{{- define "cachewitness.enginePreset" -}}
{{- $preset := get .Values.engine.presets .Values.engine.preset }}
{{- if not $preset }}
{{- fail (printf "engine.preset %q has no entry under engine.presets (use vllm, sglang, llamacpp or trtllm)" .Values.engine.preset) }}
{{- end }}
{{- toYaml $preset }}
{{- end }}

{{- define "cachewitness.engineImage" -}}
{{- $preset := include "cachewitness.enginePreset" . | fromYaml }}
{{- $repo := default $preset.image.repository .Values.engine.image.repository }}
{{- $tag := default $preset.image.tag .Values.engine.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/* The sidecar's image: a repository that names its registry (no bare "cachewitness", which a
     node would look for on Docker Hub), and the chart's appVersion unless a tag is given. */}}
{{- define "cachewitness.sidecarImage" -}}
{{- $repository := .Values.sidecar.image.repository }}
{{- if not (contains "/" $repository) }}
{{- fail (printf "sidecar.image.repository must name your registry, e.g. --set sidecar.image.repository=registry.example.com/cachewitness (build the image from the repository's Dockerfile and push it there); got %q" $repository) }}
{{- end }}
{{- printf "%s:%s" $repository (default .Chart.AppVersion .Values.sidecar.image.tag) }}
{{- end }}

{{/*
The engine's --kv-events-config JSON. vLLM with discovery: ipc:// sockets in the pod's
kv-events emptyDir, which the engine binds (vLLM binds ipc endpoints) and names at
GET /kv_event_sources; the sidecar connects to them. Only the two containers (same UID) can
reach a socket file there: nothing is on the pod's network. Otherwise (SGLang, whose
/server_info can name a tcp host and port only): a concrete host in "endpoint" makes the
engine connect to the sidecar's bound loopback SUB socket; the replay socket is the engine's
(it binds). SGLang takes the same JSON without the enable flag.
*/}}
{{- define "cachewitness.kvEventsConfig" -}}
{{- $c := dict "publisher" "zmq" "endpoint" (printf "tcp://127.0.0.1:%v" .kv.publishPort) "replay_endpoint" (printf "tcp://127.0.0.1:%v" .kv.replayPort) "topic" .kv.topic }}
{{- if and .vllm .kv.discovery }}
{{- $_ := set $c "endpoint" "ipc:///var/run/kv-events/pub" }}
{{- $_ := set $c "replay_endpoint" "ipc:///var/run/kv-events/replay" }}
{{- end }}
{{- if .vllm }}{{- $_ := set $c "enable_kv_cache_events" true }}{{- end }}
{{- toJson $c }}
{{- end }}

{{/* Whether the engine's KV events go over ipc sockets it names (vllm preset with discovery). */}}
{{- define "cachewitness.kvEventsDiscovered" -}}
{{- if and .Values.engine.kvEvents.enabled .Values.engine.kvEvents.discovery (eq .Values.engine.preset "vllm") }}true{{- end }}
{{- end }}

{{/* Whether the sidecar is told where to bind for the engine's KV cache events (sglang; vllm without discovery). */}}
{{- define "cachewitness.kvEventsOn" -}}
{{- if and .Values.engine.kvEvents.enabled (has .Values.engine.preset (list "vllm" "sglang")) (not (include "cachewitness.kvEventsDiscovered" .)) }}true{{- end }}
{{- end }}

{{/*
The engine's command, as a YAML list. Each preset binds the engine to 127.0.0.1 on the
pod-local port and turns on what the sidecar needs:
- vllm: --enable-prefix-caching, and --enable-prompt-tokens-details so that
  usage.prompt_tokens_details.cached_tokens is reported (plus VLLM_SERVER_DEV_MODE=1 in
  the env, without which POST /reset_prefix_cache is 404).
- sglang: --enable-cache-report (cached_tokens in usage) and --enable-metrics.
- llamacpp: --slot-save-path (without it the slot erase answers 501), --cache-ram 0
  (else the host-RAM prompt cache survives an erase and the next request still hits),
  --metrics and --slots.
- trtllm: an LLM API options file (written by the command itself, on the engine's cache
  volume) with return_perf_metrics (without it there is no /prometheus/metrics, whose
  trtllm_prompt_cached_tokens_total the counter witness reads), enable_iter_perf_stats and
  KV cache block reuse (prefix caching).
*/}}
{{- define "cachewitness.engineCommand" -}}
{{- $port := toString .Values.engine.port }}
{{- $model := .Values.engine.model }}
{{- if eq .Values.engine.preset "vllm" }}
- vllm
- serve
- {{ $model | quote }}
- --host
- 127.0.0.1
- --port
- {{ $port | quote }}
- --enable-prefix-caching
- --enable-prompt-tokens-details
{{- if .Values.engine.kvEvents.enabled }}
- --kv-events-config
- {{ include "cachewitness.kvEventsConfig" (dict "kv" .Values.engine.kvEvents "vllm" true) | quote }}
{{- end }}
{{- else if eq .Values.engine.preset "sglang" }}
- python3
- -m
- sglang.launch_server
- --model-path
- {{ $model | quote }}
- --host
- 127.0.0.1
- --port
- {{ $port | quote }}
- --enable-cache-report
- --enable-metrics
{{- if .Values.engine.kvEvents.enabled }}
- --kv-events-config
- {{ include "cachewitness.kvEventsConfig" (dict "kv" .Values.engine.kvEvents "vllm" false) | quote }}
{{- end }}
{{- else if eq .Values.engine.preset "llamacpp" }}
{{- $ll := .Values.engine.presets.llamacpp }}
- /app/llama-server
{{- if hasPrefix "/" $model }}
- --model
{{- else }}
- --hf-repo
{{- end }}
- {{ $model | quote }}
- --host
- 127.0.0.1
- --port
- {{ $port | quote }}
- --parallel
- {{ $ll.slots | toString | quote }}
- --ctx-size
- {{ $ll.contextSize | toString | quote }}
- --slot-save-path
- /var/lib/llama/slots
- --cache-ram
- "0"
- --metrics
- --slots
- --no-webui
{{- else if eq .Values.engine.preset "trtllm" }}
{{- $options := "/var/cache/engine/cachewitness-llm-api-options.yaml" }}
- /bin/sh
- -c
- {{ printf "printf '%%s\\n' 'return_perf_metrics: true' 'enable_iter_perf_stats: true' 'kv_cache_config:' '  enable_block_reuse: true' > %s && exec trtllm-serve \"$@\"" $options | quote }}
- trtllm-serve
- {{ $model | quote }}
- --host
- 127.0.0.1
- --port
- {{ $port | quote }}
- --backend
- pytorch
- --extra_llm_api_options
- {{ $options }}
{{- else }}
{{- fail (printf "engine.preset must be vllm, sglang, llamacpp or trtllm, not %q" .Values.engine.preset) }}
{{- end }}
{{- range .Values.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
Probe command run inside the engine container: its /health on the pod-local port.
vLLM's and SGLang's images have python3; llama.cpp's server images have curl.
*/}}
{{- define "cachewitness.engineProbeCommand" -}}
{{- $url := printf "http://127.0.0.1:%v/health" .Values.engine.port }}
{{- if eq .Values.engine.preset "llamacpp" }}
- curl
- --fail
- --silent
- --max-time
- "2"
- {{ $url | quote }}
{{- else }}
- python3
- -c
- {{ printf "import urllib.request; urllib.request.urlopen(%q, timeout=2)" $url | quote }}
{{- end }}
{{- end }}

{{/*
Worst case from SIGTERM to exit, in seconds (see termination.gracePeriodSeconds):
the engine's preStop sleep, then a /cache/reset that has just started may hold requests
for drain + retries + the last attempt, and the released requests then get the sidecar's
grace period; plus slack for process exit and evidence flush.
*/}}
{{- define "cachewitness.requiredGraceSeconds" -}}
{{- $s := .Values.sidecar }}
{{- add .Values.engine.preStopSleepSeconds $s.drainTimeoutSeconds $s.retrySeconds $s.resetAttemptTimeoutSeconds $s.gracePeriodSeconds .Values.termination.slackSeconds }}
{{- end }}

{{- define "cachewitness.terminationGracePeriodSeconds" -}}
{{- $need := include "cachewitness.requiredGraceSeconds" . | int }}
{{- $set := .Values.termination.gracePeriodSeconds }}
{{- if kindIs "invalid" $set }}
{{- $need }}
{{- else if lt (int $set) $need }}
{{- fail (printf "termination.gracePeriodSeconds=%v is below the worst-case shutdown of %d s (engine.preStopSleepSeconds + sidecar drain + retry + attempt timeout + grace + slack): raise it or leave it null" $set $need) }}
{{- else }}
{{- int $set }}
{{- end }}
{{- end }}

{{/* The headless Service that lists the pods, and its in-cluster DNS name. */}}
{{- define "cachewitness.peersServiceName" -}}
{{- printf "%s-peers" (include "cachewitness.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Absolute (trailing dot): with the pod's ndots:5, a relative name would first be tried under
     every search domain, three NXDOMAIN round trips per family on every cluster call. */}}
{{- define "cachewitness.peersDNS" -}}
{{- printf "%s.%s.svc.%s." (include "cachewitness.peersServiceName" .) .Release.Namespace .Values.peers.clusterDomain }}
{{- end }}

{{/* More than one pod: what a rollout, a disruption budget and a spread are for. */}}
{{- define "cachewitness.replicated" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{/*
The rollout. strategy set in values: that. Else, one pod: Recreate (the old pod frees its GPU
and an RWO evidence volume before the new one is created: a one-GPU node holds only one).
More pods: RollingUpdate, one pod at a time and no surge (no spare GPU is assumed), so the
Service never loses every pod.
*/}}
{{- define "cachewitness.strategy" -}}
{{- if .Values.strategy }}
{{- toYaml .Values.strategy }}
{{- else if include "cachewitness.replicated" . }}
type: RollingUpdate
rollingUpdate:
  maxSurge: 0
  maxUnavailable: 1
{{- else }}
type: Recreate
{{- end }}
{{- end }}

{{/*
Topology spread, more than one pod: topologySpreadConstraints from values (each given this
release's pods as its labelSelector unless it has one), else one soft constraint spreading the
pods over nodes, so one node's loss takes one engine; pod-template-hash keeps a rollout's old
and new pods apart in the count.
*/}}
{{- define "cachewitness.topologySpreadConstraints" -}}
{{- $selector := dict "matchLabels" (include "cachewitness.selectorLabels" . | fromYaml) }}
{{- $constraints := list }}
{{- range .Values.topologySpreadConstraints }}
{{- $constraints = append $constraints (merge (deepCopy .) (dict "labelSelector" $selector)) }}
{{- end }}
{{- if not $constraints }}
{{- $constraints = list (dict "maxSkew" 1 "topologyKey" "kubernetes.io/hostname" "whenUnsatisfiable" "ScheduleAnyway" "labelSelector" $selector "matchLabelKeys" (list "pod-template-hash")) }}
{{- end }}
{{- toYaml $constraints }}
{{- end }}

{{/* The port the kubelet probes the sidecar on: its probe listener's, when it has one. */}}
{{- define "cachewitness.probePort" -}}
{{- if .Values.sidecar.healthPort -}}
{{- if eq (int .Values.sidecar.healthPort) (int .Values.sidecar.port) -}}
{{- fail (printf "sidecar.healthPort=%v is sidecar.port too: give the probe listener a port of its own, or null" .Values.sidecar.healthPort) }}
{{- end -}}
health
{{- else -}}
http
{{- end -}}
{{- end }}
