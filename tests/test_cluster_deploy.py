"""The Swarm deployment's pieces that need no swarm: the stack file as shipped (the gateway and
catalog services, and the file without the catalog for an operator's own PostgreSQL), the
catalog image's files agreeing with the constants the rest reads, the secrets' checks, the
launcher's reading of its own container, and `sandkernel cluster up` refusing bad input before
it changes anything (an engine that is not a Swarm manager, both catalog choices at once; the
catalog node and secret checks against a scripted swarm). The deployment itself runs in
tests/test_cluster_swarm.py, with the catalog service."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sandkernel.gateway.cluster import catalog_image
from sandkernel.gateway.cluster.catalog_image import CATALOG_IMAGE, CATALOG_PORT, POSTGRES_UID
from sandkernel.gateway.cluster.deploy import (
    CATALOG_LABEL,
    CATALOG_PARTS,
    CATALOG_PASSWORD_SECRET,
    CATALOG_SERVICE,
    CATALOG_URL_SECRET,
    SECRET_NAMES,
    STACK_SERVICE,
    TLS_SECRETS,
    DeployError,
    SecretSource,
    bring_up,
    catalog_secret_sources,
    find_catalog_node,
    stack_text,
)
from sandkernel.gateway.cluster.gateway_image import dockerfile_dir
from sandkernel.gateway.cluster.launcher import (
    REQUIRED_SECRETS,
    SECRET_SETTINGS,
    LaunchError,
    engine_cgroup_parent,
    own_container_id,
    read_secrets,
)

CONTAINER_ID = "0123456789abcdef" * 4


def test_the_stack_file_runs_one_launcher_per_node_with_its_secrets_readable_by_root_only():
    stack = yaml.safe_load(stack_text())
    service = stack["services"][STACK_SERVICE]
    assert service["deploy"]["mode"] == "global"
    assert service["command"][:2] == ["cluster", "launch"]
    assert service["deploy"]["update_config"]["order"] == "stop-first"  # two gateways never share a host id
    mounted = {s["target"]: s for s in service["secrets"]}
    # (the TLS ones come with `cluster up --tls-cert`, in an override: see the tests at the end)
    assert set(mounted) == set(SECRET_SETTINGS) - set(TLS_SECRETS.values())
    assert all(s["mode"] == 0o400 for s in mounted.values())  # the gateway refuses wider secret files
    assert {stack["secrets"][s["source"]]["name"] for s in mounted.values()} == set(SECRET_NAMES) - {
        CATALOG_PASSWORD_SECRET  # the catalog's alone
    } - set(TLS_SECRETS)
    assert "environment" not in service  # nothing secret in the environment
    assert service["volumes"] == [
        {"type": "bind", "source": "/var/run/docker.sock", "target": "/var/run/docker.sock"}
    ]  # the launcher holds the socket and nothing else of the host


def test_a_secret_file_readable_by_others_or_empty_is_refused(tmp_path: Path):
    loose = tmp_path / "catalog.url"
    loose.write_text("postgresql://u:p@db/x")
    loose.chmod(0o644)
    with pytest.raises(DeployError, match="chmod 600"):
        SecretSource("sandkernel_catalog_url", loose).read()
    empty = tmp_path / "tokens.json"
    empty.write_text("  \n")
    empty.chmod(0o600)
    with pytest.raises(DeployError, match="empty"):
        SecretSource("sandkernel_tokens", empty).read()
    with pytest.raises(DeployError, match="needs a file"):
        SecretSource("sandkernel_tokens", None).read()
    generated = SecretSource("sandkernel_cluster_secret", None, generate=True).read()
    assert len(generated) >= 32 and generated != SecretSource("sandkernel_cluster_secret", None, generate=True).read()


def test_the_launcher_refuses_to_start_without_the_required_secrets(tmp_path: Path):
    (tmp_path / "tokens").write_text("{}")
    with pytest.raises(LaunchError, match=", ".join(REQUIRED_SECRETS)):
        read_secrets(tmp_path)


def test_the_launcher_finds_its_container_from_the_files_docker_mounts_into_it():
    mountinfo = (
        "1 0 0:1 / / rw - overlay overlay rw\n"
        f"2 1 8:1 /var/lib/docker/containers/{CONTAINER_ID}/resolv.conf /etc/resolv.conf rw - ext4 /dev/sda1 rw\n"
        f"3 1 8:1 /var/lib/docker/containers/{CONTAINER_ID}/hostname /etc/hostname rw - ext4 /dev/sda1 rw\n"
    )
    assert own_container_id(mountinfo) == CONTAINER_ID
    assert own_container_id("1 0 0:1 / / rw - overlay overlay rw\n") is None  # not in a container
    assert own_container_id(f"2 1 8:1 /containers/{CONTAINER_ID[:12]}/hostname /etc/hostname rw\n") is None


def test_the_launcher_reads_the_engines_cgroup_parent_from_its_own_cgroup():
    v1 = f"12:pids:/sklab-h2/{CONTAINER_ID}\n4:cpu,cpuacct:/sklab-h2/{CONTAINER_ID}\n1:name=systemd:/\n"
    assert engine_cgroup_parent(v1, CONTAINER_ID) == "/sklab-h2"
    assert engine_cgroup_parent(f"4:cpu,cpuacct:/docker/{CONTAINER_ID}\n", CONTAINER_ID) == "/docker"
    assert engine_cgroup_parent("0::/\n", CONTAINER_ID) is None  # v2: a cgroup namespace of its own
    systemd = f"4:cpu,cpuacct:/system.slice/docker-{CONTAINER_ID}.scope\n"
    assert engine_cgroup_parent(systemd, CONTAINER_ID) is None
    assert engine_cgroup_parent(f"4:cpu:/a/../b/{CONTAINER_ID}\n", CONTAINER_ID) is None
    assert engine_cgroup_parent(v1, None) is None


@pytest.mark.docker
def test_cluster_up_on_an_engine_that_is_not_a_swarm_manager_says_what_to_do(tmp_path: Path):
    url = tmp_path / "catalog.url"
    url.write_text("postgresql://u:p@127.0.0.1/x")
    url.chmod(0o600)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("sandkernel")), "cluster", "up", "--catalog-url-file", str(url)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "not a Swarm manager" in result.stdout and "docker swarm init" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_the_catalog_service_is_one_postgresql_on_the_labelled_node_with_its_volume_and_a_host_mode_port():
    stack = yaml.safe_load(stack_text())
    service = stack["services"][CATALOG_SERVICE]
    assert service["image"] == "${SANDKERNEL_CATALOG_IMAGE:-" + CATALOG_IMAGE + "}"
    deploy = service["deploy"]
    assert (deploy["mode"], deploy["replicas"]) == ("replicated", 1)
    assert deploy["placement"]["constraints"] == [f"node.labels.{CATALOG_LABEL} == true"]
    assert deploy["update_config"]["order"] == "stop-first"  # two servers never share the data directory
    assert deploy["endpoint_mode"] == "dnsrr"  # no service VIP (IPVS)
    assert service["ports"] == [{"target": 5432, "published": CATALOG_PORT, "protocol": "tcp", "mode": "host"}]
    [volume] = service["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/var/lib/postgresql/data"
    assert volume["source"] in stack["volumes"]  # a named volume of the stack, not a bind mount
    [secret] = service["secrets"]
    assert stack["secrets"][secret["source"]] == {"external": True, "name": CATALOG_PASSWORD_SECRET}
    assert secret["mode"] == 0o400 and secret["uid"] == secret["gid"] == str(POSTGRES_UID)
    assert "environment" not in service and "command" not in service  # the password only as a file
    assert service["stop_signal"] == "SIGINT"  # fast shutdown: the gateways' pooled connections do not hold it


def test_the_catalog_image_files_say_what_the_constants_say():
    dockerfile = (dockerfile_dir() / catalog_image.DOCKERFILE).read_text()
    script = (dockerfile_dir() / catalog_image.START_SCRIPT).read_text()
    assert f"groupadd -r -g {POSTGRES_UID} postgres" in dockerfile
    assert f"useradd -r -g postgres -u {POSTGRES_UID} " in dockerfile
    assert "USER postgres:postgres" in dockerfile and "STOPSIGNAL SIGINT" in dockerfile
    assert f'"-U", "{catalog_image.CATALOG_USER}", "-d", "{catalog_image.CATALOG_DATABASE}"' in dockerfile
    assert f"USER_NAME={catalog_image.CATALOG_USER}\n" in script
    assert f"DATABASE={catalog_image.CATALOG_DATABASE}\n" in script
    assert f"-c port={CATALOG_PORT} " in script and "--auth=scram-sha-256" in script
    assert "--pwfile=" in script and "PASSWORD=" not in script  # the password is read from the file only
    assert (
        catalog_image.catalog_url("10.0.0.5", "ab12")
        == f"postgresql://sandkernel:ab12@10.0.0.5:{CATALOG_PORT}/sandkernel"
    )


def test_the_stack_without_the_catalog_is_the_same_file_less_the_catalog_service():
    full = yaml.safe_load(stack_text())
    bare = yaml.safe_load(stack_text(catalog=False))
    for section, key in CATALOG_PARTS:
        del full[section][key]
    full = {k: v for k, v in full.items() if v}  # the section left empty (volumes) goes
    assert bare == full and "volumes" not in bare
    assert "catalog_url" in bare["secrets"] and list(bare["services"]) == [STACK_SERVICE]
    assert stack_text(catalog=False).startswith("# sandkernel on Docker Swarm")  # comments kept


class ScriptedNode:
    """What docker-py's Node exposes that deploy.py reads (id, attrs) and changes (update)."""

    def __init__(self, node_id: str, name: str, addr: str, *, state: str = "ready", labels: dict | None = None,
                 manager_addr: str | None = None) -> None:  # fmt: skip
        self.id = node_id
        self.attrs = {
            "Description": {"Hostname": name},
            "Status": {"State": state, "Addr": addr},
            "Spec": {"Availability": "active", "Role": "manager", "Labels": dict(labels or {})},
        }
        if manager_addr:
            self.attrs["ManagerStatus"] = {"Addr": manager_addr}
        self.updates: list[dict] = []

    def update(self, spec: dict) -> None:
        self.updates.append(spec)
        self.attrs["Spec"] = spec


