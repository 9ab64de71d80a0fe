//! The load generator itself: a seconds-long run of every scenario in every mode, so the harness
//! cannot rot. Figures here are from a debug build and mean nothing; only that every scenario ran,
//! did work and met no errors is checked.

use serde_json::Value;

/// Runs the bench in smoke mode with `args` against the test build of the gateway: its JSON
/// report and its standard output, once it has succeeded.
async fn smoke(args: &[&str]) -> (Value, String) {
    let json = tempfile::NamedTempFile::new().unwrap();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_orca-push-bench"))
        .arg("--smoke")
        .args(args)
        .arg("--gateway")
        .arg(orca_push_tests::binary())
        .arg("--json")
        .arg(json.path())
        .output()
        .await
        .expect("run orca-push-bench");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "orca-push-bench failed:\n{stdout}\n{stderr}"
    );
    let report = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    (report, stdout)
}

/// The first mode's admission rows, in the order they ran.
fn admission_rows(report: &Value) -> Vec<&Value> {
    report["modes"][0]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["scenario"] == "admission")
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_scenario_runs_in_every_mode() {
    let (report, stdout) = smoke(&["--modes", "sqlite,postgres,split", "--label", "smoke"]).await;
    let modes = report["modes"].as_array().expect("modes");
    assert_eq!(
        modes
            .iter()
            .map(|m| m["mode"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["sqlite", "postgres", "split"]
    );
    for mode in modes {
        let phases = mode["phases"].as_array().unwrap();
        let name = mode["mode"].as_str().unwrap();
        for scenario in ["idle", "handshake", "send", "deliver", "mixed"] {
            let rows: Vec<&Value> = phases
                .iter()
                .filter(|p| p["scenario"] == scenario)
                .collect();
            assert!(!rows.is_empty(), "{name}: no {scenario} row in {stdout}");
            for row in rows {
                assert_eq!(row["errors"], 0, "{name}: {row}");
                if scenario != "idle" {
                    assert!(row["ops"].as_u64().unwrap() > 0, "{name}: {row}");
                    assert!(row["rate"].as_f64().unwrap() > 0.0, "{name}: {row}");
                }
                assert!(row["rss_mib"].as_f64().unwrap() > 0.0, "{name}: {row}");
            }
        }
        let delivered = phases
            .iter()
            .filter(|p| p["scenario"] == "deliver")
            .all(|p| p["latency_ms"]["p50"].as_f64().is_some());
        assert!(delivered, "{name}: deliveries without latency");
        assert!(mode["pgbench_inserts_per_second"].is_number() == (name != "sqlite"));
        // The table names every scenario.
        assert!(stdout.contains(&format!("### {name}")), "{stdout}");
    }
}

#[tokio::test]
async fn a_wrong_gateway_path_is_one_clear_error() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_orca-push-bench"))
        .args([
            "--smoke",
            "--modes",
            "sqlite",
            "--gateway",
            "/no/such/orca-push",
        ])
        .output()
        .await
        .expect("run orca-push-bench");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--gateway /no/such/orca-push: no such file")
            && !stderr.contains("panicked"),
        "{stderr}"
    );
}

/// The admission scenario driven by wrk (`--admission-client wrk`), as the performance issue
/// measured: its script's sends are all answered `queued` (a body the gateway refused, or a send
/// over a host's quota, would count as an error), and its rows carry wrk's figures and its CPU
/// (present, not necessarily above zero: a second of a debug build's load can take wrk less than
/// one clock tick). `scripts/test` installs wrk where it is missing.
#[tokio::test(flavor = "multi_thread")]
async fn admission_runs_under_wrk() {
    let (report, stdout) = smoke(&[
        "--modes",
        "sqlite",
        "--scenarios",
        "admission",
        "--admission-client",
        "wrk",
    ])
    .await;
    let rows = admission_rows(&report);
    // The two closed loops, then the open loop at half their peak that the latency target is
    // judged at (the bench's own client: wrk offers no open loop).
    assert_eq!(rows.len(), 3, "{stdout}");
    let (open, closed) = rows.split_last().unwrap();
    let half_peak = open["phase"].as_str().unwrap();
    assert!(half_peak.starts_with("open loop at "), "{open}");
    assert!(half_peak.ends_with("(half the peak)"), "{open}");
    assert_eq!(open["errors"], 0, "{open}");
    assert!(open["latency_ms"]["p99"].as_f64().unwrap() > 0.0, "{open}");
    assert!(
        stdout.contains("send p99 < 25 ms at half the peak rate (admission scenario)"),
        "{stdout}"
    );
    for row in closed {
        assert!(row["phase"].as_str().unwrap().ends_with("(wrk)"), "{row}");
        assert_eq!(row["errors"], 0, "{row}");
        assert!(row["ops"].as_u64().unwrap() > 0, "{row}");
        assert!(row["latency_ms"]["p50"].as_f64().unwrap() > 0.0, "{row}");
        assert!(
            row["extra"]["wrk_cpu_percent"].as_f64().unwrap() >= 0.0,
            "{row}"
        );
    }
}

/// `--admission-rates` adds one open loop per rate after the one at half the peak (rates that
/// round to the same whole number once), and `--timeline` writes each open loop's sends, one a
/// line: its start (Unix microseconds) and latency (microseconds).
#[tokio::test(flavor = "multi_thread")]
async fn admission_rates_add_open_loops_and_timelines_record_them() {
    let timelines = tempfile::tempdir().unwrap();
    let (report, stdout) = smoke(&[
        "--modes",
        "sqlite",
        "--scenarios",
        "admission",
        "--admission-rates",
        "40,40.2",
        "--timeline",
        timelines.path().to_str().unwrap(),
    ])
    .await;
    let open: Vec<&str> = admission_rows(&report)
        .into_iter()
        .filter_map(|p| p["phase"].as_str())
        .filter(|phase| phase.starts_with("open loop at "))
        .collect();
    assert_eq!(open.len(), 2, "{stdout}");
    assert!(open[0].ends_with("(half the peak)"), "{open:?}");
    assert_eq!(open[1], "open loop at 40/s", "{open:?}");
    let files: Vec<_> = std::fs::read_dir(timelines.path().join("sqlite"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(files.len(), 2, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let line = text
            .lines()
            .next()
            .unwrap_or_else(|| panic!("{file:?} empty"));
        let fields: Vec<u128> = line.split(' ').map(|f| f.parse().unwrap()).collect();
        assert_eq!(fields.len(), 2, "{line}");
        assert!(fields[0] > 1_700_000_000_000_000 && fields[1] > 0, "{line}");
    }
}
