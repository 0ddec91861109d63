{{/*
Refusals: each is one line naming the key, what is wrong and what to do. The schema
(values.schema.json) refuses wrong types, negative or fractional replica counts and unknown
access modes first; these are the checks a schema cannot say well, or at all.
*/}}

{{/* A Kubernetes quantity as a number of bytes (a float: exact to 2^53, plenty to compare
     sizes), or "" when it is not a quantity of bytes. Milli ("500m") is a quantity but never a
     size: it is refused, as the typo of 500M it nearly always is. */}}
{{- define "modelserver.bytes" -}}
{{- $q := toString . -}}
{{- $number := regexFind "^([0-9]+(\\.[0-9]*)?|\\.[0-9]+)" $q -}}
{{- $suffix := trimPrefix $number $q -}}
{{- $scale := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 -}}
{{- if and $number (hasKey $scale $suffix) -}}
{{- mulf (float64 $number) (index $scale $suffix) -}}
{{- else if and $number (regexMatch "^[eE][+-]?[0-9]{1,2}$" $suffix) -}}
{{- $exponent := int (trimPrefix "+" (substr 1 (len $suffix) $suffix)) -}}
{{- $value := float64 $number -}}
{{- range until (int (max $exponent (sub 0 $exponent))) -}}
{{- if gt $exponent 0 }}{{ $value = mulf $value 10 }}{{ else }}{{ $value = divf $value 10 }}{{ end -}}
{{- end -}}
{{- $value -}}
{{- end -}}
{{- end -}}

