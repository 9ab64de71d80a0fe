"""Structural checks of the deployment artifacts that no off-the-shelf validator makes.

Run by .ci/validate-deploy (in its venv: PyYAML, python-hcl2, cloudcoil's prometheus-operator
models) after the validators themselves:

  check_deploy.py kubernetes RENDERED   the kustomization's output (`kubectl kustomize`)
  check_deploy.py terraform             ignore_changes on every Cloud Run image
  check_deploy.py workflows             jobs run the image just built; the image workflow
                                        publishes what the manifests name
  check_deploy.py compose CONFIG        `docker-compose config` output: the walk-through's wiring
  check_deploy.py dockerfile            both binaries, OCI labels
  check_deploy.py readme CONFIG         the README's compose commands name real services

Each prints one line when it passes and exits non-zero naming the first problem otherwise.
"""

import glob
import os
import re
import sys
import typing
import urllib.parse

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K8S = os.path.join(ROOT, "deploy", "kubernetes")


def fail(message):
    print(f"check_deploy: {message}", file=sys.stderr)
    sys.exit(1)


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def workspace_version():
    match = re.search(r'^version = "([^"]+)"$', read("Cargo.toml"), re.M)
    if not match:
        fail("no workspace version in Cargo.toml")
    return match.group(1)


def kustomization():
    return yaml.safe_load(read("deploy", "kubernetes", "kustomization.yaml"))


def selects(selector, labels):
    """Whether a matchLabels selector (None: everything) selects `labels`."""
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def unknown_keys(model, data, path):
    """Keys of `data` that the pydantic `model` does not declare, recursively."""
    import pydantic

    def walk(annotation, value, path):
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin is typing.Annotated:
            return walk(args[0], value, path)
        if args and origin not in (list, dict):
            # Optional[X] / Union[X, ...]: the first type that is not None.
            return walk(next(a for a in args if a is not type(None)), value, path)
        if origin is list and isinstance(value, list):
            return [e for i, v in enumerate(value) for e in walk(args[0], v, f"{path}[{i}]")]
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
            if not isinstance(value, dict):
                return []
            fields = {}
            for name, field in annotation.model_fields.items():
                fields[name] = field
                fields[field.alias or name] = field
            found = []
            for key, item in value.items():
                if key not in fields:
                    found.append(f"{path}.{key}")
                else:
                    found += walk(fields[key].annotation, item, f"{path}.{key}")
            return found
        return []

    return walk(model, data, path)


