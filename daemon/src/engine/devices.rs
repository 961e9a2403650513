//! Choosing and opening the devices rdmad serves.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::EngineError;
use crate::config::{Config, ConfigError, ProviderChoice};
use crate::provider::{loopback, verbs, Device, ProtectionDomain, ProviderError, ProviderKind};

/// A device rdmad serves, with the daemon's protection domain on it.
#[derive(Debug)]
pub struct DeviceEntry {
    // Field order is drop order: the PD goes before the device handle.
    pub pd: Arc<dyn ProtectionDomain>,
    pub device: Arc<dyn Device>,
    /// The port queue pairs use.
    pub port: u8,
    /// The pinned GID index, if the configuration pins one.
    pub gid_index: Option<u32>,
}

/// What to open, from the configuration and the `--provider` override.
#[derive(Debug, Clone)]
pub struct DeviceSelection {
    pub provider: ProviderChoice,
    pub loopback_fallback: bool,
    pub config: Config,
    pub config_path: PathBuf,
}

impl DeviceSelection {
    pub fn from_config(
        config: &Config,
        config_path: &Path,
        provider: Option<ProviderChoice>,
    ) -> DeviceSelection {
        DeviceSelection {
            provider: provider.unwrap_or(config.daemon.provider),
            loopback_fallback: config.daemon.loopback_fallback,
            config: config.clone(),
            config_path: config_path.to_owned(),
        }
    }
}

/// Opens the selected devices and allocates a PD on each.
pub fn open_devices(selection: &DeviceSelection) -> Result<Vec<DeviceEntry>, EngineError> {
    let found: Vec<Arc<dyn Device>> = match selection.provider {
        ProviderChoice::Loopback => vec![loopback_device()],
        ProviderChoice::Verbs => verbs::open_devices().map_err(|e| match e {
            ProviderError::NoDevices(why) => EngineError::DeviceUnusable(format!(
                "provider \"verbs\" was asked for, but there is no RDMA device: {why}; \
                 use provider = \"auto\" or \"loopback\" to run without one"
            )),
            other => other.into(),
        })?,
        ProviderChoice::Auto => match verbs::open_devices() {
            Ok(devices) => devices,
            Err(ProviderError::NoDevices(why)) if selection.loopback_fallback => {
                tracing::info!(
                    "no RDMA device: {why}; serving the loopback device {}",
                    loopback::DEFAULT_NAME
                );
                vec![loopback_device()]
            }
            Err(ProviderError::NoDevices(why)) => {
                return Err(EngineError::DeviceUnusable(format!(
                    "no RDMA device: {why}; and daemon.loopback_fallback is false"
                )))
            }
            Err(other) => return Err(other.into()),
        },
    };

    let wanted = &selection.config.devices;
    let names: Vec<&str> = found.iter().map(|d| d.name()).collect();
    check_named_devices(&selection.config, &selection.config_path, &names)?;

    let mut entries = Vec::new();
    for device in found {
        let config = selection.config.device(device.name());
        if !wanted.is_empty() && config.is_none() {
            tracing::info!(
                device = device.name(),
                "not listed in [[device]]; not served"
            );
            continue;
        }
        let port = config.map_or(1, |c| c.port);
        let attrs = device.attributes()?;
        if port > attrs.port_count {
            return Err(EngineError::DeviceUnusable(format!(
                "{}: port {port} is configured, but the device has ports 1..={}",
                device.name(),
                attrs.port_count
            )));
        }
        let pd = device.alloc_pd()?;
        tracing::info!(
            device = device.name(),
            provider = %device.provider(),
            node_guid = %attrs.node_guid_string(),
            port,
            "serving device"
        );
        entries.push(DeviceEntry {
            pd,
            device,
            port,
            gid_index: config.and_then(|c| c.gid_index),
        });
    }
    if entries.is_empty() {
        return Err(EngineError::DeviceUnusable("no device to serve".into()));
    }
    Ok(entries)
}

