"""Spec → objects: TF_CONFIG byte for byte, pods, service, secret, and schema validity."""

from __future__ import annotations

import base64
import json

import kubernetes_validate
import pytest
from operator_jobs import job, job_obj

from ringtrain import cluster
from ringtrain_operator import manifests, spec

W = "mnist-worker-{}.mnist.team-a.svc:2222"


@pytest.mark.parametrize(
    "kw, role, index, expected",
    [
        (
            {"workers": 1},
            "worker",
            0,
            '{"cluster":{"worker":["mnist-worker-0.mnist.team-a.svc:2222"]},'
            '"task":{"type":"worker","index":0},"environment":"cloud"}',
        ),
        (
            {"workers": 2},
            "worker",
            1,
            '{"cluster":{"worker":["mnist-worker-0.mnist.team-a.svc:2222",'
            '"mnist-worker-1.mnist.team-a.svc:2222"]},"task":{"type":"worker","index":1},'
            '"environment":"cloud"}',
        ),
        (
            {"workers": 2, "chief": 1},
            "chief",
            0,
            '{"cluster":{"chief":["mnist-chief-0.mnist.team-a.svc:2222"],'
            '"worker":["mnist-worker-0.mnist.team-a.svc:2222","mnist-worker-1.mnist.team-a.svc:2222"]},'
            '"task":{"type":"chief","index":0},"environment":"cloud"}',
        ),
        # Kubeflow's genClusterSpec: the evaluator is only ever in its own task, never in cluster
        (
            {"workers": 1, "chief": 1, "ps": 2, "evaluator": 1},
            "ps",
            1,
            '{"cluster":{"chief":["mnist-chief-0.mnist.team-a.svc:2222"],'
            '"worker":["mnist-worker-0.mnist.team-a.svc:2222"],'
            '"ps":["mnist-ps-0.mnist.team-a.svc:2222","mnist-ps-1.mnist.team-a.svc:2222"]},'
            '"task":{"type":"ps","index":1},"environment":"cloud"}',
        ),
        (
            {"workers": 1, "chief": 1, "ps": 2, "evaluator": 1},
            "evaluator",
            0,
            '{"cluster":{"chief":["mnist-chief-0.mnist.team-a.svc:2222"],'
            '"worker":["mnist-worker-0.mnist.team-a.svc:2222"],'
            '"ps":["mnist-ps-0.mnist.team-a.svc:2222","mnist-ps-1.mnist.team-a.svc:2222"]},'
            '"task":{"type":"evaluator","index":0},"environment":"cloud"}',
        ),
        (
            {"workers": 1, "chief": 0, "evaluator": 1},
            "evaluator",
            0,
            '{"cluster":{"worker":["mnist-worker-0.mnist.team-a.svc:2222"]},'
            '"task":{"type":"evaluator","index":0},"environment":"cloud"}',
        ),
    ],
)
def test_tf_config_byte_for_byte(kw, role, index, expected):
    j = job(**kw)
    assert manifests.tf_config(j, role, index) == expected
    env = {
        e["name"]: e["value"]
        for e in manifests.pod(j, j.replica(role), index)["spec"]["containers"][0]["env"]
    }
    assert env["TF_CONFIG"] == expected


def test_tf_config_gives_the_trainer_ranks_chief_first():
    j = job(workers=2, chief=1)
    ranks = {
        (r.role, i): cluster.parse(manifests.tf_config(j, r.role, i)).rank for r, i in j.members()
    }
    assert ranks == {("chief", 0): 0, ("worker", 0): 1, ("worker", 1): 2}


def test_endpoint_is_injectable_for_local_processes():
    j = job(workers=2)
    ports = {("worker", 0): 41000, ("worker", 1): 41001}
    tf = manifests.tf_config(j, "worker", 1, lambda _j, r, i: f"127.0.0.1:{ports[(r, i)]}")
    assert cluster.parse(tf).cluster == {"worker": ("127.0.0.1:41000", "127.0.0.1:41001")}


