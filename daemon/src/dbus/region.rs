//! `/org/rdmad1/region/<n>`, interface `org.rdmad1.Region`. The owning session's
//! connection frees and shares it; a session that attached it may detach.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdmad_client::types::RegionInfo;
use rdmad_client::Error;
use zbus::message::Header;
use zbus::object_server::ObjectServer;
use zbus::zvariant::OwnedValue;
use zbus::{interface, Connection};

use super::context::Context;
use super::options::Options;
use super::wire;
use crate::engine::{
    Access, AttachMode, ExportId, KeyId, QpId, RegionId, RegistrationId, RemoteRights, Span,
};

pub struct RegionObject {
    ctx: Arc<Context>,
    id: RegionId,
}

impl RegionObject {
    pub fn new(ctx: Arc<Context>, id: RegionId) -> RegionObject {
        RegionObject { ctx, id }
    }
}

#[interface(name = "org.rdmad1.Region")]
impl RegionObject {
    /// Frees the region: its keys die, attachments end, its memory is never reused.
    async fn free(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
        #[zbus(object_server)] server: &ObjectServer,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        let removed = self
            .ctx
            .blocking(move |e| e.free(&caller.owner(), id))
            .await??;
        self.ctx.withdraw(server, &removed).await;
        Ok(())
    }

