//! `/org/rdmad1/device/<escaped name>`, interface `org.rdmad1.Device`. Port state and the
//! GID table are read from the device on every request, so they are always current.

use std::sync::Arc;

use rdmad_client::device_path;
use rdmad_client::types::{Capabilities, GidEntry, LingeringObject, PortInfo};
use rdmad_client::Error;
use zbus::interface;

use crate::engine::{Engine, EngineError};

pub struct DeviceObject {
    engine: Arc<Engine>,
    name: String,
}

impl DeviceObject {
    pub fn new(engine: Arc<Engine>, name: String) -> DeviceObject {
        DeviceObject { engine, name }
    }

    pub fn path(&self) -> String {
        device_path(&self.name)
    }
}

fn failed(e: EngineError) -> zbus::fdo::Error {
    zbus::fdo::Error::Failed(Error::from(e).to_string())
}

impl DeviceObject {
    /// Asks the engine about this device on a blocking thread (verbs calls may block).
    async fn query<T: Send + 'static>(
        &self,
        ask: impl FnOnce(&Engine, &str) -> Result<T, EngineError> + Send + 'static,
    ) -> zbus::fdo::Result<T> {
        let name = self.name.clone();
        super::context::blocking(&self.engine, move |e| ask(e, &name))
            .await
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))?
            .map_err(failed)
    }
}

#[interface(name = "org.rdmad1.Device")]
impl DeviceObject {
    #[zbus(property(emits_changed_signal = "const"))]
    async fn name(&self) -> String {
        self.name.clone()
    }

    /// `verbs` or `loopback`.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn provider(&self) -> zbus::fdo::Result<String> {
        Ok(self
            .engine
            .device_summary(&self.name)
            .map_err(failed)?
            .provider)
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn node_guid(&self) -> zbus::fdo::Result<String> {
        self.query(|e, d| Ok(e.device_attributes(d)?.node_guid_string()))
            .await
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn firmware_version(&self) -> zbus::fdo::Result<String> {
        self.query(|e, d| Ok(e.device_attributes(d)?.firmware_version))
            .await
    }

    /// The port queue pairs are created on.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn port(&self) -> zbus::fdo::Result<u8> {
        Ok(self.engine.device_summary(&self.name).map_err(failed)?.port)
    }

    #[zbus(property(emits_changed_signal = "false"))]
    async fn ports(&self) -> zbus::fdo::Result<Vec<PortInfo>> {
        self.query(|e, d| {
            Ok(e.device_ports(d)?
                .into_iter()
                .map(|p| PortInfo {
                    port: p.port,
                    state: p.state.as_str().to_owned(),
                    physical_state: p.physical_state.to_owned(),
                    active_mtu: p.active_mtu,
                    max_mtu: p.max_mtu,
                    lid: p.lid,
                    link_layer: p.link_layer.as_str().to_owned(),
                })
                .collect())
        })
        .await
    }

    /// Populated GID table entries of every port.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn gids(&self) -> zbus::fdo::Result<Vec<GidEntry>> {
        self.query(|e, d| {
            Ok(e.device_gids(d)?
                .into_iter()
                .map(|(port, g)| GidEntry {
                    port,
                    index: g.index,
                    gid: g.gid.to_string(),
                    gid_type: g.gid_type.as_str().to_owned(),
                })
                .collect())
        })
        .await
    }

    /// Registrations and windows the device refused to destroy: rdmad keeps them (their
    /// memory stays pinned, what is bound over them may still work) and retries every few
    /// seconds. Empty in a healthy daemon.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn lingering_objects(&self) -> zbus::fdo::Result<Vec<LingeringObject>> {
        Ok(self
            .engine
            .device_lingering(&self.name)
            .map_err(failed)?
            .into_iter()
            .map(|l| LingeringObject {
                kind: l.kind.as_str().to_owned(),
                key: l.key,
                length: l.len,
                error: l.error,
                since_usec: super::wire::usec(l.since),
                attempts: l.attempts,
            })
            .collect())
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn capabilities(&self) -> zbus::fdo::Result<Capabilities> {
        let a = self.query(|e, d| e.device_attributes(d)).await?;
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
