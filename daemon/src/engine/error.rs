//! What the engine's operations fail with. The D-Bus layer maps each variant to a D-Bus
//! error name (`dbus/error.rs`), the one place the mapping is made.

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
    #[error("{0}")]
    Startup(String),
    #[error("{0} does not exist")]
    NoSuchObject(String),
    #[error("{0}")]
    NotAuthorized(String),
    #[error(transparent)]
    Quota(#[from] QuotaError),
    #[error("{0}")]
    PoolExhausted(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Io(String),
}

impl From<PoolError> for EngineError {
    fn from(e: PoolError) -> Self {
        match e {
            PoolError::Exhausted { .. } => EngineError::PoolExhausted(e.to_string()),
            PoolError::TooLarge { .. } | PoolError::Empty => {
                EngineError::InvalidArgument(e.to_string())
            }
            PoolError::Memory { .. } => EngineError::Io(e.to_string()),
            PoolError::Provider(p) => EngineError::Provider(p),
        }
    }
}
