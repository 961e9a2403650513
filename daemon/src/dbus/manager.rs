//! `/org/rdmad1`, interface `org.rdmad1.Manager`.

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use rdmad_client::types::DeviceSummary;
use rdmad_client::{device_path, Error};
use zbus::message::Header;
use zbus::zvariant::OwnedObjectPath;
use zbus::{interface, Connection};

use super::{caller, to_dbus_error};
use crate::engine::Engine;
use crate::policy;

/// Re-reads the configuration and applies it; `Err` carries the located config error.
/// Provided by the service, which also tells systemd about the reload.
pub type Reloader = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

pub struct Manager {
    engine: Arc<Engine>,
    reloader: Reloader,
}

impl Manager {
    pub fn new(engine: Arc<Engine>, reloader: Reloader) -> Manager {
        Manager { engine, reloader }
    }
}

fn object_path(path: String) -> OwnedObjectPath {
    OwnedObjectPath::try_from(path).expect("device_path always builds a valid object path")
}

#[interface(name = "org.rdmad1.Manager")]
impl Manager {
    /// Devices served: `(name, provider, object path)`.
    async fn list_devices(&self) -> Vec<DeviceSummary> {
        self.engine
            .devices()
            .iter()
            .map(|entry| DeviceSummary {
                name: entry.device.name().to_owned(),
                provider: entry.device.provider().to_string(),
                path: object_path(device_path(entry.device.name())),
            })
            .collect()
    }

    /// The object path of device `name`.
    async fn get_device(&self, name: &str) -> Result<OwnedObjectPath, Error> {
        let entry = self.engine.device(name).map_err(to_dbus_error)?;
        Ok(object_path(device_path(entry.device.name())))
    }

    /// Re-reads the configuration file (administrators only). An invalid file is refused
    /// with `InvalidArgument` naming file, line and key; the configuration in force stays.
    async fn reload(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = caller(connection, &header).await?;
        policy::require_admin(&caller, &self.engine.config(), "Reload")?;
        tracing::info!(uid = caller.uid, sender = %caller.bus_name, "reload requested over D-Bus");
        (self.reloader)().map_err(Error::InvalidArgument)
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }

    /// The configuration file in force.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn config_file(&self) -> String {
        self.engine.config_path().display().to_string()
    }

    /// When the daemon started, in microseconds since the Unix epoch.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn start_timestamp(&self) -> u64 {
        self.engine
            .started()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    #[zbus(property(emits_changed_signal = "const"), name = "NDevices")]
    async fn n_devices(&self) -> u32 {
        u32::try_from(self.engine.devices().len()).unwrap_or(u32::MAX)
    }

    /// Successful configuration reloads since start.
    #[zbus(property(emits_changed_signal = "false"), name = "NReloads")]
    async fn n_reloads(&self) -> u32 {
        self.engine.reload_count()
    }
}
