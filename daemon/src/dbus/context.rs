//! What every object of the D-Bus layer shares: the engine, the caller cache, the reload
//! procedure, and publishing and withdrawing the objects of sessions and regions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmad_client::names::{qp_path, region_path, session_path};
use rdmad_client::Error;
use zbus::message::Header;
use zbus::object_server::{Interface, ObjectServer};
use zbus::Connection;

use super::caller::CallerCache;
use super::manager::Reloader;
use super::queue_pair::QueuePairObject;
use super::region::RegionObject;
use super::session::SessionObject;
use crate::config::Config;
use crate::engine::{Engine, Limits, PoolAccess, QpId, RegionId, Removed, Scope, SessionId};
use crate::lock::lock;
use crate::policy::Caller;

/// Runs engine work that may block — any verbs call (creating, connecting, querying or
/// destroying queue pairs, reading the device's attributes, ports and GID table),
/// registering or deregistering memory, waiting for a data-path worker to bind a window or
/// let go of a queue pair, reloading the configuration — on a blocking thread, never on one
/// of the few threads that serve the bus, so one client's slow call never delays another's.
pub async fn blocking<T: Send + 'static>(
    engine: &Arc<Engine>,
    work: impl FnOnce(&Engine) -> T + Send + 'static,
) -> Result<T, Error> {
    let engine = Arc::clone(engine);
    tokio::task::spawn_blocking(move || work(&engine))
        .await
        .map_err(|e| Error::DeviceError(format!("internal error: {e}")))
}

/// Waits, off the executor, for regions freed before this call to be released, so that
/// counts, quota use and pool use read next no longer include them (`Engine::settled`).
pub async fn settled(engine: &Arc<Engine>) {
    if engine.releases_pending() {
        // A failed join only means the wait was cut short; the read goes on.
        let _ = blocking(engine, |e| e.settled()).await;
    }
}

/// The outcome of withdrawing an object from an object server: whether it was served
/// there (`ObjectServer::remove` fails with `InterfaceNotFound` when it was not).
pub fn served(removal: zbus::Result<bool>) -> zbus::Result<bool> {
    match removal {
        Ok(_) => Ok(true),
        Err(zbus::Error::InterfaceNotFound) => Ok(false),
        Err(e) => Err(e),
    }
}

pub struct Context {
    pub engine: Arc<Engine>,
    pub callers: CallerCache,
    pub reloader: Reloader,
    /// Each user's turns for connecting by address.
    pub connecting: super::turns::Turns,
    /// Each user's turns for window binds and invalidations.
    pub window_work: super::turns::Turns,
    /// The open direct connections.
    pub direct: super::direct::Channels,
    /// What policy grants each connection's caller under the configuration in force.
    pub grants: Mutex<HashMap<String, Arc<Grants>>>,
    /// The bus connection's objects, while it is up (`unserve` lets go of them).
    pub bus: Mutex<Option<ObjectServer>>,
    /// The objects made on direct connections: path → the name of the direct connection
    /// that serves it.
    pub served_direct: Mutex<HashMap<String, String>>,
}

/// What the policy grants a caller — its quota limits and the pools it may use — under
/// one configuration. Working it out looks users and groups up (NSS, which may block), so
/// it is done once per connection and configuration, off the bus threads.
pub struct Grants {
    config: Arc<Config>,
    pub limits: Limits,
    pub pools: PoolAccess,
    /// Whether the caller is an administrator (`Scope::All`) or reaches its own alone.
    pub scope: Scope,
}

