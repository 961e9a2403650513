//! Typed proxies for the rdmad interfaces. Methods fail with [`Error`], so a refusal
//! arrives as its `org.rdmad1.Error.*` variant; properties fail with `zbus::Error`.

use zbus::proxy;
use zbus::zvariant::OwnedObjectPath;

use crate::error::Error;
use crate::types::{Capabilities, DeviceSummary, GidEntry, PortInfo};

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
}
