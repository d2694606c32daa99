"""Store URLs: a SQLite URL with two slashes (``sqlite://run/x.db``: SQLAlchemy reads
``run`` as a host and SQLite would open ``./x.db``) is refused in one line, by the
library and the CLI; creating a store logs one INFO line saying where."""

from __future__ import annotations

import logging

import pytest

import trajstore
from trajstore.cli import main
from trajstore.errors import ValidationError
from trajstore.ingest.client import Writer


def test_two_slashes_are_refused_and_nothing_is_created(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    with pytest.raises(ValidationError, match=r"has no host, and 'run' would be dropped.*sqlite:///run/trajstore.db"):
        trajstore.connect("sqlite://run/trajstore.db")
    with pytest.raises(ValidationError, match="would be dropped"):
        Writer("sqlite://run/trajstore.db")
    assert main(["--store", "sqlite://run/trajstore.db", "init"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sqlite:///run/trajstore.db" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert list((tmp_path / "run").iterdir()) == []


def test_creating_a_store_logs_where_and_opening_it_again_does_not(store_url, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trajstore")
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()
    created = [r for r in caplog.records if "created a new store at" in r.getMessage()]
    assert len(created) == 1 and created[0].levelno == logging.INFO
    shown = store_url.split("@")[-1] if "@" in store_url else store_url
    assert shown in created[0].getMessage()
    caplog.clear()
    trajstore.connect(store_url).close()
    assert not [r for r in caplog.records if "created a new store" in r.getMessage()]
