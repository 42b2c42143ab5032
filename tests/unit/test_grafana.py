"""Grafana in the production topology: the four dashboards' JSON models are well formed for
Grafana and the ClickHouse data source plugin (unique ids, every panel on the provisioned data
source with raw SQL, a sane grid, every variable it uses defined, only the plugin's macros,
only tables the warehouse migrations create), and the provisioning files and both compose
files (docker/compose.yaml, docker/grafana/compose.embedded.yaml) wire them together. No
Grafana is needed; tests/integration/test_grafana_dashboards.py runs the SQL itself."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from perfloop.settings import StackSettings
from perfloop.warehouse.migrations import MIGRATIONS

yaml = pytest.importorskip("yaml", reason="pyyaml (dev extra) is needed to read the YAML files")

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "perfloop.yaml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "perfloop.yaml"
COMPOSE = ROOT / "docker" / "compose.yaml"
EMBEDDED = GRAFANA / "compose.embedded.yaml"

PLUGIN = "grafana-clickhouse-datasource"
DASHBOARDS = ("job", "cluster", "control-loop", "audit")
PLUGIN_MACROS = {
    *("timeFilter", "timeFilter_ms", "dateFilter", "timeInterval", "timeInterval_ms"),
    *("interval_s", "fromTime", "toTime", "fromTime_ms", "toTime_ms", "conditionalAll"),
}
"""The macros the plugin documents (its query editor's macro table) that the dashboards use."""
BARE_MACROS = ("interval_s", "fromTime", "toTime", "fromTime_ms", "toTime_ms")
"""Macros without arguments. The plugin SDK takes a macro's arguments from the first bracket
after it, so a bare one must be followed by ``)`` before any ``(``."""
SQL_FORMATS = {"singlequote", "csv"}
VARIABLE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)|\[\[(\w+)(?::(\w+))?\]\]")
CONDITIONAL_ALL = re.compile(r"\$__conditionalAll\((.*?),\s*\$\{?(\w+)\}?\)")


def _sql_of(target_or_var: dict[str, Any]) -> str:
    q = target_or_var.get("rawSql", target_or_var.get("query"))
    return q if isinstance(q, str) else q["rawSql"]


def _panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in doc["panels"]:
        out.extend(panel.get("panels", []))
        out.append(panel)
    return out


@pytest.fixture(scope="module", params=DASHBOARDS)
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return json.loads((DASHBOARD_DIR / f"{request.param}.json").read_text())


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    doc = yaml.safe_load(DATASOURCES.read_text())
    assert doc["apiVersion"] == 1
    (ds,) = doc["datasources"]
    return ds


@pytest.fixture(scope="module")
def compose_grafana() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]


@pytest.fixture(scope="module")
def embedded_grafana() -> dict[str, Any]:
    return yaml.safe_load(EMBEDDED.read_text())["services"]["grafana"]


def warehouse_relations() -> set[str]:
    """Every table and view the warehouse migrations create."""
    made = re.compile(r"CREATE (?:TABLE|VIEW|MATERIALIZED VIEW) IF NOT EXISTS (\w+)")
    return {name for m in MIGRATIONS for stmt in m.statements for name in made.findall(stmt)}


# --- the dashboards --------------------------------------------------------------------------


def test_the_folder_holds_the_four_dashboards_with_unique_uids() -> None:
    files = sorted(p.stem for p in DASHBOARD_DIR.glob("*.json"))
    assert files == sorted(DASHBOARDS)
    uids = [json.loads((DASHBOARD_DIR / f"{n}.json").read_text())["uid"] for n in DASHBOARDS]
    assert len(set(uids)) == len(uids) and all(re.fullmatch(r"[\w-]{1,40}", u) for u in uids)


def test_the_dashboard_is_a_grafana_model(dashboard: dict[str, Any]) -> None:
    assert dashboard["title"].startswith("perfloop / ") and dashboard["description"]
    assert "perfloop" in dashboard["tags"]
    assert dashboard["id"] is None  # provisioned: Grafana assigns the id
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["time"]["from"].startswith("now-") and dashboard["time"]["to"] == "now"


def test_panel_ids_are_unique_and_every_panel_queries_the_provisioned_datasource(
    dashboard: dict[str, Any], datasource: dict[str, Any]
) -> None:
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    ref = {"type": PLUGIN, "uid": datasource["uid"]}
    for panel in _panels(dashboard):
        if panel["type"] == "row":
            assert not panel.get("targets")
            continue
        title = panel["title"]
        assert title and panel.get("description"), f"panel {panel['id']}: title and description"
        assert panel["datasource"] == ref, title
        assert panel["targets"], f"{title}: no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["datasource"] == ref, title
            assert target["editorType"] == "sql" and target["rawSql"].strip(), title
            # sqlds: 0 time series (long frames widened by their string columns), 1 table
            assert target["format"] in (0, 1), title
            if panel["type"] == "timeseries":
                assert target["format"] == 0, f"{title}: a time series panel needs format 0"
                assert re.search(r"\bAS time\b.*\bORDER BY time\b", target["rawSql"]), (
                    f"{title}: a time series query selects `time` and orders by it"
                )


