//! Client side of rdmad: the D-Bus names, the wire types, the error names and typed
//! proxies for every interface. Applications link this crate; it never links libibverbs.
//! Its only `unsafe` is in [`mapping`], the shared-memory mapping the daemon uses too.

#![deny(unsafe_code)]

pub mod error;
#[allow(unsafe_code)]
pub mod mapping;
pub mod names;
pub mod proxy;
pub mod queue_pair;
pub mod ring;
pub mod types;
pub mod watch;

pub use error::Error;
pub use mapping::RegionMapping;
pub use names::{device_path, BUS_NAME, MANAGER_PATH};
/// The inline vector type of [`ring::RegionSges`], re-exported so callers need no
/// dependency of their own to build one.
pub use smallvec;
pub use types::{Capabilities, GidEntry, PortInfo};
pub use watch::{DaemonGone, DaemonWatch};

/// Connects to the bus rdmad serves on: an explicit address, else `RDMAD_BUS_ADDRESS`,
/// else the system bus.
pub async fn connect(address: Option<&str>) -> zbus::Result<zbus::Connection> {
    let from_env = std::env::var(names::BUS_ADDRESS_ENV).ok();
    match address.or(from_env.as_deref()) {
        Some("session") => zbus::Connection::session().await,
        Some("system") | None => zbus::Connection::system().await,
        Some(addr) => zbus::connection::Builder::address(addr)?.build().await,
    }
}
