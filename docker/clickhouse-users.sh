#!/bin/bash
# ClickHouse users and roles of docker/compose.secure.yaml, made once at the first start of an
# empty data volume (the image's /docker-entrypoint-initdb.d hook), as the administrator
# compose.yaml creates (CLICKHOUSE_USER, with access management).
#
#   perfloop_schema  everything on perfloop.*: `perfloop migrate` (tables, views, TTLs)
#   perfloop_writer  INSERT and SELECT on perfloop.*: the sink, the accountant
#   perfloop_reader  SELECT on perfloop.*: the stream workers (history), the actuator
#                    (settings, ended jobs), Grafana
#
# Each user's password comes from PERFLOOP_CLICKHOUSE_PASSWORD_<NAME>: 16 or more letters and
# digits (it is written into the SQL below).
set -euo pipefail

declare -A ROLE=(
  [migrate]=perfloop_schema [sink]=perfloop_writer [accountant]=perfloop_writer
  [streams]=perfloop_reader [actuator]=perfloop_reader [grafana]=perfloop_reader
)

sql="CREATE DATABASE IF NOT EXISTS perfloop;
CREATE ROLE IF NOT EXISTS perfloop_schema;
GRANT ALL ON perfloop.* TO perfloop_schema;
CREATE ROLE IF NOT EXISTS perfloop_writer;
GRANT INSERT, SELECT ON perfloop.* TO perfloop_writer;
CREATE ROLE IF NOT EXISTS perfloop_reader;
GRANT SELECT ON perfloop.* TO perfloop_reader;
"
for name in migrate streams sink actuator accountant grafana; do
  var="PERFLOOP_CLICKHOUSE_PASSWORD_${name^^}"
  password="${!var:-}"
  if [[ ! $password =~ ^[A-Za-z0-9]{16,}$ ]]; then
    echo "clickhouse-users: $var must be 16 or more letters and digits" >&2
    exit 1
  fi
  role=${ROLE[$name]}
  sql+="CREATE USER IF NOT EXISTS \`perfloop-$name\` IDENTIFIED WITH sha256_password BY '$password';
GRANT $role TO \`perfloop-$name\`;
ALTER USER \`perfloop-$name\` DEFAULT ROLE $role;
"
done

${CLICKHOUSE_CLIENT:-clickhouse client} --user "${CLICKHOUSE_USER:-default}" \
  --password "${CLICKHOUSE_PASSWORD:-}" --multiquery <<<"$sql"
echo "clickhouse-users: 6 users in 3 roles"
