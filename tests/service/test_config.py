"""service/config.py: the shipped config.toml, strict refusal of bad keys and values, overrides."""

import argparse
import tomllib
from pathlib import Path

import pytest

from service.config import (
    ConfigError,
    ServiceConfig,
    all_keys,
    load_config,
    overlap_on,
    parse_set_flags,
    worker_cpu_threads,
)

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "my.toml"
    path.write_text(text)
    return path


def refused(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or {})
    return str(info.value)


def test_shipped_config_lists_every_key_with_its_default():
    cfg = load_config(SHIPPED, {})
    assert cfg == ServiceConfig()
    raw = tomllib.loads(SHIPPED.read_text())
    listed = [f"{s}.{k}" for s, table in raw.items() for k in table]
    assert listed == all_keys()
    # the defaults the design and the brief fix
    assert cfg.service.client_endpoint == "tcp://127.0.0.1:5557"
    assert cfg.service.heartbeat_interval_s == 2.0 and cfg.service.client_timeout_s == 10.0
    assert cfg.runtime.page_size == 16 and cfg.scheduling.overlap == "auto"


def test_no_file_gives_defaults():
    assert load_config(None, {}) == ServiceConfig()


def test_partial_file_keeps_other_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "[runtime]\npage_size = 32\n"), {})
    assert cfg.runtime.page_size == 32
    assert cfg.runtime.max_kv_tokens == ServiceConfig().runtime.max_kv_tokens
    assert cfg.model == ServiceConfig().model


def test_unknown_section(tmp_path):
    msg = refused(write(tmp_path, "[runtim]\npage_size = 32\n"))
    assert "my.toml" in msg and "[runtim]" in msg and "[runtime]" in msg


def test_unknown_key(tmp_path):
    msg = refused(write(tmp_path, "[runtime]\npagesize = 32\n"))
    assert "my.toml" in msg and "runtime.pagesize" in msg
    assert "did you mean runtime.page_size" in msg


@pytest.mark.parametrize("line, key, allowed", [
    ('[runtime]\npage_size = "16"', "runtime.page_size", "[1, 1024]"),
    ("[runtime]\npage_size = 16.0", "runtime.page_size", "integer"),
    ("[scheduling]\noverlap = 1", "scheduling.overlap", 'true, false or "auto"'),
    ("[service]\nclient_timeout_s = \"10\"", "service.client_timeout_s", "number"),
    ("[model]\ndtype = 16", "model.dtype", '"bf16"'),
])
def test_wrong_type(tmp_path, line, key, allowed):
    msg = refused(write(tmp_path, line + "\n"))
    assert "my.toml" in msg and key in msg and "wrong type" in msg and allowed in msg


def test_out_of_range(tmp_path):
    msg = refused(write(tmp_path, "[runtime]\npage_size = 0\n"))
    assert msg == ("%s: runtime.page_size = 0 is out of range: must be an integer in [1, 1024]"
                   % (tmp_path / "my.toml"))
    msg = refused(write(tmp_path, "[worker]\nmax_restarts = -1\n"))
    assert "worker.max_restarts = -1" in msg and "[0, 1000]" in msg
    msg = refused(write(tmp_path, "[service]\ntelemetry_interval_s = 0.0\n"))
    assert "service.telemetry_interval_s" in msg and "(0, 60]" in msg
    msg = refused(write(tmp_path, "[service]\nclient_timeout_s = inf\n"))
    assert "service.client_timeout_s" in msg and "out of range" in msg


@pytest.mark.parametrize("line, key, shown", [
    ('[runtime]\nattention_backend = "flash"', "runtime.attention_backend", '"triton"'),
    ('[model]\ndtype = "int8"', "model.dtype", '"fp32"'),
    ('[model]\ndevice = "gpu"', "model.device", "cuda:N"),
    ('[service]\nclient_endpoint = "localhost:5557"', "service.client_endpoint", "tcp://"),
])
def test_bad_choice(tmp_path, line, key, shown):
    msg = refused(write(tmp_path, line + "\n"))
    assert "my.toml" in msg and key in msg and shown in msg


def test_keys_that_depend_on_each_other(tmp_path):
    msg = refused(None, {"service.heartbeat_interval_s": 10.0})
    assert "service.heartbeat_interval_s" in msg and "service.client_timeout_s" in msg
    msg = refused(None, {"runtime.page_size": 64, "runtime.max_kv_tokens": 32})
    assert "runtime.max_kv_tokens" in msg
    msg = refused(None, {"service.telemetry_endpoint": "tcp://127.0.0.1:5557"})
    assert "must differ" in msg


