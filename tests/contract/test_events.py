"""The progress/eval/final events, the ``/status`` document and their one human rendering.

The JSON keys and their order are a wire format: the operator, ``ringtrain run`` and users'
scripts read them, so these tests pin them to the bytes the trainer printed before the
dataclasses existed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ringtrain import events
from ringtrain_operator import observe as opstatus
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.telemetry.metrics import TrainerMetrics

PROGRESS = (
    '{"event":"progress","step":120,"epoch":0,"loss":0.412346,"samples_per_s":8412.3,'
    '"eta_s":45.0,"total_steps":500}'
)
EVAL = '{"event":"eval","step":120,"test_accuracy":0.8821}'
FINAL = (
    '{"event":"final","steps":500,"epoch":1,"loss":0.2,"test_accuracy":0.91,'
    '"samples_per_s":8300.0,"checkpoint":"/checkpoints/ckpt-0000000500.json","rank":0,'
    '"world_size":2,"terminated":false}'
)
#: a chief that merged a --trace-steps timeline names it; otherwise the key is left out
FINAL_WITH_TRACE = FINAL[:-1] + ',"trace":"/checkpoints/trace.json"}'
STATUS = (
    '{"step": 0, "epoch": 0, "loss": null, "samples_per_s": null, "test_accuracy": null, '
    '"phase": "Starting"}'
)


@pytest.mark.parametrize("line", [PROGRESS, EVAL, FINAL])
def test_every_event_round_trips_to_the_same_json_bytes(line):
    event = events.parse_line(line)
    assert event is not None and event.to_json() == line
    assert events.parse(event.to_dict()) == event


def test_the_trace_field_appears_only_when_a_trace_was_written():
    assert events.parse_line(FINAL).trace is None
    traced = events.parse_line(FINAL_WITH_TRACE)
    assert traced.trace == "/checkpoints/trace.json" and traced.to_json() == FINAL_WITH_TRACE


def test_the_status_document_has_no_event_key_and_keeps_its_bytes():
    assert json.dumps(events.Status().to_dict()) == STATUS
    st = events.Status.from_dict({"step": 7, "loss": 1.5, "phase": "Training", "extra": 1})
    assert (st.step, st.loss, st.epoch, st.phase) == (7, 1.5, None, "Training")


def test_the_trainers_status_starts_as_the_documented_bytes_and_rejects_unknown_fields():
    m = TrainerMetrics()
    assert json.dumps(m.status()) == STATUS
    m.update_status(step=3, phase="Training")
    assert (m.status()["step"], m.status()["phase"]) == (3, "Training")
    with pytest.raises(TypeError):
        m.update_status(stpe=4)


def test_the_contract_imports_neither_side():
    code = (
        "import sys, ringtrain.events; "
        "print(sorted(m for m in sys.modules if m.startswith('ringtrain_')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_reading_is_lenient_and_log_lines_are_not_events():
    assert events.parse_line("Epoch 1 starting") is None
    assert events.parse_line("{not json") is None
    assert events.parse_line('{"event":"error","error":"boom","exit_code":2}') is None
    assert events.parse([1, 2]) is None
    older = events.parse({"event": "final", "steps": 3, "unknown": True})
    assert older == events.Final(steps=3)


EVALUATION = (
    '{"event":"evaluation","step":20,"test_loss":0.5181,"test_accuracy":0.845,'
    '"checkpoint":"/checkpoints/ckpt-0000000020.json"}'
)


def test_the_evaluators_events_and_the_newer_final_fields_round_trip():
    event = events.parse_line(EVALUATION)
    assert isinstance(event, events.Evaluation) and event.to_json() == EVALUATION
    assert events.format_event(event) == (
        "checkpoint step 20  test loss 0.5181  test accuracy 0.8450"
    )
    done = events.Final(
        steps=20, test_accuracy=0.845, test_loss=0.5181, evaluations=2, terminated=False
    )
    assert events.parse_line(done.to_json()) == done
    assert events.format_event(done) == (
        "done: evaluated 2 checkpoints, last step 20, test loss 0.5181, test accuracy 0.8450"
    )
    exported = events.Final(steps=5, export="/checkpoints/model.keras")
    assert exported.to_dict()["export"] == "/checkpoints/model.keras"
    assert events.format_event(exported).endswith(", export /checkpoints/model.keras")
    assert "export" not in events.Final(steps=5).to_dict()  # left out while None: FINAL's bytes
    assert "test_loss" not in events.Status().to_dict()
    assert "ipu_memory" not in events.Status().to_dict()


def test_events_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        events.Progress(step=1).step = 2  # type: ignore[misc]


def test_human_lines_for_each_event():
    assert events.format_event(events.parse_line(PROGRESS)) == (
        "step 120/500 (24%)  epoch 0  loss 0.4123  8,412 samples/s  ETA 0:45"
    )
    assert events.format_event(events.parse_line(EVAL)) == "step 120  test accuracy 0.8821"
    assert events.format_event(events.parse_line(FINAL)) == (
        "done: 500 steps, loss 0.2000, test accuracy 0.9100, 8,300 samples/s, "
        "checkpoint /checkpoints/ckpt-0000000500.json"
    )


def test_human_lines_leave_out_or_mark_what_is_not_known():
    assert events.format_event(events.Progress(step=None)) == "starting"
    assert events.format_event(events.Progress(step=7, eta_s=4000)) == "step 7  ETA 1:06:40"
    assert events.format_event(events.Final(steps=0, samples_per_s=0.0)) == (
        "done: 0 steps, loss n/a, test accuracy n/a, 0 samples/s"
    )


def test_the_operator_reads_progress_from_fields_the_contract_defines():
    names = {f.name for cls in (events.Status, events.Final) for f in dataclasses.fields(cls)}
    assert set(opstatus._PROGRESS_KEYS) <= names
    final = events.parse_line(FINAL)
    assert opstatus.read_progress(final.to_dict()) == {
        "step": 500,
        "epoch": 1,
        "loss": 0.2,
        "samplesPerSecond": 8300.0,
        "testAccuracy": 0.91,
        "checkpoint": "/checkpoints/ckpt-0000000500.json",
    }


def _serve(body: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize(
    "body,expected",
    [
        (
            b'{"step": 12, "epoch": 0, "loss": 0.5, "phase": "Training"}',
            events.Status(step=12, epoch=0, loss=0.5, phase="Training"),
        ),
        (b"not json", None),
        (b"[1, 2]", None),
    ],
)
def test_fetch_status_reads_a_status_document_or_gives_none(body, expected):
    server = _serve(body)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/status"
        assert events.fetch_status(url, timeout_s=2.0) == expected
    finally:
        server.shutdown()
        server.server_close()


def test_fetch_status_of_nothing_listening_is_none():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()
    assert events.fetch_status(f"http://127.0.0.1:{port}/status", timeout_s=0.5) is None


def test_the_operator_reads_the_memory_report_the_trainer_serves():
    from ringtrain_trainer.ipu import memory
    from ringtrain_trainer.ipu.device import IPU, IPUConfig

    spec = keras_load.build("cnn")
    params = spec.init(0)
    plan = IPU(
        spec,
        IPUConfig(variables_on_host=False, optimizer_state_bytes=8 * len(params)),
        params,
        params.copy(),
    ).plan(32, True)
    metrics = TrainerMetrics()
    metrics.set_plan(plan, 0)
    doc = json.loads(json.dumps(metrics.status()))  # as /status sends it
    got = opstatus.read_progress(doc)["ipuMemory"]
    camel = {"optimizer_state": "optimizerStateBytes"}
    assert got == {
        "capacityBytes": plan.capacity,
        "totalBytes": plan.total,
        **{camel.get(k, f"{k}Bytes"): v for k, v in plan.kinds().items()},
        "hostOptimizerStateBytes": 0,
    }
    assert got["optimizerStateBytes"] == 8 * len(params) and set(memory.KINDS) == set(plan.kinds())