impl Context {
    /// The grants of `caller`: cached per connection while the configuration stays the
    /// same; worked out on a blocking thread when not.
    pub async fn grants(&self, caller: &Caller) -> Result<Arc<Grants>, Error> {
        let config = self.config();
        if let Some(known) = lock(&self.grants).get(&caller.bus_name) {
            if Arc::ptr_eq(&known.config, &config) {
                return Ok(Arc::clone(known));
            }
        }
        let who = caller.clone();
        let grants = Arc::new(
            self.blocking(move |e| Grants {
                limits: crate::policy::limits(&who, &config),
                pools: crate::policy::pool_access(&who, &e.pool_configs()),
                scope: crate::policy::scope(&who, &config),
                config,
            })
            .await?,
        );
        // Kept only for a connection still there: one that went meanwhile was forgotten.
        // The check and the insert happen under the lock `connection_gone` takes to forget
        // it, after marking it gone.
        let mut kept = lock(&self.grants);
        let live = if super::direct::is_direct(&caller.bus_name) {
            self.direct.is_open(&caller.bus_name)
        } else {
            self.callers.knows(&caller.bus_name)
        };
        if live {
            kept.insert(caller.bus_name.clone(), Arc::clone(&grants));
        }
        drop(kept);
        Ok(grants)
    }

    /// What `caller` reaches: its own objects, or everyone's (an administrator). From its
    /// cached grants: no lookup on the bus's threads.
    pub async fn scope(&self, caller: &Caller) -> Result<Scope, Error> {
        Ok(self.grants(caller).await?.scope)
    }

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

