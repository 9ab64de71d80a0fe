//! Progress bars while a phase runs, then a table per mode and a JSON document for machines.

use std::time::Duration;

use serde::Serialize;

use crate::scenarios::Phase;

/// A bar that fills over `seconds` (hidden when stderr is not a terminal, as in CI).
pub fn phase_bar(name: &str, seconds: f64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new((seconds * 1000.0) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("  {prefix:<48} [{bar:30}] {elapsed:>4} {msg}")
            .expect("progress template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_owned());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

/// A bar counting `total` set-up steps.
pub fn count_bar(name: &str, total: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    bar.set_style(
        indicatif::ProgressStyle::with_template("  {prefix:<48} [{bar:30}] {pos}/{len}")
            .expect("progress template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_owned());
    bar
}

/// Whether a target from the benchmark issue was met, and by what figures.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub target: String,
    pub measured: String,
    pub met: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModeReport {
    pub mode: String,
    pub description: String,
    /// Single-row INSERT commits per second on the same PostgreSQL server (pgbench), if measured.
    pub pgbench_inserts_per_second: Option<f64>,
    pub setup_seconds: f64,
    pub phases: Vec<Phase>,
    pub verdicts: Vec<Verdict>,
    /// The chaos runs' figures (docs/reliability.md), when any ran.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chaos: Vec<crate::chaos::ChaosFigure>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub label: String,
    pub started_unix: u64,
    /// The checkout the bench ran from.
    pub git_revision: String,
    /// The commit the measured gateway was built from (its `--version`), or "unknown".
    pub gateway_revision: String,
    pub gateway_binary: String,
    pub machine: Machine,
    pub settings: serde_json::Value,
    pub modes: Vec<ModeReport>,
    pub verdicts: Vec<Verdict>,
    pub total_seconds: f64,
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu_model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cpu_model,
        memory_gib: memory_kib / 1024.0 / 1024.0,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned(),
    }
}

fn ms(value: f64) -> String {
    if value >= 100.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// The table for one mode, as printed and as pasted into docs/benchmarks.md.
pub fn table(mode: &ModeReport) -> String {
    let mut out = format!("\n### {} — {}\n\n", mode.mode, mode.description);
    if let Some(tps) = mode.pgbench_inserts_per_second {
        out += &format!("pgbench, single-row INSERT commits on the same server: {tps:.0}/s\n\n");
    }
    if !mode.chaos.is_empty() {
        out += &crate::chaos::table(&mode.chaos);
    }
    if mode.phases.is_empty() {
        return out + &verdict_lines(&mode.verdicts);
    }
    out += "| scenario | phase | ok | ok/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | errors | gateway CPU % | database CPU % | bench CPU % | RSS MiB | peak RSS MiB |\n";
    out += "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in &mode.phases {
        let l = p.latency_ms.as_ref();
        let cell =
            |f: fn(&crate::scenarios::Percentiles) -> f64| l.map_or("-".into(), |l| ms(f(l)));
        out += &format!(
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |\n",
            p.scenario,
            p.phase,
            p.ops,
            p.rate,
            cell(|l| l.p50),
            cell(|l| l.p90),
            cell(|l| l.p99),
            cell(|l| l.p999),
            cell(|l| l.max),
            p.errors,
            p.gateway_cpu_percent,
            p.database_cpu_percent,
            p.bench_cpu_percent,
            p.rss_mib,
            p.peak_rss_mib,
        );
    }
    let notes: Vec<String> = mode
        .phases
        .iter()
        .flat_map(|p| {
            let mut lines = Vec::new();
            if !p.extra.is_empty() {
                let figures: Vec<String> = p
                    .extra
                    .iter()
                    .map(|(k, v)| format!("{k} {}", round(*v)))
                    .collect();
                lines.push(format!(
                    "- {} {}: {}",
                    p.scenario,
                    p.phase,
                    figures.join(", ")
                ));
            }
            if !p.error_kinds.is_empty() {
                let kinds: Vec<String> = p
                    .error_kinds
                    .iter()
                    .map(|(k, v)| format!("{k} ×{v}"))
                    .collect();
                lines.push(format!(
                    "- {} {} errors: {}",
                    p.scenario,
                    p.phase,
                    kinds.join(", ")
                ));
            }
            lines
        })
        .collect();
    if !notes.is_empty() {
        out += "\n";
        out += &notes.join("\n");
        out += "\n";
    }
    out += &verdict_lines(&mode.verdicts);
    out
}

fn round(v: f64) -> String {
    if v.fract() == 0.0 || v.abs() >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

pub fn verdict_lines(verdicts: &[Verdict]) -> String {
    if verdicts.is_empty() {
        return String::new();
    }
    let mut out = String::from("\n");
    for v in verdicts {
        out += &format!(
            "- {} {}: {}\n",
            if v.met { "met" } else { "MISSED" },
            v.target,
            v.measured
        );
    }
    out
}
