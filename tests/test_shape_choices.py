"""engine.shape_choices: a shape is timed once, its choice kept in the process and on
disk, read back by another process, merged with what others wrote; a file that
cannot be read is timed again (CPU: the store needs no GPU)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from opara_core.engine.shape_choices import ShapeChoices


@dataclass(frozen=True)
class Tile:
    block: int


def store(key=("gpu", 1)):
    return ShapeChoices("test", list(key), Tile, "library")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPARA_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_shape_is_timed_once_and_another_process_reads_the_choice(cache):
    timed = []
    first = store()
    assert first.choose("8,336", lambda: timed.append(1) or Tile(64)) == Tile(64)
    assert first.choose("8,336", lambda: timed.append(1) or "library") == Tile(64)
    assert timed == [1] and first.path.parent == cache / "test"
    again = store()  # a new process: the file, nothing timed
    assert again.choose("8,336", lambda: pytest.fail("timed again")) == Tile(64)


def test_writers_merge_and_the_key_separates_what_it_depends_on():
    one, two = store(), store()
    one.choose("a", lambda: Tile(1))
    two.choose("b", lambda: "library")  # two had not read a: its write keeps it
    assert store().known == {"a": Tile(1), "b": "library"}
    other = store(("another gpu", 1))
    assert other.path != one.path and other.known == {}


def test_a_file_that_cannot_be_read_is_timed_again(caplog):
    first = store()
    first.path.parent.mkdir(parents=True)
    first.path.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        again = store()
    assert again.known == {} and "not read" in caplog.text
    assert again.choose("a", lambda: Tile(2)) == Tile(2) and store().known == {"a": Tile(2)}
