{{/* The image both DaemonSets run: [registry/]repository, then @digest or :tag (appVersion). */}}
{{- define "hlplugin.image" -}}
{{- $repository := .Values.image.repository -}}
{{- if .Values.image.registry -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .Values.image.registry) $repository -}}
{{- end -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" $repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object, as deploy/base's kustomization adds them. */}}
{{- define "hlplugin.partOf" -}}
app.kubernetes.io/part-of: hyperlight
{{- end -}}

{{/* A duration setting, (list $ "cdiInterval"), rendered as given (seconds as a number, or a
string with its unit: "10s", "500ms") once it is within the daemons' range (files/limits.yaml).
Out of it the render fails naming the value and the range: the daemon would only warn and run its
default, so `helm install --set config.cdiInterval=2h` would succeed and do nothing. */}}
{{- define "hlplugin.duration" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $value := index $root.Values.config $name -}}
{{- $problem := include "hlplugin.durationProblem" (list $root $name $value) -}}
{{- if $problem -}}{{- fail $problem -}}{{- end -}}
{{- $value | toString | quote -}}
{{- end -}}

{{/* Why the duration setting $name cannot be $value, or nothing: (list $ name value). The
daemons' parser (src/hlplugin/durations.py) to the letter: 1-20 digits, an optional fraction of
1-20, an optional unit; the number times the unit's seconds, bounds inclusive. */}}
{{- define "hlplugin.durationProblem" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $value := index . 2 -}}
{{- $range := index ($root.Files.Get "files/limits.yaml" | fromYaml) "durations" $name -}}
{{- $seconds := -1.0 -}}
{{- if not (kindIs "string" $value) -}}
{{- $seconds = float64 $value -}}
{{- else if regexMatch "^[0-9]{1,20}([.][0-9]{1,20})?(ms|s|m|h)?$" $value -}}
{{- $number := regexFind "^[0-9.]+" $value -}}
{{- $unit := trimPrefix $number $value | default "s" -}}
{{- $seconds = mulf (float64 $number) (get (dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0) $unit) -}}
{{- end -}}
{{- if lt $seconds 0.0 -}}
config.{{ $name }}={{ $value }} is not a duration: a number of seconds or a number with ms, s, m or h (500ms, 10s, 1m)
{{- else if or (lt $seconds (float64 $range.min)) (gt $seconds (float64 $range.max)) -}}
config.{{ $name }}={{ $value }} is out of range: {{ $range.shown }} (the daemons' range; out of it they would warn and use the default)
{{- end -}}
{{- end -}}

{{/* DaemonSet metadata annotations: checkov's skips, each with its reason. */}}
{{- define "hlplugin.checkovSkips" -}}
checkov.io/skip1: CKV_K8S_23=Runs as UID 0 (all capabilities dropped) because the kubelet device-plugin socket directory is root-owned
checkov.io/skip2: CKV_K8S_40=Runs as UID 0 (all capabilities dropped) because the kubelet device-plugin socket directory is root-owned
{{- if not .Values.image.digest }}
checkov.io/skip3: CKV_K8S_43=Defaults to the release tag; pin its digest (image.digest, or digest in a kustomize overlay; docs/operations.md)
{{- end }}
checkov.io/skip4: CKV_K8S_15=IfNotPresent so a node-critical DaemonSet restarts after a reboot during a registry outage; pin releases by digest
{{- end -}}

{{/* updateStrategy: the values' rollingUpdate, surging by default (the bootstrap's three
hyperlight.dev/device-access cover a consumer's old pod, its surge pod and one still terminating;
docs/operations.md, "Upgrade"); both 0 is refused. */}}
{{- define "hlplugin.updateStrategy" -}}
{{- $rolling := .Values.updateStrategy.rollingUpdate }}
type: {{ .Values.updateStrategy.type }}
{{- if eq .Values.updateStrategy.type "RollingUpdate" }}
{{- if and (has (toString $rolling.maxUnavailable) (list "0" "0%")) (has (toString $rolling.maxSurge) (list "0" "0%")) }}
{{- fail "updateStrategy.rollingUpdate: maxUnavailable and maxSurge cannot both be 0 (a rollout could replace no pod); with maxSurge 0 set maxUnavailable to at least 1" }}
{{- end }}
rollingUpdate:
  maxUnavailable: {{ $rolling.maxUnavailable }}
  maxSurge: {{ $rolling.maxSurge }}
{{- end }}
{{- end -}}

{{/* The pod-level settings every DaemonSet shares: (list $ component), the component being
"device-plugin", "bootstrap" or "dra". The DRA driver runs only on nodes also labelled
hyperlight.dev/dra=true, and while it is enabled the main daemon stays off them: a node's three
hyperlight.dev/device-access are one consumer's (its pod, its surge and one still terminating).
On a node labelled
hyperlight.dev/dra=moving neither runs: deploy/move-node.sh lets one go before the other comes,
so the kubelet never has both (docs/dra.md). */}}
{{- define "hlplugin.podScheduling" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $nodeSelector := $root.Values.nodeSelector -}}
{{- $affinity := deepCopy $root.Values.affinity -}}
{{- if eq $component "dra" -}}
{{- $nodeSelector = merge (dict "hyperlight.dev/dra" "true") $root.Values.nodeSelector -}}
{{- else if and $root.Values.dra.enabled (eq $component "device-plugin") -}}
{{- $elsewhere := dict "key" "hyperlight.dev/dra" "operator" "NotIn" "values" (list "true" "moving") -}}
{{- $node := get $affinity "nodeAffinity" | default (dict) -}}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default (dict) -}}
{{- $terms := list -}}
{{- range $term := get $required "nodeSelectorTerms" | default (list (dict)) -}}
{{- $terms = append $terms (set $term "matchExpressions" (append (get $term "matchExpressions" | default (list)) $elsewhere)) -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ = set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ = set $affinity "nodeAffinity" $node -}}
{{- end -}}
automountServiceAccountToken: false
enableServiceLinks: false
hostNetwork: false
hostPID: false
hostIPC: false
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  seccompProfile:
    type: RuntimeDefault
# Both daemons stop within 0.8 s of SIGTERM, then answer the next readiness probe when it is due
# within 6 s: at most about 7.5 s (docs/operations.md "Probes and restarts"); more grace would
# only delay a hung one's restart.
terminationGracePeriodSeconds: 10
{{- end -}}

{{/* The container settings both daemons share, after env and ports. */}}
{{- define "hlplugin.probesAndSecurity" -}}
# HTTP listens 0.9 s (median; 1.3 s at most) after the container starts under a 200m CPU quota:
# the first check at 2 s passes, so a normal start logs no probe failure, and a slow one has 30 s more.
# Each probe may take 5 s: on a busy node the daemon's answer, from state, waits for its share of
# a CPU (a start's first answer, and once a liveness answer in a 10-round upgrade, took over 3 s on
# a loaded test machine; docs/operations.md "CPU under load").
startupProbe:
  httpGet:
    path: /healthz
    port: http
  initialDelaySeconds: 2
  periodSeconds: 1
  timeoutSeconds: 5
  failureThreshold: 30
# /healthz does not answer when the event loop is stuck (and answers 503 when the gRPC server does
# not); 3 failures 5 s apart restart a hung daemon within 30 s (with the 10 s grace).
livenessProbe:
  httpGet:
    path: /healthz
    port: http
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet:
    path: /readyz
    port: http
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/* The container securityContext: UID 0 only because the kubelet's socket directory
/var/lib/kubelet/device-plugins (and /var/run/cdi) is root-owned; every capability is dropped, so
root here cannot bypass file modes. */}}
{{- define "hlplugin.containerSecurity" -}}
securityContext:
  privileged: false
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
  runAsUser: 0
  runAsGroup: 0
  runAsNonRoot: false
  seccompProfile:
    type: RuntimeDefault
