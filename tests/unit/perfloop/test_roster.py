"""The roster of principals (`perfloop.roster`): read from its JSON file with one line naming a
bad entry, written back as read, read again when it changes; roles by job id or prefix,
setting, and highest tier."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from perfloop.exceptions import ConfigError
from perfloop.identity import Keyring, PrivateKey
from perfloop.roster import Principal, Role, Roster, RosterFile, owner_roster
from perfloop.stack._keys import stack_key_settings

KEY = PrivateKey.generate()


def test_a_roster_reads_back_as_written(tmp_path: Path) -> None:
    path = tmp_path / "roster.json"
    owner_roster(KEY).save(path)
    roster = Roster.load(path)
    assert roster.principal_of(KEY.key_id) == "owner"
    assert roster.may_set("owner", "*", "actuator.tier", "auto") == ""
    assert roster.may_set("owner", "*", "detect.hang.after_s", 30) == ""  # the stream tier's too
    assert roster.may_approve("owner", "any/job") == ""
    doc = json.loads(path.read_text())
    assert doc["principals"][0]["roles"] == [{"jobs": ["*"], "settings": ["*"], "max_tier": "auto"}]


@pytest.mark.parametrize(
    ("doc", "why"),
    [
        ("[]", 'has no "principals" list'),
        ('{"principals": [{"roles": []}]}', "principal 0: missing 'name'"),
        ('{"principals": [{"name": "a", "roles": [{"jobs": ["*"], "max_tier": "root"}]}]}',
         "max_tier 'root' is not one of"),
        ('{"principals": [{"name": "a", "keys": [{"public_key": "AAAA"}]}]}',
         "public_key is 3 bytes"),
        ("{", "is not JSON"),
    ],
)  # fmt: skip
def test_a_bad_roster_is_one_line_naming_the_entry(tmp_path: Path, doc: str, why: str) -> None:
    path = tmp_path / "roster.json"
    path.write_text(doc)
    with pytest.raises(ConfigError) as e:
        Roster.load(path)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_roles_by_job_prefix_setting_and_tier() -> None:
    ops = Principal("ops", (Role(("team-a/*", "solo"), ("actuator.*",), "recommend"),
                            Role(("solo",), ("actuator.tier",), "auto")))  # fmt: skip
    roster = Roster([ops], [])
    assert roster.may_set("ops", "team-a/x", "actuator.dry_run", True) == ""
    assert "up to tier recommend" in roster.may_set("ops", "team-a/x", "actuator.tier", "approve")
    assert roster.may_set("ops", "solo", "actuator.tier", "auto") == ""  # the second role
    assert "no role that sets" in roster.may_set("ops", "team-b/x", "actuator.tier", "observe")
    assert "no role that approves" in roster.may_approve("ops", "team-a/x")
    assert roster.may_approve("ops", "solo") == ""
    assert "principal 'nobody'" in roster.may_approve("nobody", "solo")


def test_a_roster_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "roster.json"
    owner_roster(KEY).save(path)
    live = RosterFile(path)
    other = PrivateKey.generate()
    owner_roster(other, name="ana").save(path)
    os.utime(path, ns=(1, 1))  # a change within the same clock tick is still seen
    assert live.current().principal_of(other.key_id) == "ana"
    path.write_text("{")  # a bad edit: the last good roster stays
    assert live.current().principal_of(other.key_id) == "ana"


def test_the_stack_makes_its_keys_once_and_keeps_them(tmp_path: Path) -> None:
    env = stack_key_settings(tmp_path)
    keys = tmp_path / "keys"
    assert env == {
        "PERFLOOP_RECOMMENDATION_PRIVATE_KEY": str(keys / "streams.key"),
        "PERFLOOP_RECOMMENDATION_KEYRING": str(keys / "recommenders.json"),
        "PERFLOOP_ROSTER": str(keys / "roster.json"),
        "PERFLOOP_SIGNING_PRIVATE_KEY": str(keys / "actuator.key"),
        "PERFLOOP_COMMAND_KEYRING": str(keys / "commands.json"),
    }
    streams, owner = PrivateKey.load(keys / "streams.key"), PrivateKey.load(keys / "owner.key")
    actuator = PrivateKey.load(keys / "actuator.key")  # the jobs here trust it, and it only
    assert list(Keyring.load(keys / "commands.json").keys) == [actuator.key_id]
    from perfloop.settings import ProducerSettings

    job = ProducerSettings(home=tmp_path)
    assert job.command_keyring_path == keys / "commands.json"
    assert ProducerSettings(home=tmp_path / "elsewhere").command_keyring_path is None
    assert Roster.load(keys / "roster.json").principal_of(owner.key_id) == "owner"
    assert (keys.stat().st_mode & 0o777) == 0o700
    assert ((keys / "owner.key").stat().st_mode & 0o777) == 0o600
    before = (keys / "roster.json").read_text()
    assert stack_key_settings(tmp_path) == env
    assert PrivateKey.load(keys / "streams.key").key_id == streams.key_id
    assert (keys / "roster.json").read_text() == before


def test_keys_grant_adds_a_principal_with_a_role(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from perfloop.cli.parser import main

    roster = tmp_path / "roster.json"
    assert main(["keys", "new", "ana", "--dir", str(tmp_path)]) == 0
    pub = str(tmp_path / "ana.pub.json")
    assert main(["keys", "grant", str(roster), pub, "--jobs", "team-a/*,solo",
                 "--settings", "actuator.tier", "--max-tier", "recommend"]) == 0  # fmt: skip
    assert main(["keys", "grant", str(roster), pub, "--jobs", "solo"]) == 0
    got = Roster.load(roster)
    ana = PrivateKey.load(tmp_path / "ana.key")
    assert got.principal_of(ana.key_id) == "ana"
    assert got.may_set("ana", "team-a/x", "actuator.tier", "recommend") == ""
    assert "up to tier recommend" in got.may_set("ana", "team-a/x", "actuator.tier", "approve")
    assert got.may_approve("ana", "solo") == "" and got.may_approve("ana", "team-a/x") != ""
    assert "may set actuator.* of jobs solo up to tier approve" in capsys.readouterr().out


def test_keys_revoke_revokes_a_persons_key_in_the_roster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from perfloop.cli.parser import main

    roster = tmp_path / "roster.json"
    owner = PrivateKey.generate()
    owner_roster(owner).save(roster)
    assert main(["keys", "list", str(roster)]) == 0
    assert f"{owner.key_id}  owner  trusted" in capsys.readouterr().out
    assert main(["keys", "revoke", str(roster), owner.key_id]) == 0
    got = Roster.load(roster)  # still a roster: the principal and roles kept, the key revoked
    assert got.principal_of(owner.key_id) == "owner" and got.may_approve("owner", "any") == ""
    signature = owner.sign(b"setting")
    why = got.keyring.check(owner.key_id, b"setting", signature, now_ns=0)
    assert "revoked" in why


def test_an_earlier_stacks_owner_only_roster_is_widened_and_an_edited_one_kept(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    owner = PrivateKey.generate()
    owner.save(keys / "owner.key")
    first = Role(("*",), ("actuator.*",), "auto")  # what earlier stacks gave the owner
    Roster([Principal("owner", (first,))], owner_roster(owner).keyring.keys.values()).save(
        keys / "roster.json"
    )
    stack_key_settings(tmp_path)
    widened = Roster.load(keys / "roster.json")
    assert widened.may_set("owner", "*", "detect.hang.floor_s", 30) == ""
    assert widened.principal_of(owner.key_id) == "owner"

    edited = Roster([Principal("owner", (first,)), Principal("ana", (first,))], [])
    edited.save(keys / "roster.json")
    before = (keys / "roster.json").read_text()
    stack_key_settings(tmp_path)
    assert (keys / "roster.json").read_text() == before  # someone's roster: not ours to change
