"""The command line's defaults are the config dataclasses' own: a flag repeats no value."""

from __future__ import annotations

import dataclasses

import pytest

from servicer.cli import config_from_args, parse_args
from servicer.engine_config import EngineConfig, SpeculationConfig
from servicer.handlers import HandlerOptions
from servicer.model_files import ModelSpec
from servicer.server import ServerConfig


def _defaults(config: type) -> dict[str, object]:
    return {
        each.name: each.default_factory()
        if each.default_factory is not dataclasses.MISSING
        else each.default
        for each in dataclasses.fields(config)
    }


def test_no_flags_build_the_dataclasses_defaults(monkeypatch):
    """Every field a flag sets reads, with no flags, as its dataclass's default: a default
    changed on one side only fails here."""
    monkeypatch.delenv("MLX_GRPC_WORKER_FAULTS", raising=False)
    config = config_from_args(parse_args([]))
    assert config.engine == EngineConfig()
    assert config.engine.speculation == SpeculationConfig()
    assert config.handlers == HandlerOptions()
    server = _defaults(ServerConfig)
    for name, value in server.items():
        if name == "model":
            assert config.model == ModelSpec(None, None)
        elif name not in ("engine", "handlers"):
            assert getattr(config, name) == value, name


@pytest.mark.parametrize(
    ("flag", "config", "name"),
    [
        ("--completion-batch-size", EngineConfig, "completion_batch_size"),
        ("--prefill-batch-size", EngineConfig, "prefill_batch_size"),
        ("--prefill-step-size", EngineConfig, "prefill_step_size"),
        ("--prompt-cache-size", EngineConfig, "prompt_cache_size"),
        ("--prompt-cache-block", EngineConfig, "prompt_cache_block"),
        ("--max-queued-requests", HandlerOptions, "max_queued_requests"),
        ("--stream-interval", HandlerOptions, "stream_interval"),
        ("--speculate-k", SpeculationConfig, "k_max"),
        ("--speculate-max-batch", SpeculationConfig, "max_rows"),
        ("--port", ServerConfig, "port"),
    ],
)
def test_help_says_the_dataclass_default(flag, config, name, capsys):
    """A flag's help names the default it really has."""
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    start = text.index(flag + " ", text.index("options:"))  # its entry, past the usage line
    assert f"(default {_defaults(config)[name]}" in text[start : start + 600], flag


def test_the_flags_follow_a_changed_dataclass_default(monkeypatch):
    """The CLI reads the dataclass when it parses: a new default there is the CLI's too."""
    fields = {each.name: each for each in dataclasses.fields(EngineConfig)}
    monkeypatch.setattr(fields["completion_batch_size"], "default", 7)
    monkeypatch.setattr(fields["prompt_cache_block"], "default", 64)
    args = parse_args([])
    assert (args.completion_batch_size, args.prompt_cache_block) == (7, 64)


def test_adapter_flags_name_their_own_ports_and_no_flag_is_read_by_a_prefix():
    """`--adapter NAME=PATH[@PORT]` is its own flag (not --adapter-path's abbreviation): the
    adapters served in order on the next ports, or their own; a name or port twice, or a flag
    given by a prefix, is refused."""
    config = config_from_args(
        parse_args(["--port", "7000", "--adapter", "a=/x", "--adapter", "b=/y@7100"])
    )
    assert config.engine.adapter_path is None
    assert config.engine.adapters == (("a", "/x"), ("b", "/y"))
    assert config.adapter_ports == (("a", 7001), ("b", 7100))
    assert config_from_args(parse_args(["--port", "0", "--adapter", "a=/x"])).adapter_ports == (
        ("a", 0),
    )
    for argv in (
        ["--adapter", "a=/x", "--adapter", "a=/y"],
        ["--port", "7000", "--adapter", "a=/x@7000"],
        ["--adapter", "nopath"],
        ["--adapter", "a=/x@port"],
        ["--adapt", "a=/x"],
        ["--served-model", "x"],
    ):
        with pytest.raises(SystemExit):
            config_from_args(parse_args(argv))


def test_an_adapter_port_taken_stops_the_start_before_any_address_serves(tmp_path):
    """Every address is bound before any starts: a port already taken is an error at start
    (the worker exits), not a worker serving some of its names."""
    import asyncio
    import socket

    from servicer.model_files import ModelSpec
    from servicer.server import ServerConfig, WorkerServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    config = ServerConfig(
        model=ModelSpec(str(tmp_path)), port=0, adapter_ports=(("a", 0), ("b", port))
    )
    server = WorkerServer(config)
    try:
        with pytest.raises(OSError, match=str(port)):
            asyncio.run(server.start())
        assert server._server is None  # nothing started
    finally:
        taken.close()
        server.engine.shutdown(5.0)