def check_kubernetes(rendered_path):
    kz = kustomization()
    listed = set(kz.get("resources", []))
    on_disk = {
        os.path.basename(p)
        for p in glob.glob(os.path.join(K8S, "*.yaml"))
        if os.path.basename(p) != "kustomization.yaml"
    }
    if listed != on_disk:
        fail(f"kustomization resources {sorted(listed)} differ from the manifests {sorted(on_disk)}")
    namespace = kz.get("namespace")
    if not namespace:
        fail("the kustomization sets no namespace")
    images = kz.get("images") or []
    if len(images) != 1:
        fail("the kustomization must override exactly one image")
    image_name, tag = images[0]["name"], str(images[0].get("newTag", ""))
    if tag != workspace_version():
        fail(f"the kustomization's newTag {tag!r} is not the workspace version {workspace_version()!r}")
    for name in sorted(on_disk):
        text = read("deploy", "kubernetes", name)
        if ":latest" in text:
            fail(f"{name} uses a :latest image")
        for image in re.findall(r"image:\s*(\S+)", text):
            if image.rsplit(":", 1)[0] != image_name:
                fail(f"{name} names image {image}, which the kustomization does not override")

    with open(rendered_path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    known_kinds = {
        "Namespace", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
        "HorizontalPodAutoscaler", "Job", "NetworkPolicy", "ServiceMonitor",
    }
    by_kind = {}
    for d in docs:
        if d["kind"] not in known_kinds:
            fail(f"{d['kind']} {d['metadata']['name']}: a kind this check does not know")
        by_kind.setdefault(d["kind"], []).append(d)
        if d["kind"] != "Namespace" and d["metadata"].get("namespace") != namespace:
            fail(f"{d['kind']} {d['metadata']['name']} is not in namespace {namespace}")
    if [n["metadata"]["name"] for n in by_kind.get("Namespace", [])] != [namespace]:
        fail(f"the manifests must create the namespace {namespace}")

    deployments = {d["metadata"]["name"]: d for d in by_kind.get("Deployment", [])}
    pods = {}  # name -> (labels, containers)
    for d in deployments.values():
        spec = d["spec"]["template"]["spec"]
        pods[d["metadata"]["name"]] = (d["spec"]["template"]["metadata"]["labels"], spec["containers"])
    for job in by_kind.get("Job", []):
        spec = job["spec"]["template"]["spec"]
        pods[job["metadata"]["name"]] = (job["spec"]["template"]["metadata"]["labels"], spec["containers"])
    for name, (_, containers) in pods.items():
        for c in containers:
            if c["image"] != f"{image_name}:{tag}":
                fail(f"{name} renders image {c['image']}, not {image_name}:{tag}")

    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        target = hpa["spec"]["scaleTargetRef"]["name"]
        if target not in deployments:
            fail(f"HPA {hpa['metadata']['name']} scales {target}, which is not a Deployment here")
        if "replicas" in deployments[target]["spec"]:
            fail(f"Deployment {target} sets replicas, which its HPA owns")

    # Metrics: every pod with a metrics port sits behind a Service the ServiceMonitor selects.
    services = by_kind.get("Service", [])
    monitors = by_kind.get("ServiceMonitor", [])
    if not monitors:
        fail("no ServiceMonitor")
    from cloudcoil.models.prometheus_operator import v1 as prometheus_operator

    for monitor in monitors:
        prometheus_operator.ServiceMonitor.model_validate(monitor)
        extra = unknown_keys(prometheus_operator.ServiceMonitor, monitor, monitor["metadata"]["name"])
        if extra:
            fail(f"ServiceMonitor fields its CRD does not have: {extra}")
    for name, (labels, containers) in pods.items():
        ports = [p for c in containers for p in c.get("ports", []) if p.get("name") == "metrics"]
        if not ports:
            continue
        scraped = False
        for svc in services:
            if not svc["spec"].get("selector") or not selects(svc["spec"]["selector"], labels):
                continue
            svc_ports = {p.get("name") for p in svc["spec"]["ports"] if p.get("targetPort") == "metrics"}
            for monitor in monitors:
                if selects(monitor["spec"]["selector"].get("matchLabels"), svc["metadata"].get("labels", {})):
                    if {e.get("port") for e in monitor["spec"]["endpoints"]} & svc_ports:
                        scraped = True
        if not scraped:
            fail(f"{name}'s metrics port is scraped by no ServiceMonitor")

    # NetworkPolicy: every pod is isolated; every port it listens on is let in from somewhere; every
    # service URL a pod calls is let out of the caller and into the callee.
    policies = by_kind.get("NetworkPolicy", [])

    def applying(labels, kind):
        return [
            p for p in policies
            if selects(p["spec"]["podSelector"].get("matchLabels"), labels)
            and kind in p["spec"].get("policyTypes", ["Ingress"])
        ]

    def port_listed(rule, port, port_name=None):
        ports = rule.get("ports")
        return not ports or any(p.get("port") in (port, port_name) for p in ports)

    def peer_allows(peers, labels):
        # An absent peer list allows everyone; else one podSelector peer must select the labels.
        return peers is None or any(
            "podSelector" in peer and "namespaceSelector" not in peer
            and selects(peer["podSelector"].get("matchLabels"), labels)
            for peer in peers
        )

    for name, (labels, containers) in pods.items():
        if not applying(labels, "Ingress") or not applying(labels, "Egress"):
            fail(f"{name} is not isolated by a NetworkPolicy both ways")
        for c in containers:
            for p in c.get("ports", []):
                if not any(
                    port_listed(rule, p["containerPort"], p.get("name"))
                    for pol in applying(labels, "Ingress")
                    for rule in (pol["spec"].get("ingress") or [])
                ):
                    fail(f"{name} listens on {p['containerPort']} but no NetworkPolicy lets anything in")
        egress_rules = [r for pol in applying(labels, "Egress") for r in (pol["spec"].get("egress") or [])]
        for port, what in [(53, "DNS"), (5432, "PostgreSQL"), (443, "HTTPS"), (4317, "OTLP")]:
            if not any("to" not in r and port_listed(r, port) for r in egress_rules):
                fail(f"{name} cannot reach {what} (port {port}) under its NetworkPolicies")
        for c in containers:
            for env in c.get("env", []):
                if not re.fullmatch(r"ORCA_PUSH_[A-Z]+_URL", env["name"]) or "value" not in env:
                    continue
                url = urllib.parse.urlsplit(env["value"])
                if not url.hostname or not url.hostname.startswith("orca-push-"):
                    continue
                callee = next(
                    (s for s in services if s["metadata"]["name"] == url.hostname), None
                )
                if callee is None:
                    fail(f"{name}'s {env['name']} names {url.hostname}, which is no Service here")
                callee_labels = next(
                    (lbl for lbl, _ in pods.values() if selects(callee["spec"]["selector"], lbl)), None
                )
                if callee_labels is None:
                    fail(f"Service {url.hostname} selects no pod")
                if not any(
                    peer_allows(r.get("to"), callee_labels) and port_listed(r, url.port)
                    for r in egress_rules
                ):
                    fail(f"{name} may not call {url.hostname}:{url.port} ({env['name']})")
                if not any(
                    peer_allows(r.get("from"), labels) and port_listed(r, url.port)
                    for pol in applying(callee_labels, "Ingress")
                    for r in (pol["spec"].get("ingress") or [])
                ):
                    fail(f"{url.hostname} does not let {name} in on {url.port} ({env['name']})")
    print(
        f"check_deploy: kubernetes: {len(docs)} objects in {namespace}, image {image_name}:{tag}, "
        f"{len(policies)} NetworkPolicies, {len(monitors)} ServiceMonitor"
    )


def check_terraform():
    import hcl2

    def unquote(s):
        return s.strip('"')

    found = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "terraform", "*.tf"))):
        with open(path) as f:
            doc = hcl2.load(f)
        for block in doc.get("resource", []):
            for rtype, bodies in block.items():
                rtype = unquote(rtype)
                wanted = {
                    "google_cloud_run_v2_service": "template[0].containers[0].image",
                    "google_cloud_run_v2_job": "template[0].template[0].containers[0].image",
                }.get(rtype)
                if not wanted:
                    continue
                for name, body in bodies.items():
                    ignored = [
                        unquote(i).removeprefix("${").removesuffix("}")
                        for lc in body.get("lifecycle", [])
                        for i in lc.get("ignore_changes", [])
                    ]
                    if wanted not in ignored:
                        fail(f"{rtype}.{unquote(name)} does not ignore changes to {wanted}")
                    found.append(f"{rtype}.{unquote(name)}")
    if not found:
        fail("no Cloud Run service or job in deploy/terraform")
    print(f"check_deploy: terraform: image changes ignored on {', '.join(found)}")


