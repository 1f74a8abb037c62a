"""compose/: the docker compose deployment, checked without docker.

* both variants (GPU: compose.yaml with --profile gpu; CPU: compose.yaml + compose.cpu.yaml with --profile cpu,
  merged here as docker compose merges files) validate against the Compose Specification JSON schema and keep
  the service names gateway / verifier / drafter;
* their commands are the `specdec` CLI (parsed by its own parser) and the CPU variant's commands, run as local
  processes with the ports rewritten, serve a completion through the gateway, survive the README's drafter swap;
* the Dockerfiles (parsed by `dockerfile`) use pinned bases, a non-root user, an empty entrypoint under the
  compose commands, and install what those commands need.

The schema is the copy vendored at compose/compose-spec.json (from compose-spec/compose-spec,
schema/compose-spec.json, Apache-2.0).
"""
from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from specdec_tools.local_stack import free_port

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose"
SCHEMAS = [p for p in (COMPOSE / "compose-spec.json",) if p.is_file()]
SERVICES = {"gateway", "verifier", "drafter"}
VARIANTS = {  # name: (files, in the order given to `docker compose -f`, profile)
    "gpu": (["compose.yaml"], "gpu"),
    "cpu": (["compose.yaml", "compose.cpu.yaml"], "cpu"),
}
DOCKERFILES = {"compose/Dockerfile.gpu", "compose/Dockerfile.cpu", "compose/Dockerfile.gateway"}
ENV_VARS = {"MODEL_DIR", "SPECDEC_MODEL", "DRAFTER", "K", "GPU", "GATEWAY_PORT", "HTTP_PORT", "TP", "DRAFTER_DEVICE"}


# ---- loading and merging compose files as docker compose does ---------------------------------------------------
class Reset:
    """`!reset`: the attribute is removed from what the earlier files set."""


class Override:
    """`!override VALUE`: VALUE replaces what the earlier files set (no merging)."""

    def __init__(self, value):
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct_node(loader, node):
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", lambda loader, node: Override(_construct_node(loader, node)))


def load(name: str) -> dict:
    return yaml.load((COMPOSE / name).read_text(), Loader=ComposeLoader)


REPLACED = {"command", "entrypoint", "healthcheck.test"}      # compose-spec "merge": overridden, not appended


def _as_mapping(value, default=None) -> dict:
    """depends_on / networks / environment given as a list, as the mapping they mean."""
    if isinstance(value, dict):
        return value
    out = {}
    for item in value or []:
        key, sep, val = str(item).partition("=")
        out[key] = val if sep else copy.deepcopy(default)
    return out


