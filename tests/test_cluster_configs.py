"""The cluster definitions in cluster/: the AWS cluster-launcher YAML against Ray's own
schema and checks (what `ray up` runs before it touches AWS), and the KubeRay manifests'
structure: a head without GPUs, a GPU worker group, one shared volume at the same path on
every pod, and a RayJob entrypoint whose file and config exist and validate, with its
--set overrides, and write into that volume. No Ray starts."""

import copy
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from conftest import ROOT
from raytrain_platform.config import load_config

CLUSTER = ROOT / "cluster"
LAUNCHER = CLUSTER / "aws" / "cluster.yaml"
KUBERAY = CLUSTER / "kuberay"
SHARED = "/mnt/shared"  # where the shared volume is mounted on every node / pod
GPU = "nvidia.com/gpu"


def _ray_pin() -> str:
    """The Ray version dev and CI run (constraints-cpu.txt): the cluster must run the same."""
    (pin,) = re.findall(r"^ray==(\S+)", (ROOT / "constraints-cpu.txt").read_text(), re.MULTILINE)
    return pin


def _image_ray_version(image: str) -> str:
    """``rayproject/ray:2.60.0-py311-gpu`` -> ``2.60.0``."""
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)(-[\w.-]+)?", image)
    assert match, f"not one of Ray's images: {image}"
    return match.group(1)


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _launcher_checked(config: dict) -> dict:
    """What `ray up` does to a config before it talks to the cloud: fill in the provider's
    defaults, then validate against ray-schema.json and Ray's own consistency checks."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


# --- Ray cluster launcher (AWS) -------------------------------------------------------

def test_launcher_yaml_passes_rays_validation():
    config = _load(LAUNCHER)
    prepared = _launcher_checked(config)
    assert prepared["provider"]["type"] == "aws"

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert head["resources"].get("GPU", 0) == 0, "the head must not offer GPUs"
    assert not head["node_config"]["InstanceType"].startswith(("g", "p")), "a GPU instance as head"
    assert workers and all(t["resources"]["GPU"] >= 1 for t in workers.values())
    assert sum(t.get("min_workers", 0) for t in workers.values()) <= config["max_workers"]

    assert _image_ray_version(config["docker"]["image"]) == _ray_pin()
    # The repo reaches every node at one path, and setup installs the package from there.
    (remote,) = [r for r, local in config["file_mounts"].items() if local == "."]
    assert any("pip install" in c and remote in c for c in config["setup_commands"])
    # Shared storage: mounted on the host and visible at the same path in the container.
    assert any(SHARED in c and "mount" in c for c in config["initialization_commands"])
    assert any(f"{SHARED}:{SHARED}" in opt for opt in config["docker"]["run_options"])


@pytest.mark.parametrize("breakage, error, message", [
    (lambda c: c["available_node_types"]["gpu_worker"].pop("resources"),
     jsonschema.ValidationError, "'resources' is a required property"),
    (lambda c: c.update(setup_comands=["typo"]), jsonschema.ValidationError, "setup_comands"),
    (lambda c: c.update(max_workers="four"), jsonschema.ValidationError, "not of type 'integer'"),
    (lambda c: c.update(head_node_type="no_such_type"), ValueError, "head_node_type"),
    (lambda c: c.update(max_workers=1), ValueError, "min_workers"),  # below the workers' sum
], ids=["no-resources", "unknown-key", "wrong-type", "unknown-head-type", "max-below-min"])
def test_launcher_validation_rejects_broken_copies(breakage, error, message):
    """The check above can fail: Ray's validation refuses a broken copy of the file."""
    config = _load(LAUNCHER)
    breakage(config)
    with pytest.raises(error, match=re.escape(message)):
        _launcher_checked(config)


# --- KubeRay ----------------------------------------------------------------------------

def _pod_templates(cluster_spec: dict) -> list[tuple[str, dict]]:
    pods = [("head", cluster_spec["headGroupSpec"]["template"]["spec"])]
    pods += [(g["groupName"], g["template"]["spec"]) for g in cluster_spec["workerGroupSpecs"]]
    return pods


