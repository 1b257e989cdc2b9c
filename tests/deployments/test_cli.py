"""`python -m deployments`: the app config its `serve` builds from a Serve config file and
arguments, and what `info` and `health` print, with no Ray (the README test runs them served)."""

import http.server
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments import cli
from tests.ports import free_port

REPOSITORY = Path(__file__).resolve().parents[2]
SERVE_CONFIG = REPOSITORY / "deployments/serve_config.yaml"


def serve_arguments(*argv: str):
    return cli._parser().parse_args(["serve", *argv])


def test_serve_takes_the_config_files_application_args_under_the_arguments(tiny_family_dirs):
    directory = tiny_family_dirs["flux"]
    config, http_options = cli.app_config(
        serve_arguments(
            "--config",
            str(SERVE_CONFIG),
            "--model",
            str(directory),
            "num_worker_replicas=1",
            "limits.max_inference_steps=50",
        )
    )
    assert http_options == {"host": "127.0.0.1", "port": 8000}
    assert config.app_name == "rollout" and config.probe_port == 8001
    # The file's embedded model name gives way to the directory, whose model_index.json names the family.
    assert config.model.path == str(directory) and config.model.label() == "flux"
    assert config.num_worker_replicas == 1 and config.worker_num_cpus == 0.5
    # A nested field set by a dotted key keeps the file's other fields beside it.
    assert config.limits.max_inference_steps == 50 and config.limits.max_outputs_per_prompt == 64


def test_serve_without_a_file_is_make_serves_defaults():
    config, http_options = cli.app_config(serve_arguments("--port", "8123"))
    assert http_options == {"host": "127.0.0.1", "port": 8123}
    assert config.probe_port == 8001 and config.model.label() == "embedded-digits" and config.model.path is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("applications: []\n", "applications: expected a list of one application"),
        (
            "applications:\n  - import_path: other.app:build\n",
            "applications[0].import_path: expected deployments.app:build_app",
        ),
        ("applications: [\n", "ParserError"),
    ],
)
def test_a_config_file_that_is_not_one_rollout_application_is_one_line(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as stopped:
        cli.app_config(serve_arguments("--config", str(path)))
    assert str(stopped.value).startswith(f"--config {path}: ") and message in str(stopped.value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/m", "model.path=/n"], "arguments: --model and model.path= both set the model's directory"),
        (["num_worker_replicas=0"], "app config: num_worker_replicas: "),
        (["model.path=/no/such/model"], "app config: model.path: /no/such/model is not a directory: it does not exist"),
        (["model.dtype"], "arguments: "),
        # Issue 46: a host other machines reach, with nothing asked of them.
        (["--host", "0.0.0.0"], "app config: serving on 0.0.0.0, which other machines reach, needs auth_token"),
        (["--host", "10.1.2.3"], "app config: serving on 10.1.2.3, which other machines reach, needs auth_token"),
    ],
)
def test_bad_arguments_are_one_line_naming_the_field(argv, message):
    with pytest.raises(SystemExit) as stopped:
        cli.app_config(serve_arguments(*argv))
    assert str(stopped.value).startswith(message) and "\n" not in str(stopped.value)


def test_a_public_host_serves_with_a_token_or_when_allowed_without_one(monkeypatch):
    monkeypatch.delenv("ROLLOUT_AUTH_TOKEN", raising=False)
    for argv in (["--host", "0.0.0.0", "auth_token=s3cret"], ["--host", "0.0.0.0", "allow_unauthenticated=true"]):
        assert cli.app_config(serve_arguments(*argv))[1]["host"] == "0.0.0.0"
    assert cli.app_config(serve_arguments("--host", "127.0.0.2"))[1]["host"] == "127.0.0.2"


