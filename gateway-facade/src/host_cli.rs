//! `orca-push host ...`: the desktop host's whole flow from a terminal, built on the host SDK: a
//! key, a session, phones registered (kept in the data directory beside the key, with the
//! unregister outbox), and notifications dispatched through each phone's filter.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use orca_push_host::api::{ApnsEnvironment, Kind, Notification, Platform, SendRequest, Source};
use orca_push_host::{
    DispatchConfig, DispatchEvent, Dispatcher, GatewayClient, HostFilter, HostKey, RegisterOutcome,
    Registrar, RegistrarConfig, RegistrationStore, UnregisterOutbox,
};
use serde_json::json;

mod args;

pub use args::{AgentStateArg, EnvironmentArg, HostArgs, HostCommand, PlatformArg, SourceArg};

/// The session file beside the key: `host.key` -> `host.session`.
pub fn session_path(key: &Path) -> PathBuf {
    key.with_extension("session")
}

/// The registrations and the outbox of one gateway: a folder per gateway origin in the key's
/// directory, so deletes owed to one gateway are never sent to another, and `host send` never
/// dispatches one gateway's registration ids to another.
fn data_dir(host: &HostArgs) -> anyhow::Result<PathBuf> {
    let key_dir = match host.key.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let origin = orca_push_host::origin_of(&host.gateway)?;
    let folder: String = origin
        .replace("://", "_")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    Ok(key_dir.join(format!("gateway-{folder}")))
}

fn client(host: &HostArgs) -> anyhow::Result<Arc<GatewayClient>> {
    let key = HostKey::load(&host.key)?;
    Ok(Arc::new(
        GatewayClient::new(&host.gateway, key)?.with_session_file(session_path(&host.key)),
    ))
}

/// The registrar over the data directory, after one pass of the outbox: a delete that failed on
/// an earlier run is retried by the next command.
async fn registrar(
    host: &HostArgs,
    client: Arc<GatewayClient>,
) -> anyhow::Result<Registrar<GatewayClient>> {
    let dir = data_dir(host)?;
    let store = RegistrationStore::open(&dir)
        .with_context(|| format!("cannot read the registrations in {}", dir.display()))?;
    let outbox = UnregisterOutbox::open(&dir)
        .with_context(|| format!("cannot read the unregister outbox in {}", dir.display()))?;
    let registrar = Registrar::new(
        client,
        Arc::new(store),
        Arc::new(outbox),
        RegistrarConfig::default(),
    );
    let drained = registrar.drain().await;
    if drained.remaining > 0 {
        eprintln!(
            "{} gateway delete(s) still queued; the next host command retries them",
            drained.remaining
        );
    }
    Ok(registrar)
}

fn print(json_output: bool, value: serde_json::Value, text: impl FnOnce() -> String) {
    if json_output {
        println!("{value}");
    } else {
        println!("{}", text());
    }
}

