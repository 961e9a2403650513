//! What the engine's operations fail with. Each variant keeps the error it comes from as
//! its source; the D-Bus layer maps each variant to a D-Bus error name (`dbus/error.rs`),
//! the one place the mapping is made.

use super::datapath::worker::WorkerError;
use super::pool::PoolError;
use super::tenancy::QuotaError;
use crate::config::ConfigError;
use crate::provider::ProviderError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("no device named {name:?} (devices: {available})")]
    NoSuchDevice { name: String, available: String },
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The host's devices cannot be served as configured (no device, no such port or GID).
    #[error("{0}")]
    DeviceUnusable(String),
    #[error("{0} does not exist")]
    NoSuchObject(String),
    #[error("{0}")]
    NotAuthorized(String),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error("{0}")]
    InvalidArgument(String),
    /// What was asked does not apply to this object (the message says what does).
    #[error("{0}")]
    NotSupported(String),
    /// A call to the operating system failed: what rdmad was doing, and the error.
    #[error("{what}: {source}")]
    Os {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no random numbers: {0}")]
    Random(#[from] getrandom::Error),
    /// A data-path worker could not do what the engine asked of it (bind or invalidate a
    /// window): what it was, and why.
    #[error("{what}: {source}")]
    Worker {
        what: String,
        #[source]
        source: WorkerError,
    },
}

impl EngineError {
    /// An operating-system error met while doing `what`.
    pub fn os(what: impl Into<String>, source: std::io::Error) -> EngineError {
        EngineError::Os {
            what: what.into(),
            source,
        }
    }
}
