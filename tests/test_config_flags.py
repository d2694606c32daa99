"""Settings spelled once (``trajstore._util.config``): a field made by ``option`` is its flag,
and the settings come back from the parsed flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from dataclasses import dataclass
from typing import Literal

import pytest

from trajstore._util.config import add_flags, config_from_args, flags_of, option


def _to_pair(text: str) -> tuple[int, int]:
    try:
        a, b = text.split("x")
        return int(a), int(b)
    except ValueError:
        raise ValueError(f"--pair must be AxB, got {text!r}") from None


@dataclass(frozen=True)
class _Settings:
    name: str = option(help="a required text")
    count: int = option(3, help="an integer at least 1", min=1)
    ratio: float = option(0.5, help="a number in [0, 1]", min=0, max=1)
    verbose: bool = option(False, help="a switch, off by default")
    fsync: bool = option(True, help="a switch, on by default")
    skip_rows: bool = option(True, flag="--no-row-skip", help="a switch named on its own")
    limit: int | None = option(None, help="an optional integer", min=0, metavar="N")
    engine: Literal["vllm", "sglang"] = option("vllm", help="one of two")
    wait_s: float = option(0.25, flag="--wait-ms", scale=1e3, help="seconds, spoken in ms", min=0)
    size_bytes: int = option(1 << 20, flag="--size-mb", scale=1 / (1 << 20), help="bytes, spoken in MiB",
                             min=0, min_exclusive=True)
    pair: tuple[int, int] | None = option(None, parse=_to_pair, metavar="AxB", help="parsed when built")
    secret: str | None = option(None, env="TRAJSTORE_TEST_SECRET", help="from the environment when not given")
    store_url: str | None = option(None, flag=None, dest="store", help="the program's global --store")
    old_style: int = option(7, deprecated=("--oldstyle",), help="renamed from --oldstyle")
    quiet: bool = option(False, deprecated=("--silent",), help="renamed from --silent")
    tag: tuple[str, ...] | None = option(None, env="TRAJSTORE_TEST_TAG", help="repeat it for more than one")
    uri: str | None = option(None, bare="", metavar="URI", help="a value, or the flag alone for the default")
    internal: int = 0  # not an option: no flag


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    parser.add_argument("--store", default=None)
    add_flags(parser, _Settings)
    return parser


def _parse(*argv: str) -> _Settings:
    return config_from_args(_Settings, _parser().parse_args(["--name", "n", *argv]))


def test_defaults_come_back_as_the_fields_defaults(monkeypatch):
    monkeypatch.delenv("TRAJSTORE_TEST_SECRET", raising=False)
    assert _parse() == _Settings(name="n")


def test_each_kind_of_field_parses():
    s = _parse("--count", "5", "--ratio", "1", "--verbose", "--no-fsync", "--no-row-skip", "--limit", "0",
               "--engine", "sglang", "--wait-ms", "150", "--size-mb", "2", "--pair", "48x8", "--store", "sqlite://",
               "--old-style", "9")
    assert (s.count, s.ratio, s.verbose, s.fsync, s.skip_rows, s.limit, s.engine) == (
        5, 1.0, True, False, False, 0, "sglang")
    assert (s.wait_s, s.size_bytes, s.pair, s.store_url, s.old_style) == (0.15, 2 << 20, (48, 8), "sqlite://", 9)
    assert type(s.size_bytes) is int and type(s.count) is int


@pytest.mark.parametrize("argv,message", [
    (("--count", "0"), "0 must be at least 1"),
    (("--count", "2.5"), "'2.5' is not an integer"),
    (("--ratio", "nan"), "'nan' is not a finite number"),
    (("--ratio", "1.5"), "1.5 must be at most 1"),
    (("--size-mb", "0"), "0 must be more than 0"),
    (("--engine", "tgi"), "invalid choice: 'tgi'"),
])
def test_bad_values_are_refused_by_argparse(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        _parser().parse_args(["--name", "n", *argv])


def test_a_required_field_is_a_required_flag(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args([])
    assert "the following arguments are required: --name" in capsys.readouterr().err


def test_a_repeated_flag_collects_its_values(monkeypatch):
    monkeypatch.delenv("TRAJSTORE_TEST_TAG", raising=False)
    assert _parse().tag is None
    assert _parse("--tag", "a", "--tag", "b").tag == ("a", "b")
    monkeypatch.setenv("TRAJSTORE_TEST_TAG", "from-env")
    assert _parse().tag == ("from-env",) and _parse("--tag", "a").tag == ("a",)


def test_a_flag_given_bare_takes_its_bare_value():
    assert (_parse().uri, _parse("--uri").uri, _parse("--uri", "http://x").uri) == (None, "", "http://x")


def test_parse_runs_when_the_settings_are_built_and_its_error_is_one_line():
    with pytest.raises(ValueError, match="--pair must be AxB, got '48'"):
        _parse("--pair", "48")


def test_env_is_read_when_the_flag_is_not_given(monkeypatch):
    monkeypatch.setenv("TRAJSTORE_TEST_SECRET", "from-env")
    assert _parse().secret == "from-env"
    assert _parse("--secret", "given").secret == "given"


def test_a_flag_the_parser_lacks_leaves_the_default():
    args = argparse.Namespace(name="n", count=4)
    assert config_from_args(_Settings, args) == _Settings(name="n", count=4)
    assert config_from_args(_Settings, args, count=8).count == 8  # overrides win


def test_a_deprecated_spelling_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match="--oldstyle is deprecated; use --old-style"):
        assert _parse("--oldstyle", "11").old_style == 11
    with pytest.warns(DeprecationWarning, match="--silent is deprecated; use --quiet"):
        assert _parse("--silent").quiet is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _parse("--old-style", "12", "--quiet").old_style == 12  # the current spelling: no warning
    assert "--oldstyle " not in _parser().format_help()  # old spellings are not advertised (nor in the usage)
    assert "[--silent]" not in _parser().format_usage()


def test_help_metavar_and_defaults_reach_the_parser():
    by_dest = {a.dest: a for a in _parser()._actions}
    assert by_dest["limit"].metavar == "N" and by_dest["limit"].help == "an optional integer"
    assert by_dest["wait_ms"].default == 250.0 and by_dest["size_mb"].default == 1.0
    assert by_dest["no_row_skip"].option_strings == ["--no-row-skip"] and by_dest["engine"].choices == ("vllm", "sglang")
    assert "internal" not in by_dest and "store_url" not in by_dest


def test_a_positional_argument():
    @dataclass
    class Archive:
        dir: str = option(flag="dir", help="where")
        dry_run: bool = option(False, help="count only")

    parser = argparse.ArgumentParser()
    add_flags(parser, Archive)
    assert config_from_args(Archive, parser.parse_args(["/x", "--dry-run"])) == Archive(dir="/x", dry_run=True)

    @dataclass
    class Report:
        out_dir: str | None = option(None, flag="out_dir", help="optional")

    parser = argparse.ArgumentParser()
    add_flags(parser, Report)
    assert config_from_args(Report, parser.parse_args([])) == Report()
    assert config_from_args(Report, parser.parse_args(["/y"])) == Report(out_dir="/y")


def test_groups_and_skip():
    parser = argparse.ArgumentParser()

    @dataclass
    class Grouped:
        a: int = option(1, help="in g", group="g")
        b: int = option(2, help="top")
        c: int = option(3, help="skipped")

    add_flags(parser, Grouped, skip=("c",))
    titles = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups}
    assert titles["g"] == ["a"] and "c" not in {a.dest for a in parser._actions}


def test_the_settings_survive_json():
    s = _parse("--limit", "3")
    assert _Settings(**json.loads(json.dumps(dataclasses.asdict(s)))) == s


def test_flags_of_lists_only_options():
    assert [r.field.name for r in flags_of(_Settings)][-1] == "uri"
