"""Where an embedded stack that listens beyond loopback (`perfloop up --listen ADDR`) keeps
its TLS files, and the settings a process on the stack's own machine reaches it with.

A process on the stack's machine that reads the stack's home (the person who started it,
the jobs beside it) needs no settings of its own: while that stack's supervisor runs,
`load_settings` gives it the stack's client certificate and warehouse password
(`reach_listening_stack`), as the stack's own services have. Other machines get theirs with
`perfloop keys client`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import SecretStr

__all__ = ["ListenFiles", "listening", "reach_listening_stack", "stack_fields"]

_S = TypeVar("_S")


@dataclass(frozen=True)
class ListenFiles:
    """The files under ``$PERFLOOP_HOME/listen`` (`perfloop.stack.listen` makes them)."""

    dir: Path

    @classmethod
    def of(cls, home: Path) -> ListenFiles:
        return cls(home / "listen")

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.dir / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.dir / "server.key"

    @property
    def stack_cert(self) -> Path:
        return self.dir / "stack.pem"

    @property
    def stack_key(self) -> Path:
        return self.dir / "stack.key"

    @property
    def password(self) -> Path:
        return self.dir / "clickhouse.password"

    @property
    def info(self) -> Path:
        """``listen.json``: the address, the ports and the supervisor's pid."""
        return self.dir / "listen.json"


def stack_fields(files: ListenFiles, addr: str) -> dict[str, Any]:
    """The settings of a client of the stack on its machine: the address, mutual TLS to the
    broker with the stack's client certificate, HTTPS and the password at the warehouse."""
    return {
        "host": addr,
        "kafka_security_protocol": "SSL",
        "kafka_ssl_ca": files.ca,
        "kafka_ssl_cert": files.stack_cert,
        "kafka_ssl_key": files.stack_key,
        "clickhouse_tls_cert": files.server_cert,
        "clickhouse_tls_key": files.server_key,
        "clickhouse_ca": files.ca,
        "clickhouse_password": SecretStr(files.password.read_text().strip()),
    }


def listening(home: Path) -> dict[str, Any] | None:
    """The address and ports of the stack at ``home`` while its supervisor runs with
    ``--listen`` (``addr``, ``kafka_port``, ``clickhouse_port``)."""
    try:
        info = json.loads(ListenFiles.of(home).info.read_text())
        os.kill(int(info["supervisor_pid"]), 0)
        return {"addr": str(info["addr"]), "kafka_port": int(info["kafka_port"]),
                "clickhouse_port": int(info["clickhouse_port"])}  # fmt: skip
    except PermissionError:  # it runs, as another user: its files are not ours to read
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def reach_listening_stack(settings: _S) -> _S:
    """``settings`` with the stack's address, ports and client settings (`stack_fields`)
    where they name no security, broker or warehouse of their own and the stack of their
    home listens; else as they are."""
    s: Any = settings
    if (
        getattr(s, "kafka_security_protocol", None) != "PLAINTEXT"
        or s.external_kafka
        or s.external_clickhouse
        or getattr(s, "listen", None)
        or s.clickhouse_password.get_secret_value()
    ):
        return settings
    info = listening(s.home_dir)
    if info is None:
        return settings
    try:
        fields = stack_fields(ListenFiles.of(s.home_dir), info["addr"])
    except OSError:  # not this user's stack: the settings as they are
        return settings
    ports = {"kafka_port": info["kafka_port"], "clickhouse_port": info["clickhouse_port"]}
    return s.model_copy(update=fields | ports)  # type: ignore[no-any-return]