pub async fn run(command: HostCommand) -> anyhow::Result<()> {
    match command {
        HostCommand::Keygen { key, json } => {
            let host_key = HostKey::generate();
            host_key.save_new(&key)?;
            let fingerprint = host_key.fingerprint();
            print(
                json,
                json!({ "hostFingerprint": fingerprint, "keyFile": key.display().to_string() }),
                || {
                    format!(
                        "hostFingerprint {fingerprint}\nkey written to {}",
                        key.display()
                    )
                },
            );
            Ok(())
        }
        HostCommand::Login { host, force } => {
            let client = client(&host)?;
            let session = if force {
                client.login().await?
            } else {
                client.session().await?
            };
            print(
                host.json,
                json!({ "hostFingerprint": session.host_fingerprint, "expiresAt": session.expires_at }),
                || {
                    format!(
                        "hostFingerprint {}\nsession expires at {} (Unix ms)",
                        session.host_fingerprint, session.expires_at
                    )
                },
            );
            Ok(())
        }
        HostCommand::Register {
            host,
            device_id,
            platform,
            token,
            token_file,
            apns_environment,
            sources,
            agent_states,
            silent,
            independent,
        } => {
            let mut filter = HostFilter::everything();
            if !sources.is_empty() {
                filter.sources = sources.into_iter().map(Source::from).collect();
            }
            if !agent_states.is_empty() {
                filter.agent_states = agent_states
                    .into_iter()
                    .map(|s| match s {
                        AgentStateArg::NeedsInput => orca_push_host::api::AgentState::NeedsInput,
                        AgentStateArg::Finished => orca_push_host::api::AgentState::Finished,
                    })
                    .collect();
            }
            filter.sound = silent.then_some(false);
            filter.follow_desktop = independent.then_some(false);
            let platform = match platform {
                PlatformArg::Ios => Platform::Ios,
                PlatformArg::Android => Platform::Android,
            };
            let environment = apns_environment.map(|e| match e {
                EnvironmentArg::Sandbox => ApnsEnvironment::Sandbox,
                EnvironmentArg::Production => ApnsEnvironment::Production,
            });
            let token = match (token, token_file) {
                (Some(token), _) => token,
                (None, Some(path)) => std::fs::read_to_string(&path)
                    .with_context(|| format!("cannot read {}", path.display()))?
                    .trim()
                    .to_owned(),
                (None, None) => anyhow::bail!("--token or --token-file is required"),
            };
            let registrar = registrar(&host, client(&host)?).await?;
            match registrar
                .register(&device_id, platform, &token, environment, filter)
                .await
            {
                RegisterOutcome::Registered { registration_id } => {
                    print(
                        host.json,
                        json!({ "registered": true, "registrationId": registration_id }),
                        || format!("registrationId {registration_id}"),
                    );
                    Ok(())
                }
                RegisterOutcome::NotRegistered(reason) => {
                    print(
                        host.json,
                        json!({ "registered": false, "reason": reason.as_str() }),
                        || format!("not registered: {}", reason.as_str()),
                    );
                    anyhow::bail!("registration failed: {}", reason.as_str())
                }
            }
        }
        HostCommand::Devices { host } => {
            let list = client(&host)?.devices().await?;
            if host.json {
                println!("{}", serde_json::to_string(&list)?);
            } else if list.devices.is_empty() {
                println!("no devices registered");
            } else {
                for d in &list.devices {
                    let state = if d.dead { "dead" } else { "live" };
                    println!(
                        "{}  device {}  {}  {state}",
                        d.registration_id, d.device_id, d.platform
                    );
                }
            }
            Ok(())
        }
        HostCommand::Unregister { host, device_id } => {
            let registrar = registrar(&host, client(&host)?).await?;
            let unregistered = registrar.unregister(&device_id).await;
            let drained = registrar.drain().await;
            print(
                host.json,
                json!({ "unregistered": unregistered, "pendingDeletes": drained.remaining }),
                || match (unregistered, drained.remaining) {
                    (false, _) => format!("no registration stored for device {device_id}"),
                    (true, 0) => format!("device {device_id} unregistered"),
                    (true, n) => format!(
                        "device {device_id} unregistered here; {n} gateway delete(s) queued for retry"
                    ),
                },
            );
            Ok(())
        }
        HostCommand::Send {
            host,
            title,
            body,
            source,
            agent_state,
            notification_id,
            seq,
            epoch,
            worktree_id,
            dismiss,
            registration_ids,
        } => {
            let client = client(&host)?;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let notification_id =
                notification_id.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let epoch = epoch.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
            let kind = if dismiss { Kind::Dismiss } else { Kind::Alert };
            if !registration_ids.is_empty() {
                let agent_state = match orca_push_host::gateway_agent_state(agent_state.as_deref())
                {
                    Some(state) => state,
                    // As the dispatcher does: a dismissal goes whatever the agent does now.
                    None if dismiss => None,
                    None => anyhow::bail!("the agent is still working: no push sent"),
                };
                let request = SendRequest::new(
                    registration_ids,
                    Notification {
                        notification_id: Some(notification_id),
                        notification_seq: seq.unwrap_or(now),
                        notification_epoch: epoch,
                        source: source.into(),
                        agent_state,
                        title,
                        body,
                        worktree_id,
                        kind: dismiss.then_some(kind),
                        expires_at: None,
                        sound: None,
                    },
                );
                let reply = client.send(&request).await?;
                if host.json {
                    println!("{}", serde_json::to_string(&reply)?);
                } else {
                    for r in &reply.results {
                        println!("{}  {}", r.registration_id, r.status.as_str());
                    }
                }
                return Ok(());
            }
            let dir = data_dir(&host)?;
            let store =
                Arc::new(RegistrationStore::open(&dir).with_context(|| {
                    format!("cannot read the registrations in {}", dir.display())
                })?);
            let dispatcher = Dispatcher::new(client, store, DispatchConfig::default());
            let report = dispatcher
                .dispatch(DispatchEvent {
                    notification_id: Some(notification_id),
                    notification_seq: seq.unwrap_or(now),
                    notification_epoch: epoch,
                    source: source.into(),
                    agent_state,
                    title,
                    body,
                    worktree_id,
                    kind,
                    expires_at: None,
                    emitted_at: Some(now),
                    desktop_allowed: true,
                })
                .await;
            dispatcher.shutdown().await;
            let outcomes: serde_json::Map<String, serde_json::Value> = report
                .outcomes
                .iter()
                .map(|(id, outcome)| (id.clone(), json!(outcome_text(outcome))))
                .collect();
            let skipped: serde_json::Map<String, serde_json::Value> = report
                .skipped
                .iter()
                .map(|(id, skip)| (id.clone(), json!(format!("{skip:?}"))))
                .collect();
            print(
                host.json,
                json!({
                    "notFinal": report.not_final,
                    "requests": report.requests.len(),
                    "results": outcomes,
                    "skipped": skipped,
                    "droppedDead": report.dropped_dead,
                }),
                || {
                    let mut lines = Vec::new();
                    if report.not_final {
                        lines.push("the agent is still working: no push sent".to_owned());
                    }
                    if report.outcomes.is_empty() && report.skipped.is_empty() {
                        lines.push("no registered phone: run `orca-push host register`".into());
                    }
                    for (id, outcome) in &report.outcomes {
                        lines.push(format!("{id}  {}", outcome_text(outcome)));
                    }
                    for (id, skip) in &report.skipped {
                        lines.push(format!("{id}  skipped ({skip:?})"));
                    }
                    lines.join("\n")
                },
            );
            Ok(())
        }
    }
}

