"""Where a job's shard comes from: flags, a Kubernetes Indexed Job's variables, or a Slurm array's; and the
Kubernetes example manifest."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cbgen.config import JobConfig
from cbgen.errors import CbgenError
from cbgen.parallel.sharding import resolve_sharding


def job(num_shards=None, shard_index=None) -> JobConfig:
    config = JobConfig()
    config.run.num_shards, config.run.shard_index = num_shards, shard_index
    return config


@pytest.mark.parametrize(("flags", "env", "expected"), [
    ((None, None), {}, None),
    ((4, 1), {}, (1, 4)),
    ((None, None), {"JOB_COMPLETION_INDEX": "2", "CBGEN_NUM_SHARDS": "4"}, (2, 4)),  # a Kubernetes Indexed Job
    ((4, None), {"JOB_COMPLETION_INDEX": "3"}, (3, 4)),  # the count from the flag, the index from the pod
    ((None, 0), {"CBGEN_NUM_SHARDS": "2"}, (0, 2)),
    ((3, 2), {"JOB_COMPLETION_INDEX": "0", "CBGEN_NUM_SHARDS": "9"}, (2, 3)),  # flags win
    ((None, None), {"JOB_COMPLETION_INDEX": "0", "CBGEN_NUM_SHARDS": "1"}, None),  # one shard: no split
    ((None, None), {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4", "SLURM_ARRAY_TASK_COUNT": "3"}, (1, 3)),
    ((None, None), {"JOB_COMPLETION_INDEX": "1", "CBGEN_NUM_SHARDS": "2", "SLURM_ARRAY_TASK_ID": "0",
                    "SLURM_ARRAY_TASK_COUNT": "2"}, (1, 2)),  # the Kubernetes variables before Slurm's
])
def test_resolution(flags, env, expected):
    assert resolve_sharding(job(*flags), env) == expected


@pytest.mark.parametrize(("flags", "env", "message"), [
    ((None, None), {"JOB_COMPLETION_INDEX": "1"}, "JOB_COMPLETION_INDEX (a Kubernetes Indexed Job) gives this job's "
                                                  "shard but not how many there are: pass --num-shards N or set "
                                                  "CBGEN_NUM_SHARDS=N"),
    ((4, None), {}, "--num-shards 4 needs this job's shard: pass --shard-index I"),
    ((None, 2), {}, "--shard-index gives this job's shard but not how many"),
    ((None, None), {"JOB_COMPLETION_INDEX": "4", "CBGEN_NUM_SHARDS": "4"}, "shard index 4 must be below the number "
                                                                           "of shards 4"),
    ((None, None), {"JOB_COMPLETION_INDEX": "x", "CBGEN_NUM_SHARDS": "4"}, "JOB_COMPLETION_INDEX must be an integer"),
])
def test_incomplete_or_wrong_resolution_says_what_to_give(flags, env, message):
    with pytest.raises(CbgenError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_sharding(job(*flags), env)


def test_the_kubernetes_example_is_an_indexed_job_with_a_shared_volume_and_a_merge():
    path = Path(__file__).resolve().parents[1] / "examples" / "k8s-indexed-job.yaml"
    documents = list(yaml.safe_load_all(path.read_text()))
    kinds = {d["metadata"]["name"]: d for d in documents}
    claim = kinds["cbgen-data"]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    shards, merge = kinds["cbgen-shards"]["spec"], kinds["cbgen-merge"]["spec"]
    assert shards["completionMode"] == "Indexed"
    (container,) = shards["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["CBGEN_NUM_SHARDS"]) == shards["completions"]
    assert container["command"][:2] == ["cbgen", "run"]
    out = container["command"][container["command"].index("-o") + 1]
    (merger,) = merge["template"]["spec"]["containers"]
    assert f"cbgen merge {out}" in merger["command"][-1] and f"cbgen status {out}" in merger["command"][-1]
    for spec in (shards, merge):  # both see the same volume at the same place
        pod = spec["template"]["spec"]
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "cbgen-data"
        assert all(m["mountPath"] == "/data" for c in pod["containers"] for m in c["volumeMounts"])
    rules = shards["podFailurePolicy"]["rules"]
    assert {"operator": "In", "values": [75]} in [r.get("onExitCodes") for r in rules]  # a clean stop is retried
