//! The `admission` scenario's closed loops driven by wrk (`--admission-client wrk`), the load
//! generator the performance issue measured both gateways with. The bench's own client
//! (`crate::lines`) shares the two cores with the gateway it measures and spends some 25-40 µs of
//! CPU per send; wrk, written in C around one epoll loop per thread, spends less, so what it leaves
//! to the gateway is closer to what the issue's table measured.
//!
//! wrk runs with a Lua script written here: every request names the next host of the pool in
//! turn (its bearer, its client address, its one phone) and a new notification identity; every
//! answer that is not a 200 naming the recipient `queued` counts as an error; at the end the
//! script prints one line of figures, which becomes the phase's row.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::population::Host;

/// wrk's threads at most: one per core of the machine the figures are for.
const THREADS: usize = 2;

/// Where the script's figures start on wrk's standard output.
const FIGURES: &str = "WRK-FIGURES ";

/// The wrk binary on the path.
async fn binary() -> anyhow::Result<PathBuf> {
    let found = tokio::process::Command::new("wrk")
        .arg("--version")
        .output()
        .await
        .is_ok();
    anyhow::ensure!(
        found,
        "wrk not found: --admission-client wrk needs it on the path (Debian: wrk)"
    );
    Ok("wrk".into())
}

/// wrk's threads for `connections`: as many as divide them evenly (wrk gives each thread
/// `connections / threads` and drops the rest).
fn threads(connections: usize) -> usize {
    (1..=THREADS.min(connections).max(1))
        .rev()
        .find(|t| connections.is_multiple_of(*t))
        .unwrap_or(1)
}

/// What the script prints once wrk is done: counts, and latencies in microseconds.
#[derive(Debug, Deserialize, PartialEq)]
pub struct Figures {
    pub requests: u64,
    /// Answers that were not a 200 naming the recipient `queued`.
    pub refused: u64,
    /// Of those, the 503s (`busy`, or a dependency unavailable).
    #[serde(default)]
    pub busy: u64,
    pub connect_errors: u64,
    pub read_errors: u64,
    pub write_errors: u64,
    pub timeouts: u64,
    pub duration_us: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Figures {
    /// Requests answered `queued`.
    pub fn ok(&self) -> u64 {
        self.requests.saturating_sub(self.refused)
    }

    /// Requests that failed or were refused.
    pub fn errors(&self) -> u64 {
        self.refused + self.connect_errors + self.read_errors + self.write_errors + self.timeouts
    }

    pub fn seconds(&self) -> f64 {
        Duration::from_micros(self.duration_us).as_secs_f64()
    }
}

/// The figures line among wrk's output.
pub fn parse(stdout: &str) -> anyhow::Result<Figures> {
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix(FIGURES))
        .ok_or_else(|| anyhow::anyhow!("wrk printed no figures: {stdout}"))?;
    Ok(serde_json::from_str(line)?)
}