    /// Runs engine work that may block on a blocking thread: see [`blocking`].
    pub async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Engine) -> T + Send + 'static,
    ) -> Result<T, Error> {
        blocking(&self.engine, work).await
    }

    /// Serves the object of a session `caller` just opened; like `publish_region`, it
    /// withdraws it again if the session was closed meanwhile (its connection went).
    pub async fn publish_session(
        self: &Arc<Self>,
        server: &ObjectServer,
        caller: &Caller,
        id: SessionId,
    ) -> Result<(), Error> {
        self.serve(server, caller, session_path(id.0), true, || {
            SessionObject::new(Arc::clone(self), id)
        })
        .await?;
        let scope = self.scope(caller).await?;
        if self.engine.session(&caller.owner(), scope, id).is_err() {
            let _ = self
                .remove::<SessionObject>(server, session_path(id.0))
                .await;
            return Err(Error::NoSuchObject(format!(
                "session {id}: its connection went while it was being opened"
            )));
        }
        Ok(())
    }

    /// Serves the object of a region `caller` just allocated. Its session may have been
    /// closed (by `Close`, an administrator, or its connection leaving the bus) after the
    /// engine made the region and before its object was served, and the closing withdrew
    /// nothing then: so once the object is served, the region is looked up again, and if it
    /// is gone the object is withdrawn here and the caller is told.
    pub async fn publish_region(
        self: &Arc<Self>,
        server: &ObjectServer,
        caller: &Caller,
        id: RegionId,
    ) -> Result<(), Error> {
        self.serve(server, caller, region_path(id.0), false, || {
            RegionObject::new(Arc::clone(self), id)
        })
        .await?;
        let scope = self.scope(caller).await?;
        if self.engine.region(&caller.owner(), scope, id).is_err() {
            let _ = self.remove::<RegionObject>(server, region_path(id.0)).await;
            return Err(Error::NoSuchObject(format!(
                "region {id}: its session was closed while it was being allocated"
            )));
        }
        Ok(())
    }

    /// Serves the object of a queue pair `caller` just created; like `publish_region`, it
    /// withdraws it again if the session was closed meanwhile.
    pub async fn publish_qp(
        self: &Arc<Self>,
        server: &ObjectServer,
        caller: &Caller,
        id: QpId,
    ) -> Result<(), Error> {
        self.serve(server, caller, qp_path(id.0), false, || {
            QueuePairObject::new(Arc::clone(self), id)
        })
        .await?;
        if !self.engine.owns_qp(&caller.owner(), id) {
            let _ = self.remove::<QueuePairObject>(server, qp_path(id.0)).await;
            return Err(Error::NoSuchObject(format!(
                "queue pair {id}: its session was closed while it was being created"
            )));
        }
        Ok(())
    }

    /// Serves an object `caller` made at `path` on the connection it called on (`server`).
    /// When that is a direct connection and `on_bus` is set (sessions), on the bus as well,
    /// so that administrators and tools on the bus reach it (`rdmactl session close`); a
    /// direct connection's regions and queue pairs are served on it alone, which keeps the
    /// bus out of their allocation.
    async fn serve<I: Interface>(
        &self,
        server: &ObjectServer,
        caller: &Caller,
        path: String,
        on_bus: bool,
        make: impl Fn() -> I,
    ) -> zbus::Result<()> {
        server.at(path.as_str(), make()).await?;
        if super::direct::is_direct(&caller.bus_name) {
            lock(&self.served_direct).insert(path.clone(), caller.bus_name.clone());
            let bus = lock(&self.bus).clone();
            if let (true, Some(bus)) = (on_bus, bus) {
                bus.at(path.as_str(), make()).await?;
            }
        }
        Ok(())
    }

    /// Withdraws the objects of what the engine removed. An object not served (yet) is no
    /// error: a session, region or queue pair removed while it was being made is withdrawn
    /// by its publisher (`publish_session`, `publish_region`, `publish_qp`), which looks it
    /// up again once its object is served.
    pub async fn withdraw(&self, server: &ObjectServer, removed: &Removed) {
        for id in &removed.qps {
            if let Err(e) = self.remove::<QueuePairObject>(server, qp_path(id.0)).await {
                tracing::warn!(qp = %id, "cannot withdraw the queue pair object: {e}");
            }
        }
        for id in &removed.regions {
            if let Err(e) = self.remove::<RegionObject>(server, region_path(id.0)).await {
                tracing::warn!(region = %id, "cannot withdraw the region object: {e}");
            }
        }
        for id in &removed.sessions {
            match self
                .remove::<SessionObject>(server, session_path(id.0))
                .await
            {
                Ok(true) => {}
                Ok(false) => tracing::debug!(
                    session = %id,
                    "the session's object was not served yet: its publisher withdraws it"
                ),
                Err(e) => tracing::warn!(session = %id, "cannot withdraw the session object: {e}"),
            }
        }
    }

    /// Withdraws the object at `path` wherever it is served: on the bus (or `server`, before
    /// the bus connection is up) and on the direct connection it was made on, while that is
    /// open. `Ok(false)` when nothing served it.
    async fn remove<I: Interface>(
        &self,
        server: &ObjectServer,
        path: String,
    ) -> zbus::Result<bool> {
        let channel = lock(&self.served_direct).remove(&path);
        let mut found = false;
        if let Some(name) = channel {
            // The connection is held for the whole removal (its object server needs it).
            if let Some(direct) = self.direct.connection_of(&name) {
                let removal = direct.object_server().remove::<I, _>(path.as_str());
                match tokio::time::timeout(super::direct::SEND_TIMEOUT, removal).await {
                    Ok(r) => match served(r) {
                        Ok(f) => found |= f,
                        // The object leaves the tree before its InterfacesRemoved is sent;
                        // a direct connection that is closing fails only the signal.
                        Err(e) => {
                            found = true;
                            tracing::debug!(
                                path,
                                "withdrawn from a closing direct connection: {e}"
                            );
                        }
                    },
                    Err(_) => {
                        found = true;
                        tracing::warn!(
                            channel = %name,
                            "a direct connection took nothing rdmad sent it for {:?}; it is closed",
                            super::direct::SEND_TIMEOUT
                        );
                        self.direct.shut(&name);
                    }
                }
            }
        }
        let bus = lock(&self.bus).clone();
        let bus = bus.as_ref().unwrap_or(server);
        found |= served(bus.remove::<I, _>(path.as_str()).await)?;
        Ok(found)
    }

    /// A connection left the bus: close its sessions.
    pub async fn connection_gone(&self, server: &ObjectServer, bus_name: &str) {
        self.callers.forget(bus_name);
        lock(&self.grants).remove(bus_name);
        let name = bus_name.to_owned();
        let removed = match self.blocking(move |e| e.close_sessions_of(&name)).await {
            Ok(removed) => removed,
            Err(e) => {
                tracing::error!(sender = bus_name, "closing the sessions failed: {e:?}");
                return;
            }
        };
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
