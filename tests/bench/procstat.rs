//! CPU time and memory of the gateway's processes, read from /proc.

use std::time::Instant;

/// Linux reports `utime`/`stime` in USER_HZ, which is 100 on every architecture Rust targets.
const TICKS_PER_SECOND: f64 = 100.0;

/// One reading of a set of processes.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    /// User + system CPU seconds, summed over the processes.
    pub cpu_seconds: f64,
    /// Resident memory now, summed (MiB).
    pub rss_mib: f64,
    /// The largest resident memory any one of them ever had (VmHWM, MiB).
    pub peak_rss_mib: f64,
    pub at: Instant,
}

pub fn read(pids: &[u32]) -> Reading {
    let mut reading = Reading {
        cpu_seconds: 0.0,
        rss_mib: 0.0,
        peak_rss_mib: 0.0,
        at: Instant::now(),
    };
    for pid in pids {
        reading.cpu_seconds += cpu_seconds(&format!("/proc/{pid}/stat")).unwrap_or(0.0);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        reading.rss_mib += status_kib(&status, "VmRSS:") / 1024.0;
        reading.peak_rss_mib = reading
            .peak_rss_mib
            .max(status_kib(&status, "VmHWM:") / 1024.0);
    }
    reading
}

/// Every PostgreSQL server process on this machine (the bench's server is the only one it runs),
/// so its CPU is counted beside the gateway's.
pub fn postgres_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == "postgres")
        })
        .collect()
}

/// This load generator's own CPU time, to show what it took from the machine.
pub fn own_cpu_seconds() -> f64 {
    cpu_seconds("/proc/self/stat").unwrap_or(0.0)
}

/// The CPU time of this load generator's children that have ended and been waited for (a wrk
/// run, `crate::wrk`).
pub fn children_cpu_seconds() -> f64 {
    stat_seconds("/proc/self/stat", 13).unwrap_or(0.0)
}

fn cpu_seconds(path: &str) -> Option<f64> {
    stat_seconds(path, 11)
}

/// The two clock-tick fields of `path` (a `/proc/<pid>/stat`) from `first` after the command
/// name, in seconds: utime and stime from the 12th (fields 14 and 15 overall), the waited-for
/// children's cutime and cstime from the 14th (16 and 17).
fn stat_seconds(path: &str, first: usize) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count from its end.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let user: f64 = fields.get(first)?.parse().ok()?;
    let system: f64 = fields.get(first + 1)?.parse().ok()?;
    Some((user + system) / TICKS_PER_SECOND)
}

fn status_kib(status: &str, key: &str) -> f64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(key))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0.0)
}

/// CPU seconds of each process in `pids`.
pub fn cpu_by_pid(pids: &[u32]) -> std::collections::HashMap<u32, f64> {
    pids.iter()
        .filter_map(|pid| Some((*pid, cpu_seconds(&format!("/proc/{pid}/stat"))?)))
        .collect()
}

/// Share of one core the PostgreSQL server used since `before` (taken at `since`): processes that
/// started meanwhile (a pool connecting lazily) count whole; ones that exited are lost.
pub fn postgres_cpu_percent(before: &std::collections::HashMap<u32, f64>, since: Instant) -> f64 {
    let after = cpu_by_pid(&postgres_pids());
    let used: f64 = after
        .iter()
        .map(|(pid, cpu)| cpu - before.get(pid).copied().unwrap_or(0.0))
        .sum();
    let wall = since.elapsed().as_secs_f64();
    if wall <= 0.0 {
        0.0
    } else {
        100.0 * used / wall
    }
}

/// Share of one core used between two readings, in percent.
pub fn cpu_percent(from: &Reading, to: &Reading) -> f64 {
    let wall = to.at.duration_since(from.at).as_secs_f64();
    if wall <= 0.0 {
        return 0.0;
    }
    100.0 * (to.cpu_seconds - from.cpu_seconds) / wall
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_this_process() {
        let reading = super::read(&[std::process::id()]);
        assert!(reading.rss_mib > 0.0);
        assert!(reading.peak_rss_mib >= reading.rss_mib * 0.5);
        assert!(super::own_cpu_seconds() >= 0.0);
    }
}