def merge(base, over, path: str = ""):
    """`over` (a later -f file) merged into `base`, after compose-spec's merge rules."""
    if isinstance(over, Reset):
        return Reset()
    if isinstance(over, Override):
        return strip_tags(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            sub = f"{path}.{key}" if path else key
            rel = re.sub(r"^services\.[^.]+\.", "", sub)
            if key not in out:
                out[key] = strip_tags(value)
            elif rel in REPLACED:
                out[key] = strip_tags(value)
            elif rel in ("depends_on", "networks", "environment") and re.match(r"^services\.[^.]+\.", sub):
                default = {"condition": "service_started", "required": True} if key == "depends_on" else None
                out[key] = merge(_as_mapping(out[key], default), _as_mapping(strip_tags(value), default), sub)
            elif rel in ("ports", "volumes") and isinstance(value, list):
                target = (lambda v: (str(v).split(":") + [""])[1]) if rel == "volumes" else str   # SRC:DST[:MODE]
                later = {target(v) for v in value}
                out[key] = [v for v in out[key] if target(v) not in later] + strip_tags(value)
            else:
                out[key] = merge(out[key], value, sub)
        return {k: v for k, v in out.items() if not isinstance(v, Reset)}
    if isinstance(base, list) and isinstance(over, list):
        return base + strip_tags(over)
    return strip_tags(over)


def strip_tags(value):
    if isinstance(value, Override):
        return strip_tags(value.value)
    if isinstance(value, dict):
        return {k: strip_tags(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip_tags(v) for v in value]
    return value


def variant(name: str, profile: str | None = None) -> dict:
    """The compose model of one variant: its files merged, the services of its profile (or `profile`) only."""
    files, default_profile = VARIANTS[name]
    profile = profile or default_profile
    model = strip_tags(load(files[0]))
    for f in files[1:]:
        model = merge(model, load(f))
    model["services"] = {n: s for n, s in model["services"].items()
                         if not s.get("profiles") or profile in s["profiles"]}
    return model


_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict):
    """${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR:+alt}, $VAR and $$, as compose does."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3) or ""
        assert "$" not in arg, f"nested interpolation is not handled here: {m.group(0)}"
        val = env.get(name)
        unset = val is None or (op or "").startswith(":") and val == ""
        if op in (":-", "-"):
            return arg if unset else val
        if op in (":?", "?"):
            assert not unset, f"{name}: {arg}"
            return val
        if op in (":+", "+"):
            return "" if unset else arg
        return val or ""
    return _VAR.sub(sub, value)


def variables(value) -> set[str]:
    if isinstance(value, dict):
        return set().union(*(variables(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(variables(v) for v in value)) if value else set()
    return {m.group(1) or m.group(4) for m in _VAR.finditer(value) if m.group(0) != "$$"} \
        if isinstance(value, str) else set()


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


COMPOSE_ENV = {k: v for k, v in os.environ.items() if k not in ENV_VARS}   # defaults, whatever the shell has


# ---- the files: schema, names, variants ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schemas():
    import json
    assert SCHEMAS, "compose/compose-spec.json (vendored) is missing"
    return [json.loads(p.read_text()) for p in SCHEMAS]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_validates_against_the_compose_spec(name, schemas):
    import jsonschema
    model = variant(name)
    assert set(model["services"]) == SERVICES                      # the same names in both variants
    for schema in schemas:
        for doc in (model, interpolate(model, COMPOSE_ENV), interpolate(model, {
                "MODEL_DIR": "/srv/qwen3.5", "SPECDEC_MODEL": "/models/model", "DRAFTER": "ngram", "K": "2",
                "GPU": "1", "GATEWAY_PORT": "50061-50064"})):
            jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)
    other = next(p for n, (_, p) in VARIANTS.items() if n != name)
    assert variant(name, other)["services"] == {}     # these files with the other variant's --profile: nothing


def test_gpu_variant_shares_one_gpu_and_its_namespaces():
    services = interpolate(variant("gpu")["services"], COMPOSE_ENV)
    for name in ("verifier", "drafter"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
        assert flag(services[name]["command"], "--device") == "cuda"
    assert interpolate(variant("gpu"), {"GPU": "3"})["services"]["drafter"]["deploy"]["resources"][
        "reservations"]["devices"][0]["device_ids"] == ["3"]
    assert flag(services["verifier"]["command"], "--tensor-parallel-size") == "1"
    two = interpolate(variant("gpu"), {"GPU": "0,1", "TP": "2"})["services"]
    assert flag(two["verifier"]["command"], "--tensor-parallel-size") == "2"
    for name in ("verifier", "drafter"):   # both see the two GPUs: rank 0 and the drafter on the first
        assert two[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0,1"]
    own = interpolate(variant("gpu"), {"GPU": "0,1", "DRAFTER_DEVICE": "cuda:1"})["services"]   # a GPU of its own
    assert flag(own["drafter"]["command"], "--device") == "cuda:1"
    assert flag(own["verifier"]["command"], "--device") == "cuda"
    assert "deploy" not in services["gateway"]
    assert flag(services["verifier"]["command"], "--transport") == "cuda_ipc"
    assert services["drafter"]["ipc"] in ("service:verifier", "host")
    assert services["drafter"]["pid"] in ("service:verifier", "host")
    assert services["verifier"]["ipc"] in ("shareable", "host")


def test_cpu_variant_uses_shm_and_no_gpu():
    services = interpolate(variant("cpu")["services"], COMPOSE_ENV)
    for name, service in services.items():
        assert "deploy" not in service and "gpus" not in service, name
        assert "Dockerfile.gpu" not in str(service.get("build")), name
    for name in ("verifier", "drafter"):
        assert flag(services[name]["command"], "--device") == "cpu"
    assert flag(services["verifier"]["command"], "--transport") == "shm"
    assert services["drafter"]["ipc"] in ("service:verifier", "host")  # one /dev/shm for the shm transport


def test_variants_differ_only_in_device_transport_and_image():
    gpu, cpu = variant("gpu")["services"], variant("cpu")["services"]
    for name in SERVICES:
        g, c = list(gpu[name]["command"]), list(cpu[name]["command"])
        gpu_device = "${DRAFTER_DEVICE:-cuda}" if name == "drafter" else "cuda"   # (its GPU may be another)
        for cmd, device, transport in ((g, gpu_device, "cuda_ipc"), (c, "cpu", "shm")):
            for option, value in (("--device", device), ("--transport", transport)):
                if option in cmd:
                    i = cmd.index(option)
                    assert cmd[i + 1] == value, (name, cmd)
                    del cmd[i:i + 2]
        assert g == c, name
        for key in set(gpu[name]) | set(cpu[name]):
            if key not in ("command", "profiles", "deploy", "image", "build"):
                assert gpu[name].get(key) == cpu[name].get(key), (name, key)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_services_are_wired_as_the_issue_says(name):
    model = interpolate(variant(name), COMPOSE_ENV)
    services = model["services"]
    assert model["networks"]["internal"].get("internal") is True
    ports = {}
    for svc, service in services.items():
        command = service["command"]
        assert command[:2] == ["specdec", svc], command
        # the drafter listens on the verifier's loopback only (it shares the verifier's network namespace)
        assert flag(command, "--host") == ("127.0.0.1" if svc == "drafter" else "0.0.0.0")
        ports[svc] = int(flag(command, "--port"))
        assert service["environment"]["SPECDEC_MODEL"] == ""   # empty: the demo model
        assert "/models/model" in service["volumes"][0] and service["volumes"][0].endswith(":ro")
        assert service.get("restart") == "unless-stopped"
    # only the gateway is published, on its container ports (gRPC, HTTP); verifier and drafter stay internal
    http_port = int(flag(services["gateway"]["command"], "--http-port"))
    assert services["gateway"]["ports"] == [f"50051:{ports['gateway']}", f"8000:{http_port}"]
    assert set(services["gateway"]["networks"]) == {"public", "internal"}
    for svc in ("verifier", "drafter"):
        assert "ports" not in services[svc] and "expose" not in services[svc]
    assert list(services["verifier"]["networks"]) == ["internal"]
    # one network namespace for verifier and drafter: the drafter's local lane (an abstract Unix socket, bound to
    # a network namespace) is reachable from the verifier, and the drafter from nothing else
    assert services["drafter"]["network_mode"] == "service:verifier" and "networks" not in services["drafter"]
    # addresses point at a service's own port
    for svc, service in services.items():
        for arg in service["command"]:
            m = re.fullmatch(r"([a-z-]+):(\d+)", arg)
            if m and m.group(1) in SERVICES:
                assert int(m.group(2)) == ports[m.group(1)], (svc, arg)
    assert flag(services["verifier"]["command"], "--drafter-address") == f"127.0.0.1:{ports['drafter']}"
    assert flag(services["gateway"]["command"], "--verifier-address") == f"verifier:{ports['verifier']}"
    # health: the CLI probe on the service's own port, long start periods; the gateway waits for the verifier,
    # the verifier waits for no drafter
    for svc, service in services.items():
        check = service["healthcheck"]
        assert check["test"] == ["CMD", "specdec", "health", f"127.0.0.1:{ports[svc]}"], svc
        seconds = int(re.fullmatch(r"(\d+)s", check["start_period"]).group(1))
        assert seconds >= (60 if svc == "gateway" else 600), svc
    assert services["gateway"]["depends_on"]["verifier"]["condition"] == "service_healthy"
    assert "drafter" not in services["verifier"].get("depends_on", {})
    assert services["drafter"].get("depends_on", {}).get("verifier", {}).get(
        "condition", "service_started") == "service_started"
    assert services["verifier"]["shm_size"]
    # drafter and k are variables
    swapped = interpolate(variant(name), {"DRAFTER": "ngram", "K": "5"})["services"]
    assert flag(swapped["drafter"]["command"], "--kind") == "ngram"
    assert flag(swapped["drafter"]["command"], "-k") == flag(swapped["verifier"]["command"], "-k") == "5"
    # DRAFTER changes the drafter only: `up -d` recreates no verifier (which keeps the loaded target)
    for svc in ("gateway", "verifier"):
        assert swapped[svc] == interpolate(variant(name), {"DRAFTER": "mtp", "K": "5"})["services"][svc]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_commands_parse_with_the_cli(name):
    from specdec_tools.cli import build_parser
    parser = build_parser()
    for env in (COMPOSE_ENV, {"DRAFTER": "ngram", "K": "1"}):
        for svc, service in interpolate(variant(name), env)["services"].items():
            args = parser.parse_args(service["command"][1:])
            assert args.command == svc
            probe = service["healthcheck"]["test"]
            assert probe[0] == "CMD" and probe[1] == "specdec"
            assert parser.parse_args(probe[2:]).command == "health"


def test_variables_are_documented_in_env_example():
    example = (REPO / ".env.example").read_text()
    documented = set(re.findall(r"^([A-Z_][A-Z0-9_]*)=", example, re.M))
    used = set()
    for files, _ in VARIANTS.values():
        for f in files:
            used |= variables(strip_tags(load(f)))
    assert used <= documented, used - documented
    assert ENV_VARS <= documented


def test_build_contexts_and_dockerfiles_exist():
    for name in VARIANTS:
        for svc, service in variant(name)["services"].items():
            build = service["build"]
            context = (COMPOSE / build["context"]).resolve()
            assert context == REPO, (name, svc)
            assert build["dockerfile"] in DOCKERFILES and (context / build["dockerfile"]).is_file()
    ignore = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for needed in ("pyproject.toml", "README.md", "specdec", "verifier_service", "drafter_service", "gateway",
                   "kernels"):
        assert not any(re.fullmatch(p.strip("/").replace("*", ".*"), needed) for p in ignore
                       if not p.startswith("!")), needed


# ---- Dockerfiles ---------------------------------------------------------------------------------------------------
def parse_dockerfile(rel: str) -> dict:
    """The last stage of a Dockerfile, with what it inherits from earlier stages it is built FROM: base image
    (ARG defaults resolved), USER, ENTRYPOINT, CMD, HEALTHCHECK, RUN lines, ARG defaults."""
    import dockerfile
    args, stages, stage = {}, {}, None
    for c in dockerfile.parse_file(str(REPO / rel)):
        if c.cmd == "ARG":
            key, _, default = c.value[0].partition("=")
            args[key] = default
        elif c.cmd == "FROM":
            base = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: args.get(m.group(1), m.group(0)), c.value[0])
            stage = copy.deepcopy(stages[base]) if base in stages else {
                "base": base, "user": None, "entrypoint": None, "cmd": None, "run": [], "healthcheck": None}
            if len(c.value) == 3 and c.value[1].upper() == "AS":
                stages[c.value[2]] = stage
        elif stage is not None and c.cmd in ("USER", "ENTRYPOINT", "CMD", "HEALTHCHECK"):
            stage[c.cmd.lower()] = c
        elif stage is not None and c.cmd == "RUN":
            stage["run"].append(" ".join(c.value))
    assert stage is not None, rel
    return {**stage, "args": args}


def images_of_dockerfiles() -> dict[str, set[str]]:
    """Dockerfile -> the services (in any variant) built from it."""
    out: dict[str, set[str]] = {}
    for name in VARIANTS:
        for svc, service in variant(name)["services"].items():
            out.setdefault(service["build"]["dockerfile"], set()).add(svc)
    return out


@pytest.mark.parametrize("rel", sorted(DOCKERFILES))
def test_dockerfile_pinned_nonroot_and_consistent_with_compose(rel):
    stage = parse_dockerfile(rel)
    base = stage["base"]
    assert "$" not in base, base
    name, _, digest = base.partition("@")
    tag = name.rsplit("/", 1)[-1].partition(":")[2]
    assert (tag and tag != "latest") or digest.startswith("sha256:"), f"{rel}: base {base} is not pinned"
    user = stage["user"]
    assert user is not None, f"{rel}: no USER"
    assert user.value[0].split(":")[0] not in ("root", "0"), f"{rel}: runs as root"
    assert any(re.search(r"useradd .*--uid 10001\b", r) for r in stage["run"]) and user.value[0].startswith("10001")
    # compose runs `specdec <service> ...` as the whole command: the entrypoint must be empty, `specdec` must be
    # installed on PATH (pip install of the package), and the image's own CMD must be a specdec command too
    assert stage["entrypoint"] is not None and stage["entrypoint"].json and stage["entrypoint"].value == (), rel
    assert stage["cmd"] is not None and stage["cmd"].json and stage["cmd"].value[0] == "specdec", rel
    assert any(re.search(r"\bpip install\b[^&]* /src\b", r) for r in stage["run"]), rel
    assert any("specdec" in r and "--help" in r for r in stage["run"]), f"{rel}: the build does not run specdec"
    # no image health check: compose's `specdec health 127.0.0.1:PORT` does it per service
    assert stage["healthcheck"] is None, rel
    # no `# syntax=` directive: BuildKit would pull that frontend image from a registry before building
    assert not re.search(r"(?im)^#\s*syntax\s*=", (REPO / rel).read_text()), rel
    services = images_of_dockerfiles()[rel]
    for name in VARIANTS:
        for svc, service in variant(name)["services"].items():
            if service["build"]["dockerfile"] == rel:
                assert service["command"][0] == stage["cmd"].value[0] == "specdec"
                assert service["healthcheck"]["test"][1] == "specdec"
                assert "entrypoint" not in service, svc
    assert services, rel


def test_gateway_image_has_no_torch_and_pins_within_pyproject():
    import tomllib

    from packaging.requirements import Requirement
    stage = parse_dockerfile("compose/Dockerfile.gateway")
    runs = " ".join(stage["run"])
    assert "torch" not in runs.replace("find_spec('torch')", "")
    assert re.search(r"pip install --no-deps /src", runs)
    pins = dict(re.findall(r"\b([a-z][a-z0-9-]*)==([0-9][\w.]*)", runs))
    assert set(pins) == {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "tokenizers", "fastapi",
                         "uvicorn", "jinja2", "prometheus-client"}
    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    for pkg, version in pins.items():
        assert deps[pkg].specifier.contains(version), (pkg, version, str(deps[pkg]))
    assert images_of_dockerfiles()["compose/Dockerfile.gateway"] == {"gateway"}


def run_torch_install(tmp_path: Path, **build_args: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """compose/Dockerfile.cpu's torch RUN line as the build runs it (build arguments as environment), with a
    fake `pip` that records its arguments: (the shell's result, one argument list per pip call)."""
    stage = parse_dockerfile("compose/Dockerfile.cpu")
    line = next(r for r in stage["run"] if "TORCH_FROM" in r)
    bin_dir, calls = tmp_path / "bin", tmp_path / "pip-calls"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "pip").write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {calls}\n')
    (bin_dir / "pip").chmod(0o755)
    calls.write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **{k: stage["args"][k] for k in
                                                   ("TORCH_VERSION", "TORCH_FROM", "TORCH_INDEX_URL")}, **build_args}
    proc = subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True, timeout=30)
    return proc, [c.split() for c in calls.read_text().splitlines()]


