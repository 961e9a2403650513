//! `/org/rdmad1`, interface `org.rdmad1.Manager`.

use std::collections::HashMap;
use std::sync::Arc;

use rdmad_client::names::session_path;
use rdmad_client::types::{
    DeviceSummary, PoolInfo, QueuePairInfo, QuotaEntry, RegionInfo, SessionInfo,
};
use rdmad_client::{device_path, Error};
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::{OwnedObjectPath, OwnedValue};
use zbus::{interface, Connection};

use super::context::{settled, Context};
use super::options::Options;
use super::wire;
use crate::engine::KeyId;
use crate::policy;

/// Re-reads the configuration and applies it; `Err` carries the located config error.
/// Provided by the service, which also tells systemd about the reload.
pub type Reloader = Arc<dyn Fn() -> Result<(), crate::config::ConfigError> + Send + Sync>;

pub struct Manager {
    ctx: Arc<Context>,
    /// On a direct connection: dropped with the connection's objects, which tells the
    /// stopping daemon that none of them holds the engine any more.
    _life: Option<tokio::sync::watch::Sender<()>>,
}

impl Manager {
    pub fn new(ctx: Arc<Context>, life: Option<tokio::sync::watch::Sender<()>>) -> Manager {
        Manager { ctx, _life: life }
    }
}

#[interface(name = "org.rdmad1.Manager")]
impl Manager {
    /// Devices served: `(name, provider, object path)`.
    async fn list_devices(&self) -> Vec<DeviceSummary> {
        let engine = &self.ctx.engine;
        engine
            .device_names()
            .iter()
            .filter_map(|name| engine.device_summary(name).ok())
            .map(|d| DeviceSummary {
                path: wire::path(device_path(&d.name)),
                name: d.name,
                provider: d.provider,
            })
            .collect()
    }

    /// The object path of device `name`.
    async fn get_device(&self, name: &str) -> Result<OwnedObjectPath, Error> {
        let device = self.ctx.engine.device_summary(name)?;
        Ok(wire::path(device_path(&device.name)))
    }

    /// Re-reads the configuration file (administrators only). An invalid file is refused
    /// with `InvalidArgument` naming file, line and key; the configuration in force stays.
    async fn reload(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let (who, config) = (caller.clone(), self.ctx.config());
        self.ctx
            .blocking(move |_| policy::require_admin(&who, &config, "Reload"))
            .await??;
        tracing::info!(uid = caller.uid, sender = %caller.bus_name, "reload requested over D-Bus");
        // Reading the file, looking up the users and groups it names and asking the
        // devices for their limits all may block.
        let reloader = Arc::clone(&self.ctx.reloader);
        self.ctx
            .blocking(move |_| reloader())
            .await?
            .map_err(|e| Error::InvalidArgument(e.to_string()))
    }

