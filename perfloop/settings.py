"""Settings: one frozen pydantic-settings class per service, env prefix ``PERFLOOP_``.

Settings are read once at an entry point (the CLI or a service's ``main``) and passed down;
library code never reads ``os.environ``.

Addresses resolve the same way everywhere: ``PERFLOOP_KAFKA_BOOTSTRAP`` and
``PERFLOOP_CLICKHOUSE_URL`` name an external Kafka-API cluster and ClickHouse server; when
they are unset, the embedded stack's loopback addresses (``PERFLOOP_KAFKA_PORT``,
``PERFLOOP_CLICKHOUSE_PORT``) are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from perfloop._settings_base import DEV_SIGNING_KEY, BaseServiceSettings
from perfloop._settings_check import INTERNAL_ENV, check_environment, known_settings, load_settings
from perfloop._webhook_values import (
    DEFAULT_WEBHOOK_KINDS,
    WEBHOOK_EVENTS,
    webhook_kinds,
    webhook_urls,
)

__all__ = [
    "DEFAULT_WEBHOOK_KINDS",
    "DEV_SIGNING_KEY",
    "INTERNAL_ENV",
    "WEBHOOK_EVENTS",
    "AccountantSettings",
    "ActuatorSettings",
    "BaseServiceSettings",
    "NotifierSettings",
    "ProducerSettings",
    "ReportSettings",
    "SinkSettings",
    "StackSettings",
    "StreamsSettings",
    "WarehouseServerSettings",
    "check_environment",
    "known_settings",
    "load_settings",
]


class ProducerSettings(BaseServiceSettings):
    """Producers on a training node: transport, spool, samplers, overhead budget.

    ``job_id`` and ``node`` name where telemetry comes from (``node`` defaults to the host
    name); ``spool_dir`` defaults to ``$PERFLOOP_HOME/spool/<producer>``.
    """

    job_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:/@+-]{1,128}$")
    node: str | None = Field(None, min_length=1, max_length=255)
    # transport
    linger_ms: float = Field(20.0, ge=0, le=10_000)
    publish_interval_ms: float = Field(250.0, gt=0, description="Batches leave this often.")
    """Each batch costs the broker, the stream worker and the sink a fixed price whatever it
    holds: at 1000 ms the stream worker took ~35 % less CPU beside a healthy 2-rank DDP job,
    but the job ran no faster (0.899x against 0.909x of its plain speed at 250 ms, six
    alternating triplets: `bench/README.md`), and what is seen would wait up to 0.75 s more.
    The stream worker judges a step once every rank's rows of it are in, and waits for a step
    2 s of the job's steps behind the newest (`perfloop.streams.detection.JobState.
    horizon`: at least 32 steps, at most half its ring, 512 steps up to 32 ranks and 64 from
    256): a rank whose batch comes an interval after another's must be within that, so at 250
    ms a job of up to 32 ranks is seen whole up to ~1000 steps a second, one of 256 ranks or
    more up to ~128."""
    queue_max_messages: int = Field(10_000, gt=0, description="In-memory bound before spooling.")
    message_timeout_ms: int = Field(15_000, ge=1000, description="Then a message is spooled.")
    spool_dir: Path | None = None
    spool_max_bytes: int = Field(256 << 20, gt=0)
    spool_segment_bytes: int = Field(4 << 20, gt=0)
    resend_window_s: float = Field(
        30.0, ge=0, description="Delivered messages kept to resend if the broker loses them."
    )
    stats_interval_s: float = Field(5.0, gt=0)
    # samplers
    gpu_interval_ms: float = Field(100.0, ge=10, le=60_000)
    gpu_min_interval_ms: float = Field(10.0, ge=1)
    gpu_max_interval_ms: float = Field(1000.0, ge=10, le=600_000)
    host_max_interval_factor: float = Field(10.0, ge=1)
    host_interval_ms: float = Field(1000.0, ge=10, le=600_000)
    overhead_budget_pct: float = Field(0.5, gt=0, le=100)
    adaptive_sampling: bool = True
    ddp_comm_hook: bool = Field(
        True,
        description="Time DDP's gradient all-reduce (PyTorch's stock allreduce_hook on each "
        "DistributedDataParallel without a hook of its own).",
    )
    background_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="Nice value added to perfloop's threads in a training process (0: none).",
    )
    # the job agent in traced training processes
    agent: bool = Field(True, description="Apply signed commands (`perfloop run`'s job agent).")
    signing_key: SecretStr = Field(
        SecretStr(DEV_SIGNING_KEY), description="The key commands to this job are signed with."
    )
    command_keyring: Path | None = None
    """A keyring of the public keys commands to this job must be signed with (the actuator's,
    `perfloop keys`; read again when it changes). With it, a command signed with the shared
    ``signing_key`` is refused: this job's host holds nothing that can sign a command."""
    roster: Path | None = None
    """The roster of principals (`perfloop.roster`; read again when it changes): with it (or,
    unset, the embedded stack's ``$PERFLOOP_HOME/keys/roster.json`` where it exists) this job
    takes a sampling change (``perfloop config set sampling.*``) only signed by a principal
    whose role covers it, not expired and not seen before; every other is refused, in the
    job's log and in ``audit``."""
    power_helper: Path | None = None
    """The socket of the node's GPU power-limit helper (`perfloop power-helper`, run as root):
    the job's ``gpu.power_limit_w`` commands go to it, and it checks each one itself
    (`perfloop.producers.power_helper`), so the training process needs no privilege. Unset:
    the process sets power limits through NVML itself (it must then be allowed to)."""
    config_patch: Path | None = Field(
        None,
        description="The job's config patch (slow-loop changes, read at start); default "
        "$PERFLOOP_HOME/patches/<job>.json.",
    )
    quiet: bool = False
    """No line on the job's stderr for each change its agent applies, keeps, rolls back or
    rejects (``PERFLOOP_QUIET=1``)."""
    pinned_knobs: Annotated[tuple[str, ...], NoDecode] = ()
    """Knobs the job agent refuses to change (``perfloop run --pin KNOB``;
    ``PERFLOOP_PINNED_KNOBS``: comma-separated, or a JSON list)."""

    @field_validator("pinned_knobs", mode="before")
    @classmethod
    def _known_knobs(cls, value: Any) -> tuple[str, ...]:
        from perfloop.exceptions import ConfigError
        from perfloop.schemas.knobs import pinned_knobs

        try:
            return pinned_knobs(value)
        except ConfigError as e:  # one line naming the valid knobs
            raise ValueError(str(e)) from None


class StackSettings(BaseServiceSettings):
    """`perfloop up/down/status/demo`: which services to supervise and how long to wait."""

    start_timeout_s: float = Field(60.0, gt=0)
    stop_timeout_s: float = Field(15.0, gt=0)
    restart_backoff_s: float = Field(2.0, ge=0)
    stack_priority: Literal["idle", "normal"] = Field(
        "idle",
        description="idle: the services run in idle CPU control groups (cpu.idle) where the "
        "supervisor may make them, else each in a session of its own whose scheduling group "
        "(Linux autogroup) has nice 19, so a training rank's CPU comes first; the warehouse "
        "and the sink run under SCHED_IDLE and the loop (broker, streams, actuator) under "
        "SCHED_BATCH (it never preempts a thread when it wakes up); normal: every service "
        "like any other process.",
    )
    webhook_urls: Annotated[tuple[str, ...], NoDecode] = ()
    """`NotifierSettings.webhook_urls`: when any is set, `up` starts the notifier too."""
    stream_workers: int = Field(1, ge=1, le=16)
    """How many stream workers `up` starts (``streams``, ``streams-2``, …): they share the
    input partitions in one consumer group, each partition's state moving with it."""
    broker_recycle_mb: float = Field(256.0, ge=0)
    """The embedded broker is replaced by an empty one once its resident memory has grown this
    many MiB since it started, at a moment when nothing it holds is still needed
    (`perfloop.stack._recycle`); 0: never (it then grows with everything published)."""
    broker_recycle_wait_s: float = Field(10.0, gt=0, le=12)
    """How long the stream tier may be paused for a recycle to find the broker quiet (at most
    12 s: the stream tier's output waits that long)."""
    broker_recycle_retry_s: float = Field(60.0, gt=0)
    """When a recycle did not find the broker quiet, how long before it tries again."""
    listen: str | None = None
    """`perfloop up --listen ADDR`: serve the embedded broker and warehouse at ``ADDR`` (an IP
    address or DNS name the other nodes reach this machine at) instead of loopback, with TLS
    and authentication on both: a client certificate the stack's CA signed at the broker,
    HTTPS and a password at the warehouse (`perfloop keys client` gives a node what it
    needs; docs/security.md)."""
    accounting: bool = True
    """`up` starts the accountant (`AccountantSettings`), which stores each ended job's
    accounting in the warehouse's ``job_accounting`` table."""

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> tuple[str, ...]:
        return webhook_urls(value)


class WarehouseServerSettings(BaseServiceSettings):
    """The embedded warehouse: chDB on a data directory, served over ClickHouse HTTP."""

    data_dir: Path | None = Field(None, description="Defaults to $PERFLOOP_HOME/warehouse.")
    max_body_bytes: int = Field(1 << 30, gt=0)
    sessions: int = Field(3, ge=1, le=16)
    """chDB sessions serving requests at once (each request holds one for its whole run)."""


class StreamsSettings(BaseServiceSettings):
    """The Faust stream workers: ingest, windows, phases, cross-rank analysis, the funnel.

    ``windows`` lists window sizes in seconds, tumbling ("10") or hopping ("60/10": 60 s
    windows every 10 s). Each input partition's state is snapshotted every
    ``snapshot_interval_s`` to ``$PERFLOOP_HOME/streams/<worker_name>/<partition>.snapshot``,
    and every ``changelog_interval_s``, when the partition is revoked and when the worker
    stops to the changelog topic ``perfloop.streams.state``, which any worker reads; input is
    acknowledged (and its offsets committed) only once the changelog holds it. The worker that
    gets a partition (this one restarted, or another) restores the newest snapshot it can
    read and reads on from its positions. ``restore_timeout_s`` bounds how long a newly
    assigned partition waits for the changelog before it starts without it.
    """

    app_id: str = "perfloop-streams"
    worker_name: str = Field("0", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    broker_session_timeout_s: float = Field(6.0, gt=0)
    windows: str = Field("1,10,60,60/10", min_length=1)
    allowed_lateness_s: float = Field(1.0, ge=0)
    new_job_grace_s: float = Field(2.0, ge=0, le=60)
    """A new job's windows wait this long (wall time) after its first batch before any closes:
    the kinds of a job (steps, GPU, host, spans) start publishing at different moments, and
    one that shows up after the others' windows closed would find its samples late."""
    tick_interval_s: float = Field(
        0.5,
        gt=0,
        le=10,
        description="How often the worker analyses each job and closes due windows (event "
        "time for the analyses, wall time for the timer). 0.25 s cost a healthy 2-rank DDP "
        "job on the same 2 CPUs ~3 points of its speed more than 0.5 s (bench/README.md).",
    )
    snapshot_interval_s: float = Field(2.0, gt=0)
    changelog_interval_s: float = Field(30.0, gt=0)
    restore_timeout_s: float = Field(10.0, gt=0, le=120)
    recent_ids: int = Field(
        8192,
        ge=1,
        description="Batch and event ids each partition's engine remembers, to drop a message "
        "a producer resent to a broker that lost its log (about 140 bytes each).",
    )
    data_wait_share_threshold: float = Field(0.3, gt=0, lt=1)
    recommendation_cooldown_s: float = Field(30.0, ge=0)
    max_skew_s: float = Field(300.0, gt=0, description="Event time this far ahead: DLQ.")
    max_age_s: float = Field(
        31 * 86400.0, gt=0, description="Event time this far behind the clock: DLQ."
    )
    fetch_max_wait_ms: int = Field(500, ge=1, le=1000)
    """How long a fetch of read-to-the-end partitions may wait for input. The embedded broker
    answers such a fetch after about half of it (it does not wake on new input), and each
    fetch costs it time in proportion to what the partitions hold (`perfloop.stack.broker`): a
    shorter wait delivers input sooner and costs the broker more. At most 1 s: the worker
    trusts a partition's end only if it was fetched in the last 1.5 s."""
    fetch_min_interval_ms: int = Field(500, ge=0, le=1000)
    """The least time between two of the worker's fetches. A fetch returns as soon as any
    partition has new records, so without it the worker fetches each time a producer
    publishes, and the embedded broker lists every batch of such a partition for each fetch
    (`perfloop.stack.broker`). 0: fetch again at once."""
    predictions: bool = True
    """Host the online models (`perfloop.streams.predict`) and publish their predictions;
    ``predict.enabled`` changes it live."""
    prediction_every_s: float = Field(5.0, ge=0, le=3600)
    """Event-time seconds between two step-time forecasts of a job (``predict.every_s``)."""
    metrics_port: int = Field(19464, ge=0, le=65535)
    """Port of the worker's Prometheus endpoint, ``http://<metrics_host>:<port>/metrics``
    (docs/alerts.md); 0: none. A port already taken is one line in the log, and the worker
    runs on without it."""
    metrics_host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9_.:-]{1,255}$")
    """The address the endpoint binds: loopback by default; ``0.0.0.0`` for a Prometheus on
    another host (docker/compose.yaml)."""
    metrics_max_series: int = Field(10_000, ge=100, le=10_000_000)
    """The most series the endpoint exports. Past it, the jobs with the most ranks have their
    per-rank series folded into one per job (``rank="all"``), then the jobs seen least
    recently are left out; ``perfloop_metrics_series_dropped`` says how many series that
    kept out."""
    metrics_grace_s: float = Field(300.0, gt=0, le=86_400)
    """A job's series, and a rank's, go this long after the last window, diagnosis, phase
    change or prediction that named it: an ended job's stay this long."""
    recommendation_private_key: Path | None = None
    """The stream tier's Ed25519 private key (PEM, `perfloop keys new`): every recommendation
    is signed with it and given an expiry, for an actuator holding its public key
    (``PERFLOOP_RECOMMENDATION_KEYRING``). Unset: recommendations go unsigned. `perfloop up`
    makes one under ``$PERFLOOP_HOME/keys`` (docs/security.md)."""
    roster: Path | None = None
    """`ActuatorSettings.roster`: with it a change of the stream tier's settings (``perfloop
    config set`` with target ``streams``) counts only signed by a principal whose role covers
    the setting, not expired and not seen before; every other is refused, dead-lettered and
    audited. `perfloop up` gives the stack's own. Unset: changes are taken unsigned."""
    recommendation_ttl_s: float = Field(300.0, gt=0, le=86_400)
    """A signed recommendation expires this long after it is published: an actuator acts on
    none later (a pending one is approved separately, within ``approval_ttl_s``)."""
    approval_ttl_s: float = Field(900.0, gt=0)
    """A recommendation pending approval stops counting in ``perfloop_pending_approvals``
    this long after it was asked (the actuator's `ActuatorSettings.approval_ttl_s`: the
    same variable)."""


class SinkSettings(BaseServiceSettings):
    """The warehouse sink: batches every topic into the warehouse."""

    group_id: str = "perfloop-sink"
    flush_interval_s: float = Field(5.0, gt=0)
    """How long telemetry rows (steps, spans, collectives, host and GPU samples) wait for more
    before they are inserted. Each insert costs the warehouse a fixed price (~5 ms of CPU in
    the embedded one) and each round of reading costs the broker: at 1 s the embedded stack
    took ~0.25 CPU s more per 11 s of a healthy 2-rank job than at 5 s, and the job ran at
    0.903x of its plain speed against 0.910x (six alternating triplets, `bench/README.md`).
    Detection does not wait for it (the stream worker reads the topics); SQL over the raw
    telemetry sees it this much later."""
    fast_flush_interval_s: float = Field(0.2, gt=0)
    """How long closed windows, diagnoses and other rows someone waits for may wait for more
    before they are inserted on their own (telemetry waits ``flush_interval_s``)."""
    max_batch_rows: int = Field(600_000, gt=0)
    """Bound on the rows the sink holds (the batch in the air and the one being filled, each
    flushed at half of it). At 300k rows a second a half of 200k filled in a third of a second
    and the sink stopped reading until the insert in the air landed, closed windows unread
    meanwhile; ``max_batch_bytes`` bounds the memory as well."""
    max_batch_bytes: int = Field(64 << 20, ge=1 << 20)
    """Bound on the message bytes the sink holds (the batch in the air and the one being
    filled, each flushed at half of it), beside ``max_batch_rows``; plus two messages."""
    dedup_window_messages: int = Field(200_000, gt=0)
    """How many message ids the sink remembers to drop a message sent twice."""
    dedup_seed_s: float = Field(600.0, ge=0)
    """A sink that starts first remembers the ids of the rows that landed within this many
    seconds of event time (`perfloop.warehouse._sink_seed`), so what a producer resends or
    the sink reads again after a restart lands once; 0: it starts remembering nothing."""
    session_timeout_ms: int = Field(6000, ge=1000)
    fetch_min_bytes: int = Field(1 << 20, ge=1)
    fetch_max_wait_ms: int = Field(500, ge=1, le=10_000)
    """A fetch returns once ``fetch_min_bytes`` are waiting or after ``fetch_max_wait_ms``.
    The sink reads every topic, so while input flows some partition always has new records
    and a fetch would return at once: ~2 fetches a second instead of dozens. Each costs the
    embedded broker time in proportion to what the partitions hold (`perfloop.stack.broker`); the
    sink's fetches were most of the broker's CPU in a soak, and at 200 ms the idle sink still
    fetched ~8 times a second."""
    telemetry_in_rounds: bool = True
    """Read the telemetry topics in rounds, one per flush, each partition paused once read to
    its end (`perfloop.warehouse.sink`), instead of fetching them continuously: the embedded
    broker's fetch cost grows with what a partition holds. False: fetch them continuously."""


class ActuatorSettings(BaseServiceSettings):
    """The actuator service: recommendations to signed commands."""

    group_id: str = "perfloop-actuator"
    tier: str = Field("auto", pattern="^(observe|recommend|approve|auto)$")
    signing_key: SecretStr = SecretStr(DEV_SIGNING_KEY)
    signing_private_key: Path | None = None
    """The actuator's Ed25519 private key (PEM, `perfloop keys new`): with it every command is
    signed with it (key id: its public key's) and jobs check them with the public key alone
    (``PERFLOOP_COMMAND_KEYRING``); ``signing_key`` and ``job_signing_keys`` then sign none."""
    command_keyring: Path | None = None
    """With ``signing_private_key``: the keyring of actuator keys (the one jobs hold). Commands
    the actuators before this one signed with a key in it (as trusted when they were signed)
    count in its recall of what was acted on, as its own do; no other command does."""
    recommendation_keyring: Path | None = None
    """The keyring of the stream tier's public keys (`perfloop keys`; read again when it
    changes): with it the actuator acts only on recommendations signed by one of them, not
    expired and not seen before; every other is refused and audited. Unset: recommendations
    are taken as they come."""
    roster: Path | None = None
    """The roster of principals, their keys and roles (`perfloop.roster`; read again when it
    changes): with it approvals and actuator settings count only signed by a principal's key
    (``PERFLOOP_PRINCIPAL_KEY``), not expired, not seen before, and within their role; every
    other is refused and audited, and only such stored settings are applied again at a start.
    Unset: settings are taken unsigned, approvals signed with the shared ``signing_key``."""
    job_signing_keys: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='Keys of individual jobs (JSON: {"job-id": "key"}); their commands are '
        "signed with their own key (key id job:<id>), every other job's with signing_key.",
    )
    command_ttl_s: float = Field(60.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0)
    dry_run: bool = False
    """Decide as the tier says, publish no command (each decision is audited as ``dry_run``)."""
    min_gain_pct: float = Field(5.0, ge=0)
    """Hysteresis: a recommendation expecting less gain than this is refused."""
    max_commands_per_min: int = Field(6, ge=1)
    """Commands a job may get in any 60 s."""
    approval_ttl_s: float = Field(900.0, gt=0)
    """An approval acts only on a recommendation younger than this."""
    session_timeout_ms: int = Field(6000, ge=1000)
    fetch_max_wait_ms: int = Field(500, ge=1, le=1000)
    """How long a fetch of read-to-the-end partitions may wait for input. The embedded broker
    answers such a fetch after about half of it whether or not input came (`perfloop.stack.broker`),
    so this bounds how long a recommendation waits to be read (~250 ms, against the seconds a
    diagnosis takes) and how often the idle actuator wakes the broker: at 50 ms it fetched
    ~20 times a second, and the broker, sharing the job's CPUs, took ~5 % of a core idle."""
    straggler_hook: str = ""
    """The action hook run for a straggler's node (``cluster.drain_node``, as the job's tier
    allows): a command template, e.g. ``scontrol update nodename={node} state=drain
    reason="perfloop: {reason}"`` (`perfloop.actuators.hook`: ``{node} {job} {ranks} {rec_id}
    {reason}``, run without a shell). Empty: such recommendations are only recorded. Only
    here, never a live setting: it runs commands."""
    straggler_hook_timeout_s: float = Field(30.0, gt=0, le=600)
    """A hook still running after this is killed (and audited as failed)."""
    straggler_hook_max_per_hour: int = Field(4, ge=1, le=1000)
    """The hook runs at most this often in any hour, over every job (at most once per job and
    node in any case)."""
    ended_job_retention_s: float = Field(300.0, ge=0)
    """A job that ended has its state in the actuator freed this long after (it stays ended:
    its recommendations are refused)."""
    recall_s: float = Field(3600.0, ge=0)
    """How far back a starting actuator, or one given a job's partition by its group, reads
    the commands on ``perfloop.control`` and the decisions and verdicts on
    ``perfloop.actuations`` (its own, or its predecessor's): a recommendation redelivered after
    a restart or a failover is not acted on twice, sequence numbers continue, cooldowns hold.
    0: nothing is read back."""

    @field_validator("straggler_hook")
    @classmethod
    def _valid_template(cls, value: str) -> str:
        from perfloop.command_template import check_template
        from perfloop.exceptions import ConfigError

        if value.strip():
            try:
                check_template(value)
            except ConfigError as e:  # one line naming what is wrong
                raise ValueError(str(e)) from None
        return value


class NotifierSettings(BaseServiceSettings):
    """The notifier (`perfloop service notifier`, `perfloop.notify`): webhooks for the
    diagnoses, rollbacks and pending approvals the loop produces (docs/alerts.md)."""

    webhook_urls: Annotated[tuple[str, ...], NoDecode] = ()
    """Where to POST: comma-separated, or a JSON list. Empty: the notifier has nothing to do
    (``up`` starts it only when one is set)."""
    webhook_format: str = Field("slack", pattern="^(slack|alertmanager)$")
    """slack: ``{"text": …, "blocks": […]}`` (a Slack incoming webhook, or anything that takes
    its JSON); alertmanager: Alertmanager's webhook payload (version 4)."""
    webhook_kinds: Annotated[tuple[str, ...], NoDecode] = DEFAULT_WEBHOOK_KINDS
    """What is sent: bottleneck names (a diagnosis opened or resolved), ``oom_warning``,
    ``rollback``, ``approval``, or ``all``."""
    webhook_timeout_s: float = Field(5.0, gt=0, le=120)
    """How long one POST may take."""
    webhook_tries: int = Field(3, ge=1, le=20)
    """POSTs of one notification at most (a timeout, a refused connection, HTTP 429 or 5xx
    is tried again; any other answer is final)."""
    webhook_backoff_s: float = Field(1.0, ge=0, le=600)
    """The wait before the second try, doubled before each next one (a 429's Retry-After is
    honoured up to 10 times this)."""
    webhook_queue: int = Field(1000, ge=1, le=1_000_000)
    """Notifications waiting per URL; past it the oldest is dropped (and counted)."""
    notifier_group_id: str = "perfloop-notifier"
    """The notifier's consumer group."""

    @field_validator("webhook_urls", mode="before")
    @classmethod
    def _urls(cls, value: Any) -> tuple[str, ...]:
        return webhook_urls(value)

    @field_validator("webhook_kinds", mode="before")
    @classmethod
    def _kinds(cls, value: Any) -> tuple[str, ...]:
        return webhook_kinds(value)


class ReportSettings(BaseServiceSettings):
    """`perfloop report`: the prices and peaks its accounting uses (docs/report.md)."""

    price_per_gpu_hour: float = Field(2.5, ge=0, allow_inf_nan=False)
    """What one GPU costs an hour (a job with GPUs is priced by them), in ``currency``."""
    price_per_cpu_hour: float = Field(0.05, ge=0, allow_inf_nan=False)
    """What one CPU costs an hour (a job without GPUs is priced by its nodes' CPUs)."""
    currency: str = Field("USD", min_length=1, max_length=8, pattern=r"^\S+$")
    peak_flops: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Peak FLOP/s of one device for MFU, over the device catalog's figure."""
    cpu_peak_flops: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Peak FLOP/s of the CPUs one rank runs on, for the MFU of a job without GPUs."""
    report_warmup_steps: int = Field(3, ge=0, le=1_000_000)
    """The first steps of each rank counted as warm-up, not goodput."""


class AccountantSettings(ReportSettings):
    """The accountant (`perfloop service accountant`, `perfloop.report.accountant`): each
    ended job's accounting, priced and peaked like `perfloop report`, into ``job_accounting``."""

    accounting_interval_s: float = Field(10.0, gt=0, le=3600)
    """How often the accountant looks for jobs that ended (one small query on
    ``job_lifecycle``)."""
    accounting_settle_s: float = Field(15.0, ge=0, le=86_400)
    """How long after it first sees a job's end the accountant waits before it accounts for
    the job: the sink holds telemetry rows up to ``flush_interval_s`` (5 s) before they land."""
    accounting_lookback_s: float = Field(7 * 86_400.0, gt=0)
    """Only jobs whose end is at most this old are accounted for (a first start on an old
    warehouse does not account for its whole history)."""
