//! `orca-push-mock-providers`: a mock APNs (HTTP/2 over TLS, checking the ES256 token) and a mock
//! FCM (checking the service account's RS256 assertion), for trying the gateway on one machine or
//! in `docker compose`. Each accepts every push and prints one line per arrival. It writes the
//! environment a gateway needs to reach them to `--env-file`, as `export NAME='value'` lines for a
//! POSIX shell.
//!
//! By default both listen on loopback at free ports, and the files the environment names (the
//! APNs CA, the FCM service account) are temporary files. For a gateway in another container:
//! `--listen 0.0.0.0 --apns-port 8443 --fcm-port 8081 --public-host mocks --files-dir /shared
//! --env-file /shared/mock.env`, with `/shared` a volume both containers mount.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use clap::Parser;
use orca_push_tests::mock_apns::{ApnsOptions, MockApns};
use orca_push_tests::mock_fcm::{FcmOptions, MockFcm};

#[derive(Parser)]
#[command(version, about = "Mock APNs and FCM for trying orca-push locally")]
struct Args {
    /// Where to write the gateway's environment (`export NAME='value'` lines). A file left there
    /// by an earlier run is removed at start, and this run's is removed when it stops (SIGINT or
    /// SIGTERM): its keys live only as long as the mocks.
    #[arg(long, default_value = "mock-providers.env")]
    env_file: PathBuf,
    /// The address both mocks listen on: 0.0.0.0 (or ::) to be reachable from other containers
    /// or machines.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    listen: IpAddr,
    /// The mock APNs port (0: a free one).
    #[arg(long, default_value_t = 0)]
    apns_port: u16,
    /// The mock FCM port (0: a free one).
    #[arg(long, default_value_t = 0)]
    fcm_port: u16,
    /// The host the gateway reaches the mocks by, written into the URLs of the environment file
    /// (and the FCM service account's token_uri); mock APNs' certificate names it too. Default:
    /// `localhost` for APNs, `127.0.0.1` for FCM.
    #[arg(long)]
    public_host: Option<String>,
    /// Another name for mock APNs' TLS certificate (repeatable). It always names `localhost`,
    /// `127.0.0.1` and the --public-host.
    #[arg(long = "tls-name", value_name = "NAME")]
    tls_names: Vec<String>,
    /// Write the APNs CA (`apns-ca.pem`) and the FCM service account (`fcm-service-account.json`)
    /// into this folder, and name them there in the environment file, for a gateway that shares
    /// the folder but not this process's temporary files (another container). Default: temporary
    /// files, removed when the mocks stop.
    #[arg(long, value_name = "DIR")]
    files_dir: Option<PathBuf>,
}

/// Single-quotes a value for a POSIX shell (a PEM key spans lines; quotes keep it whole).
fn quoted(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// Copies `from` to `dir/name` (keeping its 0600 mode) and returns the new path.
fn share(from: &Path, dir: &Path, name: &str) -> anyhow::Result<String> {
    let to = dir.join(name);
    std::fs::copy(from, &to).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", to.display()))?;
    Ok(to.display().to_string())
}

/// Resolves on SIGTERM (what `docker stop` sends; as PID 1 the default action would be ignored).
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut sigterm) = signal(SignalKind::terminate()) {
            sigterm.recv().await;
            return;
        }
    }
    std::future::pending::<()>().await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A reader waiting for the file must never pick up the keys of an earlier run.
    if let Err(e) = std::fs::remove_file(&args.env_file)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        anyhow::bail!("cannot remove {}: {e}", args.env_file.display());
    }
    let mut apns_options = ApnsOptions {
        listen: (args.listen, args.apns_port).into(),
        tls_names: args.tls_names.clone(),
        ..ApnsOptions::default()
    };
    let mut fcm_options = FcmOptions {
        listen: (args.listen, args.fcm_port).into(),
        ..FcmOptions::default()
    };
    if let Some(host) = &args.public_host {
        apns_options.public_host = host.clone();
        fcm_options.public_host = host.clone();
    }
    let apns = MockApns::start_with(apns_options).await;
    let fcm = MockFcm::start_with(fcm_options).await;
    let (sink, mut arrivals) = tokio::sync::mpsc::unbounded_channel();
    apns.stream_to(sink.clone());
    fcm.stream_to(sink);
    let mut env = apns.env();
    env.extend(fcm.env());
    if let Some(dir) = &args.files_dir {
        std::fs::create_dir_all(dir)?;
        let ca = share(apns.ca_file.path(), dir, "apns-ca.pem")?;
        let credentials = share(fcm.credentials.path(), dir, "fcm-service-account.json")?;
        for (name, value) in &mut env {
            match name.as_str() {
                "ORCA_PUSH_CA_FILE" => *value = ca.clone(),
                "GOOGLE_APPLICATION_CREDENTIALS" => *value = credentials.clone(),
                _ => {}
            }
        }
    }
    // Written beside it and renamed into place, so a reader never sees half a file.
    let partial = args.env_file.with_extension("partial");
    let mut file = std::fs::File::create(&partial)?;
    for (name, value) in &env {
        writeln!(file, "export {name}={}", quoted(value))?;
    }
    file.sync_all()?;
    std::fs::rename(&partial, &args.env_file)?;
    println!(
        "mock APNs at {}, mock FCM at {} (listening on {}); gateway environment in {}",
        apns.url,
        fcm.url,
        args.listen,
        args.env_file.display()
    );
    let terminate = terminated();
    tokio::pin!(terminate);
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
            () = &mut terminate => break,
        }
    }
    let _ = std::fs::remove_file(&args.env_file);
    Ok(())
}