{{- define "modelserver.checks" -}}
{{- $v := .Values -}}
{{- if not $v.image.repository -}}
{{- fail "image.repository is empty: set it to the image built from the repository's Dockerfile on your vllm-rbln base (--set image.repository=registry.example.com/modelserver-cachemgr)" -}}
{{- end -}}
{{- $size := include "modelserver.size" $v.storage.compileCache.size -}}
{{- $bytes := include "modelserver.bytes" $size -}}
{{- if not $bytes -}}
{{- fail (printf "storage.compileCache.size %q is not a Kubernetes quantity of bytes: give a size such as 200Gi, 1.5Ti or 500G" (toString $size)) -}}
{{- end -}}
{{- if lt (float64 $bytes) 1.0 -}}
{{- fail (printf "storage.compileCache.size %q is no room at all: give the size of the compile cache, such as 200Gi (the chart's default)" (toString $size)) -}}
{{- end -}}
{{- range $key := list "tmp" "home" -}}
{{- $limit := (index $v.storage $key).sizeLimit -}}
{{- if and $limit (not (include "modelserver.bytes" $limit)) -}}
{{- fail (printf "storage.%s.sizeLimit %q is not a Kubernetes quantity of bytes: give a size such as 200Gi, or \"\" for no limit" $key (toString $limit)) -}}
{{- end -}}
{{- end -}}
{{- $modes := $v.storage.compileCache.accessModes -}}
{{- if has "ReadOnlyMany" $modes -}}
{{- fail (printf "storage.compileCache.accessModes %s: the compile cache must be writable (pods publish what they compile); use [\"ReadWriteMany\"], or [\"ReadWriteOnce\"] with one pod per role" (toJson $modes)) -}}
{{- end -}}
{{- $shared := include "modelserver.shared" . -}}
{{- $roles := include "modelserver.roles" . | fromJsonArray -}}
{{- range $role := list "prefill" "decode" -}}
{{- $r := index $v $role -}}
{{- if and (not $shared) (gt (int $r.replicas) 1) -}}
{{- fail (printf "storage.compileCache.accessModes %s with %s.replicas %d: without ReadWriteMany a volume attaches to one node, so run one pod per role (the chart page): set %s.replicas to 1, or use a StorageClass with ReadWriteMany" (toJson $modes) $role (int $r.replicas) $role) -}}
{{- end -}}
{{- if and $r.warm (not $shared) (has $role $roles) -}}
{{- fail (printf "%s.warm with storage.compileCache.accessModes %s: a warm Job would need the volume while the role's pod holds it; set %s.warm to false (the one pod compiles at its first start)" $role (toJson $modes) $role) -}}
{{- end -}}
{{- if and $v.trust.readOnlyServing (has $role $roles) (not $r.warm) -}}
{{- fail (printf "trust.readOnlyServing with %s.warm false: serving pods mount the volume read-only, so only a warm Job can fill the %s cache; set %s.warm to true (the builder)" $role $role $role) -}}
{{- end -}}
{{- if and $v.trust.trustedKeys (has $role $roles) (not (and $r.warm $v.trust.signingKeySecret.name)) (not $v.remote.url) -}}
{{- fail (printf "trust.trustedKeys is set but nothing in this release signs the %s cache: serving pods would wait for a signed entry forever; set trust.signingKeySecret.name and %s.warm true (the builder), or remote.url where a builder outside publishes signed entries" $role $role) -}}
{{- end -}}
{{- range $i, $word := $r.args -}}
{{- if regexMatch "^--(host|port)(=.*)?$" (toString $word) -}}
{{- fail (printf "%s.args[%d] %q: leave --host and --port out of the server args; the chart adds --host 0.0.0.0 --port %d (server.port), which the probes and the Service use" $role $i (toString $word) (int $v.server.port)) -}}
{{- end -}}
{{- end -}}
{{- range $env := concat $v.extraEnv $r.extraEnv -}}
{{- $name := toString $env.name -}}
{{- if has $name (list "CACHEMGR_ROLE" "CACHEMGR_CACHE_ROOT" "CACHEMGR_STATE_DIR" "CACHEMGR_NPU_TYPE" "CACHEMGR_LOG_FORMAT" "CACHEMGR_RUN_ARGS" "CACHEMGR_REMOTE" "CACHEMGR_REMOTE_ENDPOINT" "CACHEMGR_TRUSTED_KEYS" "CACHEMGR_SIGNING_KEY_FILE" "POD_NAME" "NODE_NAME" "TMPDIR" "HOME" "VLLM_RBLN_COMPILE_ONLY" "RBLN_FORCE_NPU_NAME") -}}
{{- fail (printf "extraEnv sets %s, which the chart sets itself: use the value that sets it (values.yaml names each), not extraEnv" $name) -}}
{{- end -}}
{{- if has $name (list "CACHEMGR_COMPILER_VERSION" "CACHEMGR_VLLM_VERSION" "CACHEMGR_VLLM_RBLN_VERSION" "CACHEMGR_OPTIMUM_RBLN_VERSION" "CACHEMGR_TRANSFORMERS_VERSION") -}}
{{- fail (printf "extraEnv sets %s: the cache key must take the image's own version, or a new SDK image would hit the old SDK's entries; leave it unset" $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.trust.signingKeySecret.name (not (or (and $v.prefill.warm (has "prefill" $roles)) (and $v.decode.warm (has "decode" $roles)))) -}}
{{- fail "trust.signingKeySecret.name is set but no warm Job runs: the signing key is mounted in the warm Jobs (the builder) only; set prefill.warm or decode.warm to true" -}}
{{- end -}}
{{- $r := $v.probes.readiness -}}
{{- if ge (float64 $r.healthTimeout) (float64 $r.timeoutSeconds) -}}
{{- fail (printf "probes.readiness.healthTimeout %v must be below probes.readiness.timeoutSeconds %v, so that the probe reports the health check's failure itself instead of being killed" $r.healthTimeout $r.timeoutSeconds) -}}
{{- end -}}
{{- end -}}

{{/* What `helm install` and `helm upgrade` refuse about an existing PVC (the page): a smaller
     size, other access modes, another StorageClass. `lookup` answers only against a cluster;
     under helm template and --dry-run=client it returns nothing, and the check does not run
     (as the page says), unless testing.existingClaims stands in for it. */}}
{{- define "modelserver.existingClaim" -}}
{{- $found := lookup "v1" "PersistentVolumeClaim" .root.Release.Namespace .name -}}
{{- if not $found -}}
{{- $found = index (default dict .root.Values.testing.existingClaims) .name | default dict -}}
{{- end -}}
{{- toJson $found -}}
{{- end -}}

{{- define "modelserver.checkExistingClaim" -}}
{{- $v := .root.Values.storage.compileCache -}}
{{- $size := include "modelserver.size" $v.size -}}
{{- $existing := include "modelserver.existingClaim" . | fromJson -}}
{{- if $existing -}}
{{- $spec := default dict $existing.spec -}}
{{- $had := toString (dig "resources" "requests" "storage" "" $spec) -}}
{{- $hadBytes := include "modelserver.bytes" $had -}}
{{- if and $hadBytes (lt (float64 (include "modelserver.bytes" $size)) (float64 $hadBytes)) -}}
{{- fail (printf "storage.compileCache.size %s is smaller than the existing PVC %s's %s: a PVC can only grow. Set storage.compileCache.size to %s or more (growing needs a StorageClass that allows volume expansion)" $size .name $had $had) -}}
{{- end -}}
{{- $hadModes := default list $spec.accessModes -}}
{{- if and $hadModes (ne (sortAlpha $hadModes | toJson) (sortAlpha $v.accessModes | toJson)) -}}
{{- fail (printf "storage.compileCache.accessModes %s differs from the existing PVC %s's %s: Kubernetes refuses changes to an existing PVC's spec. Set storage.compileCache.accessModes to %s, or delete the PVC (its cache is lost: kubectl delete pvc %s) and install again" (toJson $v.accessModes) .name (toJson $hadModes) (toJson $hadModes) .name) -}}
{{- end -}}
{{- $class := $v.storageClassName -}}
{{- if and $class (ne $class "-") (hasKey $spec "storageClassName") (ne $class (toString $spec.storageClassName)) -}}
{{- fail (printf "storage.compileCache.storageClassName %s differs from the existing PVC %s's %s: Kubernetes refuses changes to an existing PVC's spec. Set it back to %s, or delete the PVC (its cache is lost: kubectl delete pvc %s) and install again" $class .name (toString $spec.storageClassName) (toString $spec.storageClassName) .name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
