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
use crate::engine::{AttachMode, RegionId, Removed};

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
        self.ctx.engine.registry.free(&caller, self.id)?;
        let removed = Removed {
            regions: vec![self.id],
            ..Removed::default()
        };
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
        let (token, key) = self.ctx.engine.registry.share(
            &self.ctx.config(),
            &caller,
            self.id,
            access,
            lifetime,
        )?;
        tracing::info!(
            region = self.id,
            key,
            access = access.as_str(),
            "access key created"
        );
        Ok((token, key))
    }

    /// Revokes one of this region's keys (new attaches stop; live attachments stay).
    async fn revoke_key(
        &self,
        key_id: u64,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let info = self
            .ctx
            .engine
            .registry
            .region(&self.ctx.config(), &caller, self.id)?;
        if !info.keys.iter().any(|k| k.id == key_id) {
            return Err(Error::NoSuchObject(format!(
                "region {} has no key {key_id}",
                self.id
            )));
        }
        self.ctx
            .engine
            .registry
            .revoke(&self.ctx.config(), &caller, key_id)?;
        Ok(())
    }

    /// Ends the caller's attachment of this region.
    async fn detach(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<(), Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        Ok(self.ctx.engine.registry.detach(&caller, self.id)?)
    }

    async fn get_info(
        &self,
        #[zbus(header)] header: Header<'_>,
        #[zbus(connection)] connection: &Connection,
    ) -> Result<RegionInfo, Error> {
        let caller = self.ctx.caller(connection, &header).await?;
        let info = self
            .ctx
            .engine
            .registry
            .region(&self.ctx.config(), &caller, self.id)?;
        Ok(wire::region(&info))
    }
}