class ScriptedSwarm:
    """A Swarm manager's answers, scripted: its nodes, the names of its secrets, what was created."""

    def __init__(self, nodes: list[ScriptedNode], secrets: tuple[str, ...] = ()) -> None:
        self.node_list = nodes
        self.secret_names = list(secrets)
        self.created: list[str] = []
        self.nodes = Nodes(self)
        self.secrets = Secrets(self)

    def info(self) -> dict:
        return {"Swarm": {"LocalNodeState": "active", "ControlAvailable": True}}


class Nodes:
    def __init__(self, swarm: ScriptedSwarm) -> None:
        self.swarm = swarm

    def list(self) -> list[ScriptedNode]:
        return self.swarm.node_list

    def get(self, node_id: str) -> ScriptedNode:
        return next(n for n in self.swarm.node_list if n.id == node_id)


class Secrets:
    def __init__(self, swarm: ScriptedSwarm) -> None:
        self.swarm = swarm

    def list(self) -> list:
        return [type("Secret", (), {"name": n})() for n in self.swarm.secret_names]

    def create(self, name: str, data: bytes, labels: dict) -> None:
        self.swarm.created.append(name)
        self.swarm.secret_names.append(name)


def scripted(nodes: list[ScriptedNode], secrets: tuple[str, ...] = ()) -> ScriptedSwarm:
    return ScriptedSwarm(nodes, secrets)


