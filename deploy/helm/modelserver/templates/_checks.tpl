{{/*
Refusals a schema cannot say: each is one line naming the key, what is wrong and what to do.
Every other refusal is values.schema.json's, so that helm lint (which reports a template's
`fail` as INFO and passes) refuses it too: a size that is no quantity, ReadWriteOnce with two
pods, --host in the args, extraEnv the chart sets, trust with no writer... Here remain one
number against another, a quantity under one byte, and the existing PVC (through lookup).
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
{{- $size := include "modelserver.size" $v.storage.compileCache.size -}}
{{- $bytes := include "modelserver.bytes" $size -}}
{{- if not $bytes -}}
{{- /* The schema refuses it first; this stays for --skip-schema-validation, as the PVC checks parse it. */ -}}
{{- fail (printf "storage.compileCache.size %q is not a Kubernetes quantity of bytes: give a size such as 200Gi, 1.5Ti or 500G" (toString $size)) -}}
{{- end -}}
{{- if lt (float64 $bytes) 1.0 -}}
{{- fail (printf "storage.compileCache.size %q is no room at all (less than one byte): give the size of the compile cache, such as 200Gi (the chart's default)" (toString $size)) -}}
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
