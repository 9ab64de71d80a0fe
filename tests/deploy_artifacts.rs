//! What operators read stays true of the code: the artifacts under deploy/compose (Grafana
//! dashboard, Prometheus alert rules) name only metrics the gateway emits and combine the queue's
//! gauges, which every replica reports for the same shared tables, with `max` rather than `sum`;
//! the README's environment table lists exactly the variables the gateway reads.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository")
        .to_owned()
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every `orca_push_*` name in `text`, histogram series suffixes removed.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("orca_push_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name);
        names.insert(base.to_owned());
        rest = &tail[end..];
    }
    names
}

/// The text of every Rust source file of the gateway.
fn gateway_sources() -> String {
    gateway_source_files().concat()
}

/// Every Rust source file of the gateway, a text each.
fn gateway_source_files() -> Vec<String> {
    let mut texts = Vec::new();
    let mut dirs: Vec<PathBuf> = ["services", "gateway-facade", "crates"]
        .iter()
        .map(|d| repo().join(d))
        .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                texts.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    texts
}

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs() -> Vec<String> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/compose/grafana/dashboards/orca-push.json")).unwrap();
    dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn every_metric_the_dashboard_and_alerts_query_is_emitted() {
    let sources = gateway_sources();
    let queried = metric_names(&dashboard_exprs().join("\n"))
        .into_iter()
        .chain(metric_names(&read("deploy/compose/alerts.yml")));
    for name in queried {
        assert!(
            sources.contains(&format!("\"{name}\"")),
            "{name} is queried but no gateway source emits it"
        );
    }
}

#[test]
fn the_queues_gauges_are_combined_across_replicas_with_max() {
    for expr in dashboard_exprs()
        .iter()
        .filter(|e| e.contains("orca_push_queue_batches") || e.contains("oldest_due_age"))
    {
        assert!(expr.starts_with("max"), "summed across replicas: {expr}");
    }
}

#[test]
fn dead_tokens_are_on_the_dashboard_and_alerted() {
    assert!(
        dashboard_exprs()
            .iter()
            .any(|e| e.contains("orca_push_dead_tokens_total"))
    );
    let alerts = read("deploy/compose/alerts.yml");
    for alert in [
        "OrcaPushQueueFallingBehind",
        "OrcaPushDeadTokenSurge",
        "OrcaPushProviderNotConfigured",
        "OrcaPushRetryRateHigh",
    ] {
        assert!(alerts.contains(&format!("alert: {alert}")), "{alert}");
    }
    // Prometheus loads the rules from where compose mounts them.
    assert!(read("deploy/compose/prometheus.yml").contains("/etc/prometheus/alerts.yml"));
    assert!(
        read("deploy/compose/docker-compose.yml")
            .contains("./alerts.yml:/etc/prometheus/alerts.yml:ro")
    );
}

/// The environment variables named in `text`: `ORCA_PUSH_*`, `OTEL_*` and the few others.
fn variables(text: &str, quoted: bool) -> BTreeSet<String> {
    const OTHERS: [&str; 4] = [
        "GOOGLE_APPLICATION_CREDENTIALS",
        "GCE_METADATA_HOST",
        "RUST_LOG",
        "PORT",
    ];
    let quote = if quoted { "\"" } else { "`" };
    let mut names = BTreeSet::new();
    for piece in text.split(quote).skip(1).step_by(2) {
        // In the README a name may lead a longer piece (`OTEL_TRACES_EXPORTER=none`); in the
        // source it is the whole string literal.
        let end = piece
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(piece.len());
        let name = &piece[..end];
        let whole = end == piece.len();
        let is_name =
            name.starts_with("ORCA_PUSH_") || name.starts_with("OTEL_") || OTHERS.contains(&name);
        if is_name && (whole || !quoted) {
            names.insert(name.to_owned());
        }
    }
    names
}

#[test]
fn the_readme_environment_table_lists_every_variable_the_gateway_reads() {
    // Named in the source but not gateway settings: the tests' PostgreSQL, the facade's URL,
    // which only an impossible split-mode error would name, the switch of the unit test that
    // rewrites docs/openapi.json, and the commit a build names in `--version` (read when
    // compiling, never at run time; the README's Benchmarks section says who sets it).
    const NOT_SETTINGS: [&str; 4] = [
        "ORCA_PUSH_TEST_POSTGRES_URL",
        "ORCA_PUSH_FACADE_URL",
        "ORCA_PUSH_WRITE_OPENAPI",
        "ORCA_PUSH_BUILD_REVISION",
    ];
    let readme = read("README.md");
    let section = readme
        .split("## Environment")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("the README has an Environment section");
    let rows: String = section
        .lines()
        .filter(|l| l.starts_with('|'))
        .collect::<Vec<_>>()
        .join("\n");
    let documented = variables(&rows, false);
    // File by file: a file whose quotes are odd in number (a `'"'`) would flip which pieces of
    // the next file read as string literals.
    let read_by_code: BTreeSet<String> = gateway_source_files()
        .iter()
        .flat_map(|text| variables(text, true))
        .filter(|v| !NOT_SETTINGS.contains(&v.as_str()))
        .collect();
    let undocumented: Vec<_> = read_by_code.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "read but not in the README's table: {undocumented:?}"
    );
    // The table may also name standard variables libraries read by themselves: the OTLP
    // exporter's, the SDK's metric export interval, and tracing-subscriber's `RUST_LOG`.
    let unknown: Vec<_> = documented
        .difference(&read_by_code)
        .filter(|v| {
            !v.starts_with("OTEL_EXPORTER_OTLP_")
                && *v != "OTEL_METRIC_EXPORT_INTERVAL"
                && *v != "RUST_LOG"
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "in the README's table but read nowhere: {unknown:?}"
    );
}

/// The database URL Terraform stores for Cloud Run, its interpolations filled in, is one the
/// gateway can read: with credentials and no host (the socket given only as `?host=`) it could
/// not, and the migrate job and every service would fail at their first connect.
#[test]
fn terraforms_database_url_is_one_the_gateway_can_read() {
    let main = read("deploy/terraform/main.tf");
    let line = main
        .lines()
        .find(|l| l.trim_start().starts_with("secret_data") && l.contains("postgres://"))
        .expect("main.tf stores the database URL");
    let template = line.split('"').nth(1).expect("the URL is a quoted string");
    let mut url = String::new();
    let mut rest = template;
    while let Some(at) = rest.find("${") {
        url.push_str(&rest[..at]);
        let end = rest[at..].find('}').expect("an interpolation ends") + at;
        url.push_str(if rest[at..end].contains("password") {
            "Abc123xyz"
        } else {
            "project:region:instance"
        });
        rest = &rest[end + 1..];
    }
    url.push_str(rest);
    assert!(url.starts_with("postgres://"), "{url}");
    orca_push_storage::check_postgres_url(&url).unwrap_or_else(|e| panic!("{url}: {e}"));
}