def test_overrides_win(tmp_path):
    path = write(tmp_path, "[runtime]\npage_size = 32\nattention_backend = \"triton\"\n")
    cfg = load_config(path, {"runtime.page_size": 8, "spec.algorithm": "eagle3",
                             "model.device": None})  # None = flag not given
    assert cfg.runtime.page_size == 8
    assert cfg.runtime.attention_backend == "triton"  # from the file
    assert cfg.spec.algorithm == "eagle3"
    assert cfg.model.device == "auto"


def test_bad_overrides_name_the_key():
    msg = refused(None, {"runtime.page_size": 0})
    assert msg.startswith("command line: runtime.page_size = 0 is out of range")
    assert "runtime.nope" in refused(None, {"runtime.nope": 1})
    assert "section.key" in refused(None, {"page_size": 1})


def test_set_flags_parse_toml_values():
    overrides = parse_set_flags(["runtime.page_size=32", "model.device=cuda:0",
                                 "scheduling.overlap=false", "service.client_timeout_s=30"])
    assert overrides == {"runtime.page_size": 32, "model.device": "cuda:0",
                         "scheduling.overlap": False, "service.client_timeout_s": 30}
    cfg = load_config(None, overrides)
    assert cfg.service.client_timeout_s == 30.0 and cfg.model.device == "cuda:0"
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set_flags(["runtime.page_size"])


def test_file_errors(tmp_path):
    assert "not found" in refused(tmp_path / "missing.toml")
    msg = refused(write(tmp_path, "[runtime\npage_size = 1\n"))
    assert "my.toml" in msg and "not valid TOML" in msg
    msg = refused(write(tmp_path, "runtime = 3\n"))
    assert "runtime must be a table" in msg


def test_spec_settings_are_checked_together(tmp_path):
    path = write(tmp_path, "[spec]\nalgorithm = \"eagle3\"\nnum_steps = 4\ntopk = 1\n"
                           "num_draft_tokens = 8\n")
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        load_config(path)
    with pytest.raises(ConfigError, match="spec.algorithm"):
        load_config(None, {"spec.algorithm": "medusa"})


def test_spec_disable_above_batch_size_reaches_the_worker_settings(tmp_path):
    from fmserve.serve_cmd import add_serve_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--config", str(write(tmp_path, "[spec]\nalgorithm = \"eagle3\"\n")),
                              "--spec-disable-above-batch-size", "6"])
    assert config_from_args(args).spec.disable_above_batch_size == 6
    assert "spec.disable_above_batch_size = -1 is out of range" in refused(
        None, {"spec.disable_above_batch_size": -1})


def test_unreadable_config_files_name_the_file(tmp_path):
    # A directory (or an unreadable file) and a file that is not UTF-8 used to escape as a raw
    # IsADirectoryError traceback, or a UnicodeDecodeError naming no file.
    (tmp_path / "adir.toml").mkdir()
    msg = refused(tmp_path / "adir.toml")
    assert "adir.toml" in msg and "cannot read the config file" in msg
    path = tmp_path / "latin1.toml"
    path.write_bytes("[model]\npath = \"caf\xe9\"\n".encode("latin-1"))
    msg = refused(path)
    assert "latin1.toml" in msg and "not UTF-8" in msg


def test_tcp_port_out_of_range_is_refused():
    # ZMQ takes the port modulo 2^16: ":99999" bound port 34463 without a word.
    msg = refused(None, {"service.client_endpoint": "tcp://127.0.0.1:99999"})
    assert "service.client_endpoint" in msg and "[0, 65535]" in msg
    cfg = load_config(None, {"service.client_endpoint": "tcp://127.0.0.1:65535",
                             "service.telemetry_endpoint": "tcp://127.0.0.1:0"})
    assert cfg.service.telemetry_endpoint == "tcp://127.0.0.1:0"  # 0: any free port


def test_serve_refuses_an_endpoint_it_cannot_bind_before_loading_the_model(tmp_path):
    # The service binds only after its worker has loaded the model, and a bind error there was
    # a zmq traceback naming neither the key nor what to do.
    import socket

    from fmserve.serve_cmd import check_endpoints

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, {"service.client_endpoint": f"tcp://127.0.0.1:{port}",
                                 "service.telemetry_endpoint": "tcp://127.0.0.1:0",
                                 "http.port": 0})
        with pytest.raises(ConfigError, match=f"service.client_endpoint = 'tcp://127.0.0.1:"
                                              f"{port}' cannot be bound: Address already in use"):
            check_endpoints(cfg)
        check_endpoints(load_config(None, {"service.client_endpoint": "tcp://127.0.0.1:0",
                                           "service.telemetry_endpoint": "tcp://*:0",
                                           "service.insecure": True, "http.port": 0}))
        with pytest.raises(ConfigError, match=f"http.port = {port} \\(on 127.0.0.1\\) cannot "
                                              f"be bound: Address already in use"):
            check_endpoints(load_config(None, {"service.client_endpoint": "tcp://127.0.0.1:0",
                                               "service.telemetry_endpoint": "tcp://*:0",
                                               "service.insecure": True, "http.port": port}))
    cfg = load_config(None, {"service.client_endpoint": "tcp://127.0.0.1:0",
                             "service.telemetry_endpoint": "tcp://192.0.2.1:5558",  # TEST-NET-1
                             "service.insecure": True, "http.port": 0})
    with pytest.raises(ConfigError, match="service.telemetry_endpoint = 'tcp://192.0.2.1:5558' "
                                          "cannot be bound"):
        check_endpoints(cfg)