def test_cpu_image_takes_torch_from_the_cpu_index_or_local_wheels_only(tmp_path):
    import tomllib

    from packaging.requirements import Requirement
    args = parse_dockerfile("compose/Dockerfile.cpu")["args"]
    version = args["TORCH_VERSION"]
    torch_req = next(Requirement(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "dependencies"] if Requirement(d).name == "torch")
    assert torch_req.specifier.contains(version)
    # default: PyPI's torch is a multi-GB CUDA build, so torch and its dependencies come from the CPU index
    proc, calls = run_torch_install(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert calls == [["install", f"torch=={version}", "--index-url", "https://download.pytorch.org/whl/cpu"]]
    # TORCH_FROM=wheels: torch from compose/wheels (mounted at /wheels) with no index at all, then its
    # dependencies with torch already installed
    proc, calls = run_torch_install(tmp_path, TORCH_FROM="wheels")
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 2 and f"torch=={version}" in calls[0] and "--no-index" in calls[0], calls
    assert calls[0][calls[0].index("--find-links") + 1] == "/wheels" and "--no-deps" in calls[0], calls
    assert not any("--index-url" in c for c in calls), calls
    # a bad value is refused by name, not read as one of the two
    proc, calls = run_torch_install(tmp_path, TORCH_FROM="wheel")
    assert proc.returncode != 0 and "TORCH_FROM=wheel" in proc.stderr and calls == []
    assert (REPO / "compose" / "wheels").is_dir()        # the Dockerfile mounts it in both modes
    assert images_of_dockerfiles()["compose/Dockerfile.cpu"] == {"verifier", "drafter"}
    assert images_of_dockerfiles()["compose/Dockerfile.gpu"] == {"verifier", "drafter"}


def test_cpu_image_installs_the_dependencies_of_pyproject_less_triton(tmp_path):
    """The CPU image's requirement lists, computed by its own snippets from pyproject.toml: all but triton, and
    xgrammar (which requires triton) without its dependencies."""
    import tomllib
    runs = " ".join(parse_dockerfile("compose/Dockerfile.cpu")["run"])
    (tmp_path / "src").symlink_to(REPO)

    def listed(target):
        snippet = re.search(r'python -c "(import re, tomllib;[^"]*?)" > ' + target, runs).group(1)
        return subprocess.run([sys.executable, "-c", snippet.replace("/src/", f"{tmp_path}/src/")],
                              capture_output=True, text=True, check=True).stdout.splitlines()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("triton") for d in deps) and any(d.startswith("xgrammar") for d in deps)
    assert listed("/tmp/requirements.txt") == [d for d in deps if not d.startswith(("triton", "xgrammar"))]
    assert listed("/tmp/no-deps.txt") == [d for d in deps if d.startswith("xgrammar")]
    assert "pip install -r /tmp/requirements.txt" in runs and "pip install --no-deps /src" in runs
    assert "pip install --no-deps -r /tmp/no-deps.txt" in runs


