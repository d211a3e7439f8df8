"""deploy/: the Slurm batch script and the Kubernetes manifests run commands the entrypoint accepts.

Real Slurm runs the batch script in tests/test_slurm.py; here, without any daemon, a stand-in `srun` records
the command the script gives it. The Indexed Job, its Service, the JobSet, and the TrainJob with its runtime are
checked offline: against Kubernetes' own schemas (kubernetes-validate) and the CRDs of JobSet and Kubeflow Trainer,
then for what an API server or a controller would do with them that no schema says. tests/test_indexed_job.py
runs the Indexed Job's and the TrainJob's pods as separate hosts.
"""

import copy
import os
import re
import subprocess

import jsonschema
import kubernetes_validate
import pytest
import yaml

import config
from machinery import worker_sources
from manifests import INDEXED_JOB, JOBSET, TRAINJOB, documents, job_specs, trainer
from processes import ROOT, skip_unless_ci
from machinery import exits

SBATCH = os.path.join(ROOT, "deploy", "slurm.sbatch")
TFJOB = os.path.join(ROOT, "deploy", "tfjob.yaml")
# The CRDs of JobSet and Kubeflow Trainer (../shared/k8s/README.md), beside the project's folder as in CI.
CRDS = os.path.join(ROOT, "..", "shared", "k8s")
JOBSET_CRD = os.path.join(CRDS, "jobset.x-k8s.io_jobsets.yaml")
# The oldest Kubernetes the docs name (podFailurePolicy is GA from 1.31) and the newest whose schemas
# kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.latest_version())
ENTRYPOINT = ["python", "train_mnist_mirrored.py"]


def parsed(command):
    """The entrypoint's own parser on `command`'s options; argparse exits 2 on any it does not accept."""
    assert command[:2] == ENTRYPOINT, command
    return config.from_args(config.build_parser("train_mnist_mirrored.py", "").parse_args(command[2:]))


def test_tfjob_runs_the_entrypoint_with_options_it_accepts_in_every_pod():
    with open(TFJOB) as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "TFJob"
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker"}
    for spec in specs.values():
        # Kubeflow restarts a pod on 130, 137, 138 and 143 only with this policy (docs/clusters.md).
        assert spec["restartPolicy"] == "ExitCode"
        container, = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        cfg = parsed(container["command"] + container.get("args", []))
        assert cfg.strategy == "multiworker"
        # The data and the outputs are on the volume every pod mounts.
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        for path in (cfg.data_dir, cfg.idx_dir, cfg.output_dir):
            assert any(path.startswith(m + "/") for m in mounts), path


