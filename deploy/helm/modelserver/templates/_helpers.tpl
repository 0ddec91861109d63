{{/*
Names, labels and the pieces a role's Deployment and its warm Job share. Every name derives from
the release name alone (never from a value), so a reinstall under the same name finds the PVCs
that `helm uninstall` kept.
*/}}

{{- define "modelserver.roles" -}}
{{- $roles := list -}}
{{- range $role := list "prefill" "decode" -}}
{{- if gt (int (index $.Values $role).replicas) 0 -}}{{- $roles = append $roles $role -}}{{- end -}}
{{- end -}}
{{- toJson $roles -}}
{{- end -}}

{{/* storage.compileCache.size as written: a quantity string, or a whole number of bytes
     (YAML gives numbers as floats: printed whole, never as 2.147483648e+11). */}}
{{- define "modelserver.size" -}}
{{- if kindIs "string" . -}}{{- . -}}{{- else -}}{{- printf "%d" (int64 .) -}}{{- end -}}
{{- end -}}

{{- define "modelserver.claimName" -}}
{{- printf "%s-%s-compile-cache" .root.Release.Name .role -}}
{{- end -}}

{{- define "modelserver.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* A role's serving pods: what its Deployment and Service select. A warm Job's pods carry
     component <role>-warm, so no selector of a serving role ever picks one. */}}
{{- define "modelserver.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image reference. Printed quoted wherever it lands in YAML: the schema holds repository
     and tag to a reference's grammar, and a quoted string cannot add pod-spec fields even were
     it skipped (helm template --skip-schema-validation). */}}
{{- define "modelserver.image" -}}
{{- $image := .Values.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag | toString) -}}
{{- end -}}
{{- end -}}

{{- define "modelserver.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default .Release.Name .Values.serviceAccount.name -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* ReadWriteMany lets a role's pods on different nodes share the cache; without it a role
     runs one pod (the page). */}}
{{- define "modelserver.shared" -}}
{{- if has "ReadWriteMany" .Values.storage.compileCache.accessModes -}}true{{- end -}}
{{- end -}}

{{/* The server argv: the role's args, then the address the probes and the Service use. Every
     word a string: `--set prefill.args={...,8,...}` types 8 as a number (an integer), a values
     file gives numbers as floats (1000000, never 1e+06) and booleans. */}}
{{- define "modelserver.serverArgs" -}}
{{- $args := list -}}
{{- range (index .root.Values .role).args -}}
{{- if and (kindIs "float64" .) (eq . (float64 (int64 .))) -}}
{{- $args = append $args (printf "%d" (int64 .)) -}}
{{- else -}}
{{- $args = append $args (toString .) -}}
{{- end -}}
{{- end -}}
{{- $args = concat $args (list "--host" "0.0.0.0" "--port" (toString .root.Values.server.port)) -}}
{{- toJson $args -}}
{{- end -}}

{{/* "true" when the role's warm Job runs as a pre-upgrade hook (warm-job.yaml says why): warm.hook,
     an upgrade, and the role's PVC already there (lookup, or testing.existingClaims where no
     cluster answers). */}}
{{- define "modelserver.warmHook" -}}
{{- $claim := include "modelserver.claimName" . -}}
{{- if and .root.Values.warm.hook .root.Release.IsUpgrade (include "modelserver.existingClaim" (dict "root" .root "name" $claim) | fromJson) -}}true{{- end -}}
{{- end -}}

{{- define "modelserver.warmHookName" -}}
{{- printf "%s-%s-warm" .root.Release.Name .role | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* "true" when serving pods mount the compile cache read-only: trust.readOnlyServing, whose
     auto follows trust.trustedKeys (the builder mode is the default of a trusting release). */}}
{{- define "modelserver.readOnlyServing" -}}
{{- $mode := .Values.trust.readOnlyServing -}}
{{- if or (eq (toString $mode) "true") (and (eq (toString $mode) "auto") .Values.trust.trustedKeys) -}}true{{- end -}}
{{- end -}}

{{/* cachemgr's options, as CACHEMGR_RUN_ARGS: cachemgr-entrypoint (and cachemgr-warm) split
     them on whitespace, so each is one word (the schema holds extraArgs to that). A warm Job
     takes neither the status port (warm writes no probe state) nor --on-miss (it compiles). */}}
{{- define "modelserver.runArgs" -}}
{{- $c := .root.Values.cachemgr -}}
{{- $words := list -}}
{{- if not .warm -}}
{{- $words = append $words (printf "--status-port %d" (int $c.statusPort)) -}}
{{- if eq $c.onMiss "fail" -}}{{- $words = append $words "--on-miss fail" -}}{{- end -}}
{{- end -}}
{{- if $c.stallTimeout -}}{{- $words = append $words (printf "--stall-timeout %s" $c.stallTimeout) -}}{{- end -}}
{{- range $c.extraArgs -}}{{- $words = append $words (toString .) -}}{{- end -}}
{{- join " " $words -}}
{{- end -}}

{{/* The environment of a role's serving pods (warm false), its warm Job (warm true) or its
     toolbox (toolbox true: no run options, the inspection commands read the rest). The key's
     inputs (role, NPU type, extraEnv) are the same in all, so they key alike. */}}
{{- define "modelserver.env" -}}
{{- $v := .root.Values -}}
- name: CACHEMGR_ROLE
  value: {{ .role }}