def test_readme_documents_the_commands():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Deployment with docker compose"):]
    for text in ("docker compose -f compose/compose.yaml --profile gpu up",
                 "docker compose -f compose/compose.yaml -f compose/compose.cpu.yaml --profile cpu up",
                 "MODEL_DIR=", "SPECDEC_MODEL=/models/model", "DRAFTER=ngram", "--scale drafter=0",
                 "--scale gateway="):
        assert text in section, text


# ---- the compose commands as local processes -----------------------------------------------------------------------


def localize(command: list[str], ports: dict[int, int]) -> list[str]:
    """A container command for this machine: service hosts and 0.0.0.0 -> 127.0.0.1, container ports -> free
    local ports, `specdec` -> this interpreter's console script."""
    out, prev = [], None
    for arg in command:
        new = arg
        if prev == "--host" and arg == "0.0.0.0":
            new = "127.0.0.1"
        elif prev in ("--port", "--http-port"):
            new = str(ports[int(arg)])
        elif m := re.fullmatch(r"(gateway|verifier|drafter|127\.0\.0\.1):(\d+)", arg):
            new = f"127.0.0.1:{ports[int(m.group(2))]}"
        out.append(new)
        prev = arg
    if out and out[0] == "specdec":
        script = Path(sys.executable).parent / "specdec"
        out[:1] = [str(script)] if script.is_file() else [sys.executable, "-m", "specdec"]
    return out