def test_serve_refuses_a_draft_model_that_is_no_head_directory(tmp_path):
    # It used to surface only after the worker had loaded the model, with the worker's log.
    from fmserve.default_model import ModelPathError
    from fmserve.serve_cmd import with_draft_model

    cfg = load_config(None, {"spec.algorithm": "eagle3",
                             "spec.draft_model": str(tmp_path / "nowhere")})
    with pytest.raises(ModelPathError, match="nowhere' is not a draft head directory"):
        with_draft_model(cfg)


def test_serve_log_level_is_checked_by_the_parser(capsys):
    # It reached logging.basicConfig, whose "Unknown level: 'BOGUS'" named no flag.
    from fmserve.serve_cmd import add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(["--log-level", "warning"]).log_level == "WARNING"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "bogus"])
    assert "argument --log-level: invalid choice: 'BOGUS'" in capsys.readouterr().err


def test_strict_types_and_finite_numbers():
    # A bool is no integer and an integer no bool; NaN and inf are no durations.
    assert "wrong type" in refused(None, {"runtime.page_size": True})
    assert "wrong type" in refused(None, {"runtime.wrwr_check": 1})
    for bad in (float("nan"), float("inf")):
        msg = refused(None, {"service.heartbeat_interval_s": bad})
        assert "service.heartbeat_interval_s" in msg and "out of range" in msg
    msg = refused(None, {"spec.topk": 9})
    assert msg == "command line: spec.topk = 9 is out of range: must be an integer in [1, 8]"


def test_worker_config_comes_from_the_sections():
    cfg = load_config(SHIPPED, {"runtime.page_size": 32, "spec.algorithm": "eagle3",
                                "scheduling.launch_ahead": "prepare"})
    worker = cfg.worker_config()
    assert worker.runtime is cfg.runtime and worker.model is cfg.model and worker.spec is cfg.spec
    assert worker.launch_ahead == "prepare"  # the [scheduling] section's, not its own "auto"


def test_http_api_beyond_loopback_needs_an_api_key():
    with pytest.raises(ConfigError, match=r'http.host = "0.0.0.0" would serve the HTTP API '
                                          r'beyond this machine with no API key: set one .*'
                                          r'FMSERVE_API_KEY'):
        load_config(None, {"http.host": "0.0.0.0"})
    assert load_config(None, {"http.host": "0.0.0.0", "http.api_key": "k"}).http.api_key == "k"
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert load_config(None, {"http.host": host}).http.host == host
    assert load_config(None, {"http.host": "0.0.0.0", "http.enabled": False}).http.host


def test_api_key_comes_from_the_flag_then_the_environment_then_the_file(tmp_path, monkeypatch):
    import argparse

    from fmserve.serve_cmd import add_serve_args, config_from_args
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[http]\napi_key = "from-file"\n')
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    monkeypatch.delenv("FMSERVE_API_KEY", raising=False)
    assert config_from_args(parser.parse_args(["--config", str(cfg_file)])).http.api_key == \
        "from-file"
    monkeypatch.setenv("FMSERVE_API_KEY", "from-env")
    assert config_from_args(parser.parse_args(["--config", str(cfg_file)])).http.api_key == \
        "from-env"
    assert config_from_args(parser.parse_args(["--config", str(cfg_file), "--api-key", "flag"])
                            ).http.api_key == "flag"


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://192.0.2.1:1",
                                      "tcp://eth0:5557", "tcp://example.org:5557"])
def test_an_endpoint_beyond_loopback_needs_curve_or_insecure(endpoint):
    for key in ("client_endpoint", "telemetry_endpoint"):
        message = refused(None, {f"service.{key}": endpoint})
        assert f'command line: service.{key} = "{endpoint}" can be reached from other ' \
               f'machines' in message
        for how in ("fmserve keys DIR", 'service.curve_keys = "DIR"', "--curve-keys DIR",
                    "service.insecure = true", "--insecure", "tcp://127.0.0.1:PORT"):
            assert how in message
        assert load_config(None, {f"service.{key}": endpoint, "service.insecure": True})
        assert load_config(None, {f"service.{key}": endpoint, "service.curve_keys": "keys"})
    assert "drop one" in refused(None, {"service.insecure": True, "service.curve_keys": "k"})


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.8.9.10:0",
                                      "tcp://localhost:5557", "ipc:///tmp/fm.sock",
                                      "inproc://fm"])