def steps_of(workflow):
    return [s for job in workflow["jobs"].values() for s in job.get("steps", [])]


def step_text(step):
    return " ".join(
        str(v) for v in [step.get("run", ""), *(step.get("with") or {}).values()]
    )


def check_workflows():
    deploy = yaml.safe_load(read(".github", "workflows", "cloud-push-deploy.yml"))
    steps = steps_of(deploy)
    texts = [step_text(s) for s in steps]
    executed = sorted(set(re.findall(r"gcloud run jobs execute ([a-z0-9-]+)", " ".join(texts))))
    if not executed:
        fail("the deploy workflow executes no Cloud Run job")
    for job in executed:
        first_execute = min(i for i, t in enumerate(texts) if f"gcloud run jobs execute {job}" in t)
        updated = [
            i for i, t in enumerate(texts[:first_execute])
            if "gcloud run jobs update" in t and "--image" in t and job in t
        ]
        checked = [
            i for i, t in enumerate(texts[:first_execute])
            if "gcloud run jobs describe" in t and job in t and "containers[0].image" in t
        ]
        if not updated:
            fail(f"the deploy workflow executes {job} without first setting its image")
        if not checked or min(checked) < min(updated):
            fail(f"the deploy workflow does not check {job}'s image after setting it")
    lease = [s for s in steps if s.get("uses") == "./.github/actions/cloud-sql-rollout-lease"]
    if not lease or "orca-cloud-push-migrate" not in step_text(lease[0]):
        fail("the schema step does not run under the rollout lease")
    if not os.path.exists(os.path.join(ROOT, ".github", "actions", "cloud-sql-rollout-lease", "action.yml")):
        fail("the rollout lease action is missing")
    deploy_cmd = " ".join(texts)
    if "--no-traffic" not in deploy_cmd:
        fail("the deploy workflow no longer deploys with --no-traffic")

    image = yaml.safe_load(read(".github", "workflows", "image.yml"))
    name = kustomization()["images"][0]["name"]
    if image.get("env", {}).get("IMAGE") != name:
        fail(f"image.yml does not publish {name}, the image the kustomization names")
    if (image.get("permissions") or {}).get("packages") != "write":
        fail("image.yml lacks packages: write")
    pushes = [s for s in steps_of(image) if str(s.get("uses", "")).startswith("docker/build-push-action@")]
    if not pushes or not (pushes[0].get("with") or {}).get("push"):
        fail("image.yml does not push with docker/build-push-action")
    print(f"check_deploy: workflows: {', '.join(executed)} run the image just built; image.yml publishes {name}")


