//! What every object of the D-Bus layer shares: the engine, the caller cache, the reload
//! procedure, and publishing and withdrawing the objects of sessions and regions.

use std::sync::Arc;

use rdmad_client::names::{qp_path, region_path, session_path};
use rdmad_client::Error;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::Connection;

use super::caller::CallerCache;
use super::manager::Reloader;
use super::queue_pair::QueuePairObject;
use super::region::RegionObject;
use super::session::SessionObject;
use crate::config::Config;
use crate::engine::{Engine, RegionId, Removed, SessionId};
use crate::policy::Caller;

pub struct Context {
    pub engine: Arc<Engine>,
    pub callers: CallerCache,
    pub reloader: Reloader,
}

impl Context {
    pub async fn caller(
        &self,
        connection: &Connection,
        header: &Header<'_>,
    ) -> Result<Caller, Error> {
        self.callers.caller(connection, header).await
    }

    pub fn config(&self) -> Arc<Config> {
        self.engine.config()
    }

    pub async fn publish_session(
        self: &Arc<Self>,
        server: &ObjectServer,
        id: SessionId,
    ) -> zbus::Result<()> {
        let object = SessionObject::new(Arc::clone(self), id);
        server.at(session_path(id), object).await.map(drop)
    }

    pub async fn publish_region(
        self: &Arc<Self>,
        server: &ObjectServer,
        id: RegionId,
    ) -> zbus::Result<()> {
        let object = RegionObject::new(Arc::clone(self), id);
        server.at(region_path(id), object).await.map(drop)
    }

    pub async fn publish_qp(self: &Arc<Self>, server: &ObjectServer, id: u64) -> zbus::Result<()> {
        let object = QueuePairObject::new(Arc::clone(self), id);
        server.at(qp_path(id), object).await.map(drop)
    }

    /// Withdraws the objects of what the engine removed.
    pub async fn withdraw(&self, server: &ObjectServer, removed: &Removed) {
        for id in &removed.qps {
            if let Err(e) = server.remove::<QueuePairObject, _>(qp_path(*id)).await {
                tracing::warn!(qp = id, "cannot withdraw the queue pair object: {e}");
            }
        }
        for id in &removed.regions {
            if let Err(e) = server.remove::<RegionObject, _>(region_path(*id)).await {
                tracing::warn!(region = id, "cannot withdraw the region object: {e}");
            }
        }
        for id in &removed.sessions {
            if let Err(e) = server.remove::<SessionObject, _>(session_path(*id)).await {
                tracing::warn!(session = id, "cannot withdraw the session object: {e}");
            }
        }
    }

    /// A connection left the bus: close its sessions.
    pub async fn connection_gone(&self, server: &ObjectServer, bus_name: &str) {
        self.callers.forget(bus_name);
        let removed = self.engine.registry.close_sessions_of(bus_name);
        if !removed.sessions.is_empty() {
            tracing::info!(
                sender = bus_name,
                sessions = ?removed.sessions,
                regions = removed.regions.len(),
                "connection left the bus; its sessions are closed"
            );
            self.withdraw(server, &removed).await;
        }
    }
}
