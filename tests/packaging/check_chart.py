#!/usr/bin/python3
"""Keeps helm/kiln and manifests/ from drifting where `helm` cannot run.

Renders the chart's templates with their default values using the small subset of Helm's
template language the chart uses (values, the release namespace, include of the chart's two
helpers, toYaml/nindent, if/eq/end), then requires the rendered objects to equal the objects in
manifests/ (parsed YAML, compared as data). The CRD in crds/ must be byte-identical to
manifests/crd.yaml, and every metric the Grafana dashboard queries must be one the agent exports.
With tls.enabled the controller and agent mount their Secrets and pass the TLS flags; given the
two binaries (argv[2], argv[3]: kiln-agent, kiln-controller), every flag the rendered containers
pass, TLS on or off, must be one the binary's --help lists.
"""
import json, re, subprocess, sys, yaml
from pathlib import Path

src = Path(sys.argv[1])
chart = src / "helm/kiln"
values = yaml.safe_load((chart / "values.yaml").read_text())
NAMESPACE = "kiln-system"
errors = []

def lookup(path, overrides):
    if path in overrides:
        return overrides[path]
    v = values
    for part in path.split(".")[2:]:
        v = v[part]
    return v

def scalar(v):
    return ("true" if v else "false") if isinstance(v, bool) else str(v)

def indent(text, n):
    return "\n".join((" " * n + l) if l else l for l in text.split("\n"))

def evaluate(expr, overrides):
    m = re.fullmatch(r'include "kiln.labels" \(dict "component" "(\w+)"\) \| nindent (\d+)', expr)
    if m:
        return "\n" + indent(f"app.kubernetes.io/name: kiln\napp.kubernetes.io/component: {m[1]}", int(m[2]))
    m = re.fullmatch(r'toYaml (\.Values[\w.]+) \| nindent (\d+)', expr)
    if m:
        return "\n" + indent(yaml.safe_dump(lookup(m[1], overrides), default_flow_style=False).rstrip(), int(m[2]))
    if expr == 'include "kiln.image" .':
        return f'{values["image"]["repository"]}:{values["image"]["tag"]}'
    if expr == ".Release.Namespace":
        return NAMESPACE
    if re.fullmatch(r"\.Values[\w.]+", expr):
        return scalar(lookup(expr, overrides))
    raise ValueError(f"unsupported template action: {{{{ {expr} }}}}")

def condition(expr, overrides):
    m = re.fullmatch(r'eq (\.Values[\w.]+) "([^"]*)"', expr)
    if m:
        return lookup(m[1], overrides) == m[2]
    if re.fullmatch(r"\.Values[\w.]+", expr):
        return bool(lookup(expr, overrides))
    raise ValueError(f"unsupported condition: {expr}")

def render(text, overrides={}):
    out, stack, pos = "", [], 0
    for m in re.finditer(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", text, re.S):
        chunk = text[pos:m.start()]
        if m[1]:
            chunk = chunk.rstrip()
        if all(stack):
            out += chunk
        pos = m.end()
        if m[3]:
            while pos < len(text) and text[pos] in " \t\n":
                pos += 1
        expr = m[2]
        if expr.startswith("if "):
            stack.append(all(stack) and condition(expr[3:], overrides))
        elif expr == "end":
            stack.pop()
        elif all(stack):
            out += evaluate(expr, overrides)
    return out + text[pos:]

def objects(text):
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(text) if d}

if (chart / "crds/crd.yaml").read_bytes() != (src / "manifests/crd.yaml").read_bytes():
    errors.append("helm/kiln/crds/crd.yaml differs from manifests/crd.yaml (copy it over)")

pairs = [("rbac.yaml", "rbac.yaml", {}), ("controller.yaml", "controller.yaml", {}),
         ("agent.yaml", "agent.yaml", {}),
         ("servicemonitor.yaml", "optional/servicemonitor.yaml", {".Values.serviceMonitor.enabled": True})]
for template, manifest, overrides in pairs:
    try:
        rendered = objects(render((chart / "templates" / template).read_text(), overrides))
    except Exception as e:  # a template this checker cannot render is itself a failure
        errors.append(f"templates/{template}: {e}")
        continue
    wanted = objects((src / "manifests" / manifest).read_text())
    for key in sorted(set(rendered) | set(wanted)):
        if key not in rendered:
            errors.append(f"templates/{template} does not render {key} (in manifests/{manifest})")
        elif key not in wanted:
            errors.append(f"templates/{template} renders {key}, not in manifests/{manifest}")
        elif rendered[key] != wanted[key]:
            errors.append(f"{key}: templates/{template} renders\n{json.dumps(rendered[key], sort_keys=True)}\n"
                          f"but manifests/{manifest} has\n{json.dumps(wanted[key], sort_keys=True)}")

