#!/usr/bin/env bash
# One-shot of docker/compose.secure.yaml (the kafka-setup service): a SCRAM-SHA-512
# credential for each perfloop principal, then the ACLs of kafka-acls.tsv, made as the
# broker's admin (SASL/PLAIN on the internal listener, the only user PLAIN knows).
#
# Each principal's password comes from PERFLOOP_KAFKA_PASSWORD_<NAME> (NAME: PRODUCER,
# STREAMS, SINK, ACTUATOR, NOTIFIER, MIGRATE, OPERATOR); use letters and digits only
# (`openssl rand -hex 24`): the credential is given inside brackets to kafka-configs.sh.
# Running it again changes nothing but the passwords.
set -euo pipefail

BOOTSTRAP=${BOOTSTRAP:-kafka:19092}
KAFKA_BIN=${KAFKA_BIN:-/opt/kafka/bin}
ACLS=${ACLS:-/etc/perfloop/kafka-acls.tsv}
CA=${CA:-/etc/perfloop/secrets/ca.pem}
PRINCIPALS=(producer streams sink actuator notifier migrate operator)

conf=$(mktemp)
trap 'rm -f "$conf"' EXIT
cat > "$conf" <<PROPS
security.protocol=SASL_SSL
sasl.mechanism=PLAIN
sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD:?set KAFKA_ADMIN_PASSWORD}";
ssl.truststore.type=PEM
ssl.truststore.location=$CA
PROPS

for name in "${PRINCIPALS[@]}"; do  # every password first: nothing is made with one missing
  var="PERFLOOP_KAFKA_PASSWORD_${name^^}"
  if [[ ! ${!var:-} =~ ^[A-Za-z0-9]{16,}$ ]]; then
    echo "kafka-setup: $var must be 16 or more letters and digits" >&2
    exit 1
  fi
done

for name in "${PRINCIPALS[@]}"; do
  var="PERFLOOP_KAFKA_PASSWORD_${name^^}"
  "$KAFKA_BIN/kafka-configs.sh" --bootstrap-server "$BOOTSTRAP" --command-config "$conf" \
    --alter --add-config "SCRAM-SHA-512=[password=${!var}]" \
    --entity-type users --entity-name "perfloop-$name" </dev/null
done

while IFS=$'\t' read -r principal operation kind pattern name; do
  case "$principal" in '' | '#'*) continue ;; esac
  case "$kind" in
    topic) resource=(--topic "$name") ;;
    group) resource=(--group "$name") ;;
    cluster) resource=(--cluster) ;;
    *) echo "kafka-setup: $ACLS: unknown resource type '$kind'" >&2; exit 1 ;;
  esac
  "$KAFKA_BIN/kafka-acls.sh" --bootstrap-server "$BOOTSTRAP" --command-config "$conf" \
    --add --allow-principal "User:$principal" --operation "$operation" \
    "${resource[@]}" --resource-pattern-type "$pattern" </dev/null
done < "$ACLS"
echo "kafka-setup: ${#PRINCIPALS[@]} principals and their ACLs are in place"
