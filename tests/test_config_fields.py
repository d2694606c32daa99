"""Every setting is one field with its doc: each field of the commands' settings classes is a flag
of its command, with help, and the flags build the settings back (a new option is one field)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from trajstore._util.config import config_from_args, flags_of
from trajstore._upkeep.retention_cli import ArchiveOptions, PartitionOptions
from trajstore.cli import (_DemoOptions, _ExportOptions, _GcOptions, _InitOptions, _MaterializeOptions, _parser,
                           _ProjectionOptions)
from trajstore.ingest.proxy._config import ProxyConfig
from trajstore.ingest.service import ServeConfig
from trajstore.inspect.report import _ReportOptions
from trajstore.inspect.sql import _SqlOptions
from trajstore.inspect.trackers import _Track, _Trackers
from trajstore.replay._config import ReplayConfig
from trajstore.scale._config import ShardConfig, WorkerConfig

COMMANDS = [("serve", ServeConfig), ("proxy", ProxyConfig), ("worker", ShardConfig), ("worker", WorkerConfig),
            ("worker", _Trackers), ("track", _Trackers), ("replay", ReplayConfig), ("report", _ReportOptions),
            ("archive", ArchiveOptions), ("partition", PartitionOptions), ("sql", _SqlOptions), ("track", _Track),
            ("init", _InitOptions), ("materialize", _MaterializeOptions), ("export", _ExportOptions), ("gc", _GcOptions),
            ("demo", _DemoOptions), ("projection create", _ProjectionOptions)]
GLOBAL = {"store", "payload"}  # the CLI's global flags (trajstore --store URL COMMAND ...)


def _subparser(name: str):
    """The parser of ``name``, a command or a command's action (``"projection create"``)."""
    parser = _parser()
    for word in name.split():
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = sub.choices[word]
    return parser


@pytest.mark.parametrize("command,cls", COMMANDS)
def test_every_field_is_a_flag_of_its_command_with_help(command, cls):
    resolved = flags_of(cls)
    assert [r.field.name for r in resolved] == [f.name for f in dataclasses.fields(cls)], "a field without option()"
    actions = {a.dest: a for a in _subparser(command)._actions}
    for r in resolved:
        assert r.spec.help.strip(), f"{cls.__name__}.{r.field.name} has no help"
        assert r.dest in actions, f"{cls.__name__}.{r.field.name}: trajstore {command} has no flag for it"
        if r.name is not None:
            names = actions[r.dest].option_strings or [r.dest]  # a positional is named by its dest
            assert r.name in names and actions[r.dest].help.endswith(r.spec.help)
        else:
            assert r.dest in GLOBAL


@pytest.mark.parametrize("command,cls", COMMANDS)
def test_the_command_s_defaults_are_the_settings_defaults(command, cls):
    required = {ProxyConfig: (["--upstream", "http://127.0.0.1:9"], {"upstream": "http://127.0.0.1:9"}),
                ArchiveOptions: (["/a"], {"out_dir": "/a"}), _SqlOptions: (["SELECT 1"], {"query": "SELECT 1"}),
                _ExportOptions: (["/e"], {"dir": "/e"}), _ProjectionOptions: (["p"], {"name": "p"})}
    argv, values = required.get(cls, ([], {}))
    assert config_from_args(cls, _parser().parse_args([*command.split(), *argv])) == cls(**values)


def test_the_replay_server_s_tokens_repeat():
    args = _parser().parse_args(["replay", "--token", "a", "--token", "b", "--write-token", "w", "--hold-s", "0"])
    config = ReplayConfig.from_args(args)
    assert (config.token, config.write_token, config.hold_s) == (("a", "b"), "w", 0.0)


def test_the_worker_s_flags_build_its_shard_config():
    args = _parser().parse_args(["worker", "--shard", "1", "--num-shards", "3", "--max-trajectories", "9",
                                 "--abandon-after-s", "60", "--poll-s", "0.5", "--gc-grace-s", "-1",
                                 "--gc-interval-s", "7", "--unavailable-timeout-s", "30", "--no-gc"])
    assert ShardConfig.from_args(args) == ShardConfig(
        shard=1, num_shards=3, max_trajectories=9, abandon_after_s=60.0, poll_s=0.5, gc_grace_s=-1.0,
        gc_interval_s=7.0, unavailable_timeout_s=30.0, gc=False)
    assert ShardConfig(gc_grace_s=-1.0).collects() is None and ShardConfig(shard=1).collects() is None
    assert ShardConfig(gc_grace_s=5.0).follow_kwargs()["gc_grace_s"] == 5.0


def test_materialize_follow_takes_the_loop_s_flags():
    args = _parser().parse_args(["materialize", "--follow", "--shard", "2", "--num-shards", "4", "--poll-s", "3",
                                 "--gc-interval-s", "9", "--unavailable-timeout-s", "5"])
    config = ShardConfig.from_args(args)
    assert (config.shard, config.num_shards, config.poll_s, config.gc_interval_s, config.unavailable_timeout_s,
            config.gc) == (2, 4, 3.0, 9.0, 5.0, True)
    assert config.collects() is None  # only shard 0 collects


def test_the_ray_shards_take_the_worker_s_options(tmp_path):
    """``trajstore worker`` and the Ray shards have the same options: every ShardConfig field is a
    keyword of ``start_shards`` and ``MaterializerShard``, and a shard follows with the config the
    worker's flags build."""
    from trajstore.scale.ray_actors import MaterializerShard, start_shards

    renamed = {"shard": "shard_index", "gc": None}  # a shard's index is its place; gc off is gc_grace_s=None
    for fn in (MaterializerShard.__init__, start_shards):
        params = set(inspect.signature(fn).parameters)
        for f in dataclasses.fields(ShardConfig):
            name = renamed.get(f.name, f.name)
            if name is not None and not (fn is start_shards and f.name == "shard"):
                assert name in params, f"{fn.__qualname__} lacks {name}"
    shard = MaterializerShard(f"sqlite:///{tmp_path}/s.db", 0, 2, str(tmp_path / "p"), 9, poll_s=0.5,
                              gc_grace_s=3.0, gc_interval_s=7.0, abandon_after_s=60.0, unavailable_timeout_s=30.0)
    try:
        worker = _parser().parse_args(["worker", "--num-shards", "2", "--max-trajectories", "9", "--poll-s", "0.5",
                                       "--gc-grace-s", "3", "--gc-interval-s", "7", "--abandon-after-s", "60",
                                       "--unavailable-timeout-s", "30"])
        assert shard.config == ShardConfig.from_args(worker)
        assert shard.config.follow_kwargs() == {"poll_s": 0.5, "gc_grace_s": 3.0, "gc_interval_s": 7.0,
                                                "abandon_after_s": 60.0, "unavailable_timeout_s": 30.0}
    finally:
        shard.store.close()
