"""The docker deployment: compose file, instance config and Dockerfiles agree with each other.

The YAML-level tests always run. ``docker compose config`` (or the older
``docker-compose config``) validates the compose file with Docker's own parser
where a compose client is installed; no Docker daemon is needed for that.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import require_service
from dagster._core.instance.config import dagster_instance_config

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
SERVICES = {"postgres", "user_code", "webserver", "daemon"}
REQUIRED_ENV = {"DAGSTER_PG_PASSWORD", "DPFLOW_RECORDINGS_DIR", "DPFLOW_SSH_DIR"}


def _load(name: str) -> dict:
    return yaml.safe_load((DOCKER / name).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("docker-compose.yml")


@pytest.fixture(scope="module")
def instance_yaml() -> dict:
    return _load("dagster.yaml")


def _mounts(service: dict) -> dict[str, tuple[str, str]]:
    """container path -> (source, mode) of a service's short-syntax volumes."""
    out = {}
    for spec in service.get("volumes", []):
        parts = spec.split(":")
        out[parts[1]] = (parts[0], parts[2] if len(parts) > 2 else "rw")
    return out


def _interpolated_name(value: str) -> str | None:
    """``VAR`` of a ``${VAR...}`` value, else None."""
    m = re.fullmatch(r"\$\{([A-Z0-9_]+)(?::?[-?][^}]*)?\}", str(value))
    return m.group(1) if m else None


def test_services_and_healthchecks(compose):
    services = compose["services"]
    assert set(services) == SERVICES
    pg_test = " ".join(services["postgres"]["healthcheck"]["test"])
    assert "pg_isready" in pg_test
    assert services["user_code"]["healthcheck"]["test"][1:4] == ["dagster", "api", "grpc-health-check"]
    for name in ("user_code", "webserver", "daemon"):
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy", name
    for name in ("webserver", "daemon"):
        assert services[name]["depends_on"]["user_code"]["condition"] == "service_healthy", name
    assert services["webserver"]["entrypoint"][0] == "dagster-webserver"
    assert services["daemon"]["entrypoint"][:2] == ["dagster-daemon", "run"]
    # the UI is published on loopback only
    assert all(p.startswith("127.0.0.1:") for p in services["webserver"]["ports"])
    networks = set(compose["networks"])
    for name, service in services.items():
        assert set(service["networks"]) <= networks, name


def test_postgres_settings_are_one_set_of_variables(compose, instance_yaml):
    services = compose["services"]
    pg_env = services["postgres"]["environment"]
    db = instance_yaml["storage"]["postgres"]["postgres_db"]
    storage_vars = {key: db[key]["env"] for key in ("hostname", "port", "username", "password", "db_name")}
    for name in ("user_code", "webserver", "daemon"):
        env = services[name]["environment"]
        assert set(storage_vars.values()) <= set(env), name
        assert env[storage_vars["hostname"]] in (services["postgres"]["container_name"], "postgres")
        assert env[storage_vars["port"]] == "5432"
        # the same compose variables feed the server and its clients
        assert _interpolated_name(env[storage_vars["username"]]) == _interpolated_name(pg_env["POSTGRES_USER"])
        assert _interpolated_name(env[storage_vars["password"]]) == _interpolated_name(pg_env["POSTGRES_PASSWORD"])
        assert _interpolated_name(env[storage_vars["db_name"]]) == _interpolated_name(pg_env["POSTGRES_DB"])
    # the password is required from the environment, never a literal
    assert re.fullmatch(r"\$\{DAGSTER_PG_PASSWORD:\?[^}]+\}", pg_env["POSTGRES_PASSWORD"])


def test_recordings_and_ssh_key_mounted_read_only_everywhere(compose, instance_yaml):
    services = compose["services"]
    launcher = instance_yaml["run_launcher"]["config"]
    run_mounts = _mounts({"volumes": launcher["container_kwargs"]["volumes"]})
    code_mounts = _mounts(services["user_code"])
    assert code_mounts == run_mounts  # run containers see what the code server sees
    env = services["user_code"]["environment"]
    recordings = env["DPFLOW_RECORDINGS_ROOT"]
    ssh_key = env["DPFLOW_SERVER_KEY"].split(":-", 1)[-1].rstrip("}")
    ssh_dir = str(Path(ssh_key).parent)
    assert code_mounts[recordings][1] == "ro"
    assert code_mounts[ssh_dir][1] == "ro"
    assert code_mounts[env["DPFLOW_WORKDIR"]][1] == "rw"
    declared = compose["volumes"]
    for source, _mode in run_mounts.values():
        # named volumes with a fixed name, so containers the daemon starts find them
        assert declared[source]["name"] == source
    for vol in (code_mounts[recordings][0], code_mounts[ssh_dir][0]):
        opts = declared[vol]["driver_opts"]
        assert opts["type"] == "none" and opts["o"].split(",") == ["bind", "ro"]
        assert _interpolated_name(opts["device"]) in REQUIRED_ENV
    for name in ("webserver", "daemon"):
        assert _mounts(services[name])["/var/run/docker.sock"][0] == "/var/run/docker.sock"


