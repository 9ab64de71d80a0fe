//! `orca-push-mock-providers`: a mock APNs (HTTP/2 over TLS, checking the ES256 token) and a mock
//! FCM (checking the service account's RS256 assertion), for trying the gateway on one machine.
//! Each accepts every push and prints one line per arrival. It writes the environment a gateway
//! needs to reach them to `--env-file`, as `export NAME='value'` lines for a POSIX shell.

use std::io::Write as _;
use std::path::PathBuf;

use clap::Parser;
use orca_push_tests::mock_apns::MockApns;
use orca_push_tests::mock_fcm::MockFcm;

#[derive(Parser)]
#[command(version, about = "Mock APNs and FCM for trying orca-push locally")]
struct Args {
    /// Where to write the gateway's environment (`export NAME='value'` lines).
    #[arg(long, default_value = "mock-providers.env")]
    env_file: PathBuf,
}

/// Single-quotes a value for a POSIX shell (a PEM key spans lines; quotes keep it whole).
fn quoted(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let apns = MockApns::start().await;
    let fcm = MockFcm::start().await;
    let (sink, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    apns.stream_to(sink.clone());
    fcm.stream_to(sink);
    let mut env = apns.env();
    env.extend(fcm.env());
    // Written beside it and renamed into place, so a reader never sees half a file.
    let partial = args.env_file.with_extension("partial");
    let mut file = std::fs::File::create(&partial)?;
    for (name, value) in &env {
        writeln!(file, "export {name}={}", quoted(value))?;
    }
    file.sync_all()?;
    std::fs::rename(&partial, &args.env_file)?;
    println!(
        "mock APNs at {}, mock FCM at {}; gateway environment in {}",
        apns.url,
        fcm.url,
        args.env_file.display()
    );
    loop {
        tokio::select! {
            arrival = arrivals.recv() => {
                let Some(arrival) = arrival else { break };
                // The first 8 characters of the token tell a walk-through's phones apart.
                let token: String = arrival.token.chars().take(8).collect();
                println!(
                    "push arrived: provider={} token={token}… notificationId={}",
                    arrival.provider,
                    arrival.notification_id.as_deref().unwrap_or("-"),
                );
            }
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    Ok(())
}