/// `s` as a Lua string literal.
fn lua_string(s: &str) -> String {
    let mut quoted = String::with_capacity(s.len() + 2);
    quoted.push('"');
    for c in s.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\r' => quoted.push_str("\\r"),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// The script for one closed loop of `threads` threads over `hosts`: request `n` of thread `t`
/// (from 0) is number `k = n * threads + t`, and goes as host `k mod hosts` with notification
/// sequence `first_seq + k` and notification id `w<first_seq + k>`, so that no two requests of a
/// run share an identity when each loop's `first_seq` is apart from the others' by more than its
/// requests. A thread stops once `k` reaches `limit`, so that no host spends more than its share
/// of the quota budget. Each host's body is written here up to its notification identity
/// (JSON-encoded by serde), the script appends the rest.
pub fn script(
    hosts: &[&Host],
    threads: usize,
    first_seq: u64,
    limit: u64,
) -> anyhow::Result<String> {
    anyhow::ensure!(!hosts.is_empty(), "no hosts to send as");
    let mut table = String::new();
    for host in hosts {
        let ids = host.registration_ids(None);
        let head = format!(
            r#"{{"v":1,"registrationIds":{},"notification":{{"notificationEpoch":{},"source":"agent-task-complete","agentState":"finished","title":"Agent finished","body":"The benchmark's task is done.","notificationId":"#,
            serde_json::to_string(&ids)?,
            serde_json::to_string(&host.epoch)?,
        );
        writeln!(
            table,
            "  {{{}, {}, {}}},",
            lua_string(host.bearer().to_str()?),
            lua_string(host.forwarded.to_str()?),
            lua_string(&head),
        )?;
    }
    Ok(format!(
        r#"-- Written by orca-push-bench for one closed loop of the admission scenario.
local hosts = {{
{table}}}
local threads = {{}}

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

n = 0
refused = 0
busy = 0

request = function()
  local k = n * {threads} + tid
  n = n + 1
  if k >= {limit} then
    wrk.thread:stop()
  end
  local h = hosts[(k % #hosts) + 1]
  local seq = {first_seq} + k
  local body = h[3] .. '"w' .. seq .. '","notificationSeq":' .. seq .. '}}}}'
  return wrk.format("POST", "/v1/send", {{
    ["Authorization"] = h[1],
    ["X-Forwarded-For"] = h[2],
    ["Content-Type"] = "application/json",
  }}, body)
end

response = function(status, headers, body)
  if status ~= 200 or not string.find(body, '"queued"', 1, true) then
    refused = refused + 1
  end
  if status == 503 then
    busy = busy + 1
  end
end

done = function(summary, latency, requests)
  local refused = 0
  local busy = 0
  for _, thread in ipairs(threads) do
    refused = refused + thread:get("refused")
    busy = busy + thread:get("busy")
  end
  local e = summary.errors
  io.write(string.format(
    '{FIGURES}{{"requests":%d,"refused":%d,"busy":%d,"connect_errors":%d,"read_errors":%d,' ..
    '"write_errors":%d,"timeouts":%d,"duration_us":%d,"p50_us":%.1f,"p90_us":%.1f,' ..
    '"p99_us":%.1f,"p999_us":%.1f,"max_us":%.1f}}\n',
    summary.requests, refused, busy, e.connect, e.read, e.write, e.timeout,
    summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency:percentile(99.9), latency.max))
end
"#
    ))
}

/// Runs wrk for `seconds` at `connections` against `base`, sending as `hosts` from `first_seq`
/// and at most `limit` requests (`script`); its figures.
pub async fn run(
    base: &str,
    connections: usize,
    seconds: f64,
    hosts: &[&Host],
    first_seq: u64,
    limit: u64,
) -> anyhow::Result<Figures> {
    let threads = threads(connections);
    let script = script(hosts, threads, first_seq, limit)?;
    let mut file = tempfile::Builder::new().suffix(".lua").tempfile()?;
    std::io::Write::write_all(&mut file, script.as_bytes())?;
    let output = tokio::process::Command::new(binary().await?)
        .arg(format!("-t{threads}"))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", seconds.ceil().max(1.0) as u64))
        .arg("--timeout")
        .arg("30s")
        .arg("-s")
        .arg(file.path())
        .arg(format!("{}/v1/send", base.trim_end_matches('/')))
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        output.status.success(),
        "wrk failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    parse(&stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_figures_line_is_read_among_wrks_own_output() {
        let out = "Running 1s test @ http://127.0.0.1:1/v1/send\n  2 threads and 8 connections\n\
            WRK-FIGURES {\"requests\":100,\"refused\":3,\"connect_errors\":0,\"read_errors\":1,\
            \"write_errors\":0,\"timeouts\":0,\"duration_us\":1000000,\"p50_us\":800.0,\
            \"p90_us\":1200.5,\"p99_us\":3000.0,\"p999_us\":4000.0,\"max_us\":5000.0}\n";
        let figures = parse(out).unwrap();
        assert_eq!(figures.ok(), 97);
        assert_eq!(figures.errors(), 4);
        assert_eq!(figures.seconds(), 1.0);
        assert!(parse("Running 1s test\n").is_err());
    }

    #[test]
    fn every_connection_gets_a_thread_that_holds_it() {
        assert_eq!(threads(1), 1);
        assert_eq!(threads(8), 2);
        assert_eq!(threads(7), 1, "7 over 2 threads would open 6");
        assert_eq!(threads(64), 2);
    }

    #[test]
    fn lua_strings_escape_quotes_and_backslashes() {
        assert_eq!(lua_string(r#"a"b\c"#), r#""a\"b\\c""#);
    }
}
