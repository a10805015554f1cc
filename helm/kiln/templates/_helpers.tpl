{{- define "kiln.labels" -}}
app.kubernetes.io/name: kiln
app.kubernetes.io/component: {{ .component }}
{{- end -}}
{{- define "kiln.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}
