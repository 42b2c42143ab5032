"""Acceptance (issue 25): the stream tier's key and a person's key rotated mid-run, on an
embedded stack as `perfloop up` makes it (its keys under its home, `perfloop.stack._keys`).

- The stream tier: a new key is trusted beside the old one, whose trust ends after a short
  overlap; the stream worker is given the new key and restarted (SIGKILL, the supervisor
  starts it again). A recommendation the old key signed within the overlap is taken; the
  starving loader of a job that then runs is recommended under the new key and a command is
  issued for it (nothing refused); after the overlap a recommendation the old key signed is
  refused, and audited.
- A person (the stack's owner): a second key of theirs in the roster, the first's trust
  ending after the overlap. A setting signed with the new key is applied; after the overlap
  one signed with the old key is refused, and audited.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from perfloop.actuators import sign
from perfloop.identity import Keyring, PrivateKey, TrustedKey
from perfloop.roster import Roster
from perfloop.schemas import ConfigChange, Recommendation
from perfloop.schemas.topics import Topics
from perfloop.settings import StackSettings
from perfloop.stack import read_state

from .conftest import audit_of, perfloop_cli, private_stack, publish, query, stack_env, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS = 1_000_000_000
OVERLAP_S = 30.0


@pytest.fixture(scope="module")
def rotating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackSettings]:
    with private_stack(
        tmp_path_factory.mktemp("perfloop-rotation"), PERFLOOP_BROKER_RECYCLE_MB="0"
    ) as settings:
        yield settings


def _retire(entry: TrustedKey, after_ns: int) -> TrustedKey:
    return TrustedKey(entry.key_id, entry.principal, entry.public, after_ns)


def test_the_stream_tier_and_a_person_rotate_their_keys_mid_run(
    rotating: StackSettings, tmp_path: Any
) -> None:
    stack = rotating
    keys = stack.home / "keys"
    old_streams, old_owner = (
        PrivateKey.load(keys / "streams.key"),
        PrivateKey.load(keys / "owner.key"),
    )
    new_streams, new_owner = PrivateKey.generate(), PrivateKey.generate()
    overlap_ends = time.time_ns() + int(OVERLAP_S * NS)
    run = uuid.uuid4().hex[:8]

    def rec(job: str, key: PrivateKey) -> Recommendation:
        return sign(Recommendation(
            ts_ns=time.time_ns(), job_id=job, node="n0", rank=-1, knob="dataloader.num_workers",
            from_value=2, to_value=4, loop="fast", expected_gain_pct=30.0, confidence=0.9,
            rationale="loader starves", expires_ts_ns=time.time_ns() + 300 * NS), key)  # fmt: skip

    def setting(key: PrivateKey, value: bool) -> ConfigChange:
        return sign(ConfigChange(
            ts_ns=time.time_ns(), job_id=f"rot-{run}", node="cli", rank=-1, target="actuator",
            applies_to=f"rot-{run}", key="actuator.dry_run", value=value, author="owner@it",
            expires_ts_ns=time.time_ns() + 300 * NS), key)  # fmt: skip

    # the new keys trusted beside the old, whose trust ends with the overlap
    ring = Keyring.load(keys / "recommenders.json")
    ring.keys[old_streams.key_id] = _retire(ring.keys[old_streams.key_id], overlap_ends)
    ring.keys[new_streams.key_id] = TrustedKey.of(new_streams.public_bytes(), "streams")
    ring.save(keys / "recommenders.json")
    roster = Roster.load(keys / "roster.json")
    roster.keyring.keys[old_owner.key_id] = _retire(
        roster.keyring.keys[old_owner.key_id], overlap_ends
    )
    roster.keyring.keys[new_owner.key_id] = TrustedKey.of(new_owner.public_bytes(), "owner")
    roster.save(keys / "roster.json")

    # within the overlap, the old stream key still counts
    early = rec(f"rot-early-{run}", old_streams)
    publish(stack, Topics.RECOMMENDATIONS, early)
    taken = wait_for(lambda: audit_of(stack, early.event_id), 30, "the early recommendation")
    assert taken[0][0] == "issued", taken

    # the stream worker gets the new key: written over the old file, the worker restarted
    new_streams.save(tmp_path / "streams.key")
    os.replace(tmp_path / "streams.key", keys / "streams.key")
    state = read_state(stack)
    assert state is not None
    old_pid = state["services"]["streams"]["pid"]
    os.kill(old_pid, signal.SIGKILL)

    def restarted() -> bool:
        now = read_state(stack) or {}
        svc = (now.get("services") or {}).get("streams") or {}
        return svc.get("pid") not in (None, old_pid) and svc.get("state") == "running"

    wait_for(restarted, 60, "the stream worker started again")

    # a person's new key: their setting is applied
    new_key_file = tmp_path / "owner-2.key"
    new_owner.save(new_key_file)
    env = stack_env(stack.home) | {
        "PERFLOOP_KAFKA_PORT": str(stack.kafka_port),
        "PERFLOOP_CLICKHOUSE_PORT": str(stack.clickhouse_port),
        "PERFLOOP_PRINCIPAL_KEY": str(new_key_file),
    }
    set_ = perfloop_cli("config", "set", "actuator.dry_run", "true", "--job", f"rot-{run}",
                        env=env)  # fmt: skip
    assert set_.returncode == 0, set_.stderr
    log = stack.home / "logs" / "actuator.log"
    wait_for(lambda: f"actuator.dry_run for job rot-{run}" in log.read_text(), 30,
             "the actuator to take the new key's setting")  # fmt: skip

    # a job with a starving loader, recommended under the new stream key
    job = f"rot-job-{run}"
    sim = perfloop_cli("simulate", "--scenario", "dataloader_starvation", "--nodes", "1",
                       "--ranks-per-node", "2", "--duration", "60", "--speed", "2",
                       "--job-id", job, env=env, timeout=120)  # fmt: skip
    assert sim.returncode == 0, sim.stdout + sim.stderr
    recs_sql = "SELECT rec_id, key_id FROM recommendations WHERE job_id = {j:String}"
    recs = wait_for(lambda: query(stack, recs_sql, j=job), 30, "the job's recommendations")
    assert {k for _, k in recs} == {new_streams.key_id}, recs
    decided = wait_for(
        lambda: all(audit_of(stack, r) for r, _ in recs) and [audit_of(stack, r) for r, _ in recs],
        30,
        "the actuator's decisions on them",
    )
    outcomes = {row[0] for rows in decided for row in rows}
    assert "refused" not in outcomes and "issued" in outcomes, decided

    # after the overlap, the old keys count for nothing, and their refusals are on record
    time.sleep(max(0.0, (overlap_ends - time.time_ns()) / NS) + 1)
    late_rec, late_setting = rec(f"rot-late-{run}", old_streams), setting(old_owner, False)
    publish(stack, Topics.RECOMMENDATIONS, late_rec)
    publish(stack, Topics.CONTROL, late_setting)
    for ev in (late_rec, late_setting):
        rows = wait_for(lambda ev=ev: audit_of(stack, ev.event_id), 30, "the late refusal")
        assert rows[0][0] == "refused" and "no longer trusted" in rows[0][2], rows
    assert log.read_text().count(f"actuator.dry_run for job rot-{run}") == 1  # the new key's
