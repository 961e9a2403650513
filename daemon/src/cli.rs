//! Command-line options of `rdmad`.

use std::path::PathBuf;

use clap::Parser;

use crate::config::{LogLevel, ProviderChoice, DEFAULT_PATH};
use crate::logging::LogTarget;

/// rdmad owns the host's RDMA devices, protection domains and registered memory, and lends
/// them to local processes over D-Bus (bus name org.rdmad1).
#[derive(Debug, Clone, Parser)]
#[command(name = "rdmad", version, about, long_about = None)]
pub struct Args {
    /// Configuration file.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_PATH)]
    pub config: PathBuf,

    /// Bus to serve on: `system`, `session`, or a D-Bus address such as
    /// `unix:path=/run/rdmad-test/bus`.
    #[arg(long, value_name = "system|session|ADDRESS", default_value = "system")]
    pub bus: String,

    /// Which devices to serve; overrides `daemon.provider` in the configuration.
    #[arg(long, value_enum)]
    pub provider: Option<ProviderChoice>,

    /// Log level; overrides `daemon.log_level` in the configuration.
    #[arg(long, value_enum)]
    pub log_level: Option<LogLevel>,

    /// Where logs go: the journal (with structured fields), stderr, or `auto` (the journal
    /// when its socket exists and stderr is not a terminal).
    #[arg(long, value_enum, default_value = "auto")]
    pub log_target: LogTarget,

    /// Check the configuration file and exit: 0 if it is valid, else 1 with the error.
    #[arg(long)]
    pub check_config: bool,
}
