"""deploy/'s Kubernetes manifests, read as Kubernetes, JobSet and Kubeflow Trainer read them: each one's Job spec."""

import os
import re

from processes import ROOT

INDEXED_JOB = os.path.join(ROOT, "deploy", "indexed-job.yaml")
JOBSET = os.path.join(ROOT, "deploy", "jobset.yaml")
TRAINJOB = os.path.join(ROOT, "deploy", "trainjob.yaml")


def documents(path):
    """{kind: document} of a manifest file."""
    import yaml

    with open(path) as f:
        return {doc["kind"]: doc for doc in yaml.safe_load_all(f)}


def trainer_applied(runtime, trainjob):
    """The Job spec of the runtime's replicated job `node` as Kubeflow Trainer builds it for the TrainJob (its
    jobset and plainml plugins): numNodes pods, the TrainJob's command, and its env added to the container `node`;
    the JobSet's label that the runtime's env reads, resolved as the kubelet would (the JobSet has the TrainJob's
    name)."""
    import copy

    from machinery import worker_sources

    replicated, = [r for r in runtime["spec"]["template"]["spec"]["replicatedJobs"]
                   if r["name"] == worker_sources.TRAINJOB_REPLICATED_JOB]
    spec = copy.deepcopy(replicated["template"]["spec"])
    job = trainjob["spec"]["trainer"]
    spec["parallelism"] = spec["completions"] = job.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    container, = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "node"]
    container["command"] = job["command"]
    env = {var["name"]: var for var in container.get("env", []) + job.get("env", [])}
    labels = {worker_sources.TRAINJOB_NAME_LABEL: trainjob["metadata"]["name"]}
    for var in env.values():
        field = var.pop("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field:
            var["value"] = labels[re.fullmatch(r"metadata\.labels\['(.+)'\]", field)[1]]
    container["env"] = list(env.values())
    return spec


def job_specs():
    """(name, the Job's spec, its pods' host name with {index}, their subdomain) of each manifest; the TrainJob's
    Job is the one Trainer makes from it and its runtime."""
    from machinery import worker_sources

    indexed = documents(INDEXED_JOB)
    job, service = indexed["Job"], indexed["Service"]
    jobset = documents(JOBSET)["JobSet"]
    replicated = jobset["spec"]["replicatedJobs"][0]
    train = documents(TRAINJOB)
    name = train["TrainJob"]["metadata"]["name"]
    return [("indexed-job", job["spec"], job["metadata"]["name"] + "-{index}", service["metadata"]["name"]),
            ("jobset", replicated["template"]["spec"], f"{jobset['metadata']['name']}-{replicated['name']}-0-{{index}}",
             jobset["spec"]["network"]["subdomain"]),
            # JobSet's Service is named after the JobSet where the runtime names no subdomain.
            ("trainjob", trainer_applied(train["TrainingRuntime"], train["TrainJob"]),
             f"{name}-{worker_sources.TRAINJOB_REPLICATED_JOB}-0-{{index}}", name)]


def trainer(spec):
    """The one container of a Job spec's pods: the trainer."""
    container, = spec["template"]["spec"]["containers"]
    return container