# Outside /dev: the kubelet bind-mounts this file into the container.
terminationMessagePath: /termination-log
terminationMessagePolicy: FallbackToLogsOnError
{{- end -}}

{{/* Pod template metadata: the fixed labels win over podLabels (the selector relies on them);
podAnnotations win over the prometheus.io ones. */}}
{{- define "hlplugin.podMetadata" -}}
{{- $root := index . 0 -}}
{{- $labels := index . 1 -}}
{{- $port := index . 2 -}}
labels:
  {{- toYaml (merge (dict) $labels (dict "app.kubernetes.io/part-of" "hyperlight") $root.Values.podLabels) | nindent 2 }}
annotations:
  {{- toYaml (merge (dict) $root.Values.podAnnotations (dict "prometheus.io/scrape" "true" "prometheus.io/port" (toString $port) "prometheus.io/path" "/metrics")) | nindent 2 }}
{{- end -}}

{{/* The DRA driver's ServiceAccount: the DaemonSet runs as it, RBAC grants it, and the
ResourceSlice policy matches it by this one name. */}}
{{- define "hlplugin.draServiceAccount" -}}
hyperlight-dra
{{- end -}}

{{/* The lifetime the DRA driver's projected token asks for, in seconds: an hour, as the
kubelet's own kube-api-access volume asks; the kubelet rotates it at 80% of that. */}}
{{- define "hlplugin.draTokenSeconds" -}}
3600
{{- end -}}
