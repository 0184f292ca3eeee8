{{/*
The chart name, or nameOverride.
*/}}
{{- define "handoff.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name, prefix of every resource. Truncated to 40 characters so that
"<fullname>-<role>-<ordinal>" and the StatefulSet's controller-revision-hash label stay
within Kubernetes' limits.
*/}}
{{- define "handoff.fullname" -}}
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

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "handoff.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource.
*/}}
{{- define "handoff.labels" -}}
helm.sh/chart: {{ include "handoff.chart" . }}
{{ include "handoff.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: handoff
{{- end }}

{{/*
Labels of pod templates: like handoff.labels without helm.sh/chart, so that a chart
version bump alone does not restart GPU nodes.
*/}}
{{- define "handoff.podLabels" -}}
{{ include "handoff.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/part-of: handoff
{{- end }}

{{/*
Labels that select this release's objects.
*/}}
{{- define "handoff.selectorLabels" -}}
app.kubernetes.io/name: {{ include "handoff.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Selector labels of the LB pods.
*/}}
{{- define "handoff.lb.selectorLabels" -}}
{{ include "handoff.selectorLabels" . }}
app.kubernetes.io/component: lb
{{- end }}

{{/*
Names and labels of one role's nodes. Called with (dict "root" $ "role" "mixed").
*/}}
{{- define "handoff.node.fullname" -}}
{{- printf "%s-%s" (include "handoff.fullname" .root) .role }}
{{- end }}

{{- define "handoff.node.selectorLabels" -}}
{{ include "handoff.selectorLabels" .root }}
app.kubernetes.io/component: node
handoff/role: {{ .role }}
{{- end }}

{{/*
The roles, in a fixed order.
*/}}
{{- define "handoff.roleNames" -}}
mixed prefill decode
{{- end }}

{{/*
The enabled roles, space separated. Fails when none is, or when prefill and decode
are not enabled together.
*/}}
{{- define "handoff.enabledRoles" -}}
{{- $enabled := list }}
{{- range $role := splitList " " (include "handoff.roleNames" .) }}
{{- if (index $.Values.roles $role).enabled }}
{{- $enabled = append $enabled $role }}
{{- end }}
{{- end }}
{{- if not $enabled }}
{{- fail "handoff: no node role is enabled; set roles.mixed.enabled=true, or roles.prefill.enabled and roles.decode.enabled" }}
{{- end }}
{{- if ne (has "prefill" $enabled) (has "decode" $enabled) }}
{{- fail "handoff: roles.prefill and roles.decode must be enabled together (a prefill/decode split needs both)" }}
{{- end }}
{{- join " " $enabled }}
{{- end }}

{{/*
The address the LB resolves for a role: its headless Service's cluster DNS name and
the sidecar port. Called with (dict "root" $ "role" "mixed").
*/}}
{{- define "handoff.node.discoveryAddress" -}}
{{- printf "%s.%s.svc.%s:%d" (include "handoff.node.fullname" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.node.sidecar.port) }}
{{- end }}

{{/*
The image of every container.
*/}}
{{- define "handoff.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The ServiceAccount's name.
*/}}
{{- define "handoff.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "handoff.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The Secret holding the tokens: the existing one, or the one the chart creates.
*/}}
{{- define "handoff.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- printf "%s-auth" (include "handoff.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The token environment variables, from the Secret only (SPEC section 6).
*/}}
{{- define "handoff.tokenEnv" -}}
{{- if eq .Values.auth.adminTokenKey .Values.auth.apiKeyKey }}
{{- fail "handoff: auth.adminTokenKey and auth.apiKeyKey must differ" }}
{{- end }}
{{- if and .Values.auth.existingSecret (or .Values.auth.adminToken .Values.auth.apiKey) }}
{{- fail (printf "handoff: auth.adminToken and auth.apiKey must be empty with auth.existingSecret (%s): the tokens are that Secret's, and a token given here would be ignored" .Values.auth.existingSecret) }}
{{- end -}}
- name: HANDOFF_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "handoff.secretName" . | quote }}
      key: {{ .Values.auth.adminTokenKey | quote }}
- name: HANDOFF_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "handoff.secretName" . | quote }}
      key: {{ .Values.auth.apiKeyKey | quote }}
{{- end }}

