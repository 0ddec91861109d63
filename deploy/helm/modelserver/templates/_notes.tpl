{{/* The NOTES' trust paragraph: which mode the release runs in, what it stops and what it does
     not. docs/design.md ("The threat model") is the source; these are its rows, in short. */}}
{{- define "modelserver.notes.trust" -}}
{{- $v := .Values -}}
{{- $readOnly := include "modelserver.readOnlyServing" . -}}
{{- if not $v.trust.trustedKeys }}

Trust: the open mode (no trust.trustedKeys). An entry is code that every pod loading it runs, and
nothing checks who built it: whoever can write the volume can change one (kubectl exec into any
pod of the role{{ if $v.toolbox.enabled }}, or into a toolbox{{ end }}).
{{- if $readOnly }}
The serving pods mount the cache read-only (trust.readOnlyServing): they change nothing, but
what the warm Jobs or anything else writes goes unchecked.
{{- end }}
The builder mode stops that: trust.trustedKeys and trust.signingKeySecret, with the warm Jobs on.
{{- else if $readOnly }}

Trust: the builder mode (trust.trustedKeys; trust.readOnlyServing {{ $v.trust.readOnlyServing }}: serving is read-only). The
warm Jobs are the volume's only writers and hold the signing key; serving pods load only what a
trusted key signed, checked byte for byte, from a read-only mount. Stopped: a serving pod, its
server or a kubectl exec into it changing an entry, adding files to a warm Job's staging while
it compiles (which the Job would sign), or changing a file between a pod's check and its
server's read.
{{- if $v.trust.recordUse }}
Left to them: use records in usage/ (trust.recordUse), which keep entries from prune, and the
volume's free space.
{{- end }}
Not stopped: anything else that mounts the PVC read-write (keep the warm Jobs its only writer),
root on a node, the storage backend, and the builder itself.
{{- if $v.toolbox.enabled }}
The toolboxes mount it read-write: turn them off (toolbox.enabled=false) when you are done.
{{- end }}
{{- else }}

Trust: the signed mode (trust.trustedKeys; trust.readOnlyServing false: the volume is read-write
to the serving pods). Stopped: a changed or forged entry is never loaded (pods load only what a
trusted key signed, checked byte for byte). Not stopped: whoever writes the volume (kubectl exec
into a serving pod{{ if $v.toolbox.enabled }} or a toolbox{{ end }}) can add files to a warm Job's staging while it compiles,
which the Job then signs, change a file between a pod's check and its server's read, and delete
entries. The builder mode (trust.readOnlyServing auto or true) stops the first two.
{{- end }}
{{- end -}}