class LocalCompose:
    """The services of one compose variant as local processes (what `docker compose up` would start)."""

    # what is not in the gateway image (compose/Dockerfile.gateway): importing any of it fails in its process
    NOT_IN_GATEWAY_IMAGE = ("torch", "triton", "transformers", "safetensors", "numpy", "grpc_tools")

    def __init__(self, variant_name: str, env: dict, log_dir: Path):
        self.variant_name, self.env, self.log_dir = variant_name, env, log_dir
        model = variant(variant_name)
        self.services = model["services"]
        self.ports = {int(flag(s["command"], option)): free_port() for s in self.services.values()
                      for option in ("--port", "--http-port") if option in s["command"]}
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.blocked = log_dir / "not-in-gateway-image"
        for module in self.NOT_IN_GATEWAY_IMAGE:
            (self.blocked / module).mkdir(parents=True, exist_ok=True)
            (self.blocked / module / "__init__.py").write_text(
                f"raise ImportError('{module} is not in the gateway image')\n")

    def resolved(self, name: str, env: dict) -> dict:
        return interpolate(self.services[name], env)

    def port(self, name: str) -> int:
        return self.ports[int(flag(self.services[name]["command"], "--port"))]

    def start(self, name: str, **overrides) -> None:
        env = {**self.env, **overrides}
        service = self.resolved(name, env)
        proc_env = {**os.environ, **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
        if name == "gateway":
            proc_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.blocked),
                                                                   proc_env.get("PYTHONPATH")]))
        log = self.log_dir / f"{name}-{len(list(self.log_dir.glob(name + '-*.log')))}.log"
        self.logs[name] = log
        with open(log, "w") as out:
            self.procs[name] = subprocess.Popen(localize(service["command"], self.ports), stdout=out,
                                                stderr=subprocess.STDOUT, env=proc_env, start_new_session=True)

    def stop(self, name: str, timeout: float = 20.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)                  # what `docker compose stop` sends
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)

    def tail(self) -> str:
        return "\n".join(f"--- {n} ---\n" + p.read_text()[-3000:] for n, p in self.logs.items() if p.exists())

    def healthy(self, name: str) -> bool:
        test = self.resolved(name, self.env)["healthcheck"]["test"]
        assert test[0] == "CMD"
        return subprocess.run(localize(test[1:], self.ports), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=30).returncode == 0

    def wait_healthy(self, name: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy(name):
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited ({proc.returncode})\n{self.tail()}"
            assert time.monotonic() < deadline, f"{name} not healthy after {timeout:.0f}s\n{self.tail()}"
            time.sleep(0.3)

    def up(self) -> None:
        """Start in dependency order (depends_on, ipc/pid: service:X), waiting where compose waits."""
        started: list[str] = []

        def deps(name):
            service = self.services[name]
            out = {d: c.get("condition", "service_started") for d, c in
                   _as_mapping(service.get("depends_on"), {}).items()}
            for key in ("ipc", "pid", "network_mode"):
                if str(service.get(key, "")).startswith("service:"):
                    out.setdefault(service[key].split(":", 1)[1], "service_started")
            return out

        def visit(name, seen=()):
            assert name not in seen, f"dependency cycle at {name}"
            if name in started:
                return
            for dep, condition in deps(name).items():
                visit(dep, (*seen, name))
                if condition == "service_healthy":
                    self.wait_healthy(dep)
            self.start(name)
            started.append(name)
        for name in self.services:
            visit(name)
        for name in self.services:
            self.wait_healthy(name)


PROMPT = [5, 17, 3, 99, 42, 64, 8, 100]


def generate(address: str) -> list[int]:
    import grpc

    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        replies = list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt_token_ids=PROMPT, sampling=gateway_pb2.SamplingParams(max_tokens=16, ignore_eos=True)),
            timeout=60))
    assert replies[-1].finish_reason == "length"
    return [t for r in replies for t in r.token_ids]