def _check_cluster_spec(spec: dict, claim: str) -> int:
    """The structure both RayCluster and RayJob need; returns the GPUs the workers offer."""
    assert spec["rayVersion"] == _ray_pin()
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("num-gpus") == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    for kind in ("limits", "requests"):
        assert GPU not in head_container["resources"].get(kind, {}), "the head requests a GPU"

    gpus = 0
    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        assert {"groupName", "replicas", "minReplicas", "maxReplicas", "template"} <= set(group)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        (container,) = group["template"]["spec"]["containers"]
        limit = int(container["resources"]["limits"][GPU])
        assert limit >= 1, f"worker group {group['groupName']} has no GPU"
        assert int(container["resources"].get("requests", {}).get(GPU, limit)) == limit
        gpus += limit * group["replicas"]

    for name, pod in _pod_templates(spec):
        for container in pod["containers"]:
            assert _image_ray_version(container["image"]) == spec["rayVersion"], name
            assert container["resources"]["limits"].get("memory"), name
        # The shared claim is a volume of every pod, mounted at the same path in each.
        volumes = {v["name"]: v for v in pod["volumes"]}
        (shared,) = [n for n, v in volumes.items()
                     if v.get("persistentVolumeClaim", {}).get("claimName") == claim]
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == shared]
        assert mount["mountPath"] == SHARED, name
    return gpus


