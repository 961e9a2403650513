//! Typed proxies for the rdmad interfaces. Methods fail with [`Error`], so a refusal
//! arrives as its `org.rdmad1.Error.*` variant; properties fail with `zbus::Error`.

use std::collections::HashMap;
use zbus::proxy;

use zbus::zvariant::{OwnedFd, OwnedObjectPath, OwnedValue, Value};

use crate::error::Error;
use crate::types::{
    Capabilities, DeviceSummary, Endpoint, GidEntry, LingeringObject, PoolInfo, PortInfo,
    QueuePairInfo, QuotaEntry, RegionInfo, RingInfo, SessionInfo,
};

/// `options a{sv}` of the mutating methods.
pub type Options<'a> = HashMap<&'a str, Value<'a>>;

#[proxy(
    interface = "org.rdmad1.Manager",
    default_service = "org.rdmad1",
    default_path = "/org/rdmad1"
)]
pub trait Manager {
    /// Devices the daemon serves.
    fn list_devices(&self) -> Result<Vec<DeviceSummary>, Error>;
    /// Object path of the named device.
    fn get_device(&self, name: &str) -> Result<OwnedObjectPath, Error>;
    /// Re-reads the configuration file (admin only). An invalid file is refused with
    /// `InvalidArgument` and the running configuration stays in force.
    fn reload(&self) -> Result<(), Error>;
    /// Opens a session bound to this connection: it ends with `Session.Close` or when the
    /// connection leaves the bus, and everything in it is released.
    fn open_session(&self, options: Options<'_>) -> Result<OwnedObjectPath, Error>;
    /// Opens a direct connection (no options yet): one end of a socket pair on which the
    /// daemon serves these same objects peer to peer, each call skipping the bus daemon.
    /// Calls on it run as this caller; sessions opened on it close when it closes. Called
    /// on the bus; [`crate::connect_direct`] makes the connection.
    fn open_direct(&self, options: Options<'_>) -> Result<zbus::zvariant::OwnedFd, Error>;
    /// Sessions the caller may see (its user's; all for administrators).
    fn list_sessions(&self) -> Result<Vec<SessionInfo>, Error>;
    /// Regions the caller may see (its user's and those it attached; all for administrators).
    fn list_regions(&self) -> Result<Vec<RegionInfo>, Error>;
    fn list_pools(&self) -> Result<Vec<PoolInfo>, Error>;
    /// Queue pairs the caller may see (its user's; all for administrators).
    fn list_queue_pairs(&self) -> Result<Vec<QueuePairInfo>, Error>;
    /// Limits and live use of `uid` (the caller's own; anyone's for administrators).
    fn get_quota(&self, uid: u32) -> Result<Vec<QuotaEntry>, Error>;
    /// Revokes an access key (its region's owner or an administrator).
    fn revoke_key(&self, key_id: u64) -> Result<(), Error>;

    /// The daemon's version.
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    /// Path of the configuration file in force.
    #[zbus(property)]
    fn config_file(&self) -> zbus::Result<String>;
    /// Start time, microseconds since the Unix epoch.
    #[zbus(property)]
    fn start_timestamp(&self) -> zbus::Result<u64>;
    /// Number of devices served.
    #[zbus(property, name = "NDevices")]
    fn n_devices(&self) -> zbus::Result<u32>;
    /// How often the configuration was reloaded successfully.
    #[zbus(property(emits_changed_signal = "false"), name = "NReloads")]
    fn n_reloads(&self) -> zbus::Result<u32>;
    /// Live daemon and provider objects by kind (`sessions`, `regions`, `mrs`, …).
    #[zbus(property(emits_changed_signal = "false"))]
    fn object_counts(&self) -> zbus::Result<HashMap<String, u64>>;
    #[zbus(property(emits_changed_signal = "false"), name = "NSessions")]
    fn n_sessions(&self) -> zbus::Result<u32>;
    #[zbus(property(emits_changed_signal = "false"), name = "NRegions")]
    fn n_regions(&self) -> zbus::Result<u32>;
}

#[proxy(interface = "org.rdmad1.Device", default_service = "org.rdmad1")]
pub trait Device {
    #[zbus(property)]
    fn name(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn provider(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn node_guid(&self) -> zbus::Result<String>;
    #[zbus(property)]
    fn firmware_version(&self) -> zbus::Result<String>;
    /// The port queue pairs are created on.
    #[zbus(property)]
    fn port(&self) -> zbus::Result<u8>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn ports(&self) -> zbus::Result<Vec<PortInfo>>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn gids(&self) -> zbus::Result<Vec<GidEntry>>;
    #[zbus(property)]
    fn capabilities(&self) -> zbus::Result<Capabilities>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn lingering_objects(&self) -> zbus::Result<Vec<LingeringObject>>;
}

#[proxy(interface = "org.rdmad1.Session", default_service = "org.rdmad1")]
pub trait Session {
    /// Ends the session, freeing its regions and ending its attachments.
    fn close(&self) -> Result<(), Error>;
    /// Allocates a region of at least `size` bytes from `pool`: its object, a read-write
    /// memfd to map, and its size.
    fn allocate_region(
        &self,
        pool: &str,
        size: u64,
        options: Options<'_>,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64), Error>;
    /// Attaches the region an access key grants: its object, a memfd (read-only for an
    /// `ro` key), its size and the access (`ro` or `rw`).
    fn attach_region(
        &self,
        key: &str,
        options: Options<'_>,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64, String), Error>;
    /// Creates an RC queue pair on `device`: its object, the ring memfd, the doorbell (a
    /// pipe's write end) and the completion channel (a pipe's read end), and the ring's size
    /// and depths.
    fn create_queue_pair(
        &self,
        device: &str,
        options: Options<'_>,
    ) -> Result<(OwnedObjectPath, OwnedFd, OwnedFd, OwnedFd, RingInfo), Error>;
    /// Listens for connections by address (rdma_cm) on `address` (empty: any) and `port`:
    /// options as `create_queue_pair`'s for the queue pairs `accept` makes, `backlog`
    /// (`u`), `private_data` (`ay`) for every accept. Returns the listener's number and
    /// the address and port it listens on.
    fn listen(
        &self,
        address: &str,
        port: u16,
        options: Options<'_>,
    ) -> Result<(u64, String, u16), Error>;
    /// Waits for the next connection request on `listener` and accepts it with a new
    /// queue pair (option `timeout_ms`): what `create_queue_pair` returns, and the
    /// connection (`address`, `port`, `local_address`, `local_port`, `qp_num`,
    /// `private_data`).
    #[allow(clippy::type_complexity)]
    fn accept(
        &self,
        listener: u64,
        options: Options<'_>,
    ) -> Result<
        (
            OwnedObjectPath,
            OwnedFd,
            OwnedFd,
            OwnedFd,
            RingInfo,
            HashMap<String, OwnedValue>,
        ),
        Error,
    >;
    /// Stops a listener; requests still waiting are rejected.
    fn stop_listening(&self, listener: u64) -> Result<(), Error>;
    fn get_info(&self) -> Result<SessionInfo, Error>;
}

#[proxy(interface = "org.rdmad1.QueuePair", default_service = "org.rdmad1")]
pub trait QueuePair {
    /// What a peer needs to connect to this queue pair.
    fn endpoint(&self) -> Result<Endpoint, Error>;
    /// Connects to a peer's endpoint.
    fn connect(&self, remote: &Endpoint, options: Options<'_>) -> Result<(), Error>;
    /// Connects by address through rdma_cm to whoever listens on `address` and `port`
    /// (options `private_data`, `source`, `timeout_ms`); returns the connection as
    /// `Session.Accept` describes it.
    fn connect_to(
        &self,
        address: &str,
        port: u16,
        options: Options<'_>,
    ) -> Result<HashMap<String, OwnedValue>, Error>;
    /// Moves a queue pair connected with `{"state": "rtr"}` to RTS (option `psn`).
    fn ready(&self, options: Options<'_>) -> Result<(), Error>;
    /// Moves the queue pair to the error state: what it holds completes flushed.
    fn flush(&self) -> Result<(), Error>;
    fn destroy(&self) -> Result<(), Error>;
    fn get_info(&self) -> Result<QueuePairInfo, Error>;
}

#[proxy(interface = "org.rdmad1.Region", default_service = "org.rdmad1")]
pub trait Region {
    /// Frees the region (owner only): its keys die and attachments end.
    fn free(&self) -> Result<(), Error>;
    /// Creates an access key: options `access` (`"ro"` or `"rw"`, default `"ro"`) and
    /// `expires_in` (seconds, `t`). Returns the token and the key's id.
    fn share(&self, options: Options<'_>) -> Result<(String, u64), Error>;
    /// Revokes one of this region's keys.
    fn revoke_key(&self, key_id: u64) -> Result<(), Error>;
    /// Binds a window over the region through queue pair `qp` for its peer; option
    /// `access` (letters r, w, a; default "rw"). Returns `(addr, rkey, length, export id)`.
    fn export_remote(
        &self,
        qp: &zbus::zvariant::ObjectPath<'_>,
        options: Options<'_>,
    ) -> Result<(u64, u32, u64, u64), Error>;
    /// Invalidates an export.
    fn release_export(&self, export_id: u64) -> Result<(), Error>;
    /// Registers part of the region in a protection domain of the session's own: options
    /// `domain` (`u`, required, from 1), `offset`, `length`, `iova` (`t`), `access` (letters
    /// l, r, w, a; default "l"). Returns `(registration, lkey, rkey)`; the rkey works
    /// through the session's queue pairs created with the same `domain`.
    fn register(&self, options: Options<'_>) -> Result<(u64, u32, u32), Error>;
    /// Removes a registration: its rkey stops working.
    fn deregister(&self, registration: u64) -> Result<(), Error>;
    /// Ends the caller's attachment.
    fn detach(&self) -> Result<(), Error>;
    fn get_info(&self) -> Result<RegionInfo, Error>;
}

#[proxy(interface = "org.rdmad1.Pool", default_service = "org.rdmad1")]
pub trait Pool {
    #[zbus(property(emits_changed_signal = "const"))]
    fn name(&self) -> zbus::Result<String>;
    #[zbus(property(emits_changed_signal = "const"))]
    fn device(&self) -> zbus::Result<String>;
    #[zbus(property(emits_changed_signal = "const"))]
    fn capacity(&self) -> zbus::Result<u64>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn used(&self) -> zbus::Result<u64>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn free(&self) -> zbus::Result<u64>;
    #[zbus(property(emits_changed_signal = "false"), name = "NRegions")]
    fn n_regions(&self) -> zbus::Result<u64>;
    #[zbus(property(emits_changed_signal = "false"))]
    fn warm_regions(&self) -> zbus::Result<u64>;
}