def test_run_launcher_matches_compose(compose, instance_yaml):
    services = compose["services"]
    launcher = instance_yaml["run_launcher"]
    assert (launcher["module"], launcher["class"]) == ("dagster_docker", "DockerRunLauncher")
    cfg = launcher["config"]
    assert compose["networks"][cfg["network"]]["name"] == cfg["network"]
    # DockerRunLauncher fails a launch when a forwarded variable is unset in the daemon
    daemon_env = services["daemon"]["environment"]
    missing = [v for v in cfg["env_vars"] if v not in daemon_env]
    assert missing == []
    # every run is launched in the user-code image
    assert services["user_code"]["environment"]["DAGSTER_CURRENT_IMAGE"] == services["user_code"]["image"]


def test_instance_yaml_is_valid_and_safe(instance_yaml, tmp_path):
    shutil.copy(DOCKER / "dagster.yaml", tmp_path / "dagster.yaml")
    config, _ = dagster_instance_config(str(tmp_path))
    assert config["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert config["run_monitoring"]["enabled"] is True
    assert config["run_monitoring"]["start_timeout_seconds"] > 0
    assert config["run_retries"]["enabled"] is True and config["run_retries"]["max_retries"] >= 1
    # a failed asset (a failed training run) is not relaunched by automation
    assert config["run_retries"]["retry_on_asset_or_op_failure"] is False
    assert config["concurrency"]["pools"]["default_limit"] == 1
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    text = (DOCKER / "dagster.yaml").read_text()
    assert "password:\n        env: DAGSTER_PG_PASSWORD" in text


def test_workspace_points_at_the_code_server(compose):
    workspace = _load("workspace.yaml")
    (entry,) = workspace["load_from"]
    grpc = entry["grpc_server"]
    assert grpc["host"] == compose["services"]["user_code"]["container_name"]
    cmd = re.search(r"^CMD (\[.*\])$", (DOCKER / "Dockerfile.user_code").read_text(), re.M).group(1)
    args = yaml.safe_load(cmd)
    assert args[:3] == ["dagster", "code-server", "start"]
    assert int(args[args.index("-p") + 1]) == grpc["port"]
    assert args[args.index("-m") + 1] == "dpflow_dagster.definitions"
    assert compose["services"]["user_code"]["healthcheck"]["test"][-1] == str(grpc["port"])


def test_dockerfiles_bake_in_no_secrets():
    for name in ("Dockerfile.user_code", "Dockerfile.dagster"):
        text = (DOCKER / name).read_text()
        for line in text.splitlines():
            if line.startswith(("ENV", "ARG")):
                assert not re.search(r"PASSWORD|SECRET|API_KEY|PASSPHRASE", line), line
            if line.startswith(("COPY", "ADD")):
                assert not re.search(r"\.ssh|id_(rsa|ed25519)|\.env\b", line), line
        assert "FROM python:3.11" in text
        ignore = [l for l in (DOCKER / f"{name}.dockerignore").read_text().splitlines() if l and not l.startswith("#")]
        assert ignore[0] == "**"  # deny by default: no .env, keys or .venv reach the build
    user_code = (DOCKER / "Dockerfile.user_code").read_text()
    assert re.search(r'pip install --index-url "\$\{TORCH_INDEX_URL\}" "torch==\$\{TORCH_VERSION\}"', user_code)
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in user_code
    assert (DOCKER / ".gitignore").read_text().split() == [".env"]


def _compose_client() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates(tmp_path):
    client = _compose_client()
    if client is None:
        require_service("docker compose", "neither `docker compose` nor `docker-compose` works on this machine")
    (tmp_path / "recordings").mkdir()
    (tmp_path / "ssh").mkdir()
    env_file = tmp_path / "empty.env"  # ignore a developer's docker/.env
    env_file.write_text("")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DAGSTER_PG_PASSWORD": "pw-from-env",
        "DPFLOW_RECORDINGS_DIR": str(tmp_path / "recordings"),
        "DPFLOW_SSH_DIR": str(tmp_path / "ssh"),
    }
    cmd = [*client, "--env-file", str(env_file), "-f", str(DOCKER / "docker-compose.yml"), "config"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert set(resolved["services"]) == SERVICES
    assert resolved["volumes"]["dpflow_recordings"]["driver_opts"]["device"] == str(tmp_path / "recordings")
    assert resolved["volumes"]["dpflow_ssh"]["driver_opts"]["device"] == str(tmp_path / "ssh")
    assert resolved["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pw-from-env"
    assert resolved["services"]["daemon"]["environment"]["DAGSTER_PG_PASSWORD"] == "pw-from-env"

    # without the password the file does not resolve, and says which variable is missing
    env.pop("DAGSTER_PG_PASSWORD")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "DAGSTER_PG_PASSWORD" in proc.stderr
