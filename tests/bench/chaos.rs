//! The chaos figures of docs/reliability.md. `chaos-kill`: the all-in-one gateway SIGKILLed every
//! few seconds under a mixed load and restarted on the same data. `chaos-pg-restart`: its
//! PostgreSQL server stopped and started again under a steady load. Every event a host sends is
//! retried with the same identity until it is answered, every provider arrival is matched to a
//! phone and event, so accepted, delivered, lost and duplicated are counted, never estimated.
//!
//! Both run with `ORCA_PUSH_COALESCE_MS=0`: every event goes alone, so each phone-and-event pair
//! has exactly one provider request to look for (a summary would fold several into one).

mod ledger;
mod load;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

use self::ledger::{Ledger, Outcome, Tally};
use crate::report::Verdict;
use crate::scenarios::Arrivals;
use crate::{Mode, ModeRun};

/// One chaos run's figures, as printed and written to the JSON report.
#[derive(Debug, Clone, Serialize)]
pub struct ChaosFigure {
    pub scenario: String,
    pub description: String,
    pub figures: BTreeMap<String, f64>,
    /// Failed or refused requests by kind (`503 dependency_unavailable`, `transport`, ...).
    pub failures: BTreeMap<String, u64>,
    pub verdicts: Vec<Verdict>,
}

fn tally_figures(tally: &Tally) -> BTreeMap<String, f64> {
    BTreeMap::from([
        ("events sent".into(), tally.events as f64),
        ("requests".into(), tally.attempts as f64),
        ("events given up unanswered".into(), tally.gave_up as f64),
        (
            "accepted (phone+event queued)".into(),
            tally.accepted as f64,
        ),
        ("delivered (phone+event)".into(), tally.delivered as f64),
        ("lost".into(), tally.lost as f64),
        (
            "undelivered past deadline".into(),
            tally.expired_undelivered as f64,
        ),
        (
            "delivered, never answered queued".into(),
            tally.delivered_unconfirmed as f64,
        ),
        (
            "arrivals without notificationId".into(),
            tally.unidentified_arrivals as f64,
        ),
        ("duplicates".into(), tally.duplicates as f64),
        (
            "duplicated phone+event".into(),
            tally.duplicated_pairs as f64,
        ),
        (
            "duplicates with another collapse id".into(),
            tally.duplicates_with_other_collapse_id as f64,
        ),
        (
            "duplicates with no disruption between".into(),
            tally.duplicates_without_disruption_between as f64,
        ),
        (
            "max ms from a duplicate's first copy to the disruption".into(),
            tally.duplicate_first_to_disruption_max_ms,
        ),
    ])
}

fn tally_verdicts(tally: &Tally) -> Vec<Verdict> {
    vec![
        Verdict {
            target: "accepted equals delivered (none lost)".into(),
            measured: format!(
                "{} accepted, {} delivered, {} lost, {} undelivered past deadline",
                tally.accepted, tally.delivered, tally.lost, tally.expired_undelivered
            ),
            met: tally.accepted == tally.delivered && tally.accepted > 0,
        },
        Verdict {
            target: "duplicates only across a disruption, with the first copy's collapse id".into(),
            measured: format!(
                "{} duplicates ({} with another collapse id, {} with no disruption between)",
                tally.duplicates,
                tally.duplicates_with_other_collapse_id,
                tally.duplicates_without_disruption_between
            ),
            met: tally.duplicates_with_other_collapse_id == 0
                && tally.duplicates_without_disruption_between == 0,
        },
    ]
}

/// Waits until every accepted phone-and-event pair has arrived at a provider, or `within`, or
/// until the last outstanding pair is past its deadline. Returns the seconds it took.
async fn drain(ledger: &Ledger, arrivals: &Arrivals, within: Duration) -> f64 {
    let started = Instant::now();
    let bar = crate::report::phase_bar(
        "chaos: waiting for the queue to drain",
        within.as_secs_f64(),
    );
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        ledger.arrived(arrivals.take_kept());
        let outstanding = ledger.outstanding();
        bar.set_position(started.elapsed().as_millis() as u64);
        bar.set_message(format!("{outstanding} outstanding"));
        let past_deadlines = ledger
            .last_outstanding_deadline()
            .is_none_or(|d| Instant::now() > d);
        if outstanding == 0 || past_deadlines || started.elapsed() >= within {
            // The mocks may still be passing on the last arrivals.
            tokio::time::sleep(Duration::from_secs(2)).await;
            ledger.arrived(arrivals.take_kept());
            bar.finish_and_clear();
            return started.elapsed().as_secs_f64();
        }
    }
}