class Answering(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the class's status and JSON body, and records the Authorization header."""

    status, body, authorization = 200, {}, []

    def do_GET(self):
        type(self).authorization.append(self.headers.get("Authorization"))
        payload = json.dumps(self.body).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_sigterm_stops_serve_as_ctrl_c_does(monkeypatch, capsys):
    """`docker stop` sends SIGTERM to the main process only: `serve` takes Ctrl-C's way out, so the
    ingress answers what is in flight before the application and Ray go (README.md's test sends the
    Ctrl-C to a served `make serve`; benchmarks.reliability times both signals on one)."""
    import ray
    from ray import serve

    from deployments import local_ray

    calls = []

    def call(name):
        return lambda *args, **kwargs: calls.append(name)

    ingress = SimpleNamespace(
        stop_serving=SimpleNamespace(remote=lambda: SimpleNamespace(result=call("ingress.stop_serving")))
    )
    monkeypatch.setattr(local_ray, "start_local_ray", call("start_local_ray"))
    monkeypatch.setattr(serve, "start", call("serve.start"))
    monkeypatch.setattr(cli, "run_app", lambda config: calls.append("run_app") or ingress)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"))
    for module, name in ((serve, "delete"), (serve, "shutdown"), (ray, "shutdown")):
        monkeypatch.setattr(module, name, call(f"{module.__name__}.{name}"))
    main_thread = threading.main_thread()

    def terminate_once_serving():
        # Only once `serve` waits with its handler in place: a SIGTERM without it would end pytest.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            waiting_in = sys._current_frames()[main_thread.ident].f_code.co_name
            if signal.getsignal(signal.SIGTERM) is cli._stop_as_on_ctrl_c and waiting_in == "wait":
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    def give_up(signum, frame):
        raise TimeoutError("serve did not wait with its SIGTERM handler installed within 30 s")

    previous_handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    signal.signal(signal.SIGUSR1, give_up)
    threading.Thread(target=terminate_once_serving, daemon=True).start()
    try:
        cli.serve(serve_arguments("--port", "8123"))
    finally:
        for number, handler in previous_handlers.items():
            signal.signal(number, handler)
    assert "serving application 'rollout'" in capsys.readouterr().out
    assert calls == [
        "start_local_ray",
        "serve.start",
        "run_app",
        "ingress.stop_serving",
        "ray.serve.delete",
        "ray.serve.shutdown",
        "ray.shutdown",
    ]


@pytest.fixture
def answering():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Answering.authorization = []
    yield server
    server.shutdown()
    server.server_close()


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_health_prints_ready_and_sends_the_token(answering, monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUT_AUTH_TOKEN", "s3cret")
    Answering.status, Answering.body = 200, {"status": "ok", "worker_replicas_running": 2}
    cli.main(["health", "--url", base_url(answering)])
    assert capsys.readouterr().out == "ready: 2 worker replica(s) running\n"
    assert Answering.authorization == ["Bearer s3cret"]


def test_health_exits_1_with_the_reason_when_not_ready(answering):
    Answering.status, Answering.body = 503, {"status": "unhealthy", "reason": "no worker replica is running"}
    with pytest.raises(SystemExit) as stopped:
        cli.main(["health", "--url", base_url(answering)])
    assert str(stopped.value) == f"{base_url(answering)}/health: 503: no worker replica is running"


def test_a_refused_token_says_which_variable_to_set(answering, monkeypatch):
    monkeypatch.delenv("ROLLOUT_AUTH_TOKEN", raising=False)
    Answering.status, Answering.body = 401, {"detail": "missing bearer token"}
    with pytest.raises(SystemExit) as stopped:
        cli.main(["info", "--url", base_url(answering)])
    assert (
        str(stopped.value) == f"{base_url(answering)}/rollout/info: 401: set ROLLOUT_AUTH_TOKEN to the server's token"
    )
    assert Answering.authorization == [None]


def test_no_server_is_one_line_that_says_to_start_one():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["info", "--url", url])
    assert str(stopped.value).startswith(f"{url}/rollout/info: no answer (") and "make serve" in str(stopped.value)


def test_calibrate_prints_the_table_and_writes_it_into_a_serve_config_file(tmp_path, capsys):
    config_file = tmp_path / "serve_config.yaml"
    config_file.write_text(SERVE_CONFIG.read_text())
    arguments = ["calibrate", "--size", "16x16", "--candidates", "1", "2", "--repeats", "1", "--load", "3"]
    cli.main([*arguments, "--write", str(config_file)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("embedded-digits, float32, on cpu, batch invariance by padding: ms for a batch of 3 samples")
    assert printed[1] == "| size | calls of | 1 | 2 | chosen |"
    assert printed[3].startswith("| 16x16 | transformer | ") and printed[4].startswith("| 16x16 | VAE | ")
    chosen, chosen_for_decode = (int(line.rsplit("|", 2)[1]) for line in printed[3:5])
    assert printed[5] == f'model.micro_batch_sizes: {{"16x16": {chosen}}}'
    assert printed[6] == f'model.decode_batch_sizes: {{"16x16": {chosen_for_decode}}}'
    config, _ = cli.app_config(serve_arguments("--config", str(config_file)))
    assert config.model.micro_batch_sizes == {"16x16": chosen} and config.num_worker_replicas == 2
    assert config.model.decode_batch_sizes == {"16x16": chosen_for_decode}


def test_calibrate_under_kernels_checks_invariance_and_writes_the_mode_with_the_sizes(tmp_path, capsys):
    config_file = tmp_path / "serve_config.yaml"
    config_file.write_text(SERVE_CONFIG.read_text())
    arguments = ["calibrate", "--candidates", "1", "4", "--repeats", "1", "--batch-invariance", "kernels"]
    cli.main([*arguments, "--write", str(config_file)])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("embedded-digits, float32, on cpu, batch invariance by kernels:")
    assert printed[4].startswith("| 16x16 | VAE | ") and printed[4].endswith(" | an image a call |")
    assert printed[5] == (
        "16x16: a sample alone and beside two others, velocity differs by 0, image by 0: batch invariance holds"
    )
    config, _ = cli.app_config(serve_arguments("--config", str(config_file)))
    assert config.model.batch_invariance == "kernels" and set(config.model.micro_batch_sizes) == {"16x16"}
    assert config.model.decode_batch_sizes == {}  # the kernels decode an image a call


def test_calibrate_names_a_bad_size():
    with pytest.raises(SystemExit) as stopped:
        cli.main(["calibrate", "--size", "16"])
    assert str(stopped.value) == "--size: expected HEIGHTxWIDTH such as 1024x1024, got '16'"


def test_calibrate_names_a_bad_load():
    with pytest.raises(SystemExit) as stopped:
        cli.main(["calibrate", "--load", "0"])
    assert str(stopped.value) == "calibrate: load must be an integer >= 1, got 0"


def test_an_answer_that_is_not_a_json_object_is_one_line(answering):
    Answering.status, Answering.body = 200, ["not", "an", "object"]
    with pytest.raises(SystemExit) as stopped:
        cli.main(["health", "--url", base_url(answering)])
    assert str(stopped.value) == f'{base_url(answering)}/health: 200, not a JSON object: b\'["not", "an", "object"]\''
