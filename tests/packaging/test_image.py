"""The container image's recipe: the Dockerfile, .dockerignore and docker/, checked where CI can check them.

No image is built here (CI has no registry and no container runtime; docs/container.md says how one was
built and run with podman). What cannot drift silently is checked instead: the entrypoint and every
`docker run` the docs show parse with kvgate's own argument parsers; checkov passes with only the skips that
the Dockerfile justifies; the final stage runs as a numeric non-root user, installs no build tools and gets
nothing but the venv built from the wheel; every TARGET is handled; versions agree with their one source.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

import kvgate
from kvgate import cli
from tests.services import checkov_command

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "container.md"
BUILD_SCRIPT = REPO / "docker" / "build-image.sh"
TARGETS = {"gateway", "cpu", "cuda"}
# Skips the Dockerfile justifies in place (`# checkov:skip=ID: reason`); any other finding fails.
JUSTIFIED_SKIPS = {"CKV_DOCKER_2", "CKV_DOCKER_7"}
# Packages that compile or build things: none may be installed by the final stage or the stage it is built on.
BUILD_TOOLS = re.compile(r"^(build-essential|gcc(-\d+)?|g\+\+(-\d+)?|cpp|clang.*|make|cmake|ninja-build|autoconf"
                         r"|automake|libtool|pkg-config|git|python3-pip|python3-venv|python3-setuptools|.+-dev)$")


@dataclass
class Stage:
    name: str
    base: str  # another stage's name, or an image reference
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)

    def values(self, instruction: str) -> list[str]:
        return [value for name, value in self.instructions if name == instruction]


def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE), cache_content=True)


def stages() -> list[Stage]:
    result: list[Stage] = []
    for item in dockerfile().structure:
        if item["instruction"] == "FROM":
            base, _, name = item["value"].partition(" AS ")
            result.append(Stage(name=name.strip(), base=base.strip()))
        elif result and item["instruction"] != "COMMENT":
            result[-1].instructions.append((item["instruction"], item["value"]))
    return result


def stage(name: str) -> Stage:
    return next(s for s in stages() if s.name == name)


def final_stage_lineage() -> list[Stage]:
    """The final stage and every stage it is FROM, down to the base image: what ends up in the image."""
    by_name = {s.name: s for s in stages()}
    lineage = [stages()[-1]]
    while lineage[-1].base in by_name:
        lineage.append(by_name[lineage[-1].base])
    return lineage


def exec_form(stage_: Stage, instruction: str) -> list[str]:
    [value] = stage_.values(instruction)[-1:]
    parsed = json.loads(value)  # the exec form: a JSON array, so no shell sits between kvgate and its signals
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), f"{instruction} {value}"
    return parsed


def arg_defaults(stage_: Stage) -> dict[str, str]:
    return dict(v.split("=", 1) for v in stage_.values("ARG") if "=" in v)


def global_arg_default(name: str) -> str:
    for item in dockerfile().structure:
        if item["instruction"] == "FROM":
            break
        if item["instruction"] == "ARG" and item["value"].startswith(name + "="):
            return item["value"].split("=", 1)[1]
    raise AssertionError(f"no global ARG {name}=... before the first FROM")


def apt_packages(run: str) -> list[str]:
    """The packages each `apt-get install` of a RUN installs (options and shell syntax dropped)."""
    packages = []
    for command in re.split(r"&&|;|\|\|", run):
        words = shlex.split(command)
        if words[:2] == ["apt-get", "install"]:
            packages += [w for w in words[2:] if not w.startswith("-")]
    return packages


# ------------------------------------------------------------------------------ arguments vs the real parsers


def parse_kvgate_argv(argv: list[str]) -> None:
    """Parse argv as `kvgate` would, down into the forwarded subcommand's own parser; usage errors raise
    SystemExit(2), which fails the test that calls this."""
    args, rest = cli.build_parser().parse_known_args(argv)
    if args.command in cli.FORWARDED:
        module = importlib.import_module(cli.FORWARDED[args.command][0])
        sub_parser = module.build_parser()
        sub_args = sub_parser.parse_args(rest)
        if args.command == "engine":  # the engine also refuses bad combinations before it loads anything
            module.engine_config(sub_args, sub_parser)
    else:
        assert not rest, f"kvgate {args.command} does not take {rest}"


def documented_runs() -> list[tuple[str, list[str]]]:
    """Every `docker run` / `podman run` in docs/container.md's code blocks: (the line, kvgate's argv)."""
    text = DOCS.read_text()
    runs = []
    for block in re.findall(r"```(?:sh|bash|console)?\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if len(words) < 3 or words[0] not in ("docker", "podman") or "run" not in words:
                continue
            images = [i for i, w in enumerate(words) if re.fullmatch(r"([\w.-]+/)*kvgate:[\w.+-]+", w)]
            assert images, f"docs/container.md: `{line.strip()}` runs no kvgate:TAG image the test can find"
            image = images[0]
            entrypoint = words[words.index("--entrypoint") + 1] if "--entrypoint" in words else "kvgate"
            if entrypoint == "kvgate":
                runs.append((line.strip(), words[image + 1:]))
    return runs


def test_entrypoint_is_kvgate_in_exec_form_and_the_default_cmd_is_its_help() -> None:
    final = stages()[-1]
    assert exec_form(final, "ENTRYPOINT") == ["kvgate"]
    cmd = exec_form(final, "CMD")
    with pytest.raises(SystemExit) as exited:  # `--help` prints the usage and exits 0
        parse_kvgate_argv(cmd)
    assert exited.value.code == 0


def test_every_documented_docker_run_parses_with_the_real_kvgate_parsers() -> None:
    runs = documented_runs()
    commands = {argv[0] for _, argv in runs if argv and not argv[0].startswith("-")}
    assert {"router", "autoscaler", "engine", "registry"} <= commands, f"docs/container.md runs only {commands}"
    for line, argv in runs:
        try:
            parse_kvgate_argv(argv)
        except SystemExit as exited:
            assert exited.code == 0, f"docs/container.md: `{line}` does not parse: kvgate {' '.join(argv)}"


def test_every_documented_server_listens_beyond_the_container_loopback() -> None:
    """A server left on its default 127.0.0.1 inside a container cannot be reached through a published port."""
    for line, argv in documented_runs():
        if argv and argv[0] in ("router", "engine", "up") and "--help" not in argv:
            assert "--host" in argv and argv[argv.index("--host") + 1] == "0.0.0.0", line


def test_exposed_ports_are_the_servers_default_ports() -> None:
    exposed = {int(p) for value in stages()[-1].values("EXPOSE") for p in value.split()}
    router = importlib.import_module("kvgate.router.main").build_parser().parse_args(["--registry", "r"])
    engine = importlib.import_module("kvgate.engine.server.main").build_parser().parse_args(["--model", "m"])
    assert {router.port, engine.port} <= exposed


# ------------------------------------------------------------------------------------------------ checkov


def test_checkov_passes_the_dockerfile_with_only_the_justified_skips() -> None:
    # --skip-download: no call to Prisma Cloud for guidelines (this CI has no route there, and needs none).
    result = subprocess.run([*checkov_command(), "--file", str(DOCKERFILE), "--framework",
                             "dockerfile", "--skip-download", "--output", "json"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    report = json.loads(result.stdout)
    summary = report["summary"]
    failed = [f"{c['check_id']} {c['check_name']} (lines {c['file_line_range']})"
              for c in report["results"]["failed_checks"]]
    assert summary["failed"] == 0 and result.returncode == 0, f"checkov findings: {failed}"
    assert summary["parsing_errors"] == 0 and summary["passed"] > 50, summary  # it did scan something
    skipped = {c["check_id"]: c["check_result"].get("suppress_comment") or ""
               for c in report["results"]["skipped_checks"]}
    assert set(skipped) == JUSTIFIED_SKIPS, skipped
    assert all(len(reason.strip()) > 20 for reason in skipped.values()), f"a skip without its reason: {skipped}"


def test_the_base_image_default_is_a_release_tag_not_latest() -> None:
    """What the CKV_DOCKER_7 skip relies on: checkov cannot see through ARG BASE_IMAGE, so this test does."""
    base = global_arg_default("BASE_IMAGE")
    name, _, tag = base.partition("@")[0].rpartition(":")
    assert name and tag and tag != "latest", base


# ------------------------------------------------------------------------------------- the final stage


def test_the_final_stage_runs_as_a_numeric_non_root_user() -> None:
    final = stages()[-1]
    user = final.values("USER")[-1]
    uid, _, gid = user.partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading the image's /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and (not gid or (gid.isdigit() and int(gid) != 0)), user
    last_user = max(i for i, (name, _) in enumerate(final.instructions) if name == "USER")
    assert not [v for name, v in final.instructions[last_user:] if name == "RUN"], "a RUN after USER runs as kvgate"


def test_nothing_that_builds_software_is_installed_in_the_final_image() -> None:
    lineage = final_stage_lineage()
    installed = [p for s in lineage for run in s.values("RUN") for p in apt_packages(run)]
    assert "python3" in installed  # the parse found the install at all
    assert not [p for p in installed if BUILD_TOOLS.match(p)], installed
    assert not [run for s in lineage for run in s.values("RUN") if re.search(r"\bpip\b", run)], \
        "pip runs only in the builder"


def test_the_final_stage_gets_only_the_venv_from_the_builder() -> None:
    copies = stages()[-1].values("COPY")
    assert copies == ["--from=builder /opt/kvgate /opt/kvgate"], copies  # no source tree, no wheel cache
    assert not stages()[-1].values("ADD")


def test_the_builder_installs_the_wheel_it_built_never_the_source_tree() -> None:
    [install] = [run for run in stage("builder").values("RUN") if "pip wheel" in run]
    assert "$pip wheel --no-deps --wheel-dir /wheels /src" in install
    installs = re.findall(r"\$pip install ([^;]+)", install)
    # torch first (from the target's index), then the wheel with its extras: nothing else, no `.`, no -e.
    assert [i for i in installs if '"torch==${TORCH_VERSION}"' not in i] == ['"${wheel}${extras}"'], installs
    assert not [i for i in installs if "/src" in i or re.search(r"(^|\s)(\.|-e|--editable)(\s|$)", i)], installs
    assert 'wheel="/wheels/kvgate-${VERSION}-py3-none-any.whl"' in install


def test_every_target_is_handled_and_an_unknown_one_is_refused() -> None:
    builder_runs = stage("builder").values("RUN")
    cases = [run for run in builder_runs if 'case "${TARGET}" in' in run]
    assert len(cases) == 2, cases  # the early refusal, and the install
    guard, install = cases
    assert re.search(r"\bgateway\|cpu\|cuda\)", guard) and "*) echo" in guard and "exit 1" in guard
    branches = set(re.findall(r"(?:in|;;)\s+(\w+)\)", install))
    assert branches == TARGETS, branches
    assert arg_defaults(stage("builder"))["TARGET"] in TARGETS
    assert arg_defaults(stage("builder"))["TARGET"] == arg_defaults(stages()[-1])["TARGET"]


def test_version_and_torch_defaults_agree_with_their_one_source() -> None:
    for name in ("builder", stages()[-1].name):
        assert arg_defaults(stage(name))["VERSION"] == kvgate.__version__, name
    makefile = (REPO / "Makefile").read_text()
    [torch_spec] = re.findall(r"^TORCH_SPEC := torch==(\S+)$", makefile, flags=re.M)
    assert arg_defaults(stage("builder"))["TORCH_VERSION"] == torch_spec


def test_the_image_is_labelled_with_its_version() -> None:
    labels = dockerfile().labels  # as a build with the default arguments sets them
    assert labels["org.opencontainers.image.version"] == kvgate.__version__
    assert labels["org.opencontainers.image.title"] == "kvgate"
    assert labels["org.opencontainers.image.licenses"] == tomllib.loads((REPO / "pyproject.toml").read_text())[
        "project"]["license"]


# ------------------------------------------------------------------------------------------ .dockerignore


def dockerignore_excludes(path: str) -> bool:
    """Whether .dockerignore keeps `path` (relative, with /) out of the build context: Docker's rules (a
    pattern matches the path or a folder above it; `*` stays within one folder, `**` spans any number; the
    last matching line wins; `!` lets back in)."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = "".join("(.*/)?" if token == "**/" else ".*" if token == "**" else "[^/]*" if token == "*"
                        else "[^/]" if token == "?" else re.escape(token)
                        for token in re.findall(r"\*\*/|\*\*|\*|\?|[^*?]+", pattern))
        if any(re.fullmatch(regex, prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def test_dockerignore_sends_what_the_wheel_is_built_from_and_nothing_else() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    needed = ["pyproject.toml", pyproject["project"]["readme"], "docker/check_target.py",
              *(f"{folder}/__init__.py" for folder in package_dirs), "router/dashboard_page.html"]
    assert [p for p in needed if (REPO / p).exists()] == needed, "a file the test expects is gone"
    assert not [p for p in needed if dockerignore_excludes(p)], [p for p in needed if dockerignore_excludes(p)]
    kept_out = [".venv/bin/python", ".git/config", "tests/conftest.py", "examples/registry/models.yaml",
                "kvgate.egg-info/PKG-INFO", "router/__pycache__/app.cpython-311.pyc", "docker/build-image.sh",
                ".kvgate-cache/smollm2-135m/model.safetensors", "helm/kvgate/values.yaml"]
    assert all(dockerignore_excludes(p) for p in kept_out), [p for p in kept_out if not dockerignore_excludes(p)]


def test_the_builder_runs_check_target_from_the_context() -> None:
    assert any("/src/docker/check_target.py" in run for run in stage("builder").values("RUN"))


# ---------------------------------------------------------------------------- docker/check_target.py


def check_target_module():
    spec = importlib.util.spec_from_file_location("check_target", REPO / "docker" / "check_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("target", "version", "cuda", "ok"), [
    ("gateway", None, None, True), ("gateway", "2.13.0+cpu", None, False),
    ("cpu", "2.13.0+cpu", None, True), ("cpu", "2.13.0", "13.0", False), ("cpu", None, None, False),
    ("cuda", "2.13.0", "13.0", True), ("cuda", "2.13.0+cpu", None, False), ("cuda", None, None, False),
    ("tpu", "2.13.0", None, False),
])
def test_check_target_accepts_only_the_torch_each_target_promises(target, version, cuda, ok) -> None:
    assert (check_target_module().problem(target, version, cuda) is None) == ok


def test_check_target_on_this_venv_which_has_the_cpu_torch() -> None:
    """The script as the builder runs it, on a real torch: `make test` installs the CPU build."""
    def run(target: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(REPO / "docker" / "check_target.py"), target],
                              capture_output=True, text=True, timeout=120)
    cpu, gateway = run("cpu"), run("gateway")
    assert cpu.returncode == 0 and "CUDA none" in cpu.stdout, cpu
    assert gateway.returncode == 1 and "the gateway target has none" in gateway.stderr, gateway


# ------------------------------------------------------------------------------- docker/build-image.sh


def build_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(BUILD_SCRIPT), *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", ["build-image.sh", "smoke-test.sh"])
def test_the_scripts_parse_as_bash(script) -> None:
    result = subprocess.run(["bash", "-n", str(REPO / "docker" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_build_script_refuses_bad_arguments_before_doing_anything() -> None:
    unknown = build_script("--target", "tpu")
    assert unknown.returncode == 1 and "--target must be gateway, cpu or cuda; got 'tpu'" in unknown.stderr
    assert "--torch-wheel" in build_script("--help").stdout


@pytest.mark.parametrize(("target", "wheel", "error"), [
    ("cpu", "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "needs a CPU build of torch"),
    ("cuda", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "needs a CUDA build of torch"),
    ("gateway", "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "the gateway target has no torch"),
])
def test_build_script_refuses_a_torch_wheel_of_the_wrong_build(tmp_path, target, wheel, error) -> None:
    (tmp_path / wheel).write_bytes(b"")
    result = build_script("--target", target, "--torch-wheel", str(tmp_path / wheel))
    assert result.returncode == 1 and error in result.stderr, result.stderr