def _claim_name() -> str:
    pvc = _load(KUBERAY / "shared-storage.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    # Every pod writes checkpoints into it at once: it must be ReadWriteMany.
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"]
    return pvc["metadata"]["name"]


def test_raycluster_manifest():
    cluster = _load(KUBERAY / "raycluster.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert cluster["metadata"]["name"]
    assert cluster["spec"]["authOptions"] == {"mode": "token"}  # the RayJob's too: the same spec
    assert _check_cluster_spec(cluster["spec"], _claim_name()) >= 1


def test_rayjob_manifest_runs_a_valid_config_into_the_shared_volume():
    job = _load(KUBERAY / "rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    spec = job["spec"]
    gpus = _check_cluster_spec(spec["rayClusterSpec"], _claim_name())
    # One cluster definition: the RayJob's is the RayCluster's.
    assert spec["rayClusterSpec"] == _load(KUBERAY / "raycluster.yaml")["spec"]

    # The runtime env ships the repo (working_dir: a remote zip) and installs the package.
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert re.match(r"(https|s3|gs)://\S+\.zip$", runtime_env["working_dir"])
    assert any(p.startswith("raytrain_platform") for p in runtime_env["pip"])

    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "python" and (ROOT / argv[1]).is_file(), argv[:2]
    assert argv[1] == "pipelines/train.py"
    config = argv[argv.index("--config") + 1]
    assert (ROOT / config).is_file()
    overrides = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert len(argv) == 4 + 2 * len(overrides), f"unparsed arguments in {argv}"
    cfg = load_config(ROOT / config, overrides)
    assert Path(cfg.run.storage_path).is_relative_to(SHARED)  # checkpoints survive a lost pod
    assert cfg.scaling.use_gpu and cfg.scaling.num_workers <= gpus


def test_manifest_checks_can_fail():
    """The structural checks refuse a GPU on the head and a pod without the shared mount."""
    claim = _claim_name()
    good = _load(KUBERAY / "raycluster.yaml")["spec"]

    gpu_head = copy.deepcopy(good)
    gpu_head["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"][GPU] = "1"
    no_mount = copy.deepcopy(good)
    no_mount["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMounts"] = []
    elsewhere = copy.deepcopy(good)
    elsewhere["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["volumeMounts"][0][
        "mountPath"] = "/data"
    for broken in (gpu_head, no_mount, elsewhere):
        with pytest.raises((AssertionError, ValueError)):
            _check_cluster_spec(broken, claim)


def test_dockerfile_matches_the_cluster():
    """The optional image (cluster/Dockerfile) is on the same Ray and copies paths that exist."""
    text = (CLUSTER / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.MULTILINE)
    assert _image_ray_version(base) == _ray_pin()
    for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE):
        *sources, _dest = [p for p in line.split() if not p.startswith("--")]
        assert all((ROOT / s).exists() for s in sources), line


def test_a_submitted_jobs_own_env_vars_are_left_to_it(monkeypatch):
    """`ray job submit --runtime-env-json '{"env_vars": {"TOKENIZERS_PARALLELISM": ...}}'`: the
    driver's runtime_env set the same variables again, and Ray's merge (run here as
    `ray.init` runs it inside a job) refused the pair, so the job failed."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    from ray.runtime_env.runtime_env import _merge_runtime_env

    from raytrain_platform.launch.session import JOB_ENV, driver_runtime_env

    job = {"working_dir": ".", "env_vars": {"RAY_DATA_DISABLE_PROGRESS_BARS": "0", "TOKENIZERS_PARALLELISM": "true"}}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": job}))
    merged = _merge_runtime_env(job, driver_runtime_env())
    assert merged is not None
    assert merged["env_vars"] == {**JOB_ENV, **job["env_vars"]}  # the user's values stand
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR)  # outside a job: every variable of the driver's
    assert driver_runtime_env() == {"env_vars": JOB_ENV}


def test_local_cluster_makes_the_token_a_fresh_machine_lacks(tmp_path):
    """`ray start --head` with RAY_AUTH_MODE=token never makes a token: `up` on a machine
    where nothing had made ~/.ray/auth_token failed. `ensure_token` makes it once and
    keeps it after."""
    import os
    import subprocess
    import sys

    code = "import sys; sys.path.insert(0, 'cluster'); import local_cluster; print(local_cluster.ensure_token())"
    env = {**os.environ, "HOME": str(tmp_path)}
    token, texts = tmp_path / ".ray" / "auth_token", []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.stdout.strip() == str(token), run.stderr[-500:]
        texts.append(token.read_text())
    assert len(texts[0].strip()) >= 32 and texts[1] == texts[0]  # kept: every node and client presents it


def test_aws_sync_keeps_every_tracked_file_but_the_run_outputs():
    """rsync reads an unanchored `data` as any folder named data: the package's own
    raytrain_platform/data/ was left off every node."""
    import subprocess

    excluded = _load(LAUNCHER)["rsync_exclude"]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert tracked and all(p.startswith("/") or p.startswith("**/") for p in excluded), excluded
    anchored = [p.strip("/") for p in excluded if p.startswith("/")]
    assert not [f for f in tracked if f.split("/")[0] in anchored]
    assert {"data", "runs", "sweeps", "exported"} <= set(anchored)


def test_the_kuberay_job_installs_every_dependency_rays_image_lacks():
    """cluster/README.md's `ray job submit` pip list left out transformers, peft, mlflow
    and the rest: an hf, LoRA or tracked run failed on import on the cluster."""
    import json
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {re.split(r"[<>=\[ ;]", d)[0].lower() for d in deps} - {"ray", "pyyaml"}  # pyyaml: Ray's own
    text = (CLUSTER / "README.md").read_text()
    (pip,) = re.findall(r"--runtime-env-json '(\{\"pip\".*?\})'", text, re.DOTALL)
    listed = {re.split(r"[<>=\[ ]", p)[0].lower() for p in json.loads(pip)["pip"]}
    assert wanted <= listed, sorted(wanted - listed)


def test_a_job_is_warned_when_its_runs_would_land_in_its_copy_of_the_working_dir(tmp_path, monkeypatch, capsys):
    """Inside `ray job submit --working-dir .`, the default `./runs` resolved into Ray's
    temporary copy of the checkout: the runs were lost with it, silently."""
    import json

    import yaml
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    from conftest import mlp_config
    from raytrain_platform.launch.trainer import prepare

    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(mlp_config(tmp_path, "job")))
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg.zip"}}))
    prepare("c.yaml", ["run.storage_path=./runs"])
    prepare("c.yaml", ["run.storage_path=./runs", "train.lr=0.01"])  # a sweep's next trial: said once
    err = capsys.readouterr().err
    assert err.startswith("warning: run.storage_path = ") and "copy of its working_dir" in err
    assert len(err.splitlines()) == 1
    prepare("c.yaml", [f"run.storage_path={tmp_path.parent / 'shared'}"])  # outside the copy: nothing said
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR)  # not a job: nothing said
    prepare("c.yaml", ["run.storage_path=./runs2"])
    assert capsys.readouterr().err == ""