    /// Creates an access key. Options: `access` (`"ro"` or `"rw"`, default `"ro"`),
    /// `expires_in` (seconds). Returns the token (give it to the other process) and the
    /// key's id (to revoke it).
    async fn share(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(String, u64), Error> {
        let opts = Options::new("Share", &options, &["access", "expires_in"])?;
        let access = match opts.string("access")?.as_deref() {
            None => AttachMode::ReadOnly,
            Some(s) => AttachMode::parse(s).ok_or_else(|| {
                Error::InvalidArgument(format!("Share: access must be \"ro\" or \"rw\", not {s:?}"))
            })?,
        };
        let lifetime = opts.unsigned("expires_in")?.map(Duration::from_secs);
        let caller = self.ctx.caller(connection, &header).await?;
        let limits = self.ctx.grants(&caller).await?.limits.clone();
        let (token, key) =
            self.ctx
                .engine
                .share(&caller.owner(), &limits, self.id, access, lifetime)?;
        tracing::info!(
            region = %self.id,
            key = %key,
            access = access.as_str(),
            "access key created"
        );
        Ok((token, key.0))
    }

    /// Makes the region reachable by the peer of queue pair `qp` (yours, connected, on the
    /// region's device): binds a type-2 memory window over the whole region through it.
    /// Option `access`: any of `r` (RDMA READ), `w` (RDMA WRITE), `a` (atomics); default
    /// `"rw"`. Returns `(addr, rkey, length, export id)`; give the peer the first three.
    /// `ReleaseExport`, freeing the region, destroying the QP or ending the session
    /// invalidates the rkey.
    async fn export_remote(
        &self,
        qp: zbus::zvariant::ObjectPath<'_>,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(u64, u32, u64, u64), Error> {
        let opts = Options::new("ExportRemote", &options, &["access"])?;
        let letters = opts.string("access")?.unwrap_or_else(|| "rw".to_owned());
        let mut access = RemoteRights::default();
        for c in letters.chars() {
            match c {
                'r' => access.read = true,
                'w' => access.write = true,
                'a' => access.atomic = true,
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "ExportRemote: access {letters:?}: use letters r, w and a"
                    )))
                }
            }
        }
        if access == RemoteRights::default() {
            return Err(Error::InvalidArgument(
                "ExportRemote: access must grant something".into(),
            ));
        }
        let qp_id = rdmad_client::names::object_id(qp.as_str())
            .filter(|_| qp.as_str().starts_with(rdmad_client::names::QP_PATH_PREFIX))
            .ok_or_else(|| Error::InvalidArgument(format!("{qp} is not a queue pair's path")))?;
        let caller = self.ctx.caller(connection, &header).await?;
        let (id, limits) = (self.id, self.ctx.grants(&caller).await?.limits.clone());
        // The bind waits for the queue pair's send queue to reach it: a thread at most
        // `WINDOW_WORK_PER_USER` of the caller's calls hold at once.
        let turn = self.ctx.window_work.take(caller.uid).await?;
        let export = self
            .ctx
            .blocking(move |e| e.export_remote(&caller.owner(), &limits, id, QpId(qp_id), access))
            .await??;
        drop(turn);
        tracing::info!(
            region = %self.id,
            qp = %qp_id,
            export = %export.export,
            "region exported"
        );
        Ok((export.addr, export.rkey, export.len, export.export.0))
    }

    /// Registers part of the region in a protection domain of the session's own, under
    /// an address of the caller's choosing and with remote rights of its own: what a verbs
    /// program's `ibv_reg_mr` is. Options: `domain` (`u`, required, from 1: the session's
    /// name for the domain; queue pairs created with the same `domain` use it), `offset`
    /// and `length` (`t`: the part of the region, default all of it), `iova` (`t`: the
    /// address work requests and peers name its first byte by, default the offset),
    /// `access` (any of `l` local write, `r` remote read, `w` remote write, `a` remote
    /// atomics; default `"l"`; `w` and `a` need `l`). Returns `(registration, lkey,
    /// rkey)`: the rkey works through the session's queue pairs in that domain only, at
    /// once and until `Deregister`, `Free` or the end of the session.
    async fn register(
        &self,
        options: HashMap<String, OwnedValue>,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(u64, u32, u32), Error> {
        let opts = Options::new(
            "Register",
            &options,
            &["domain", "offset", "length", "iova", "access"],
        )?;
        let invalid = |what: String| Error::InvalidArgument(format!("Register: {what}"));
        let domain = opts
            .unsigned("domain")?
            .ok_or_else(|| invalid("option \"domain\" is required (a number from 1)".into()))?;
        let domain = u32::try_from(domain)
            .ok()
            .filter(|d| *d > 0)
            .ok_or_else(|| invalid(format!("domain {domain} is not a number from 1 to 2^32-1")))?;
        let letters = opts.string("access")?.unwrap_or_else(|| "l".to_owned());
        let mut access = Access::NONE;
        for c in letters.chars() {
            access = access
                | match c {
                    'l' => Access::LOCAL_WRITE,
                    'r' => Access::REMOTE_READ,
                    'w' => Access::REMOTE_WRITE,
                    'a' => Access::REMOTE_ATOMIC,
                    _ => {
                        return Err(invalid(format!(
                            "access {letters:?}: use letters l, r, w and a"
                        )))
                    }
                };
        }
        let offset = opts.unsigned("offset")?.unwrap_or(0);
        let length = opts.unsigned("length")?;
        let iova = opts.unsigned("iova")?;
        let caller = self.ctx.caller(connection, &header).await?;
        let grants = self.ctx.grants(&caller).await?;
        let (id, limits, scope) = (self.id, grants.limits.clone(), grants.scope);
        let handout = self
            .ctx
            .blocking(move |e| {
                let size = e.region(&caller.owner(), scope, id)?.size;
                let length = length.unwrap_or(size.saturating_sub(offset));
                let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(length))
                else {
                    return Err(crate::engine::EngineError::InvalidArgument(format!(
                        "Register: offset {offset} and length {length} do not fit region {id}"
                    )));
                };
                let span = Span {
                    offset,
                    len,
                    iova: iova.unwrap_or(offset as u64),
                };
                e.register(&caller.owner(), &limits, id, domain, span, access)
            })
            .await??;
        tracing::debug!(
            region = %self.id,
            registration = %handout.registration,
            domain,
            access = ?access,
            "region registered in a domain of its session's"
        );
        Ok((handout.registration.0, handout.lkey, handout.rkey))
    }

    /// Removes a registration `Register` made: its rkey stops working.
    async fn deregister(
        &self,
        registration: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        Ok(self
            .ctx
            .blocking(move |e| e.deregister(&caller.owner(), id, RegistrationId(registration)))
            .await??)
    }

    /// Invalidates an export: the rkey it gave stops working.
    async fn release_export(
        &self,
        export_id: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let id = self.id;
        // As `export_remote`'s bind, the invalidation waits for the send queue.
        let turn = self.ctx.window_work.take(caller.uid).await?;
        let released = self
            .ctx
            .blocking(move |e| e.release_export(&caller.owner(), id, ExportId(export_id)))
            .await?;
        drop(turn);
        Ok(released?)
    }

    /// Revokes one of this region's keys (new attaches stop; live attachments stay).
    async fn revoke_key(
        &self,
        key_id: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        Ok(self
            .ctx
            .engine
            .revoke_of_region(&caller.owner(), scope, self.id, KeyId(key_id))?)
    }

    /// Ends the caller's attachment of this region.
    async fn detach(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        Ok(self.ctx.engine.detach(&caller.owner(), self.id)?)
    }

    async fn get_info(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<RegionInfo, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let scope = self.ctx.scope(&caller).await?;
        let info = self.ctx.engine.region(&caller.owner(), scope, self.id)?;
        Ok(wire::region(&info))
    }
}