def test_desired_objects_are_service_secret_then_pods():
    objs = manifests.desired_objects(job(workers=2, chief=1), token="s3cret")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Service", "mnist"),
        ("Secret", "mnist-ring-token"),
        ("Pod", "mnist-chief-0"),
        ("Pod", "mnist-worker-0"),
        ("Pod", "mnist-worker-1"),
    ]
    svc, sec = objs[0], objs[1]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"ringtrain.io/job-name": "mnist"}
    assert base64.b64decode(sec["data"]["token"]) == b"s3cret"
    for o in objs:
        assert o["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "ringtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "name": "mnist",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_tokens_are_random_per_call_and_never_in_pods():
    j = job()
    a, b = manifests.secret(j)["data"]["token"], manifests.secret(j)["data"]["token"]
    assert a != b and len(base64.b64decode(a)) >= 32
    objs = manifests.desired_objects(j, token="s3cret")
    assert "s3cret" not in json.dumps(objs[2:]) and "czNjcmV0" not in json.dumps(objs[2:])


def test_trainer_pod_runs_ringtrain_worker_with_every_flag():
    obj = job_obj(
        trainer={
            "dataset": "mnist-5k",
            "steps": 20,
            "batchSize": 32,
            "ipusPerWorker": 2,
            "variablesOnHost": False,
            "bucketMB": 0.5,
            "optimizer": "sgd",
            "learningRate": 0.05,
            "evalEvery": 10,
            "checkpoint": {"everySteps": 5, "path": "/ckpt"},
        }
    )
    j = spec.load(obj)
    p = manifests.pod(j, j.replica("worker"), 1)
    (c,) = p["spec"]["containers"]
    assert c["name"] == "ringtrain" and c["image"] == "ringtrain:0.1.0"
    assert c["command"] == ["ringtrain", "worker"]
    assert c["args"] == [
        "--data",
        "/usr/share/datasets/fashion-mnist",
        "--dataset",
        "mnist-5k",
        "--model",
        "cnn",
        "--seed",
        "0",
        "--steps",
        "20",
        "--batch-size",
        "32",
        "--eval-every",
        "10",
        "--optimizer",
        "sgd",
        "--lr",
        "0.05",
        "--ipus-per-worker",
        "2",
        "--ipu-memory-mb",
        "900",
        "--no-variables-on-host",
        "--gradient-accumulation-steps",
        "1",
        "--stochastic-rounding",
        "OFF",
        "--bucket-mb",
        "0.5",
        "--ring-transport",
        "grpc+tcp",
        "--ring-step-timeout-s",
        "30",
        "--ring-min-bytes-per-s",
        "1048576",
        "--ring-connect-timeout-s",
        "120",
        "--ring-health-timeout-s",
        "3",
        "--ring-stall-warning-s",
        "60",
        "--ring-rejoin-limit",
        "3",
        "--checkpoint-dir",
        "/ckpt",
        "--checkpoint-every",
        "5",
        "--checkpoint-keep",
        "3",
        "--metrics-port",
        "9400",
        "--json",
        "--termination-log",
        "/dev/termination-log",
    ]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["RINGTRAIN_TOKEN_FILE"] == "/var/run/ringtrain/ring-token/token"
    assert {"name": "metrics", "containerPort": 9400, "protocol": "TCP"} in c["ports"]
    assert {"name": "ring", "containerPort": 2222, "protocol": "TCP"} in c["ports"]
    assert c["terminationMessagePath"] == "/dev/termination-log"
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["ring-token"]["readOnly"] is True
    assert mounts["checkpoints"]["mountPath"] == "/ckpt" and mounts["tmp"]["mountPath"] == "/tmp"
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["ring-token"]["secret"]["secretName"] == "mnist-ring-token"
    assert vols["checkpoints"] == {"name": "checkpoints", "emptyDir": {}}
    assert p["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_pod_identity_and_secure_defaults():
    j = job(workers=2)
    p = manifests.pod(j, j.replica("worker"), 1)
    meta, s = p["metadata"], p["spec"]
    assert meta["name"] == "mnist-worker-1" and meta["namespace"] == "team-a"
    assert meta["labels"] == {
        "ringtrain.io/job-name": "mnist",
        "ringtrain.io/replica-type": "worker",
        "ringtrain.io/replica-index": "1",
    }
    assert (s["hostname"], s["subdomain"], s["restartPolicy"]) == (
        "mnist-worker-1",
        "mnist",
        "OnFailure",
    )
    assert s["automountServiceAccountToken"] is False
    assert s["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert s["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def test_the_token_is_mounted_read_only_and_never_world_readable():
    """Kubeflow #3262 mounted its secret 0644. Ours is 0400 (0440 with the fsGroup), read-only,
    in the main container only, even when a template brings its own volume of that name."""
    obj = job_obj(workers=1)
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {
            "volumes": [
                {"name": "ring-token", "secret": {"secretName": "x", "defaultMode": 0o644}}
            ],
            "initContainers": [{"name": "init", "image": "busybox"}],
            "containers": [{"name": "ringtrain"}, {"name": "sidecar", "image": "busybox"}],
        }
    }
    j = spec.load(obj)
    s = manifests.pod(j, j.replica("worker"), 0)["spec"]
    (vol,) = [v for v in s["volumes"] if v["name"] == "ring-token"]
    assert vol["secret"] == {"secretName": "mnist-ring-token", "defaultMode": 0o400}
    assert vol["secret"]["defaultMode"] & 0o077 == 0
    main, sidecar = s["containers"]
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == "ring-token"]
    assert mount["readOnly"] is True
    assert "ring-token" not in json.dumps(sidecar) + json.dumps(s["initContainers"])
    for c in [*s["containers"], *s["initContainers"]]:  # every container, not just ours
        assert c["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    assert s["automountServiceAccountToken"] is False
    assert s["securityContext"]["runAsNonRoot"] is True
    assert s["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_token_never_reaches_tf_config_status_events_metrics_or_logs(caplog):
    from fake_kube import FakeKube
    from prometheus_client import CollectorRegistry, generate_latest

    from ringtrain_operator.metrics import OperatorMetrics
    from ringtrain_operator.reconcile import reconcile

    caplog.set_level("DEBUG")
    kube = FakeKube(job_obj(workers=2, chief=1))
    metrics = OperatorMetrics(CollectorRegistry())
    d = reconcile(kube, "team-a", "mnist", fetch=lambda ip: None, metrics=metrics)
    secret = kube.objects[("Secret", "mnist-ring-token")]
    token = base64.b64decode(secret["data"]["token"]).decode()
    encoded = secret["data"]["token"]
    pods = [o for (kind, _), o in kube.objects.items() if kind == "Pod"]
    seen = {
        "pods (env, TF_CONFIG)": json.dumps(pods),
        "status": json.dumps(kube.job["status"]),
        "events": json.dumps([e.message for e in d.events]),
        "metrics": generate_latest(metrics.registry).decode(),
        "logs": caplog.text,
    }
    for where, text in seen.items():
        assert token not in text and encoded not in text, where
    tf = [
        e["value"]
        for p in pods
        for e in p["spec"]["containers"][0]["env"]
        if e["name"] == "TF_CONFIG"
    ]
    assert len(tf) == 3 and all(token not in t for t in tf)
    other = FakeKube(job_obj(workers=2, chief=1))
    reconcile(other, "team-a", "mnist", fetch=lambda ip: None)
    assert other.objects[("Secret", "mnist-ring-token")]["data"]["token"] != encoded  # per job


@pytest.mark.parametrize(
    "policy, pod_policy",
    [
        ("Never", "Never"),
        ("ExitCode", "OnFailure"),
        ("OnFailure", "OnFailure"),
        ("Always", "Always"),
    ],
)
def test_pod_restart_policy(policy, pod_policy):
    j = job(policy=policy)
    assert manifests.pod(j, j.replica("worker"), 0)["spec"]["restartPolicy"] == pod_policy


def test_template_values_win_and_stock_commands_run_unchanged():
    obj = job_obj(workers=1)
    del obj["spec"]["trainer"]
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "metadata": {
            "labels": {"team": "a", "ringtrain.io/job-name": "spoof"},
            "annotations": {"note": "x"},
        },
        "spec": {
            "securityContext": {"runAsUser": 2000},
            "containers": [
                {
                    "name": "tf",
                    "image": "tensorflow/tensorflow:2.16.1",
                    "command": ["python", "train.py"],
                    "env": [{"name": "A", "value": "1"}, {"name": "TF_CONFIG", "value": "stale"}],
                    "securityContext": {"readOnlyRootFilesystem": False},
                }
            ],
        },
    }
    j = spec.load(obj)
    p = manifests.pod(j, j.replica("worker"), 0)
    (c,) = p["spec"]["containers"]
    assert c["command"] == ["python", "train.py"] and "args" not in c
    assert c["image"] == "tensorflow/tensorflow:2.16.1"
    env = [(e["name"], e["value"]) for e in c["env"]]
    assert env[0] == ("A", "1") and [n for n, _ in env].count("TF_CONFIG") == 1
    assert dict(env)["TF_CONFIG"] == manifests.tf_config(j, "worker", 0)
    assert p["metadata"]["labels"]["team"] == "a"
    assert p["metadata"]["labels"]["ringtrain.io/job-name"] == "mnist"
    assert p["metadata"]["annotations"] == {"note": "x"}  # no prometheus: no trainer metrics
    assert p["spec"]["securityContext"]["runAsUser"] == 2000
    assert c["securityContext"]["readOnlyRootFilesystem"] is False
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "checkpoints" not in {v["name"] for v in p["spec"]["volumes"]}
    assert obj["spec"]["replicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"][1] == {
        "name": "TF_CONFIG",
        "value": "stale",
    }  # the template itself is not modified


def test_checkpoint_volume_and_image_override():
    obj = job_obj(
        trainer={"checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}}
    )
    obj["spec"]["replicaSpecs"]["Worker"]["template"] = {
        "spec": {
            "containers": [
                {
                    "name": "ringtrain",
                    "image": "registry.example/ringtrain:dev",
                    "resources": {"limits": {"memory": "2Gi"}},
                }
            ]
        }
    }
    j = spec.load(obj)
    p = manifests.pod(j, j.replica("worker"), 0)
    (c,) = p["spec"]["containers"]
    assert c["image"] == "registry.example/ringtrain:dev"
    assert c["resources"] == {"limits": {"memory": "2Gi"}}
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["checkpoints"] == {
        "name": "checkpoints",
        "persistentVolumeClaim": {"claimName": "ckpt"},
    }


@pytest.mark.parametrize("version", ["1.25.0", "1.37.0"])
@pytest.mark.parametrize(
    "kw", [{"workers": 2}, {"workers": 2, "chief": 1, "ps": 1, "evaluator": 1}]
)
def test_every_object_validates_against_the_kubernetes_schema(kw, version):
    for obj in manifests.desired_objects(job(**kw)):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_crd_validates_against_the_kubernetes_schema():
    kubernetes_validate.validate(spec.crd(), "1.25.0", strict=True)


def test_the_trainer_parses_the_pod_command_into_the_spec(tmp_path):
    """The contract between operator and trainer, checked with the trainer's own parser."""
    from ringtrain_trainer.config import TrainerConfig

    obj = job_obj(
        workers=2,
        chief=1,
        trainer={
            "dataset": "mnist-5k",
            "steps": 20,
            "batchSize": 32,
            "ipusPerWorker": 2,
            "variablesOnHost": False,
            "bucketMB": 0.5,
            "learningRate": 0.01,
            "lrDecay": 0.5,
            "evalEvery": 10,
            "checkpoint": {"everySteps": 5, "path": "/ckpt"},
            "ring": {
                "transport": "grpc",
                "stepTimeoutSeconds": 90.5,
                "connectTimeoutSeconds": 300,
                "encryptData": True,
            },
        },
    )
    j = spec.load(obj)
    (c,) = manifests.pod(j, j.replica("worker"), 1)["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    sec = manifests.secret(j, "s3cret\n")
    for key, value in sec["data"].items():  # the Secret's files, as the kubelet mounts them
        (tmp_path / key).write_bytes(base64.b64decode(value))
    assert env["RINGTRAIN_TLS_DIR"] == "/var/run/ringtrain/ring-token"
    env["RINGTRAIN_TOKEN_FILE"] = str(tmp_path / "token")
    env["RINGTRAIN_TLS_DIR"] = str(tmp_path)
    assert c["command"] == ["ringtrain", "worker"]
    cfg = TrainerConfig.from_args(c["args"], env)
    t = j.trainer
    assert (cfg.dataset, cfg.steps, cfg.epochs, cfg.batch_size) == ("mnist-5k", 20, None, 32)
    assert (cfg.ipus_per_worker, cfg.variables_on_host, cfg.bucket_mb) == (2, False, 0.5)
    assert (cfg.lr, cfg.lr_decay, cfg.optimizer, cfg.eval_every) == (0.01, 0.5, t.optimizer, 10)
    assert (cfg.checkpoint_dir, cfg.checkpoint_every) == ("/ckpt", 5)
    assert (cfg.metrics_port, cfg.json, cfg.termination_log) == (9400, True, "/dev/termination-log")
    assert (cfg.ring_transport, cfg.ring_step_timeout_s, cfg.ring_connect_timeout_s) == (
        "grpc",
        90.5,
        300.0,
    )
    assert cfg.ring_encrypt_data is True and cfg.token == b"s3cret"
    assert cfg.tls.files() == {
        k: base64.b64decode(v) for k, v in sec["data"].items() if k != "token"
    }
    assert (cfg.cluster.rank, cfg.cluster.world_size) == (2, 3)
    assert cfg.token == b"s3cret"


def test_the_crd_ring_defaults_are_the_trainer_defaults():
    """A job without spec.trainer.ring runs the ring exactly as a bare ``ringtrain worker``
    would: the CRD's defaults, passed as flags, equal the trainer's own defaults."""
    from ringtrain_trainer.config import TrainerConfig

    j = spec.load(job_obj(workers=2, trainer={}))
    (c,) = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"]
    cfg = TrainerConfig.from_args(c["args"], {})
    bare = TrainerConfig()
    assert (cfg.ring_transport, cfg.ring_step_timeout_s, cfg.ring_connect_timeout_s) == (
        bare.ring_transport,
        bare.ring_step_timeout_s,
        bare.ring_connect_timeout_s,
    )


def test_a_zero_learning_rate_is_refused_like_the_trainer_does():
    with pytest.raises(spec.InvalidSpec, match=r"spec\.trainer\.learningRate"):
        spec.load(job_obj(trainer={"learningRate": 0}))


def test_checkpoint_keep_reaches_the_workers_checkpoint_manager(tmp_path):
    """spec.trainer.checkpoint.keep is the worker's --checkpoint-keep (default 3, at least 1)."""
    from ringtrain_trainer.checkpoint.store import CheckpointManager
    from ringtrain_trainer.config import TrainerConfig

    j = spec.load(job_obj(trainer={"checkpoint": {"keep": 5}}))
    (c,) = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"]
    cfg = TrainerConfig.from_args(c["args"], {})
    assert (j.trainer.checkpoint_keep, cfg.checkpoint_keep) == (5, 5)
    assert TrainerConfig.from_args([], {}).checkpoint_keep == 3
    assert CheckpointManager(tmp_path, cfg.checkpoint_keep).keep == 5
    with pytest.raises(spec.InvalidSpec, match=r"spec\.trainer\.checkpoint\.keep"):
        spec.load(job_obj(trainer={"checkpoint": {"keep": 0}}))
    with pytest.raises(spec.InvalidSpec, match="--checkpoint-keep must be at least 1"):
        TrainerConfig.from_args(["--checkpoint-keep", "0"], {})


def test_ring_workers_declare_the_side_channel_and_probe_the_grpc_health_service():
    """exec (default: any cluster) runs `ringtrain health` on the ring port; grpc is the
    kubelet's own gRPC probe (>= 1.24); none leaves them out."""
    j = spec.load(job_obj(workers=2, trainer={}))
    c = manifests.pod(j, j.replica("worker"), 0)["spec"]["containers"][0]
    assert {"name": "ring-data", "containerPort": 2223, "protocol": "TCP"} in c["ports"]
    assert c["livenessProbe"]["exec"]["command"][:2] == ["ringtrain", "health"]
    assert "127.0.0.1:2222" in c["readinessProbe"]["exec"]["command"]
    grpc_form = manifests.worker_probes("grpc")
    assert grpc_form["livenessProbe"]["grpc"] == {"port": 2224}  # plaintext: kubelet has no TLS
    assert manifests.worker_probes("none") == {}
    assert manifests.probe_form({manifests.PROBE_ENV: "grpc"}) == "grpc"
    single = spec.load(job_obj(workers=1, trainer={}))
    assert (
        "livenessProbe"
        not in manifests.pod(single, single.replica("worker"), 0)["spec"]["containers"][0]
    )


def test_the_data_volume_is_mounted_read_only_and_replaces_data_dir():
    j = spec.load(
        job_obj(
            trainer={
                "data": {
                    "volume": {"persistentVolumeClaim": {"claimName": "my-data"}},
                    "path": "/mnt/in",
                    "file": "fashion.npz",
                }
            }
        )
    )
    p = manifests.pod(j, j.replica("worker"), 0)
    (c,) = p["spec"]["containers"]
    vols = {v["name"]: v for v in p["spec"]["volumes"]}
    assert vols["data"] == {"name": "data", "persistentVolumeClaim": {"claimName": "my-data"}}
    assert {"name": "data", "mountPath": "/mnt/in", "readOnly": True} in c["volumeMounts"]
    assert c["args"][c["args"].index("--data") + 1] == "/mnt/in/fashion.npz"
    bare = manifests.pod(job(), job().replica("worker"), 0)
    assert "data" not in {v["name"] for v in bare["spec"]["volumes"]}
    (c,) = bare["spec"]["containers"]
    assert c["args"][c["args"].index("--data") + 1] == "/usr/share/datasets/fashion-mnist"


def test_export_reaches_the_worker_and_the_evaluator_runs_the_same_command():
    from ringtrain_trainer.config import TrainerConfig

    j = spec.load(
        job_obj(
            workers=1,
            chief=1,
            evaluator=1,
            trainer={
                "dataset": "mnist-5k",
                "export": {"path": "out/m.onnx", "format": "onnx"},
                "checkpoint": {"volume": {"persistentVolumeClaim": {"claimName": "c"}}},
            },
        )
    )
    chief = manifests.pod(j, j.replica("chief"), 0)["spec"]["containers"][0]
    ev = manifests.pod(j, j.replica("evaluator"), 0)["spec"]["containers"][0]
    assert chief["args"] == ev["args"] and ev["command"] == ["ringtrain", "worker"]
    env = {e["name"]: e["value"] for e in ev["env"] if e["name"] == "TF_CONFIG"}
    cfg = TrainerConfig.from_args(ev["args"], env)
    assert (cfg.export, cfg.export_format) == ("out/m.onnx", "onnx")
    assert cfg.cluster.task_type == "evaluator" and not cfg.cluster.in_ring
    assert (
        cfg.cluster.ring
        == cluster.parse(env["TF_CONFIG"]).ring
        == ("mnist-chief-0.mnist.team-a.svc:2222", "mnist-worker-0.mnist.team-a.svc:2222")
    )