- name: CACHEMGR_CACHE_ROOT
  value: /var/cache/cachemgr
- name: CACHEMGR_STATE_DIR
  value: /run/cachemgr
# The NPU type, named so a warm Job on a CPU node keys the same. Where a device answers it
# decides, and a name that disagrees stops the pod (exit 78).
- name: CACHEMGR_NPU_TYPE
  value: {{ $v.npu.type | quote }}
- name: CACHEMGR_LOG_FORMAT
  value: {{ $v.cachemgr.logFormat | quote }}
{{- with and (not .toolbox) (include "modelserver.runArgs" .) }}
- name: CACHEMGR_RUN_ARGS
  value: {{ . | quote }}
{{- end }}
{{- if $v.remote.url }}
- name: CACHEMGR_REMOTE
  value: {{ $v.remote.url | quote }}
{{- with $v.remote.endpoint }}
- name: CACHEMGR_REMOTE_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- with $v.trust.trustedKeys }}
- name: CACHEMGR_TRUSTED_KEYS
  value: {{ join " " . | quote }}
{{- end }}
{{- if and .warm $v.trust.signingKeySecret.name }}
- name: CACHEMGR_SIGNING_KEY_FILE
  value: {{ printf "/etc/cachemgr/signing/%s" $v.trust.signingKeySecret.key | quote }}
{{- end }}
{{- if .hook }}
# The warm Job runs as the pre-upgrade hook, before any pod rolls (its remedies say what works then).
- name: CACHEMGR_WARM_HOOK
  value: pre-upgrade
{{- end }}
{{- if .warm }}
# vllm-rbln compiles with no NPU when told the target; neither enters the key.
- name: VLLM_RBLN_COMPILE_ONLY
  value: "1"
- name: RBLN_FORCE_NPU_NAME
  value: {{ $v.npu.type | quote }}
{{- end }}
# Who holds a lease or uses an entry, in `cachemgr locks` and `cachemgr ls`.
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: TMPDIR
  value: /tmp
- name: HOME
  value: {{ $v.storage.home.mountPath | quote }}
{{- with concat $v.extraEnv (index $v .role).extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The volumes and mounts of a role's pods: the role's compile cache, the pod-local state dir
     (probes, and the view a hit serves from), TMPDIR, HOME, and the operator's own.

     Read-only serving (serving pods only; never the warm Job, the builder, nor the toolbox):
     ONE volume of the claim, mounted read-only at the root and, with trust.recordUse, again
     read-write at usage/ through a subPath. Not the claim as two volumes with two readOnly
     settings: whether the kubelet mounts one PVC twice in a pod is not something to rely on.
     The volume source says readOnly only when no mount of it writes (recordUse false):
     persistentVolumeClaim.readOnly forces every mount of the volume read-only. */}}
{{- define "modelserver.readOnlyHere" -}}
{{- if and (not .warm) (not .toolbox) (include "modelserver.readOnlyServing" .root) -}}true{{- end -}}
{{- end -}}

{{- define "modelserver.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: compile-cache
  mountPath: /var/cache/cachemgr
  {{- if include "modelserver.readOnlyHere" . }}
  readOnly: true
  {{- if $v.trust.recordUse }}
- name: compile-cache
  mountPath: /var/cache/cachemgr/usage
  subPath: usage
  {{- end }}
  {{- end }}
- name: cachemgr-state
  mountPath: /run/cachemgr
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ $v.storage.home.mountPath | quote }}
{{- if and .warm $v.trust.signingKeySecret.name }}
- name: signing-key
  mountPath: /etc/cachemgr/signing
  readOnly: true
{{- end }}
{{- with $v.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "modelserver.volumes" -}}
{{- $v := .root.Values -}}
- name: compile-cache
  persistentVolumeClaim:
    claimName: {{ include "modelserver.claimName" . }}
    {{- if and (include "modelserver.readOnlyHere" .) (not $v.trust.recordUse) }}
    readOnly: true
    {{- end }}
- name: cachemgr-state
  emptyDir: {}
- name: tmp
  emptyDir:
    {{- with $v.storage.tmp.sizeLimit }}
    sizeLimit: {{ . | quote }}
    {{- else }} {}
    {{- end }}
- name: home
  emptyDir:
    {{- with $v.storage.home.sizeLimit }}
    sizeLimit: {{ . | quote }}
    {{- else }} {}
    {{- end }}
{{- if and .warm $v.trust.signingKeySecret.name }}
- name: signing-key
  secret:
    secretName: {{ $v.trust.signingKeySecret.name | quote }}
    defaultMode: 0400
    items:
      - key: {{ $v.trust.signingKeySecret.key | quote }}
        path: {{ $v.trust.signingKeySecret.key | quote }}
{{- end }}
{{- with $v.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Resources with the role's NPUs as a limit (an extended resource: the request follows). */}}
{{- define "modelserver.resources" -}}
{{- $resources := deepCopy (default dict .resources) -}}
{{- if gt (int .npus) 0 -}}
{{- $limits := deepCopy (default dict $resources.limits) -}}
{{- $_ := set $limits .resourceName (toString (int .npus)) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}
