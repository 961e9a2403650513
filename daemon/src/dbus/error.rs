//! Engine and policy errors as D-Bus errors: the one place the mapping is made.

use rdmad_client::Error;

use crate::engine::ProviderError;
use crate::engine::{EngineError, PoolError};
use crate::policy::PolicyError;

impl From<EngineError> for Error {
    fn from(e: EngineError) -> Self {
        to_dbus_error(e)
    }
}

pub fn to_dbus_error(e: EngineError) -> Error {
    let message = e.to_string();
    match e {
        EngineError::NoSuchDevice { .. } | EngineError::NoSuchObject(_) => {
            Error::NoSuchObject(message)
        }
        EngineError::Config(_) | EngineError::InvalidArgument(_) => Error::InvalidArgument(message),
        EngineError::Provider(p) => provider_error(p),
        EngineError::DeviceUnusable(_)
        | EngineError::Os { .. }
        | EngineError::Random(_)
        | EngineError::Worker { .. } => Error::DeviceError(message),
        EngineError::NotAuthorized(_) => Error::NotAuthorized(message),
        EngineError::NotSupported(_) => Error::NotSupported(message),
        EngineError::Quota(_) => Error::QuotaExceeded(message),
        EngineError::Pool(PoolError::Exhausted { .. }) => Error::PoolExhausted(message),
        EngineError::Pool(PoolError::TooLarge { .. } | PoolError::Empty) => {
            Error::InvalidArgument(message)
        }
        EngineError::Pool(PoolError::Memory { .. }) => Error::DeviceError(message),
        EngineError::Pool(PoolError::Provider(p)) => provider_error(p),
    }
}

pub fn provider_error(e: ProviderError) -> Error {
    let message = e.to_string();
    match e {
        ProviderError::NotSupported { .. } => Error::NotSupported(message),
        ProviderError::InvalidArgument { .. } => Error::InvalidArgument(message),
        ProviderError::Connection { .. } => Error::ConnectionFailed(message),
        ProviderError::NoDevices(_) | ProviderError::Os { .. } | ProviderError::Flushed { .. } => {
            Error::DeviceError(message)
        }
    }
}

impl From<PolicyError> for Error {
    fn from(e: PolicyError) -> Self {
        match e {
            PolicyError::NotAdmin { .. } | PolicyError::OthersQuota => {
                Error::NotAuthorized(e.to_string())
            }
        }
    }
}
