//! `/org/rdmad1/device/<escaped name>`, interface `org.rdmad1.Device`. Port state and the
//! GID table are read from the device on every request, so they are always current.

use std::sync::Arc;

use rdmad_client::device_path;
use rdmad_client::types::{Capabilities, GidEntry, LingeringObject, PortInfo};
use zbus::interface;

use super::error::provider_error;
use crate::engine::{DeviceEntry, Engine};
use crate::provider::ProviderError;

pub struct DeviceObject {
    engine: Arc<Engine>,
    index: usize,
}

impl DeviceObject {
    pub fn new(engine: Arc<Engine>, index: usize) -> DeviceObject {
        DeviceObject { engine, index }
    }

    pub fn path(&self) -> String {
        device_path(self.entry().device.name())
    }

    fn entry(&self) -> &DeviceEntry {
        &self.engine.devices()[self.index]
    }
}

/// Property getters answer `org.freedesktop.DBus.Error.Failed` with the device's message.
fn failed(e: ProviderError) -> zbus::fdo::Error {
    zbus::fdo::Error::Failed(provider_error(e).to_string())
}

impl DeviceObject {
    /// Asks the device (verbs calls: `ibv_query_device`, `ibv_query_port`,
    /// `ibv_query_gid`, sysfs reads) on a blocking thread.
    async fn query<T: Send + 'static>(
        &self,
        ask: impl FnOnce(&DeviceEntry) -> Result<T, ProviderError> + Send + 'static,
    ) -> zbus::fdo::Result<T> {
        let index = self.index;
        super::context::blocking(&self.engine, move |e| ask(&e.devices()[index]))
            .await
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?
            .map_err(failed)
    }
}

#[interface(name = "org.rdmad1.Device")]
impl DeviceObject {
    #[zbus(property(emits_changed_signal = "const"))]
    async fn name(&self) -> String {
        self.entry().device.name().to_owned()
    }

    /// `verbs` or `loopback`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn provider(&self) -> String {
        self.entry().device.provider().to_string()
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn node_guid(&self) -> zbus::fdo::Result<String> {
        self.query(|d| Ok(d.device.attributes()?.node_guid_string()))
            .await
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn firmware_version(&self) -> zbus::fdo::Result<String> {
        self.query(|d| Ok(d.device.attributes()?.firmware_version))
            .await
    }

    /// The port queue pairs are created on.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn port(&self) -> u8 {
        self.entry().port
    }

    #[zbus(property(emits_changed_signal = "false"))]
    async fn ports(&self) -> zbus::fdo::Result<Vec<PortInfo>> {
        self.query(|d| {
            let count = d.device.attributes()?.port_count;
            (1..=count)
                .map(|port| {
                    let p = d.device.query_port(port)?;
                    Ok(PortInfo {
                        port: p.port,
                        state: p.state.as_str().to_owned(),
                        physical_state: p.physical_state.to_owned(),
                        active_mtu: p.active_mtu,
                        max_mtu: p.max_mtu,
                        lid: p.lid,
                        link_layer: p.link_layer.as_str().to_owned(),
                    })
                })
                .collect()
        })
        .await
    }

    /// Populated GID table entries of every port.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn gids(&self) -> zbus::fdo::Result<Vec<GidEntry>> {
        self.query(|d| {
            let count = d.device.attributes()?.port_count;
            let mut out = Vec::new();
            for port in 1..=count {
                for g in d.device.gid_table(port)? {
                    out.push(GidEntry {
                        port,
                        index: g.index,
                        gid: g.gid.to_string(),
                        gid_type: g.gid_type.as_str().to_owned(),
                    });
                }
            }
            Ok(out)
        })
        .await
    }

    /// Registrations and windows the device refused to destroy: rdmad keeps them (their
    /// memory stays pinned, what is bound over them may still work) and retries every few
    /// seconds. Empty in a healthy daemon.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn lingering_objects(&self) -> Vec<LingeringObject> {
        self.entry()
            .device
            .lingering()
            .into_iter()
            .map(|l| LingeringObject {
                kind: l.kind.as_str().to_owned(),
                key: l.key,
                length: l.len,
                error: l.error,
                since_usec: super::wire::usec(l.since),
                attempts: l.attempts,
            })
            .collect()
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn capabilities(&self) -> zbus::fdo::Result<Capabilities> {
        let a = self.query(|d| d.device.attributes()).await?;
        Ok(Capabilities {
            max_qp: a.max_qp,
            max_qp_wr: a.max_qp_wr,
            max_sge: a.max_sge,
            max_cq: a.max_cq,
            max_cqe: a.max_cqe,
            max_mr: a.max_mr,
            max_pd: a.max_pd,
            max_mr_size: a.max_mr_size,
            max_mw: a.max_mw,
            max_qp_rd_atom: a.max_qp_rd_atom,
            atomics: a.atomics.as_str().to_owned(),
            memory_windows: a.memory_window_types(),
        })
    }
}