fn outcome_text(outcome: &orca_push_host::Outcome) -> String {
    match outcome {
        orca_push_host::Outcome::Status(status) => status.as_str().to_owned(),
        orca_push_host::Outcome::Failed(category) => format!("failed: {category}"),
        orca_push_host::Outcome::NoResult => "no result".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// Every `orca-push host` command takes `--json`, as the README says.
    #[test]
    fn every_host_command_prints_json_on_request() {
        let mut cli = crate::cli::Cli::command();
        cli.build();
        let host = cli.find_subcommand("host").expect("host command");
        for command in host.get_subcommands().filter(|c| c.get_name() != "help") {
            assert!(
                command
                    .get_arguments()
                    .any(|arg| arg.get_long() == Some("json")),
                "host {} has no --json",
                command.get_name()
            );
        }
    }

    /// `orca-push host <command> --help` explains every argument.
    #[test]
    fn every_host_argument_has_help_text() {
        let mut cli = crate::cli::Cli::command();
        cli.build();
        let host = cli.find_subcommand("host").expect("host command");
        for command in host.get_subcommands() {
            assert!(command.get_about().is_some(), "{}", command.get_name());
            for arg in command.get_arguments() {
                if matches!(arg.get_id().as_str(), "help" | "version") {
                    continue;
                }
                assert!(
                    arg.get_help().is_some(),
                    "host {} --{} has no help",
                    command.get_name(),
                    arg.get_id()
                );
            }
        }
    }
}
