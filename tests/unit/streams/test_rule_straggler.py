"""The straggler rule end to end: a persistent straggler on a real-looking DDP job gets one
slow-loop drain recommendation naming its host and rank, once per episode."""

from __future__ import annotations

from perfloop.schemas import Recommendation
from perfloop.streams.funnel import Funnel
from perfloop.streams.rules import StragglerRule
from tests.unit.streams._ddp import DDPJob


def test_a_persistent_straggler_names_its_node_once_per_episode() -> None:
    job = DDPJob(4, nodes=2, seed=9)
    job.steps(20)
    job.steps(300, extra_ms=[0.0, 0.0, 0.0, 45.0])  # rank 3, on node 1, ~30 s
    funnel, rule = Funnel(), StragglerRule(min_age_s=10)
    recs: list[Recommendation] = [r for d in job.feed(funnel) for r in rule.evaluate([d])]
    (rec,) = recs
    assert (rec.knob, rec.loop, rec.from_value, rec.to_value, rec.rank) == (
        "cluster.drain_node", "slow", "", "ddp-node-1", -1)  # fmt: skip
    assert rec.evidence["rank"] == 3 and rec.evidence["lateness_ms"] > 30
    assert rec.evidence["straggling_s"] >= 10 and "steps" in rec.evidence
    assert "rank 3 on host ddp-node-1" in rec.rationale
    # it resolves and comes back: a new episode, a new recommendation
    job.steps(60)
    job.steps(300, extra_ms=[0.0, 0.0, 0.0, 45.0])
    again = [r for d in job.feed(funnel) for r in rule.evaluate([d])]
    assert len(again) == 1 and again[0].to_value == "ddp-node-1"


def test_a_short_or_explained_straggler_gets_nothing() -> None:
    job = DDPJob(2, seed=10)
    job.steps(20)
    job.steps(90, extra_ms=[0.0, 45.0])  # ~9 s: opens, not yet persistent
    rule = StragglerRule(min_age_s=10)
    diags = job.feed(Funnel(), tail_s=0.0)
    assert [d for d in diags if d.bottleneck == "straggler" and d.state == "open"]
    assert [r for d in diags for r in rule.evaluate([d])] == []
    explained = [d.model_copy(update={"explained_by": "thermal_throttle",
                                      "ts_ns": d.ts_ns + 60 * 10**9})
                 for d in diags if d.bottleneck == "straggler"]  # fmt: skip
    assert rule.evaluate(explained) == []
