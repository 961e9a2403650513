//! Logging through `tracing`: to journald with structured fields when running under
//! systemd, to stderr otherwise. The level can change at run time (reload).

use std::io::IsTerminal;
use std::path::Path;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

use crate::config::LogLevel;

const JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogTarget {
    Auto,
    Journal,
    Stderr,
}

/// Changes the log level of the running daemon.
#[derive(Debug, Clone)]
pub struct LogHandle {
    filter: reload::Handle<EnvFilter, Registry>,
}

fn filter(level: LogLevel) -> EnvFilter {
    // Our own crate at the chosen level, libraries only when they warn.
    EnvFilter::new(format!("warn,rdmad={}", level.as_str()))
}

/// Installs the global subscriber. Falls back to stderr (and says so) when the journal
/// was asked for but cannot be reached.
pub fn init(target: LogTarget, level: LogLevel) -> LogHandle {
    let (filter_layer, handle) = reload::Layer::new(filter(level));
    let want_journal = match target {
        LogTarget::Journal => true,
        LogTarget::Stderr => false,
        LogTarget::Auto => Path::new(JOURNAL_SOCKET).exists() && !std::io::stderr().is_terminal(),
    };
    let mut journal_error = None;
    let journald = if want_journal {
        match tracing_journald::layer() {
            Ok(layer) => Some(layer.with_syslog_identifier("rdmad".to_owned())),
            Err(e) => {
                journal_error = Some(e);
                None
            }
        }
    } else {
        None
    };
    let stderr = journald.is_none().then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_target(false)
    });
    tracing_subscriber::registry()
        .with(filter_layer)
        .with(journald)
        .with(stderr)
        .init();
    if let Some(e) = journal_error {
        tracing::warn!("cannot log to the journal ({e}); logging to stderr");
    }
    LogHandle { filter: handle }
}

impl LogHandle {
    pub fn set_level(&self, level: LogLevel) {
        if let Err(e) = self.filter.reload(filter(level)) {
            tracing::warn!("cannot change the log level: {e}");
        }
    }
}
