//! `/org/rdmad1/session/<n>`, interface `org.rdmad1.Session`. Only the connection that
//! opened a session may use it; its user (or an administrator) may look at it and close it.

use std::collections::HashMap;
use std::sync::Arc;

use rdmad_client::names::region_path;
use rdmad_client::types::{RingInfo, SessionInfo};
use rdmad_client::Error;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::{OwnedFd, OwnedObjectPath, OwnedValue};
use zbus::{interface, Connection};

use super::context::Context;
use super::options::Options;
use super::wire;
use crate::engine::{QpOptions, SessionId};
use crate::policy;

pub struct SessionObject {
    ctx: Arc<Context>,
    id: SessionId,
}

impl SessionObject {
    pub fn new(ctx: Arc<Context>, id: SessionId) -> SessionObject {
        SessionObject { ctx, id }
    }
}

#[interface(name = "org.rdmad1.Session")]
impl SessionObject {
    /// Ends the session: its regions are freed, its attachments end.
    async fn close(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, uid, config) = (self.id, caller.uid, self.ctx.config());
        let removed = self
            .ctx
            .blocking(move |e| {
                e.close_session(&caller.owner(), policy::scope(&caller, &config), id)
            })
            .await??;
        tracing::info!(
            session = %self.id,
            uid,
            regions = removed.regions.len(),
            "session closed"
        );
        self.ctx.withdraw(server, &removed).await;
        Ok(())
    }

    /// Allocates a region of at least `size` bytes from `pool`. Returns its object, a
    /// read-write memfd to map (`MAP_SHARED`) and its size.
    async fn allocate_region(
        &self,
        pool: &str,
        size: u64,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64), Error> {
        Options::new("AllocateRegion", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, config, allocating, pool) =
            (self.id, self.ctx.config(), caller.clone(), pool.to_owned());
        let handout = self
            .ctx
            .blocking(move |e| {
                let limits = policy::limits(&allocating, &config);
                let pools = policy::pool_access(&allocating, &e.pool_configs());
                e.allocate(&allocating.owner(), &limits, &pools, id, &pool, size)
            })
            .await??;
        self.ctx
            .publish_region(server, &caller, handout.region)
            .await?;
        tracing::debug!(
            session = %self.id,
            region = %handout.region,
            size = handout.size,
            "region allocated"
        );
        Ok((
            wire::path(region_path(handout.region.0)),
            OwnedFd::from(handout.fd),
            handout.size,
        ))
    }

    /// Attaches the region an access key grants. Returns its object, a memfd (opened
    /// read-only for an `ro` key), its size and the access, `ro` or `rw`.
    async fn attach_region(
        &self,
        key: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(OwnedObjectPath, OwnedFd, u64, String), Error> {
        Options::new("AttachRegion", &options, &[])?;
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, key) = (self.id, key.to_owned());
        let handout = self
            .ctx
            .blocking(move |e| {
                let pools = policy::pool_access(&caller, &e.pool_configs());
                e.attach(&caller.owner(), &pools, id, &key)
            })
            .await??;
        tracing::info!(
            session = %self.id,
            region = %handout.region,
            access = handout.access.as_str(),
            "region attached"
        );
        Ok((
            wire::path(region_path(handout.region.0)),
            OwnedFd::from(handout.fd),
            handout.size,
            handout.access.as_str().to_owned(),
        ))
    }

    /// Creates an RC queue pair (and its CQ) on `device`. Options (`u`): `send_depth`,
    /// `recv_depth` (default 128), `max_sge` (default 4), `domain` (a protection domain of
    /// the session's own, from 1, as `Region.Register` takes it: the queue pair's requests
    /// then use the registrations in that domain, and its peer reaches their rkeys).
    /// Returns its object, the ring memfd
    /// (map it shared, read-write), the doorbell (the write end of a pipe: write a byte
    /// after submitting when the ring asks for a wake-up), the completion channel (the read
    /// end of a pipe, readable when completions arrive), and the ring's size and depths.
    async fn create_queue_pair(
        &self,
        device: &str,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(OwnedObjectPath, OwnedFd, OwnedFd, OwnedFd, RingInfo), Error> {
        let opts = Options::new(
            "CreateQueuePair",
            &options,
            &[
                "send_depth",
                "recv_depth",
                "max_sge",
                "max_inline",
                "domain",
            ],
        )?;
        let mut qp_options = QpOptions::default();
        let narrow = |key: &str, value: u64| {
            u32::try_from(value).map_err(|_| {
                Error::InvalidArgument(format!("CreateQueuePair: {key} {value} is too large"))
            })
        };
        for (key, slot) in [
            ("send_depth", &mut qp_options.send_depth),
            ("recv_depth", &mut qp_options.recv_depth),
            ("max_sge", &mut qp_options.max_sge),
            ("max_inline", &mut qp_options.max_inline),
        ] {
            if let Some(v) = opts.unsigned(key)? {
                *slot = narrow(key, v)?;
            }
        }
        if let Some(domain) = opts.unsigned("domain")? {
            qp_options.domain = Some(u32::try_from(domain).ok().filter(|d| *d > 0).ok_or_else(
                || {
                    Error::InvalidArgument(format!(
                        "CreateQueuePair: domain {domain} is not a number from 1 to 2^32-1"
                    ))
                },
            )?);
        }
        let caller = self.ctx.caller(connection, &header).await?;
        let (session, creating, on, config) = (
            self.id,
            caller.clone(),
            device.to_owned(),
            self.ctx.config(),
        );
        let q = self
            .ctx
            .blocking(move |e| {
                let limits = policy::limits(&creating, &config);
                e.create_qp(&creating.owner(), &limits, session, &on, qp_options)
            })
            .await??;
        let id = q.id;
        self.ctx.publish_qp(server, &caller, id).await?;
        tracing::info!(
            session = %self.id,
            qp = %id,
            qpn = q.qp_num,
            device,
            "queue pair created"
        );
        Ok((
            wire::path(rdmad_client::names::qp_path(id.0)),
            OwnedFd::from(q.ring),
            OwnedFd::from(q.doorbell),
            OwnedFd::from(q.completion),
            RingInfo {
                size: q.ring_size,
                sq_entries: q.sq_entries,
                cq_entries: q.cq_entries,
            },
        ))
    }

    async fn get_info(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<SessionInfo, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = policy::scope(&caller, &self.ctx.config());
        let info = self.ctx.engine.session(&caller.owner(), scope, self.id)?;
        Ok(wire::session(&info))
    }
}
