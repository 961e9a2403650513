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
}

#[derive(Debug, Subcommand)]
pub enum DevCommand {
    /// Show all devices, or the one named.
    Show {
        /// Device name, e.g. rxe0.
        name: Option<String>,
    },
}