def info(address: str):
    import grpc

    from specdec.rpc.v1 import gateway_pb2, gateway_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).Info(gateway_pb2.InfoRequest(), timeout=10)


def verifier_stats(address: str):
    import grpc

    from specdec.rpc.v1 import verifier_pb2, verifier_pb2_grpc
    with grpc.insecure_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Stats(verifier_pb2.StatsRequest(), timeout=10)


def wait_for(predicate, what: str, stack: LocalCompose, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout:.0f}s\n{stack.tail()}"
        time.sleep(0.3)


def smoke_client():
    """compose/smoke_client.py (compose/ is no package), imported from its file."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("smoke_client", COMPOSE / "smoke_client.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(180)
def test_compose_commands_serve_and_swap_the_drafter(tmp_path):
    """The CPU variant's exact commands, env and health checks as local processes; the README's drafter swap."""
    from specdec_tools.tiny import make_tiny
    model_dir = make_tiny(tmp_path / "model", overrides={"vocab_size": 400}, tokenizer=True, progress=False)
    env = {**COMPOSE_ENV, "SPECDEC_MODEL": str(model_dir)}
    stack = LocalCompose("cpu", env, tmp_path)
    try:
        stack.up()
        gateway = f"127.0.0.1:{stack.port('gateway')}"
        verifier = f"127.0.0.1:{stack.port('verifier')}"
        wait_for(lambda: info(gateway).drafter_kind == "mtp", "mtp drafter connected", stack)
        first = info(gateway)
        assert first.num_draft_tokens == 3 and first.has_tokenizer and first.vocab_size == 400
        with_mtp = generate(gateway)
        assert len(with_mtp) == 16
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.ports[8000]}/health", timeout=10) as answer:
            assert answer.status == 200                 # the published HTTP port serves the OpenAI API
        stats = verifier_stats(verifier)
        assert stats.transport == "shm" and stats.draft_tokens > 0, stats   # the CPU variant's transport
        # the drafter on the verifier's loopback: steps take its local lane (what compose/smoke.sh checks in Docker)
        assert "mtp connected at 127.0.0.1" in stack.logs["verifier"].read_text()
        assert "steps over the local lane" in stack.logs["verifier"].read_text()
        assert "device steps" in stack.logs["verifier"].read_text()   # overlapped steps through shared memory
        client = smoke_client()                       # compose/smoke.sh's checks fail when they should
        assert client.main(["generate", gateway, "def f():", "--max-tokens", "8", "--drafts", "required"]) == 0
        assert client.main(["generate", gateway, "def f():", "--max-tokens", "8", "--drafts", "none"]) == 1

        # DRAFTER=none: the drafter scaled to 0; the verifier decodes without drafts, same output
        stack.stop("drafter")
        wait_for(lambda: not verifier_stats(verifier).drafter_connected, "drafter gone", stack)
        assert info(gateway).drafter_kind == "none"                   # what compose/smoke.sh waits for
        assert client.main(["wait-drafter", gateway, "none", "--timeout", "5"]) == 0
        assert client.main(["wait-drafter", gateway, "mtp", "--timeout", "1"]) == 1
        assert client.main(["generate", gateway, "def f():", "--max-tokens", "8", "--drafts", "none"]) == 0
        assert client.main(["generate", gateway, "def f():", "--max-tokens", "8", "--drafts", "required"]) == 1
        assert generate(gateway) == with_mtp

        # DRAFTER=ngram docker compose ... up -d drafter: only the drafter restarts, the verifier re-handshakes
        verifier_pid = stack.procs["verifier"].pid
        stack.start("drafter", DRAFTER="ngram")
        stack.wait_healthy("drafter")
        wait_for(lambda: info(gateway).drafter_kind == "ngram", "ngram drafter connected", stack)
        assert generate(gateway) == with_mtp                             # lossless whatever the drafter
        assert stack.procs["verifier"].pid == verifier_pid and stack.procs["verifier"].poll() is None
        assert verifier_stats(verifier).drafter_kind == "ngram"
    finally:
        stack.stop_all()