def mock_flags():
    """The long flags orca-push-mock-providers declares (clap derive: field names, or long = ...)."""
    source = read("tests", "bin", "orca-push-mock-providers.rs")
    body = source.split("struct Args {", 1)[1].split("\n}\n", 1)[0]
    flags = set(re.findall(r'long = "([a-z-]+)"', body))
    for attrs, field in re.findall(r"((?:\s*#\[arg\([^\]]*\)\]\n)+)\s*(\w+):", body):
        if 'long = "' not in attrs:
            flags.add(field.replace("_", "-"))
    return flags


def check_compose(config_path):
    with open(config_path) as f:
        config = yaml.safe_load(f)
    services = config["services"]
    for needed in ("mocks", "cli", "facade", "jaeger", "grafana", "prometheus"):
        if needed not in services:
            fail(f"compose has no {needed} service")
    mocks = services["mocks"]
    if mocks.get("entrypoint") != ["orca-push-mock-providers"]:
        fail("the mocks service does not run orca-push-mock-providers")
    args = dict(a.removeprefix("--").split("=", 1) for a in mocks["command"])
    unknown = set(args) - mock_flags()
    if unknown:
        fail(f"the mocks service passes flags the binary does not have: {sorted(unknown)}")
    env_file = args.get("env-file", "")
    shared = os.path.dirname(env_file)
    if args.get("files-dir") != shared:
        fail("the mocks must write their files where their env file is")

    def mounts(service):
        return {
            (v["source"] if isinstance(v, dict) else v.split(":")[0]): (
                v["target"] if isinstance(v, dict) else v.split(":")[1]
            )
            for v in service.get("volumes", [])
        }

    volume = next((src for src, dst in mounts(mocks).items() if dst == shared), None)
    if volume is None:
        fail(f"the mocks service mounts nothing at {shared}")
    senders = [n for n, s in services.items() if "--service sender" in " ".join(s.get("command") or [])]
    if not senders:
        fail("compose runs no sender")
    for name in senders:
        s = services[name]
        if mounts(s).get(volume) != shared:
            fail(f"{name} does not mount the mocks' volume at {shared}")
        if f". {env_file} &&" not in " ".join(s["command"]):
            fail(f"{name} does not read {env_file}")
        if (s.get("depends_on") or {}).get("mocks", {}).get("condition") != "service_healthy":
            fail(f"{name} does not wait for the mocks")
    cli = services["cli"]
    if cli.get("network_mode") != "service:facade":
        fail("the cli service does not share the facade's network (its origin is localhost)")
    public = services["facade"]["environment"].get("ORCA_PUSH_PUBLIC_URL")
    if cli["environment"].get("ORCA_PUSH_GATEWAY_URL") != public:
        fail("the cli calls another origin than the gateway binds into its challenges")
    print(f"check_deploy: compose: mocks -> {', '.join(senders)} through {volume}:{env_file}")


def check_dockerfile():
    text = read("Dockerfile")
    if not text.startswith("# syntax=docker/dockerfile:1"):
        fail("the Dockerfile does not ask for the BuildKit syntax")
    for needed in (
        "--mount=type=cache,id=orca-push-cargo-registry",
        "--mount=type=cache,id=orca-push-target",
        "--bin orca-push --bin orca-push-mock-providers",
        "/usr/local/bin/",
    ):
        if needed not in text:
            fail(f"the Dockerfile lacks {needed}")
    for label in ("source", "revision", "version", "licenses", "title", "description"):
        if f"org.opencontainers.image.{label}=" not in text:
            fail(f"the Dockerfile lacks the OCI label {label}")
    if 'org.opencontainers.image.licenses="Apache-2.0"' not in text:
        fail("the Dockerfile's license label is not Apache-2.0")
    print("check_deploy: dockerfile: both binaries, cache mounts, OCI labels")


def check_readme(config_path):
    with open(config_path) as f:
        services = set(yaml.safe_load(f)["services"])
    readme = read("README.md")
    used = re.findall(
        r"docker compose (?:run(?: --rm)?|logs(?: -f)?|exec|restart|stop|start) ([a-z0-9-]+)", readme
    )
    if not used:
        fail("the README names no compose service")
    missing = sorted(set(used) - services)
    if missing:
        fail(f"the README names compose services that do not exist: {missing}")
    print(f"check_deploy: readme: compose services {sorted(set(used))} exist")


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    {
        "kubernetes": check_kubernetes,
        "terraform": check_terraform,
        "workflows": check_workflows,
        "compose": check_compose,
        "dockerfile": check_dockerfile,
        "readme": check_readme,
    }[what](*rest)