    /// Opens a session owned by the calling connection (no options yet). It ends with
    /// `Session.Close` or when the connection leaves the bus.
    async fn open_session(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<OwnedObjectPath, Error> {
        Options::new("OpenSession", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let limits = self.ctx.grants(&caller).await?.limits.clone();
        let id = self.ctx.engine.open_session(&caller.owner(), &limits)?;
        self.ctx.publish_session(server, &caller, id).await?;
        tracing::info!(session = %id, uid = caller.uid, sender = %caller.bus_name, pid = caller.pid.unwrap_or(0), "session opened");
        // The caller may have left the bus (or closed its direct connection) before the
        // session existed, in which case the watcher saw nothing to close.
        let gone = if super::direct::is_direct(&caller.bus_name) {
            !self.ctx.direct.is_open(&caller.bus_name)
        } else {
            let dbus = zbus::fdo::DBusProxy::new(connection).await?;
            let name = zbus::names::BusName::try_from(caller.bus_name.as_str())
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
            !dbus.name_has_owner(name).await?
        };
        if gone {
            self.ctx.connection_gone(server, &caller.bus_name).await;
        }
        Ok(wire::path(session_path(id.0)))
    }

    /// Opens a direct connection: returns one end of a socket pair on which rdmad serves
    /// these same objects peer to peer (no options yet). Calls on it skip the bus daemon;
    /// they run as this caller, and what is opened on it closes with it.
    async fn open_direct(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<zbus::zvariant::OwnedFd, Error> {
        Options::new("OpenDirect", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let fd = super::direct::open(&self.ctx, &caller)?;
        Ok(fd.into())
    }

    /// Sessions the caller may see: its user's, or every session for administrators.
    async fn list_sessions(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<Vec<SessionInfo>, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        // Each session's user is named: a lookup, off the bus's threads.
        self.ctx
            .blocking(move |e| {
                e.sessions(&caller.owner(), scope)
                    .iter()
                    .map(wire::session)
                    .collect()
            })
            .await
    }

    /// Regions the caller may see: its user's and those its user attached, or every
    /// region for administrators.
    async fn list_regions(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<Vec<RegionInfo>, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        let regions = self.ctx.engine.regions(&caller.owner(), scope);
        Ok(regions.iter().map(wire::region).collect())
    }

    /// Queue pairs the caller may see: its user's, or all for administrators.
    async fn list_queue_pairs(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<Vec<QueuePairInfo>, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        // Each state comes from the device (ibv_query_qp).
        self.ctx
            .blocking(move |e| {
                e.qps(&caller.owner(), scope)
                    .iter()
                    .map(super::queue_pair::info)
                    .collect()
            })
            .await
    }

    async fn list_pools(&self) -> Vec<PoolInfo> {
        settled(&self.ctx.engine).await;
        self.ctx
            .engine
            .pool_snapshots()
            .iter()
            .map(wire::pool)
            .collect()
    }

    /// Limits and live use of `uid`: the caller's own, anyone's for administrators.
    async fn get_quota(
        &self,
        uid: u32,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<Vec<QuotaEntry>, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        // Another user's limits come from a lookup of its groups: off the bus's threads.
        let config = self.ctx.config();
        let limits = self
            .ctx
            .blocking(move |_| policy::limits_of(&caller, &config, uid))
            .await??;
        settled(&self.ctx.engine).await;
        let lines = self.ctx.engine.quota(&limits);
        Ok(lines
            .into_iter()
            .map(|l| QuotaEntry {
                name: l.kind.key().to_owned(),
                limit: l.limit,
                used: l.used,
                source: l.source,
            })
            .collect())
    }

    /// Revokes an access key by id: its region's owner or an administrator.
    async fn revoke_key(
        &self,
        key_id: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        self.ctx
            .engine
            .revoke(&caller.owner(), scope, KeyId(key_id))?;
        tracing::info!(key = %key_id, uid = caller.uid, "access key revoked");
        Ok(())
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn version(&self) -> String {
        env!("CARGO_PKG_VERSION").to_owned()
    }

    /// The configuration file in force.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn config_file(&self) -> String {
        self.ctx.engine.config_path().display().to_string()
    }

    /// When the daemon started, in microseconds since the Unix epoch.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn start_timestamp(&self) -> u64 {
        wire::usec(self.ctx.engine.started())
    }

    #[zbus(property(emits_changed_signal = "const"), name = "NDevices")]
    async fn n_devices(&self) -> u32 {
        u32::try_from(self.ctx.engine.device_names().len()).unwrap_or(u32::MAX)
    }

    /// Successful configuration reloads since start.
    #[zbus(property(emits_changed_signal = "false"), name = "NReloads")]
    async fn n_reloads(&self) -> u32 {
        self.ctx.engine.reload_count()
    }

    /// Open sessions (of all users).
    #[zbus(property(emits_changed_signal = "false"), name = "NSessions")]
    async fn n_sessions(&self) -> u32 {
        settled(&self.ctx.engine).await;
        u32::try_from(self.ctx.engine.counts().sessions).unwrap_or(u32::MAX)
    }

    /// Live objects: the daemon's (`sessions`, `regions`, `keys`, `warm_regions`) and the
    /// providers' (`pds`, `mrs`, `mws`, `cqs`, `qps`, the daemon's own PDs and warm regions
    /// included), and `lingering`: registrations and windows a device refused to destroy
    /// (counted among `mrs` and `mws` too; listed by each device's `LingeringObjects`).
    /// Tests and operators use it to see that everything is released.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn object_counts(&self) -> HashMap<String, u64> {
        settled(&self.ctx.engine).await;
        let engine = &self.ctx.engine;
        let counts = engine.counts();
        let p = engine.provider_counts();
        let warm: u64 = engine
            .pool_snapshots()
            .iter()
            .map(|p| p.stats.warm_regions)
            .sum();
        [
            ("sessions", counts.sessions as u64),
            ("regions", counts.regions as u64),
            ("keys", counts.keys as u64),
            ("queue_pairs", counts.qps as u64),
            ("warm_regions", warm),
            ("pds", p.pds),
            ("mrs", p.mrs),
            ("mws", p.mws),
            ("cqs", p.cqs),
            ("qps", p.qps),
            ("lingering", engine.lingering().len() as u64),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// Allocated regions (of all users).
    #[zbus(property(emits_changed_signal = "false"), name = "NRegions")]
    async fn n_regions(&self) -> u32 {
        settled(&self.ctx.engine).await;
        u32::try_from(self.ctx.engine.counts().regions).unwrap_or(u32::MAX)
    }
}
