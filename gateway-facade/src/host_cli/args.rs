//! The arguments of `orca-push host ...`: its subcommands, where the gateway is and which host
//! this is, and the values its options take.

use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use orca_push_host::api::Source;

#[derive(Subcommand)]
pub enum HostCommand {
    /// Create a new host keypair file (mode 0600). Never overwrites one.
    Keygen {
        /// The key file to create.
        #[arg(long, env = "ORCA_PUSH_HOST_KEY", default_value_os_t = orca_push_host::default_key_path())]
        key: PathBuf,
        /// Print JSON for scripts instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Get a session for the key, reusing the cached one while it is valid (so a running desktop
    /// keeps its session), and print it (never the token).
    Login {
        #[command(flatten)]
        host: HostArgs,
        /// Prove the key again even when a cached session is still valid. Other processes of this
        /// host pick up the new session from the session file on their next 401.
        #[arg(long)]
        force: bool,
    },
    /// Register a phone's native push token (an upsert: a new token for the same device id
    /// replaces the old one), and keep the registration in the data directory.
    Register {
        #[command(flatten)]
        host: HostArgs,
        /// The desktop's id for the paired phone (1 to 128 characters).
        #[arg(long)]
        device_id: String,
        /// The phone's platform.
        #[arg(long, value_enum)]
        platform: PlatformArg,
        /// The phone's native token: APNs hex, or an FCM registration string. It lands in the
        /// shell's history; --token-file keeps it out.
        #[arg(
            long,
            required_unless_present = "token_file",
            conflicts_with = "token_file"
        )]
        token: Option<String>,
        /// A file holding the phone's native token (surrounding whitespace is ignored).
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// APNs endpoint of an iOS token (required for ios, refused for android).
        #[arg(long, value_enum)]
        apns_environment: Option<EnvironmentArg>,
        /// Sources this phone wants (default: all). Repeat or separate with commas.
        #[arg(long, value_enum, value_delimiter = ',')]
        sources: Vec<SourceArg>,
        /// Agent states this phone wants (default: all). Repeat or separate with commas.
        #[arg(long, value_enum, value_delimiter = ',')]
        agent_states: Vec<AgentStateArg>,
        /// Send this phone's alerts without sound.
        #[arg(long)]
        silent: bool,
        /// Ignore the desktop's own notification switches for this phone (followDesktop: false).
        #[arg(long)]
        independent: bool,
    },
    /// List this host's registrations as the gateway holds them (never their tokens).
    Devices {
        #[command(flatten)]
        host: HostArgs,
    },
    /// Unregister a phone: drop its local registration and delete it at the gateway, through the
    /// durable outbox (a delete that fails now is retried by the next `host` command).
    Unregister {
        #[command(flatten)]
        host: HostArgs,
        /// The device id given to `host register`.
        #[arg(long)]
        device_id: String,
    },
    /// Send a notification. Without --registration-id it is dispatched to every registered phone
    /// whose filter takes it, in batches of at most 20, with one retry.
    Send {
        #[command(flatten)]
        host: HostArgs,
        /// Title, 1 to 80 characters.
        #[arg(long)]
        title: String,
        /// Body, at most 180 characters.
        #[arg(long, default_value = "")]
        body: String,
        /// What raised the notification.
        #[arg(long, value_enum, default_value = "agent-task-complete")]
        source: SourceArg,
        /// The agent's state as the desktop knows it: blocked and waiting become needs-input;
        /// working, running and busy send no alert (a dismissal still goes, with no state);
        /// anything else becomes finished.
        #[arg(long)]
        agent_state: Option<String>,
        /// The event's id (default: a new UUID). A dismissal names the alert it dismisses.
        #[arg(long)]
        notification_id: Option<String>,
        /// The event's sequence number (default: the current Unix ms).
        #[arg(long)]
        seq: Option<u64>,
        /// The sequence's epoch (default: a new UUID).
        #[arg(long)]
        epoch: Option<String>,
        /// The worktree the event belongs to (at most 2048 characters).
        #[arg(long)]
        worktree_id: Option<String>,
        /// Send a dismissal of `--notification-id` instead of an alert.
        #[arg(long)]
        dismiss: bool,
        /// Send to these registration ids directly, bypassing filters (repeatable, at most 20).
        #[arg(long = "registration-id")]
        registration_ids: Vec<String>,
    },
}

/// Where the gateway is and which host this is.
#[derive(Args)]
pub struct HostArgs {
    /// The gateway's base URL.
    #[arg(
        long,
        env = "ORCA_PUSH_GATEWAY_URL",
        default_value = "https://push.onorca.dev"
    )]
    pub(super) gateway: String,
    /// The host key file; its directory also holds the session cache, the phones' registrations
    /// and the unregister outbox.
    #[arg(long, env = "ORCA_PUSH_HOST_KEY", default_value_os_t = orca_push_host::default_key_path())]
    pub(super) key: PathBuf,
    /// Print JSON for scripts instead of text.
    #[arg(long)]
    pub(super) json: bool,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PlatformArg {
    Ios,
    Android,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum EnvironmentArg {
    Sandbox,
    Production,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum SourceArg {
    AgentTaskComplete,
    TerminalBell,
    Plugin,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum AgentStateArg {
    NeedsInput,
    Finished,
}

impl From<SourceArg> for Source {
    fn from(source: SourceArg) -> Self {
        match source {
            SourceArg::AgentTaskComplete => Self::AgentTaskComplete,
            SourceArg::TerminalBell => Self::TerminalBell,
            SourceArg::Plugin => Self::Plugin,
        }
    }
}
