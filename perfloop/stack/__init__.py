"""The embedded stack that `perfloop up` runs on one machine.

- `perfloop.stack.supervisor`: starts, watches and restarts the services, records them, and
  stops exactly what it started (`perfloop up`, `up_detached`); `perfloop.stack.control`:
  `down` and `status` from outside it; their names are also here
  (``from perfloop.stack import Supervisor``);
- `perfloop.stack.broker`: the embedded Kafka-API broker (the Tansu binary) and its limits;
- `perfloop.stack.warehouse_server`: chDB served over the ClickHouse HTTP interface
  (``python -m perfloop.stack.warehouse_server``);
- `perfloop.stack.listen`: the stack beyond loopback (`perfloop up --listen`): its
  certificates and password, and what a node needs to reach it (`client_bundle`, `perfloop
  keys client`).
"""

from perfloop.stack.control import STATE_FILE, check_external, down, read_state, status
from perfloop.stack.listen import client_bundle
from perfloop.stack.supervisor import AUTOGROUP_NICE, SERVICES, Supervisor, up_detached

__all__ = [
    "AUTOGROUP_NICE",
    "SERVICES",
    "STATE_FILE",
    "Supervisor",
    "check_external",
    "client_bundle",
    "down",
    "read_state",
    "status",
    "up_detached",
]