{{/*
Environment shared by every container: a writable HOME on the /tmp emptyDir, since the
root filesystem is read-only.
*/}}
{{- define "handoff.commonEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
{{- end }}

{{/*
For a container the chart gives no GPU: the CUDA image sets NVIDIA_VISIBLE_DEVICES=all, and where the NVIDIA
runtime is the node's default it reads that variable and mounts every GPU of the host into a container that
requested none (the LB, the sidecar, a CPU engine), GPUs the device plugin gave to other pods. "void" mounts none.
*/}}
{{- define "handoff.noGpuEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end }}

{{/*
A number as a flag value: integers without a decimal point or exponent (values arrive
as float64), other numbers as written.
*/}}
{{- define "handoff.num" -}}
{{- if eq (float64 .) (float64 (int64 .)) }}
{{- int64 . }}
{{- else }}
{{- . }}
{{- end }}
{{- end }}

{{/*
Refuse extra flags that would move the engine off localhost or away from its port.
Called with (dict "args" LIST "where" "node.engine.extraArgs").
*/}}
{{- define "handoff.checkEngineArgs" -}}
{{- range $arg := .args }}
{{- range $flag := list "--host" "--port" }}
{{- if include "handoff.argSetsFlag" (dict "arg" $arg "flag" $flag) }}
{{- fail (printf "handoff: %s must not set %s: the engine listens on 127.0.0.1:node.engine.port only" $.where $arg) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"true" when one argument gives FLAG: "--flag", "--flag=V", or an abbreviation of it ("--hos", "--admin-tok=V"),
which the processes' argparse takes for the flag. Called with (dict "arg" ARG "flag" "--host").
*/}}
{{- define "handoff.argSetsFlag" -}}
{{- $name := first (splitList "=" .arg) }}
{{- if and (ge (len $name) 4) (hasPrefix "--" $name) (hasPrefix $name .flag) }}true{{ end }}
{{- end }}

{{/*
Values the processes would refuse at start (a crash loop), or that would make a stopping node
or a release fan-out cut work short: checked here, with the value's name.
*/}}
{{- define "handoff.checkTimeoutsAndPorts" -}}
{{- $lb := .Values.lb }}
{{- $node := .Values.node }}
{{- range $name := list "controlTimeout" "weightSyncTimeout" }}
{{- if gt (float64 (get $lb $name)) (float64 $lb.maxControlTimeout) }}
{{- fail (printf "handoff: lb.%s (%v) must not exceed lb.maxControlTimeout (%v): the LB would exit at start" $name (get $lb $name) $lb.maxControlTimeout) }}
{{- end }}
{{- end }}
{{- $lbWeight := include "handoff.lbWeightSyncTimeout" . }}
{{- if gt (float64 $lbWeight) (float64 $lb.maxControlTimeout) }}
{{- fail (printf "handoff: the LB's --weight-sync-timeout (%v: lb.weightSyncTimeout %v plus the sidecar's and the LB's margins) must not exceed lb.maxControlTimeout (%v): the LB would exit at start; raise lb.maxControlTimeout" $lbWeight $lb.weightSyncTimeout $lb.maxControlTimeout) }}
{{- end }}
{{- if gt (float64 $node.sidecar.drainTimeout) 3600.0 }}
{{- fail (printf "handoff: node.sidecar.drainTimeout (%v) must be at most 3600 (the sidecar's --max-drain-timeout)" $node.sidecar.drainTimeout) }}
{{- end }}
{{- if ge (float64 $node.sidecar.drainTimeout) (float64 $lb.controlTimeout) }}
{{- fail (printf "handoff: node.sidecar.drainTimeout (%v) must be shorter than lb.controlTimeout (%v): a release would time out while nodes still drain" $node.sidecar.drainTimeout $lb.controlTimeout) }}
{{- end }}
{{- if le (float64 $node.terminationGracePeriodSeconds) (float64 $node.sidecar.drainTimeout) }}
{{- fail (printf "handoff: node.terminationGracePeriodSeconds (%v) must exceed node.sidecar.drainTimeout (%v): a stopping node's requests get the drain timeout to finish" $node.terminationGracePeriodSeconds $node.sidecar.drainTimeout) }}
{{- end }}
{{- if lt (float64 $lb.shutdownTimeout) (float64 $lbWeight) }}
{{- fail (printf "handoff: lb.shutdownTimeout (%v) must not be below the LB's --weight-sync-timeout (%v: lb.weightSyncTimeout %v plus the sidecar's and the LB's margins): a stopping LB would cut a weight call the nodes still run; raise lb.shutdownTimeout and lb.terminationGracePeriodSeconds with it" $lb.shutdownTimeout $lbWeight $lb.weightSyncTimeout) }}
{{- end }}
{{- if le (float64 $lb.terminationGracePeriodSeconds) (addf $lb.shutdownTimeout 5) }}
{{- fail (printf "handoff: lb.terminationGracePeriodSeconds (%v) must exceed lb.shutdownTimeout (%v) plus the 5 s preStop pause: a stopping LB would be killed while its calls still run" $lb.terminationGracePeriodSeconds $lb.shutdownTimeout) }}
{{- end }}
{{- if eq (int64 $node.engine.maxTotalTokens) 1 }}
{{- fail "handoff: node.engine.maxTotalTokens must be 0 (the engine's default) or at least 2: the engine refuses --max-total-tokens 1 at start" }}
{{- end }}
{{- if and $lb.pdb.enabled (gt (int $lb.replicas) 1) (ge (int $lb.pdb.minAvailable) (int $lb.replicas)) }}
{{- fail (printf "handoff: lb.pdb.minAvailable (%v) must be below lb.replicas (%v): the budget would allow no eviction and block every node drain" $lb.pdb.minAvailable $lb.replicas) }}
{{- end }}
{{- if eq (int $node.engine.port) (int $node.sidecar.port) }}
{{- fail (printf "handoff: node.engine.port and node.sidecar.port must differ (both %v): the containers share the pod's network" $node.sidecar.port) }}
{{- end }}
{{- end }}

{{/*
Checks of the model volume the schema cannot express.
*/}}
{{- define "handoff.checkModelVolume" -}}
{{- $model := .Values.model }}
{{- $vol := $model.volume }}
{{- if and (eq $vol.type "hostPath") (not $vol.hostPath.path) }}
{{- fail "handoff: model.volume.hostPath.path must be set when model.volume.type is hostPath" }}
{{- end }}
{{- if and (eq $vol.type "hostPath") (not (hasPrefix "/" $vol.hostPath.path)) }}
{{- fail (printf "handoff: model.volume.hostPath.path must be absolute, got %q" $vol.hostPath.path) }}
{{- end }}
{{- if and (eq $vol.type "existingClaim") (not $vol.existingClaim.claimName) }}
{{- fail "handoff: model.volume.existingClaim.claimName must be set when model.volume.type is existingClaim" }}
{{- end }}
{{- $mount := trimSuffix "/" $model.mountPath }}
{{- if and (ne $vol.type "none") (not (hasPrefix "builtin:" $model.path)) (ne $model.path $mount) (not (hasPrefix (printf "%s/" $mount) $model.path)) }}
{{- fail (printf "handoff: model.path %q is not under model.mountPath %q, where the model volume is mounted" $model.path $model.mountPath) }}
{{- end }}
{{- end }}

{{/*
The name of the model's claim (pvc or existingClaim).
*/}}
{{- define "handoff.modelClaimName" -}}
{{- if eq .Values.model.volume.type "existingClaim" }}
{{- .Values.model.volume.existingClaim.claimName }}
{{- else }}
{{- printf "%s-models" (include "handoff.fullname" .) }}
{{- end }}
{{- end }}

{{/*
The engine's health check, run inside the engine container: its /health on localhost, given the probe's
timeoutSeconds. Through no proxy: urllib would send it to an http_proxy of the container's environment (one
set in node.engine.extraEnv to fetch models), and the engine would fail every check. Called with
(dict "root" $ "timeout" SECONDS).
*/}}
{{- define "handoff.engineHealthCommand" -}}
{{- $url := printf "http://127.0.0.1:%d/health" (int .root.Values.node.engine.port) -}}
- python
- -c
- {{ printf "import urllib.request as u; u.build_opener(u.ProxyHandler({})).open('%s', timeout=%d)" $url (int .timeout) | quote }}
{{- end }}

{{/*
Refuse token flags in extra args: the tokens reach the processes from the Secret only, never in a pod spec.
Called with (dict "args" LIST "where" "lb.extraArgs").
*/}}
{{- define "handoff.checkNoTokenArgs" -}}
{{- range $arg := .args }}
{{- range $flag := list "--admin-token" "--api-key" }}
{{- if include "handoff.argSetsFlag" (dict "arg" $arg "flag" $flag) }}
{{- fail (printf "handoff: %s must not set %s: a token in the args is readable in the pod spec; use auth.* (the Secret)" $.where $flag) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Refuse the token variables in extra env: the chart sets them from the Secret; a second definition would put a token
in the pod spec, or hide the Secret's (the last definition wins: the LB and the nodes would hold different tokens).
Called with (dict "env" LIST "where" "lb.extraEnv").
*/}}
{{- define "handoff.checkNoTokenEnv" -}}
{{- range $var := .env }}
{{- if has $var.name (list "HANDOFF_ADMIN_TOKEN" "HANDOFF_API_KEY") }}
{{- fail (printf "handoff: %s must not set %s: the tokens come from auth.* (the Secret) only" $.where $var.name) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A hash of the auth values, on the pod templates: a change of a token, of a key or of the Secret's name rolls
the LB and the nodes together, so that no pod keeps a token the others no longer have (a Secret's new value
reaches a container only when it starts). Tokens given in the values go through scrypt (derivePassword,
about 0.3 s), so that the annotation does not let anyone who can read pods test guesses of a chosen token
cheaply; generated tokens are not in the values and are kept across upgrades.
*/}}
{{- define "handoff.authChecksum" -}}
{{- $auth := .Values.auth }}
{{- $names := omit $auth "adminToken" "apiKey" | toJson }}
{{- if or $auth.adminToken $auth.apiKey }}
{{- printf "%s/%s" $names (derivePassword 1 "maximum" (toJson $auth) "handoff-auth" (include "handoff.fullname" .)) | sha256sum }}
{{- else }}
{{- sha256sum $names }}
{{- end }}
{{- end }}

{{/*
The sidecar's bound on one call to its engine (--control-timeout): above the engine's own bound on weight
calls (lb.weightSyncTimeout), so that the engine's clean answer comes back, and never below the sidecar's
default of 600 s; at most a week, the most seconds the sidecar takes (it exits at start past it).
*/}}
{{- define "handoff.sidecarControlTimeout" -}}
{{- include "handoff.num" (minf 604800 (maxf 600 (addf .Values.lb.weightSyncTimeout 60))) }}
{{- end }}

{{/*
The LB's per-node bound on weight calls (--weight-sync-timeout): above the sidecar's bound on its engine call
(handoff.sidecarControlTimeout, itself above the engine's own lb.weightSyncTimeout), so that an update the engine
ends at its bound (504 weight_sync_timeout, nothing loaded) comes back as that answer, never as the LB's own
per-node timeout (which leaves the trainer unable to tell whether it landed); at most a week.
*/}}
{{- define "handoff.lbWeightSyncTimeout" -}}
{{- include "handoff.num" (minf 604800 (addf (include "handoff.sidecarControlTimeout" .) 30)) }}
{{- end }}

{{/*
Checks of networkPolicy the schema cannot express (only when it is enabled).
*/}}
{{- define "handoff.checkNetworkPolicy" -}}
{{- $np := .Values.networkPolicy }}
{{- $sync := $np.weightSyncPorts }}
{{- range $list := list "clientsFrom" "metricsFrom" "trainerFrom" }}
{{- range $i, $peer := (get $np $list) }}
{{- $selects := or (hasKey $peer "podSelector") (hasKey $peer "namespaceSelector") }}
{{- if not (or $selects (hasKey $peer "ipBlock")) }}
{{- fail (printf "handoff: networkPolicy.%s[%d] names no peer: give it podSelector, namespaceSelector or ipBlock (Kubernetes refuses an empty one)" $list $i) }}
{{- end }}
{{- if and $selects (hasKey $peer "ipBlock") }}
{{- fail (printf "handoff: networkPolicy.%s[%d] mixes ipBlock with a selector: Kubernetes refuses that; make them two peers" $list $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- if gt (int $sync.start) (int $sync.end) }}
{{- fail (printf "handoff: networkPolicy.weightSyncPorts.start (%v) must not exceed networkPolicy.weightSyncPorts.end (%v)" $sync.start $sync.end) }}
{{- end }}
{{- range $name := list "engine" "sidecar" }}
{{- $port := int (get (get $.Values.node $name) "port") }}
{{- if and (ge $port (int $sync.start)) (le $port (int $sync.end)) }}
{{- fail (printf "handoff: networkPolicy.weightSyncPorts (%v-%v) must not hold node.%s.port (%d): the trainer's pods would reach that port too" $sync.start $sync.end $name $port) }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not $np.metricsFrom) }}
{{- fail "handoff: networkPolicy.metricsFrom must name Prometheus' pods when metrics.serviceMonitor.enabled: the policies would block its scrapes of /metrics" }}
{{- end }}
{{- end }}

{{/*
Selector labels of every node pod of the release, whatever its role.
*/}}
{{- define "handoff.node.allSelectorLabels" -}}
{{ include "handoff.selectorLabels" . }}
app.kubernetes.io/component: node
{{- end }}

{{/*
"true" when a release writes the weights' backup to node.engine.backupDir (the node's disk): weightsBackup=disk, or
weightsBackup=cpu on a CPU engine (its backend spills the storages to files). A CUDA engine's cpu backup is pinned
host memory.
*/}}
{{- define "handoff.backupSpillsToDisk" -}}
{{- $engine := .Values.node.engine }}
{{- or (eq $engine.weightsBackup "disk") (and (eq $engine.weightsBackup "cpu") (eq $engine.device "cpu")) }}
{{- end }}

{{/*
A backup on the node's disk needs its size: the emptyDir's sizeLimit, and the engine's ephemeral-storage request,
so that the scheduler places the pod where the disk has room and the kubelet, short of disk, does not evict the
node first (a pod using more than it requested goes first). The engine's own free-space check sees the node's
disk, not the limit.
*/}}
{{- define "handoff.checkBackupSize" -}}
{{- $size := toString .Values.node.engine.backupSizeLimit }}
{{- $zero := regexMatch "^0*[.]?0*([eE][0-9]+|m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$" $size }}
{{- if and (eq (include "handoff.backupSpillsToDisk" .) "true") $zero }}
{{- fail "handoff: node.engine.backupSizeLimit must be set (above 0) when the weights backup is written to disk (weightsBackup=disk, or cpu on a CPU engine): set it above the weights' size; the engine requests it as ephemeral-storage" }}
{{- end }}
{{- end }}

{{/*
The engine's mounts must be distinct places: Kubernetes refuses two volumes on one path (the model or the backup
on /tmp or /dev/shm), a volume on / hides the image, and the backup inside the model's mount would put its mount
point in the model's claim (read-only, or the trainer's checkpoints).
*/}}
{{- define "handoff.checkEngineMounts" -}}
{{- $paths := dict }}
{{- if ne .Values.model.volume.type "none" }}
{{- $_ := set $paths "model.mountPath" .Values.model.mountPath }}
{{- end }}
{{- if eq (include "handoff.backupSpillsToDisk" .) "true" }}
{{- $_ := set $paths "node.engine.backupDir" .Values.node.engine.backupDir }}
{{- end }}
{{- range $name, $path := $paths }}
{{- $clean := clean $path }}
{{- if has $clean (list "/" "/tmp" "/dev/shm") }}
{{- fail (printf "handoff: %s (%s) must not be %s: the engine's root file system, /tmp and /dev/shm are the chart's" $name $path $clean) }}
{{- end }}
{{- end }}
{{- if and (hasKey $paths "node.engine.backupDir") (hasKey $paths "model.mountPath") }}
{{- $model := clean .Values.model.mountPath }}
{{- $backup := clean .Values.node.engine.backupDir }}
{{- if or (eq $model $backup) (hasPrefix (printf "%s/" $model) $backup) (hasPrefix (printf "%s/" $backup) $model) }}
{{- fail (printf "handoff: node.engine.backupDir (%s) and model.mountPath (%s) must not hold one another: each is a volume of its own" $backup $model) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The node pods' security context: podSecurityContext, and with a weight-sync rule (networkPolicy.enabled and
trainerFrom) the pods' ephemeral port range pinned to networkPolicy.weightSyncPorts (net.ipv4.ip_local_port_range,
a namespaced sysctl Kubernetes allows by default). The torch process group's members listen on ports taken from
that range: a pod whose range is not the rule's (another kernel default, a runtime that sets it) would refuse
the trainer's connections and the join would time out.
*/}}
{{- define "handoff.node.podSecurityContext" -}}
{{- $context := deepCopy .Values.podSecurityContext }}
{{- $np := .Values.networkPolicy }}
{{- if and $np.enabled $np.trainerFrom }}
{{- $sysctls := list }}
{{- range $sysctl := ($context.sysctls | default list) }}
{{- if eq $sysctl.name "net.ipv4.ip_local_port_range" }}
{{- fail "handoff: podSecurityContext.sysctls must not set net.ipv4.ip_local_port_range with networkPolicy.trainerFrom: the chart sets it to networkPolicy.weightSyncPorts, the ports the policy opens" }}
{{- end }}
{{- $sysctls = append $sysctls $sysctl }}
{{- end }}
{{- $range := printf "%d %d" (int $np.weightSyncPorts.start) (int $np.weightSyncPorts.end) }}
{{- $sysctls = append $sysctls (dict "name" "net.ipv4.ip_local_port_range" "value" $range) }}
{{- $_ := set $context "sysctls" $sysctls }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/*
A Kubernetes quantity (values.schema.json's "quantity": 512Mi, 2G, 1.5Gi, 1e9, 1073741824) in bytes, as an integer.
*/}}
{{- define "handoff.quantityBytes" -}}
{{- $q := toString . }}
{{- $units := dict "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "m" 0.001 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "E" 1000000000000000000.0 }}
{{- $suffix := regexFind "(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)$" $q }}
{{- if $suffix }}
{{- int64 (mulf (float64 (trimSuffix $suffix $q)) (get $units $suffix)) }}
{{- else }}
{{- int64 (float64 $q) }}
{{- end }}
{{- end }}

{{/*
The sidecar's bound on the request bodies it holds at once (--hold-max-bytes): a quarter of its container's memory
limit. The process's default, 1 GiB, is the whole default limit: a sidecar holding a paused node's queue (a weight
update) would be killed by the cgroup's OOM killer, with every held and running request, before it answered a 503.
A body held takes its bytes and more while it is read and passed on, beside the process itself and the answers
in flight. Empty when the sidecar has no memory limit.
*/}}
{{- define "handoff.sidecarHoldMaxBytes" -}}
{{- $limits := (.Values.node.sidecar.resources | default dict).limits | default dict }}
{{- with $limits.memory }}
{{- div (int64 (include "handoff.quantityBytes" .)) 4 }}
{{- end }}
{{- end }}

{{/*
The sidecar's bound on the bodies and buffered non-stream answers of the requests it runs at once
(--max-inflight-bytes): a quarter of its container's memory limit too, beside the held bodies' quarter (an answer
takes about twice its bytes while it is joined and passed on), and never under the sidecar's --max-body-bytes
default (64 MiB), which it refuses at start. Empty when the sidecar has no memory limit.
*/}}
{{- define "handoff.sidecarInflightBytes" -}}
{{- with include "handoff.sidecarHoldMaxBytes" . }}
{{- max (int64 .) 67108864 }}
{{- end }}
{{- end }}

{{/*
The sidecar's bound on the request bodies all its requests hold at once, arriving, held or running
(--max-buffered-body-bytes): half its container's memory limit, the held bodies' quarter and the running requests'
quarter, so a full hold queue leaves room for the bodies of the calls that end it (a weight update's). The process's
default, 1 GiB, is the whole default limit. Never under the sidecar's --max-body-bytes default (64 MiB), which it
refuses at start. Empty when the sidecar has no memory limit.
*/}}
{{- define "handoff.sidecarBufferedBodyBytes" -}}
{{- with include "handoff.sidecarHoldMaxBytes" . }}
{{- max (mul (int64 .) 2) 67108864 }}
{{- end }}
{{- end }}

{{/*
The LB's bound on the request bodies all its requests hold at once (--max-buffered-body-bytes): half its container's
memory limit, the other half for the process and the non-stream answers it buffers. The process's default, 1 GiB, is
the whole default limit: an LB holding that many bodies (reached at 1073 MiB RSS) would be killed by the cgroup's OOM
killer, every stream through it included, before it answered one 503. Never under the LB's --max-body-bytes default
(64 MiB), which it refuses at start. Empty when the LB has no memory limit.
*/}}
{{- define "handoff.lbBufferedBodyBytes" -}}
{{- $limits := (.Values.lb.resources | default dict).limits | default dict }}
{{- with $limits.memory }}
{{- max (div (int64 (include "handoff.quantityBytes" .)) 2) 67108864 }}
{{- end }}
{{- end }}

{{/*
The LB's bound on the non-stream answers all its requests hold at once (--max-buffered-answer-bytes): a quarter of
its container's memory limit (the bodies take half), never under the LB's --max-answer-bytes default (256 MiB), below
which it refuses to start. Empty when the LB has no memory limit (the process's default, 1 GiB).
*/}}
{{- define "handoff.lbBufferedAnswerBytes" -}}
{{- $limits := (.Values.lb.resources | default dict).limits | default dict }}
{{- with $limits.memory }}
{{- max (div (int64 (include "handoff.quantityBytes" .)) 4) 268435456 }}
{{- end }}
{{- end }}

{{/*
A Prometheus duration of values.schema.json's form (500ms, 15s, 1m, 1h) in milliseconds.
*/}}
{{- define "handoff.durationMs" -}}
{{- $unit := regexFind "(ms|s|m|h)$" . }}
{{- mul (int64 (trimSuffix $unit .)) (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit) }}
{{- end }}