def three_nodes(addr: str = "10.1.0.1", **first: object) -> list[ScriptedNode]:
    return [ScriptedNode("a1" * 12, "node-1", addr, **first),  # type: ignore[arg-type]
            ScriptedNode("b2" * 12, "node-2", "10.1.0.2"), ScriptedNode("c3" * 12, "node-3", "10.1.0.3")]  # fmt: skip


def test_the_catalog_node_must_be_one_ready_node_and_the_only_labelled_one():
    with pytest.raises(DeployError, match=r"no node of this swarm matches \(its nodes: node-1, node-2, node-3\)"):
        find_catalog_node(scripted(three_nodes()), "node-9")
    with pytest.raises(DeployError, match="node node-1 is down/active: the catalog needs a ready, active node"):
        find_catalog_node(scripted(three_nodes(state="down")), "node-1")
    nodes = three_nodes()
    nodes[2].attrs["Spec"]["Labels"][CATALOG_LABEL] = "true"
    with pytest.raises(DeployError, match=r"node node-3 already has the label sandkernel.catalog=true.*volume"):
        find_catalog_node(scripted(nodes), "node-1")
    found = find_catalog_node(scripted(three_nodes()), "b2b2")  # an id prefix names a node too
    assert (found.name, found.address, found.labelled) == ("node-2", "10.1.0.2", False)
    manager = find_catalog_node(scripted(three_nodes(addr="0.0.0.0", manager_addr="10.1.0.9:2377")), "node-1")
    assert manager.address == "10.1.0.9"  # a manager reporting no address: its manager address


def test_the_catalog_secrets_are_made_together_or_kept_together():
    swarm = scripted(three_nodes())
    node = find_catalog_node(swarm, "node-1")
    password, url = (s.read() for s in catalog_secret_sources(swarm, node))
    assert url == f"postgresql://sandkernel:{password.decode()}@10.1.0.1:5432/sandkernel".encode()
    assert len(password) == 48 and password.isalnum()  # hex: nothing to quote in the URL
    with pytest.raises(DeployError, match=f"{CATALOG_PASSWORD_SECRET} exists but {CATALOG_URL_SECRET} does not"):
        catalog_secret_sources(scripted(three_nodes(), (CATALOG_PASSWORD_SECRET,)), node)
    with pytest.raises(DeployError, match=f"{CATALOG_URL_SECRET} exists .* leave out --catalog-node"):
        catalog_secret_sources(scripted(three_nodes(), (CATALOG_URL_SECRET,)), node)