/// Polls `/ready` until it answers 200; the time it took, or None after `within`.
async fn until_ready(http: &reqwest::Client, base: &str, within: Duration) -> Option<Instant> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        let ready = http
            .get(format!("{base}/ready"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ready {
            return Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

fn seconds(d: Duration) -> f64 {
    d.as_secs_f64()
}

impl ModeRun<'_> {
    /// `chaos-kill`: SIGKILL and restart the all-in-one process every `kill_every` seconds of a
    /// `chaos_seconds` mixed load at `chaos_rate`, then wait for the queue to drain and count.
    pub(crate) async fn chaos_kill(&self) -> anyhow::Result<ChaosFigure> {
        let args = self.args;
        anyhow::ensure!(self.mode != Mode::Split, "chaos-kill runs all in one");
        let mut gateway = self.start(Some(0)).await;
        let target = self.target(&gateway);
        let pool = self.population(&target, args.chaos_hosts).await?;
        let ledger = Arc::new(Ledger::default());
        self.arrivals.take_kept();
        self.arrivals.keep_all();
        let started = Instant::now();
        let deadline = started + Duration::from_secs_f64(args.chaos_seconds);
        let bar = crate::report::phase_bar("chaos: kill -9 under load", args.chaos_seconds);
        // Each kill an instant: the killed process sends nothing after it, and the restarted one
        // may deliver before `/ready` is seen to answer.
        let mut kills: Vec<(Instant, Instant)> = Vec::new();
        let mut downtimes: Vec<f64> = Vec::new();
        let killing = async {
            let every = Duration::from_secs_f64(args.kill_every);
            let mut next = started + every;
            while next < deadline {
                tokio::time::sleep_until(next.into()).await;
                let killed_at = Instant::now();
                gateway.process("all").kill().await;
                gateway.process("all").respawn().await;
                let ready = until_ready(self.http, &gateway.base, Duration::from_secs(60)).await;
                let ready = ready.context("the gateway was not ready within 60 s of a restart")?;
                kills.push((killed_at, killed_at));
                downtimes.push(seconds(ready - killed_at));
                bar.set_position(started.elapsed().as_millis() as u64);
                bar.set_message(format!("{} kills", kills.len()));
                next += every;
            }
            anyhow::Ok(())
        };
        let loading = load::run(
            &pool,
            &ledger,
            args.chaos_rate,
            deadline,
            std::future::pending(),
        );
        let (killed, ()) = tokio::join!(killing, loading);
        bar.finish_and_clear();
        killed?;
        let load_seconds = seconds(started.elapsed());
        let drained = drain(
            &ledger,
            self.arrivals,
            Duration::from_secs_f64(args.drain_seconds),
        )
        .await;
        self.keep_log(&gateway);
        let tally = ledger.tally(&kills);
        let mut figures = tally_figures(&tally);
        figures.insert("kills".into(), kills.len() as f64);
        figures.insert("load seconds (last answers included)".into(), load_seconds);
        figures.insert("drain seconds".into(), drained);
        let mean = downtimes.iter().sum::<f64>() / downtimes.len().max(1) as f64;
        let max = downtimes.iter().copied().fold(0.0, f64::max);
        figures.insert("restart: kill to /ready, mean s".into(), mean);
        figures.insert("restart: kill to /ready, max s".into(), max);
        Ok(ChaosFigure {
            scenario: "chaos-kill".into(),
            description: format!(
                "SIGKILL every {} s during {} s of alerts at {} ops/s (80% single, 20% bursts of 5), \
                 {} hosts × {} phones, coalescing window 0",
                args.kill_every,
                args.chaos_seconds,
                args.chaos_rate,
                args.chaos_hosts,
                args.devices
            ),
            figures,
            failures: tally.failures.clone(),
            verdicts: tally_verdicts(&tally),
        })
    }

    /// `chaos-pg-restart`: a steady load, PostgreSQL stopped (`--pg-stop`) for
    /// `pg_outage_seconds` after `pg_before_seconds`, started again (`--pg-start`), the load kept
    /// up for `pg_after_seconds`; how soon the gateway answers `queued` again, and the counts.
    pub(crate) async fn chaos_pg_restart(&self) -> anyhow::Result<ChaosFigure> {
        let args = self.args;
        anyhow::ensure!(
            self.mode != Mode::Sqlite,
            "chaos-pg-restart needs PostgreSQL"
        );
        let (Some(stop), Some(start)) = (&args.pg_stop, &args.pg_start) else {
            anyhow::bail!(
                "chaos-pg-restart needs --pg-stop and --pg-start (scripts/chaos sets them)"
            );
        };
        let gateway = self.start(Some(0)).await;
        let orca_push_storage::DatabaseConfig::Postgres { url } = gateway.database.clone() else {
            anyhow::bail!("chaos-pg-restart: the gateway is not on PostgreSQL");
        };
        let target = self.target(&gateway);
        let pool = self.population(&target, args.chaos_hosts).await?;
        let ledger = Arc::new(Ledger::default());
        self.arrivals.take_kept();
        self.arrivals.keep_all();
        let total = args.pg_before_seconds + args.pg_outage_seconds + args.pg_after_seconds;
        let started = Instant::now();
        // A bound on the load, however long PostgreSQL takes to come back.
        let deadline = started + Duration::from_secs_f64(total + 120.0);
        let bar = crate::report::phase_bar("chaos: PostgreSQL restart under load", total);
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let restarting = async {
            tokio::time::sleep(Duration::from_secs_f64(args.pg_before_seconds)).await;
            let stopped_at = Instant::now();
            shell(stop).await.context("--pg-stop")?;
            let stop_took = stopped_at.elapsed();
            bar.set_message("PostgreSQL down");
            tokio::time::sleep(Duration::from_secs_f64(args.pg_outage_seconds)).await;
            let start_issued = Instant::now();
            shell(start).await.context("--pg-start")?;
            let start_took = start_issued.elapsed();
            let pg_ready = until_postgres(
                secrecy::ExposeSecret::expose_secret(&url),
                Duration::from_secs(60),
            )
            .await?;
            bar.set_message("PostgreSQL up");
            let gateway_ready =
                until_ready(self.http, &gateway.base, Duration::from_secs(60)).await;
            // The load goes on for `pg_after_seconds` once PostgreSQL is back.
            let after = Duration::from_secs_f64(args.pg_after_seconds);
            tokio::time::sleep_until((pg_ready + after).into()).await;
            let _ = done_tx.send(());
            anyhow::Ok(Timeline {
                stopped_at,
                stop_took,
                start_issued,
                start_took,
                pg_ready,
                gateway_ready,
            })
        };
        let stop_load = async {
            let _ = done_rx.await;
        };
        let loading = load::run(&pool, &ledger, args.chaos_rate, deadline, stop_load);
        let (restarted, ()) = tokio::join!(restarting, loading);
        bar.finish_and_clear();
        let Timeline {
            stopped_at,
            stop_took,
            start_issued,
            start_took,
            pg_ready,
            gateway_ready,
        } = restarted?;
        let drained = drain(
            &ledger,
            self.arrivals,
            Duration::from_secs_f64(args.drain_seconds),
        )
        .await;
        self.keep_log(&gateway);
        // The outage lasts until the server accepts again: nothing is claimed meanwhile, so an
        // arrival during it was under way at the stop.
        let tally = ledger.tally(&[(stopped_at, pg_ready)]);
        let mut figures = tally_figures(&tally);
        let since_ready = |at: Instant| at.saturating_duration_since(pg_ready).as_secs_f64();
        let attempts = ledger.attempts();
        let first_queued = attempts
            .iter()
            .filter(|a| matches!(a.outcome, Outcome::Queued) && a.started >= pg_ready)
            .map(|a| a.ended)
            .min();
        let last_failure = attempts
            .iter()
            .filter(|a| !matches!(a.outcome, Outcome::Queued))
            .map(|a| a.ended)
            .max();
        let first_failure = attempts
            .iter()
            .filter(|a| !matches!(a.outcome, Outcome::Queued))
            .map(|a| a.ended)
            .min();
        let during_outage = attempts
            .iter()
            .filter(|a| a.ended >= stopped_at && a.started <= pg_ready)
            .count();
        figures.insert(
            "PostgreSQL down s (stop to accepting)".into(),
            seconds(pg_ready - stopped_at),
        );
        figures.insert("PostgreSQL: stop command s".into(), seconds(stop_took));
        figures.insert("PostgreSQL: start command s".into(), seconds(start_took));
        figures.insert(
            "PostgreSQL: start issued to accepting s".into(),
            seconds(pg_ready - start_issued),
        );
        let longest = attempts
            .iter()
            .map(|a| seconds(a.ended - a.started))
            .fold(0.0, f64::max);
        figures.insert("longest request s".into(), longest);
        figures.insert(
            "first queued after PostgreSQL accepts, s (request sent after)".into(),
            first_queued.map_or(f64::NAN, since_ready),
        );
        figures.insert(
            "last failed answer after PostgreSQL accepts, s (0: none after)".into(),
            last_failure.map_or(0.0, since_ready),
        );
        figures.insert(
            "first failed answer after the stop, s".into(),
            first_failure.map_or(f64::NAN, |at| {
                seconds(at.saturating_duration_since(stopped_at))
            }),
        );
        figures.insert(
            "/ready 200 after PostgreSQL accepts, s".into(),
            gateway_ready.map_or(f64::NAN, since_ready),
        );
        figures.insert("requests spanning the outage".into(), during_outage as f64);
        figures.insert("drain seconds".into(), drained);
        let mut verdicts = tally_verdicts(&tally);
        let recovered = last_failure.map_or(0.0, since_ready);
        verdicts.push(Verdict {
            target: "sends answered queued again within 5 s of PostgreSQL".into(),
            measured: format!(
                "first queued {:.2} s, last failure {recovered:.2} s after it accepts connections",
                first_queued.map_or(f64::NAN, since_ready)
            ),
            met: first_queued.is_some_and(|at| since_ready(at) <= 5.0) && recovered <= 5.0,
        });
        let internal: u64 = tally
            .failures
            .iter()
            .filter(|(kind, _)| kind.starts_with("500"))
            .map(|(_, n)| n)
            .sum();
        verdicts.push(Verdict {
            target: "failures during the outage are 503s, never 500".into(),
            measured: format!("{internal} answered 500"),
            met: internal == 0,
        });
        Ok(ChaosFigure {
            scenario: "chaos-pg-restart".into(),
            description: format!(
                "PostgreSQL stopped ({stop}) {} s into alerts at {} ops/s, down {} s, load kept \
                 {} s after, {} hosts × {} phones, coalescing window 0",
                args.pg_before_seconds,
                args.chaos_rate,
                args.pg_outage_seconds,
                args.pg_after_seconds,
                args.chaos_hosts,
                args.devices
            ),
            figures,
            failures: tally.failures.clone(),
            verdicts,
        })
    }
}

/// When PostgreSQL went down and came back, and when the gateway said it was ready.
struct Timeline {
    stopped_at: Instant,
    stop_took: Duration,
    start_issued: Instant,
    start_took: Duration,
    pg_ready: Instant,
    gateway_ready: Option<Instant>,
}

/// Runs `command` with `sh -c`; an error unless it exits 0.
async fn shell(command: &str) -> anyhow::Result<()> {
    let output = tokio::process::Command::new("sh")
        .args(["-c", command])
        .output()
        .await?;
    anyhow::ensure!(
        output.status.success(),
        "`{command}` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// Connects to PostgreSQL until a query answers: the instant it accepts connections again.
async fn until_postgres(url: &str, within: Duration) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + within;
    loop {
        let answered = match sqlx::PgPool::connect(url).await {
            Ok(pool) => {
                let ok = sqlx::query("SELECT 1").execute(&pool).await.is_ok();
                pool.close().await;
                ok
            }
            Err(_) => false,
        };
        if answered {
            return Ok(Instant::now());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "PostgreSQL did not come back within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The chaos figures as a table per run (their verdicts are among the mode's).
pub fn table(figures: &[ChaosFigure]) -> String {
    let mut out = String::new();
    for f in figures {
        out += &format!(
            "\n#### {} — {}\n\n| figure | value |\n|---|---:|\n",
            f.scenario, f.description
        );
        for (name, value) in &f.figures {
            let value = if value.fract() == 0.0 {
                format!("{value:.0}")
            } else {
                format!("{value:.2}")
            };
            out += &format!("| {name} | {value} |\n");
        }
        if !f.failures.is_empty() {
            let kinds: Vec<String> = f
                .failures
                .iter()
                .map(|(k, v)| format!("{k} ×{v}"))
                .collect();
            out += &format!("\nfailed or refused requests: {}\n", kinds.join(", "));
        }
    }
    out
}