def test_a_loopback_or_local_endpoint_needs_nothing(endpoint):
    assert load_config(None, {"service.client_endpoint": endpoint}).service.insecure is False


def test_the_admin_token_comes_from_the_environment_over_the_file(tmp_path, monkeypatch):
    from fmserve.serve_cmd import add_serve_args, config_from_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    path = write(tmp_path, '[service]\nadmin_token = "from-file"\n')
    token = lambda *flags: config_from_args(  # noqa: E731
        parser.parse_args(["--config", str(path), *flags])).service.admin_token
    monkeypatch.delenv("FMSERVE_ADMIN_TOKEN", raising=False)
    assert token() == "from-file"
    monkeypatch.setenv("FMSERVE_ADMIN_TOKEN", "from-env")
    assert token() == "from-env"
    assert token("--set", "service.admin_token=from-set") == "from-set"


def test_serve_refuses_a_plain_endpoint_beyond_loopback_at_start(capsys):
    from fmserve.cli import main

    assert main(["serve", "--endpoint", "tcp://0.0.0.0:5557"]) == 2
    err = capsys.readouterr().err
    assert 'service.client_endpoint = "tcp://0.0.0.0:5557" can be reached from other machines' \
        in err and "--curve-keys DIR" in err and "--insecure" in err


def test_a_bad_drain_timeout_names_its_closed_range():
    # A float range with ge (not gt) was a TypeError while building the message (fuzzing).
    message = refused(None, {"service.drain_timeout_s": -1.0})
    assert "service.drain_timeout_s = -1.0 is out of range: must be a number in [0, 3600]" in message
    assert "has the wrong type" in refused(None, {"service.drain_timeout_s": [1]})


@pytest.mark.parametrize("cores, device, on, threads", [
    (2, "cpu", False, 0), (4, "cpu", True, 3), (16, "cpu", True, 0), (2, "cuda:0", True, 0)])
def test_overlap_auto_is_on_where_the_scheduler_does_not_take_the_workers_core(
        monkeypatch, cores, device, on, threads):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    auto = load_config(None, {})
    assert overlap_on(auto, device) is on
    if device == "cpu":  # 3-8 cores: one is left to the scheduler while it overlaps
        assert worker_cpu_threads(auto) == threads
    for forced in (True, False):
        cfg = load_config(None, {"scheduling.overlap": forced})
        assert overlap_on(cfg, device) is forced


def test_parallel_settings_reach_the_worker():
    from fmserve.cli import build_parser
    from fmserve.serve_cmd import config_from_args

    args = build_parser().parse_args(["serve", "--tp", "2", "--dp", "3", "--config",
                                      str(SHIPPED)])
    cfg = config_from_args(args)
    assert cfg.parallel.tp == 2 and cfg.worker_config().parallel.tp == 2
    assert cfg.parallel.dp == 3
    assert "out of range" in refused(None, {"parallel.dp": 0})
    assert "out of range" in refused(None, {"parallel.tp": 0})
    # EAGLE runs on tensor-parallel ranks too (tests/gpu/test_tensor_parallel_eagle.py).
    spec_tp = load_config(None, {"parallel.tp": 2, "spec.algorithm": "eagle3"}).worker_config()
    assert spec_tp.parallel.tp == 2 and spec_tp.spec.enabled
    # DP attention: one group of tp attention ranks (tests/e2e/test_dp_attention_service.py);
    # not several such groups yet, and no overlap (the group steps one plan at a time).
    dpa = load_config(None, {"parallel.tp": 2, "parallel.dp_attention": True})
    assert dpa.worker_config().parallel.dp_attention and not overlap_on(dpa, "cuda:0")
    assert "not built yet" in refused(None, {"parallel.tp": 2, "parallel.dp": 2,
                                             "parallel.dp_attention": True})
    assert "needs parallel.tp >= 2" in refused(None, {"parallel.dp_attention": True})
    # The attention ranks' batches differ: a fixed drafting limit would split their forwards.
    assert "all must draft or none" in refused(None, {
        "parallel.tp": 2, "parallel.dp_attention": True, "spec.algorithm": "eagle3",
        "spec.disable_above_batch_size": 4})


def test_tensor_parallel_ranks_and_replicas_share_the_cpu_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _: {0, 1, 2, 3})
    assert worker_cpu_threads(load_config(None, {"parallel.tp": 2})) == 2
    assert worker_cpu_threads(load_config(None, {"parallel.tp": 8})) == 1
    # Data-parallel replicas share them too: one team per rank of every replica.
    assert worker_cpu_threads(load_config(None, {"parallel.dp": 2})) == 2
    assert worker_cpu_threads(load_config(None, {"parallel.dp": 2, "parallel.tp": 2})) == 1