def test_the_grid_is_sane(dashboard: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in _panels(dashboard):
        g = panel["gridPos"]
        assert set(g) == {"h", "w", "x", "y"}, panel["title"]
        assert g["w"] >= 1 and g["h"] >= 1 and g["x"] >= 0 and g["y"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, f"{panel['title']}: wider than the 24-column grid"
        xs, ys = range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"])
        cells = {(x, y) for x in xs for y in ys}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_every_variable_used_is_defined_before_use_and_quoted_for_sql(
    dashboard: dict[str, Any], datasource: dict[str, Any]
) -> None:
    variables = dashboard["templating"]["list"]
    names = [v["name"] for v in variables]
    assert len(names) == len(set(names))
    multi = {v["name"] for v in variables if v.get("multi") or v.get("includeAll")}

    def check(text: str, defined: set[str], where: str) -> None:
        # A $__conditionalAll's second argument names the variable; the condition uses it.
        for cond, var in CONDITIONAL_ALL.findall(text):
            assert var in defined, f"{where}: $__conditionalAll on unknown variable {var}"
            assert re.search(rf"\$\{{{var}:\w+\}}", cond), f"{where}: {var} unused in {cond!r}"
        body = CONDITIONAL_ALL.sub(lambda m: m[1], text)
        for m in VARIABLE.finditer(body):
            name, fmt = m[1] or m[3] or m[4], m[2] or m[5]
            if name.startswith("__"):  # a macro: test_only_the_plugins_macros_and_safely_placed
                continue
            assert name in defined, f"{where}: ${name} is not defined (before it)"
            if name in multi:
                assert fmt in SQL_FORMATS, (
                    f"{where}: multi-value ${name} needs ${{{name}:singlequote}} or :csv"
                )

    for i, var in enumerate(variables):
        if var["type"] == "constant":
            assert var["hide"] == 2 and str(var["query"]).strip(), var["name"]
            continue
        assert var["type"] == "query", var["name"]
        assert var["datasource"] == {"type": PLUGIN, "uid": datasource["uid"]}, var["name"]
        assert var["query"]["editorType"] == "sql", var["name"]
        check(_sql_of(var), set(names[:i]), f"variable {var['name']}")
    for panel in _panels(dashboard):
        check(panel["title"], set(names), f"title of {panel['title']!r}")
        for target in panel.get("targets", []):
            check(target["rawSql"], set(names), repr(panel["title"]))


def test_only_the_plugins_macros_and_safely_placed(dashboard: dict[str, Any]) -> None:
    queries = [_sql_of(v) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queries += [t["rawSql"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for sql in queries:
        for name in re.findall(r"\$__(\w+)", sql):
            assert name in PLUGIN_MACROS, f"$__{name} is not one of the plugin's macros"
        for name in BARE_MACROS:
            for m in re.finditer(rf"\$__{name}\b", sql):
                after = sql[m.end() :]
                first = re.search(r"[()]", after)
                assert first and first[0] == ")", (
                    f"$__{name} must be followed by ')' before any '(' (write (… / $__{name})): "
                    f"{sql[m.start() : m.start() + 60]!r}"
                )
        # $__conditionalAll splits its arguments at top-level commas, quotes included
        for m in re.finditer(r"\$__conditionalAll\(", sql):
            depth, args = 0, 1
            for ch in sql[m.end() - 1 :]:
                depth += {"(": 1, ")": -1}.get(ch, 0)
                args += ch == "," and depth == 1
                if depth == 0:
                    break
            assert args == 2, (
                f"$__conditionalAll needs exactly 2 arguments: {sql[m.start() :][:80]}"
            )


def test_the_sql_reads_only_what_the_warehouse_migrations_create(dashboard: dict[str, Any]) -> None:
    known = warehouse_relations()
    assert {"steps", "audit", "approvals", "prediction_accuracy", "job_info"} <= known
    queries = [_sql_of(v) for v in dashboard["templating"]["list"] if v["type"] == "query"]
    queries += [t["rawSql"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for sql in queries:
        for table in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", sql):
            assert table in known, f"{table} is not a table or view of the warehouse: {sql[:80]}"


# --- provisioning and compose ----------------------------------------------------------------


def test_the_datasource_is_the_clickhouse_plugin_on_the_perfloop_database(
    datasource: dict[str, Any],
) -> None:
    assert datasource["type"] == PLUGIN and datasource["uid"] == "perfloop-clickhouse"
    data = datasource["jsonData"]
    assert data["defaultDatabase"] == "perfloop"
    # Grafana fills these from its environment, which each compose file sets
    filled = {"host": "HOST", "port": "PORT", "protocol": "PROTOCOL", "username": "USER"}
    for key, var in filled.items():
        assert data[key] == f"${{CLICKHOUSE_{var}}}", key
    assert datasource["secureJsonData"] == {"password": "${CLICKHOUSE_PASSWORD}"}


def test_the_dashboard_provider_loads_the_folder_compose_mounts(
    compose_grafana: dict[str, Any], embedded_grafana: dict[str, Any]
) -> None:
    doc = yaml.safe_load(PROVIDERS.read_text())
    (provider,) = doc["providers"]
    assert provider["type"] == "file" and provider["allowUiUpdates"] is False
    path = provider["options"]["path"]
    for svc, base in ((compose_grafana, COMPOSE.parent), (embedded_grafana, EMBEDDED.parent)):
        binds = [str(v).split(":") for v in svc["volumes"] if str(v).startswith(".")]
        mounts = {parts[0]: parts[1] for parts in binds}
        assert (base / _key_for(mounts, path)).resolve() == DASHBOARD_DIR
        assert (base / _key_for(mounts, "/etc/grafana/provisioning")).resolve() == (
            GRAFANA / "provisioning"
        )
        home = svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
        assert home.startswith(path + "/") and (DASHBOARD_DIR / Path(home).name).is_file()


def _key_for(mounts: dict[str, str], target: str) -> str:
    sources = [src for src, dst in mounts.items() if dst == target]
    assert sources, f"nothing is mounted on {target}: {mounts}"
    return sources[0]


def _plugin_version(svc: dict[str, Any]) -> str:
    spec = str(svc["environment"]["GF_INSTALL_PLUGINS"])
    m = re.fullmatch(rf"{PLUGIN} (\S+)", spec)
    assert m, f"GF_INSTALL_PLUGINS installs the ClickHouse plugin at a pinned version: {spec!r}"
    return m[1]


def test_compose_runs_grafana_on_the_clickhouse_service(compose_grafana: dict[str, Any]) -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    svc = compose_grafana
    assert re.fullmatch(r"grafana/grafana-oss:\d+\.\d+\.\d+", svc["image"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", _plugin_version(svc))
    assert any(str(p).split(":")[-1] == "3000" for p in svc["ports"])
    env = svc["environment"]
    assert env["CLICKHOUSE_HOST"] == "clickhouse" and "clickhouse" in compose["services"]
    assert (env["CLICKHOUSE_PROTOCOL"], str(env["CLICKHOUSE_PORT"])) == ("native", "9000")
    ch = compose["services"]["clickhouse"]["environment"]
    assert env["CLICKHOUSE_USER"] == ch["CLICKHOUSE_USER"]  # the same interpolation
    assert env["CLICKHOUSE_PASSWORD"] == ch["CLICKHOUSE_PASSWORD"]
    assert ch["CLICKHOUSE_DB"] == "perfloop"
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    # the dashboards need the tables: Grafana starts once the migrations ran
    assert svc["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "grafana-data" in compose["volumes"]


def test_the_embedded_variant_reaches_the_stacks_loopback_warehouse(
    compose_grafana: dict[str, Any], embedded_grafana: dict[str, Any]
) -> None:
    svc = embedded_grafana
    assert svc["image"] == compose_grafana["image"]
    assert svc["network_mode"] == "host"  # the embedded warehouse listens on loopback only
    env = svc["environment"]
    assert env["CLICKHOUSE_PROTOCOL"] == "http"  # the embedded server speaks HTTP only
    assert env["CLICKHOUSE_HOST"] == StackSettings().host == "127.0.0.1"
    assert (
        env["CLICKHOUSE_PORT"]
        == f"${{PERFLOOP_CLICKHOUSE_PORT:-{StackSettings().clickhouse_port}}}"
    )
    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    # The same plugin as production: the embedded server writes Native at the plugin's
    # protocol revision (perfloop.stack._native; test_warehouse_compat reads it back).
    m = re.fullmatch(rf"{PLUGIN} \$\{{GRAFANA_CLICKHOUSE_PLUGIN:-(\S+)\}}",
                     env["GF_INSTALL_PLUGINS"])  # fmt: skip
    assert m, env["GF_INSTALL_PLUGINS"]
    assert m.group(1) == str(compose_grafana["environment"]["GF_INSTALL_PLUGINS"]).split()[-1]