def test_sbatch_script_gives_srun_the_entrypoint_and_its_own_arguments_last(tmp_path):
    """`sbatch deploy/slurm.sbatch --epochs 1 --output-dir DIR`: the arguments reach every task and win."""
    fake = tmp_path / "bin"
    fake.mkdir()
    record = tmp_path / "srun-argv"
    (fake / "srun").write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > {record}\n')
    (fake / "srun").chmod(0o755)
    output_dir = str(tmp_path / "my runs" / "try")  # a space, which the script must keep in one argument
    proc = subprocess.run(["bash", SBATCH, "--epochs", "1", "--output-dir", output_dir], cwd=ROOT,
                          env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "HOME": "/home/u"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = record.read_text().split("\0")[:-1]
    # srun ends the step when a task fails; each task runs the entrypoint under a shell that records its status.
    assert argv[0] == "--kill-on-bad-exit=1" and argv[1:3] == ["bash", "-c"]
    cfg = parsed(argv[argv.index("task") + 1:])
    assert cfg.strategy == "multiworker" and cfg.epochs == 1 and cfg.output_dir == output_dir
    # The script's own defaults stay where the caller did not override them.
    assert cfg.data_dir == "/home/u/tensorflow_datasets" and cfg.idx_dir == "/home/u/mnist-idx"


# ---------------------------------------------------------------- Kubernetes: Indexed Job, Service, JobSet

JOB_SPECS = job_specs()


def test_each_pod_has_a_stable_dns_name():
    """An Indexed Job's pod is `<job>-<index>.<subdomain>` where its subdomain is a headless Service selecting it;
    JobSet makes that Service for one replicated Job of its own."""
    indexed = documents(INDEXED_JOB)
    job, service = indexed["Job"], indexed["Service"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    jobset = documents(JOBSET)["JobSet"]
    assert jobset["spec"]["network"]["enableDNSHostnames"] and len(jobset["spec"]["replicatedJobs"]) == 1
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 1


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_job_and_its_service_validate_against_kubernetes_own_schemas(version):
    """--strict: an unknown or misspelt field fails, as kubectl's strict field validation would."""
    refused = []
    for doc in documents(INDEXED_JOB).values():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except jsonschema.ValidationError as err:  # its text holds the whole schema: keep the message
            refused.append(f"{doc['kind']}: {err.message} at {'.'.join(map(str, err.absolute_path))}")
    assert refused == []


def closed(schema):
    """The CRD's schema with every object that lists its properties closed to others: an API server drops unknown
    fields of a custom resource (kubectl's strict field validation refuses them), where JSON Schema allows them."""
    schema = copy.deepcopy(schema)
    nodes = [schema]
    while nodes:
        node = nodes.pop()
        if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        nodes.extend(v for v in node.get("properties", {}).values())
        nodes.extend(node[key] for key in ("items", "additionalProperties") if isinstance(node.get(key), dict))
    return schema


def crd_schema(path, version):
    """A validator of the CRD at `path`'s schema for `version`, closed as an API server is."""
    if not os.path.exists(path):
        skip_unless_ci(f"the CRD is not at {os.path.normpath(path)}")
    with open(path) as f:
        crd = yaml.safe_load(f)
    schema, = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(closed(schema))


@pytest.fixture(scope="module")
def jobset_schema():
    return crd_schema(JOBSET_CRD, "v1alpha2")


def test_the_jobset_validates_against_its_crd(jobset_schema):
    jobset = documents(JOBSET)["JobSet"]
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert [e.message for e in jobset_schema.iter_errors(jobset)] == []
    # The check has teeth: a misspelt field and a failure rule without its required name are refused.
    misspelt = copy.deepcopy(jobset)
    misspelt["spec"]["replicatedJobs"][0]["template"]["spec"]["completion"] = 2
    unnamed = copy.deepcopy(jobset)
    del unnamed["spec"]["failurePolicy"]["rules"][0]["name"]
    for bad in (misspelt, unnamed):
        assert list(jobset_schema.iter_errors(bad))


def first_match(rules, code):
    """The action of the first podFailurePolicy rule whose exit codes match `code` (the Job controller tries them in
    order); None where none does."""
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes and (code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
    return None


@pytest.mark.parametrize("name, spec, host, subdomain", JOB_SPECS, ids=[s[0] for s in JOB_SPECS])
def test_the_pod_failure_policy_carries_the_exit_status_contract(name, spec, host, subdomain):
    pod = spec["template"]["spec"]
    # The API server accepts a podFailurePolicy only with restartPolicy Never: with OnFailure the kubelet would
    # restart the container in place, and no rule would ever see an exit status.
    assert pod["restartPolicy"] == "Never"
    assert spec["completionMode"] == "Indexed"
    rules = spec["podFailurePolicy"]["rules"]
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes:
            # What the API server refuses: values unsorted or repeated, 0 in an In list, a container not in the pod.
            assert codes["values"] == sorted(set(codes["values"])) and 1 <= len(codes["values"]) <= 255, codes
            assert not (codes["operator"] == "In" and 0 in codes["values"]), codes
            assert codes["containerName"] == trainer(spec)["name"]
    # A disrupted pod (drained node, pre-emption) is seen first, whatever its status (143 after it saved).
    assert rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rules[0]["action"] == {"indexed-job": "Ignore", "jobset": "FailJob", "trainjob": "FailJob"}[name]
    actions = [rule["action"] for rule in rules[1:]]
    assert actions == sorted(actions, key=["FailJob", "Count"].index)  # FailJob before Count
    for code in exits.PERMANENT_EXIT_STATUSES:
        assert first_match(rules[1:], code) == "FailJob", code
    for code in exits.RETRYABLE_EXIT_STATUSES:
        assert first_match(rules[1:], code) == "Count", code
    # A replacement pod starts only once the pod it replaces has ended, so it never reads a backup being written;
    # the grace period is longer than Kubernetes' default 30 s, for the save.
    assert spec["podReplacementPolicy"] == "Failed"
    assert pod["terminationGracePeriodSeconds"] > 30


@pytest.mark.parametrize("name, spec, host, subdomain", JOB_SPECS, ids=[s[0] for s in JOB_SPECS])
def test_every_pod_finds_its_workers_and_runs_options_the_entrypoint_accepts(name, spec, host, subdomain):
    """The pods' variables, read by the entrypoint's own parser on the host each pod of the Job gets."""
    container = trainer(spec)
    env = {var["name"]: var["value"] for var in container["env"]}
    workers = int(env["MNIST_WORKERS"])
    assert spec["completions"] == spec["parallelism"] == workers  # every worker at once
    if name == "indexed-job":
        # One lost worker costs one count per worker: its own failure and the others' 138.
        assert spec["backoffLimit"] >= workers and spec["backoffLimit"] % workers == 0
    else:
        assert spec["backoffLimit"] == 0  # any failure fails the Job, and JobSet restarts the whole set
    assert [p["containerPort"] for p in container["ports"]] == [int(env["MNIST_WORKER_PORT"])]
    expected = [f"{host.format(index=i)}.{subdomain}:{env['MNIST_WORKER_PORT']}" for i in range(workers)]
    for index in range(workers):
        found = worker_sources.find({**env, "JOB_COMPLETION_INDEX": str(index)}, host.format(index=index))
        assert type(found).__name__ == {"trainjob": "TrainJob"}.get(name, "IndexedJob")
        assert (found.rank, found.count, found.addresses) == (index, workers, expected)
    cfg = parsed(container["command"] + container.get("args", []))
    assert cfg.strategy == "multiworker"
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    for path in (cfg.data_dir, cfg.idx_dir, cfg.output_dir):
        assert any(path.startswith(m + "/") for m in mounts), path


# What the Job controller writes on a Job that failed (pkg/controller/job/pod_failure_policy.go, job_controller.go).
JOB_FAILURES = {
    "disrupted": ("PodFailurePolicy", "Pod default/mnist-mirrored-workers-0-1-x7k2p has condition DisruptionTarget "
                                      "matching FailJob rule at index 0"),
    "permanent": ("PodFailurePolicy", "Container trainer for pod default/mnist-mirrored-workers-0-1-x7k2p failed with "
                                      "exit code 2 matching FailJob rule at index 1"),
    "retryable": ("BackoffLimitExceeded", "Job has reached the specified backoff limit"),
}


JOBSET_SPECS = {"jobset": documents(JOBSET)["JobSet"]["spec"],
                "trainjob": documents(TRAINJOB)["TrainingRuntime"]["spec"]["template"]["spec"]}


@pytest.mark.parametrize("name", JOBSET_SPECS)
def test_the_jobset_restarts_the_set_on_what_is_retryable_and_fails_on_what_is_not(name):
    """JobSet tries its failure rules in order, the first match deciding; RestartJobSet when none matches."""
    policy = JOBSET_SPECS[name]["failurePolicy"]
    assert policy["restartStrategy"] == "BlockingRecreate" and policy["maxRestarts"] >= 1

    def action(reason, message):
        for rule in policy["rules"]:
            if (reason in rule.get("onJobFailureReasons", [reason]) and
                    any(re.search(p, message) for p in rule.get("onJobFailureMessagePatterns", [".*"]))):
                return rule["action"]
        return "RestartJobSet"

    assert {what: action(*failure) for what, failure in JOB_FAILURES.items()} == {
        "disrupted": "RestartJobSetAndIgnoreMaxRestarts", "permanent": "FailJobSet", "retryable": "RestartJobSet"}


# ---------------------------------------------------------------- Kubeflow Trainer: TrainJob and its runtime

@pytest.mark.parametrize("kind", ["TrainingRuntime", "TrainJob"])
def test_the_trainjob_and_its_runtime_validate_against_their_crds(kind):
    plural = {"TrainingRuntime": "trainingruntimes", "TrainJob": "trainjobs"}[kind]
    schema = crd_schema(os.path.join(CRDS, f"trainer.kubeflow.org_{plural}.yaml"), "v1alpha1")
    doc = documents(TRAINJOB)[kind]
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert [e.message for e in schema.iter_errors(doc)] == []
    # The check has teeth: a misspelt field is refused, and so is a runtime reference without its name.
    misspelt = copy.deepcopy(doc)
    misspelt["spec"]["numNode"] = 2
    assert list(schema.iter_errors(misspelt))
    if kind == "TrainJob":
        unnamed = copy.deepcopy(doc)
        del unnamed["spec"]["runtimeRef"]["name"]
        assert list(schema.iter_errors(unnamed))


def test_the_trainjob_runs_on_its_runtime_as_the_plainml_plugin_would():
    """What the CRDs' schemas cannot say: the rules the API server checks in CEL, and what Trainer does."""
    docs = documents(TRAINJOB)
    runtime, job = docs["TrainingRuntime"], docs["TrainJob"]
    # The TrainJob's CEL rules: its name is a DNS label of at most 63 characters.
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 63
    ref = job["spec"]["runtimeRef"]
    assert (ref["kind"], ref["name"]) == ("TrainingRuntime", runtime["metadata"]["name"])
    # No framework in the mlPolicy: Trainer's plainml plugin, which adds the TrainJob's env and nothing else.
    assert set(runtime["spec"]["mlPolicy"]) == {"numNodes"}
    jobset = runtime["spec"]["template"]["spec"]
    replicated, = jobset["replicatedJobs"]
    assert replicated["name"] == worker_sources.TRAINJOB_REPLICATED_JOB
    assert replicated["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    # Host names <trainjob>-node-0-<i>.<trainjob>: one replicated job of one Job, and the JobSet's own subdomain.
    assert replicated.get("replicas", 1) == 1 and "subdomain" not in jobset["network"]
    assert jobset["network"]["enableDNSHostnames"]
    # One worker count: the TrainJob's numNodes, which replaces the runtime's, is the count the pods are told.
    workers = job["spec"]["trainer"]["numNodes"]
    assert runtime["spec"]["mlPolicy"]["numNodes"] == workers
    assert {var["name"]: var["value"] for var in job["spec"]["trainer"]["env"]} == {"MNIST_WORKERS": str(workers)}
    env = {var["name"]: var for var in replicated["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MNIST_TRAINJOB"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        f"metadata.labels['{worker_sources.TRAINJOB_NAME_LABEL}']")