def test_cluster_up_with_a_catalog_node_checks_everything_before_it_labels_the_node(tmp_path: Path):
    swarm = scripted(three_nodes())
    with pytest.raises(DeployError, match=r"sandkernel_tokens .* needs a file"):
        bring_up(stack_name="sk", catalog_url_file=None, tokens_file=None, cluster_secret_file=None,
                 catalog_node="node-1", client=swarm, progress=lambda _: None)  # type: ignore[arg-type]  # fmt: skip
    assert swarm.node_list[0].updates == [] and swarm.created == []  # nothing changed
    with pytest.raises(DeployError, match="give one of them"):
        bring_up(stack_name="sk", catalog_url_file=tmp_path / "url", tokens_file=None, cluster_secret_file=None,
                 catalog_node="node-1", client=swarm)  # type: ignore[arg-type]  # fmt: skip
    with pytest.raises(DeployError, match="needs a node's name"):
        bring_up(stack_name="sk", catalog_url_file=None, tokens_file=None, cluster_secret_file=None,
                 catalog_node=" ", client=swarm)  # type: ignore[arg-type]  # fmt: skip


def test_cluster_up_refuses_both_catalog_choices_at_once(tmp_path: Path):
    url = tmp_path / "catalog.url"
    url.write_text("postgresql://u:p@127.0.0.1/x")
    url.chmod(0o600)
    result = subprocess.run(
        [str(Path(sys.executable).with_name("sandkernel")), "cluster", "up", "--catalog-url-file", str(url),
         "--catalog-node", "node-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "--catalog-node runs the stack's own PostgreSQL" in result.stdout and "give one of them" in result.stdout


def test_the_launcher_takes_the_tls_secrets_together_or_not_at_all(tmp_path: Path):
    for name in ("catalog_url", "cluster_secret", "tls_cert"):
        (tmp_path / name).write_text("x")
    with pytest.raises(LaunchError, match="tls_cert and tls_key come together"):
        read_secrets(tmp_path)
    (tmp_path / "tls_key").write_text("k")
    (tmp_path / "cluster_ca").write_text("ca")
    assert set(read_secrets(tmp_path)) == {"catalog_url", "cluster_secret", "tls_cert", "tls_key", "cluster_ca"}


def test_cluster_up_with_tls_gives_the_gateway_service_the_three_secrets_root_only(tmp_path: Path):
    from sandkernel.gateway.cluster.deploy import TlsFiles, tls_override

    override = tls_override(TlsFiles(tmp_path / "c.pem", tmp_path / "k.pem", tmp_path / "ca.pem"))
    secrets = override["services"]["gateway"]["secrets"]
    assert [(s["source"], s["target"], s["mode"]) for s in secrets] == [
        ("tls_cert", "tls_cert", 0o400), ("tls_key", "tls_key", 0o400), ("cluster_ca", "cluster_ca", 0o400)
    ]  # fmt: skip
    assert override["secrets"]["tls_key"] == {"external": True, "name": "sandkernel_tls_key"}
    assert "cluster_ca" not in tls_override(TlsFiles(tmp_path / "c.pem", tmp_path / "k.pem"))["secrets"]


def test_cluster_up_checks_the_certificate_before_anything_is_deployed(tmp_path: Path):
    from .certificates import make_certificates

    good, other = make_certificates(tmp_path / "good"), make_certificates(tmp_path / "other")
    for path in (good.cert, good.ca, other.key):
        path.chmod(0o600)
    sandkernel = str(Path(sys.executable).with_name("sandkernel"))
    for flags, said in (
        (["--tls-cert", str(good.cert)], "needs both --tls-cert and --tls-key"),
        (["--cluster-ca", str(good.ca)], "--cluster-ca goes with --tls-cert"),
        (["--tls-cert", str(good.cert), "--tls-key", str(other.key)], "cannot be used"),  # another's key
    ):
        result = subprocess.run([sandkernel, "cluster", "up", *flags], capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and said in result.stdout, (flags, result.stdout, result.stderr)
        assert "Traceback" not in result.stdout + result.stderr
    good.cert.chmod(0o644)  # a usable pair, but a file others can read is refused like any secret's
    result = subprocess.run(
        [sandkernel, "cluster", "up", "--tls-cert", str(good.cert), "--tls-key", str(good.key)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "readable by others; chmod 600" in result.stdout, result.stdout