/// Checks that every device `config` names is one of `host` (the devices the provider
/// offers), and that every pool's device is one rdmad would serve. The same check runs at
/// start, against the devices just opened, and at reload, against [`host_device_names`], so a
/// reload never accepts a file the next start would refuse. Errors carry the key; their line
/// is found with [`ConfigError::located`].
pub fn check_named_devices(config: &Config, path: &Path, host: &[&str]) -> Result<(), ConfigError> {
    let error = |key: String, message: String| ConfigError {
        file: path.to_owned(),
        line: 0,
        key,
        message,
    };
    for (i, dev) in config.devices.iter().enumerate() {
        if !host.contains(&dev.name.as_str()) {
            return Err(error(
                format!("device[{i}].name"),
                format!(
                    "no device named {:?} on this host (found: {})",
                    dev.name,
                    host.join(", ")
                ),
            ));
        }
    }
    let served = |name: &str| {
        if config.devices.is_empty() {
            host.contains(&name)
        } else {
            config.device(name).is_some()
        }
    };
    for (i, pool) in config.effective_pools().iter().enumerate() {
        if let Some(name) = pool.device.as_deref().filter(|name| !served(name)) {
            return Err(error(
                format!("pool[{i}].device"),
                format!("no device named {name:?} is served"),
            ));
        }
    }
    Ok(())
}

/// The names of the devices the running provider offers now: a fresh device list for the
/// verbs provider (a device may have come or gone since the start; if the list cannot be
/// read, the served ones), the served device for loopback.
pub fn host_device_names(served: &[DeviceEntry]) -> Vec<String> {
    let served_names = || served.iter().map(|d| d.device.name().to_owned()).collect();
    match served.first().map(|d| d.device.provider()) {
        Some(ProviderKind::Verbs) => verbs::device_names().unwrap_or_else(|_| served_names()),
        _ => served_names(),
    }
}

fn loopback_device() -> Arc<dyn Device> {
    Arc::new(loopback::LoopbackDevice::new(loopback::DEFAULT_NAME))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection(provider: ProviderChoice, fallback: bool, devices: &str) -> DeviceSelection {
        let path = Path::new("/etc/rdmad/rdmad.toml");
        let text = format!("[daemon]\nloopback_fallback = {fallback}\n{devices}");
        let config = Config::parse(path, &text).unwrap();
        DeviceSelection::from_config(&config, path, Some(provider))
    }

    fn host_has_rdma() -> bool {
        verbs::open_devices().is_ok()
    }

    #[test]
    fn auto_falls_back_to_loopback_only_where_allowed() {
        let served = open_devices(&selection(ProviderChoice::Auto, true, "")).unwrap();
        if host_has_rdma() {
            assert!(served
                .iter()
                .all(|d| d.device.name() != loopback::DEFAULT_NAME));
        } else {
            assert_eq!(served.len(), 1);
            assert_eq!(served[0].device.name(), loopback::DEFAULT_NAME);
            let refused = open_devices(&selection(ProviderChoice::Auto, false, ""));
            let msg = refused.unwrap_err().to_string();
            assert!(msg.contains("loopback_fallback is false"), "{msg}");
            let verbs_only = open_devices(&selection(ProviderChoice::Verbs, true, ""));
            let msg = verbs_only.unwrap_err().to_string();
            assert!(msg.contains("there is no RDMA device"), "{msg}");
        }
    }

    #[test]
    fn configured_device_that_does_not_exist_is_a_config_error() {
        let sel = selection(
            ProviderChoice::Loopback,
            true,
            "[[device]]\nname = \"mlx5_7\"\n",
        );
        match open_devices(&sel) {
            Err(EngineError::Config(e)) => {
                assert_eq!(e.key, "device[0].name");
                assert!(e.message.contains("no device named \"mlx5_7\""), "{e}");
            }
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn configured_port_must_exist() {
        let sel = selection(
            ProviderChoice::Loopback,
            true,
            "[[device]]\nname = \"loopback0\"\nport = 2\n",
        );
        let msg = open_devices(&sel).unwrap_err().to_string();
        assert!(
            msg.contains("port 2 is configured, but the device has ports 1..=1"),
            "{msg}"
        );
    }
}