# GPU power enforce adds the capability NVML needs.
agent = objects(render((chart / "templates/agent.yaml").read_text(), {".Values.agent.gpuPowerPolicy": "enforce"}))
caps = agent[("DaemonSet", "kiln-agent")]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]
if caps.get("add") != ["SYS_ADMIN"]:
    errors.append(f"gpuPowerPolicy=enforce: capabilities are {caps}, want SYS_ADMIN added")

# agent.extraArgs are passed after the chart's own flags.
extra = ["--label=topology.kubernetes.io/zone=z1", "--label=rack=r7"]
agent = objects(render((chart / "templates/agent.yaml").read_text(), {".Values.agent.extraArgs": extra}))
args = agent[("DaemonSet", "kiln-agent")]["spec"]["template"]["spec"]["containers"][0]["args"]
if args[-2:] != extra:
    errors.append(f"agent.extraArgs: the DaemonSet passes {args}, want {extra} at the end")

# mTLS: each side mounts its Secret and passes the flags that read it.
tls_on = {".Values.tls.enabled": True}
tls_objects = {**objects(render((chart / "templates/controller.yaml").read_text(), tls_on)),
               **objects(render((chart / "templates/agent.yaml").read_text(), tls_on))}
for kind, name, secret, flags in [
        ("Deployment", "kiln-controller", values["tls"]["controllerSecret"],
         ["--tls-cert=/etc/kiln/tls/tls.crt", "--tls-key=/etc/kiln/tls/tls.key",
          "--tls-client-ca=/etc/kiln/tls/ca.crt",
          "--tls-node-identity=" + ("true" if values["tls"]["nodeIdentity"] else "false")]),
        ("DaemonSet", "kiln-agent", values["tls"]["agentSecret"],
         ["--controller-ca=/etc/kiln/tls/ca.crt", "--controller-cert=/etc/kiln/tls/tls.crt",
          "--controller-key=/etc/kiln/tls/tls.key"])]:
    pod = tls_objects[(kind, name)]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    for f in flags:
        if f not in args:
            errors.append(f"tls.enabled: {kind}/{name} does not pass {f} (args: {args})")
    if {"name": "tls", "secret": {"secretName": secret}} not in pod["volumes"]:
        errors.append(f"tls.enabled: {kind}/{name} does not mount Secret {secret}")
    if {"name": "tls", "mountPath": "/etc/kiln/tls", "readOnly": True} not in pod["containers"][0]["volumeMounts"]:
        errors.append(f"tls.enabled: {kind}/{name} does not mount /etc/kiln/tls read-only")

if len(sys.argv) > 3:
    helps = {"kiln-agent": subprocess.run([sys.argv[2], "--help"], capture_output=True, text=True).stdout,
             "kiln-controller": subprocess.run([sys.argv[3], "--help"], capture_output=True, text=True).stdout}
    for overrides in ({}, tls_on):
        rendered = {**objects(render((chart / "templates/controller.yaml").read_text(), overrides)),
                    **objects(render((chart / "templates/agent.yaml").read_text(), overrides))}
        for (kind, name), obj in rendered.items():
            if kind not in ("Deployment", "DaemonSet"):
                continue
            for arg in obj["spec"]["template"]["spec"]["containers"][0]["args"]:
                flag = arg.split("=")[0]
                if not re.search(re.escape(flag) + r"\b", helps[name]):
                    errors.append(f"{kind}/{name} passes {flag}, which {name} --help does not list")

dashboard = json.loads((chart / "dashboards/kiln.json").read_text())
exported = set(re.findall(r'"(kiln_[a-z0-9_]+)', (src / "agent/agent.cc").read_text()))
for panel in dashboard["panels"]:
    for target in panel["targets"]:
        for metric in re.findall(r"\bkiln_[a-z0-9_]+", target["expr"]):
            if metric not in exported:
                errors.append(f"dashboard panel '{panel['title']}' queries {metric}, which the agent does not export")

for e in errors:
    print("FAIL:", e)
if errors:
    sys.exit(1)
print(f"chart renders manifests/ with its defaults; dashboard queries {len(exported)} known metrics")
