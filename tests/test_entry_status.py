"""Registry entry status is an enum (``EntryStatus``) whose members are the strings the
tables and JSON showed before: ``backends`` and ``backends --json`` print the same text."""

from __future__ import annotations

import json

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend import DisabledBackend
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.registry import AVAILABLE, CONFLICT, FAILED, UNAVAILABLE, EntryStatus

STRINGS = {"available", "unavailable", "failed", "conflict"}


@pytest.mark.parametrize("member", list(EntryStatus))
def test_each_status_is_its_string_everywhere(member):
    text = member.value
    assert isinstance(member, str) and member == text and hash(member) == hash(text)
    assert str(member) == text and f"{member}" == text and format(member, "") == text and f"{member:>0}" == text
    assert json.dumps(member) == json.dumps(text) and json.dumps({"status": member}) == f'{{"status": "{text}"}}'
    assert EntryStatus(text) is member


def test_the_module_constants_are_the_members():
    assert {AVAILABLE, UNAVAILABLE, FAILED, CONFLICT} == set(EntryStatus)
    assert {m.value for m in EntryStatus} == STRINGS


class CudaOnly(DisabledBackend):
    pass


def test_backends_output_shows_the_plain_strings(capsys):
    registry.register(
        BackendSpec(
            name="cuda_only_x", backend_class=CudaOnly, phases=("decode",), devices=("cuda",), api_version="1.1"
        )
    )
    assert main(["backends", "--device-type", "cpu", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["cuda_only_x"]["status"] == "unavailable" and type(rows["cuda_only_x"]["status"]) is str
    assert rows["disabled"]["status"] == "available"
    assert {row["status"] for row in rows.values()} <= STRINGS
    assert main(["backends", "--device-type", "cpu"]) == 0
    table = capsys.readouterr().out
    assert "unavailable" in table and "EntryStatus" not in table
    entry = next(e for e in registry.list_backends("cpu") if e.name == "cuda_only_x")
    assert entry.status is EntryStatus.UNAVAILABLE and entry.as_row()["status"] == "unavailable"
    assert type(entry.as_row()["status"]) is str
