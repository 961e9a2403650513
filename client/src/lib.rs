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

/// Opens a direct connection to rdmad over `bus` (a connection to the bus rdmad serves on):
/// `Manager.OpenDirect`, then a peer-to-peer D-Bus connection on the socket it returns.
/// The same proxies work on it (their destination is ignored) and every call goes straight
/// to rdmad, about one bus round trip cheaper than through the bus daemon. It runs as the
/// caller `bus` identified; sessions opened on it close when it is dropped or the daemon
/// closes it. Needs a tokio runtime.
pub async fn connect_direct(bus: &zbus::Connection) -> Result<zbus::Connection, Error> {
    let manager = proxy::ManagerProxy::new(bus).await?;
    let fd = manager
        .open_direct(std::collections::HashMap::new())
        .await?;
    let stream = std::os::unix::net::UnixStream::from(std::os::fd::OwnedFd::from(fd));
    let stream = stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream))
        .map_err(|e| Error::ZBus(zbus::Error::InputOutput(std::sync::Arc::new(e))))?;
    // The socket pair is rdmad's own, already tied to the caller: nothing to authenticate.
    let guid = zbus::Guid::generate();
    Ok(
        zbus::connection::Builder::authenticated_socket(stream, guid)?
            .p2p()
            .build()
            .await?,
    )
}
