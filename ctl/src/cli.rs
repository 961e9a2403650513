//! `rdmactl [OPTIONS] OBJECT [COMMAND]`; `show` is the default command.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "rdmactl",
    version,
    about = "Show and control rdmad, the RDMA resource daemon"
)]
pub struct Cli {
    /// Print JSON (the same keys as the text output).
    #[arg(short, long, global = true)]
    pub json: bool,

    /// Indent JSON output.
    #[arg(short, long, global = true)]
    pub pretty: bool,

    /// D-Bus address of the bus rdmad serves on (`system`, `session` or an address).
    #[arg(
        long,
        global = true,
        env = "RDMAD_BUS_ADDRESS",
        default_value = "system"
    )]
    pub bus: String,

    #[command(subcommand)]
    pub object: Object,
}

#[derive(Debug, Subcommand)]
pub enum Object {
    /// The daemon: version, start time, devices, configuration.
    Status,
    /// RDMA devices rdmad serves.
    #[command(visible_alias = "device")]
    Dev {
        #[command(subcommand)]
        command: Option<DevCommand>,
    },
    /// Re-read the configuration file (administrators only).
    Reload,
    /// Memory pools: capacity, use, warm regions.
    Pool {
        #[command(subcommand)]
        command: Option<ShowCommand>,
    },
    /// Sessions: yours, or everyone's for administrators.
    Session {
        #[command(subcommand)]
        command: Option<SessionCommand>,
    },
    /// Regions: yours and those you attached, or everyone's for administrators.
    Region {
        #[command(subcommand)]
        command: Option<ShowCommand>,
    },
    /// Queue pairs: yours, or everyone's for administrators.
    Qp {
        #[command(subcommand)]
        command: Option<ShowCommand>,
    },
    /// Quota limits and live use of a user (default: you).
    Quota {
        /// User name or uid (administrators may ask about anyone).
        user: Option<String>,
    },
    /// Access keys of visible regions (never the tokens).
    Key {
        #[command(subcommand)]
        command: Option<KeyCommand>,
    },
    /// Run an unmodified verbs program through rdmad: the libibverbs it loads is rdmad's,
    /// so its devices, protection domains and memory are rdmad's, within your quotas.
    #[command(
        after_help = "rdmactl exec puts the directory of rdmad's libibverbs.so.1 first on \
                      LD_LIBRARY_PATH (and passes --bus on as RDMAD_BUS_ADDRESS), then runs \
                      PROGRAM in its place. A service does the same with \
                      Environment=LD_LIBRARY_PATH=/usr/lib/rdmad/verbs."
    )]
    Exec {
        /// The program and its arguments, e.g. `rdmactl exec -- ibv_devinfo -v`.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ShowCommand {
    /// Show them all.
    Show,
}

#[derive(Debug, Subcommand)]
pub enum SessionCommand {
    /// Show visible sessions.
    Show,
    /// Close a session, releasing everything in it (its user or an administrator).
    Close {
        /// Session number, as `rdmactl session` shows it.
        id: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Show the keys of visible regions.
    Show,
    /// Revoke a key: no new attaches (live attachments stay). Owner or administrator.
    Revoke {
        /// Key number, as `rdmactl key` shows it.
        id: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum DevCommand {
    /// Show all devices, or the one named.
    Show {
        /// Device name, e.g. rxe0.
        name: Option<String>,
    },
}
