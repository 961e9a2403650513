//! Sessions, regions, access keys and quota reports, for owners the policy layer named.

use super::*;

/// How often an allocation refused for want of room waits for queued releases and tries
/// again before the refusal stands.
const SETTLE_ATTEMPTS: u32 = 16;

/// Whether `e` refused an allocation for want of room (a quota, a full pool), which memory
/// still being released may give back.
fn wants_room(e: &EngineError) -> bool {
    matches!(
        e,
        EngineError::Quota(_) | EngineError::Pool(PoolError::Exhausted { .. })
    )
}

impl Engine {
    /// Opens a session for `owner`, within `limits`.
    pub fn open_session(&self, owner: &Owner, limits: &Limits) -> Result<SessionId, EngineError> {
        self.registry.open_session(owner, limits)
    }

    /// Closes session `id` (`owner`'s user's, or anyone's in scope `All`); returns what
    /// was removed with it.
    pub fn close_session(
        &self,
        owner: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<Removed, EngineError> {
        let teardown = self.registry.close_session(owner, scope, id)?;
        Ok(self.release(teardown))
    }

    /// Closes every session of a bus connection that left the bus; returns what was
    /// removed.
    pub fn close_sessions_of(&self, connection: &str) -> Removed {
        self.release(self.registry.close_sessions_of(connection))
    }

    /// Closes every session (the bus is going away); returns what was removed.
    pub fn close_all(&self) -> Removed {
        self.release(self.registry.close_all())
    }

    pub fn session(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: SessionId,
    ) -> Result<SessionInfo, EngineError> {
        self.registry.session(viewer, scope, id)
    }

    pub fn sessions(&self, viewer: &Owner, scope: Scope) -> Vec<SessionInfo> {
        self.registry.sessions(viewer, scope)
    }

    // Regions and keys.

    /// Allocates a region of at least `size` bytes from pool `pool` into `session`
    /// (`owner`'s), within `limits` and if `pools` admits the pool.
    pub fn allocate(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &str,
        size: u64,
    ) -> Result<Handout, EngineError> {
        let pool = self.pool(pool)?;
        let mut waits = 0;
        let mut looked_at_kept = false;
        loop {
            let releasing = self.releaser.pending();
            match self
                .registry
                .allocate(owner, limits, pools, session, pool, size)
            {
                // Memory on its way out still counts: wait for it, then try again. Others
                // may take the room first (a user's many clients freeing and allocating at
                // once), so this repeats while releases are queued, a bounded number of
                // times. Registrations kept for requests in flight may have been let go
                // since the release thread last looked: one look at them, not more (they
                // may be kept for ever).
                Err(e) if waits < SETTLE_ATTEMPTS && wants_room(&e) => {
                    crate::test_hooks::refused_allocation();
                    let look = !looked_at_kept && self.releaser.kept() > 0;
                    if !self.room_on_its_way(releasing) && !look {
                        return Err(e);
                    }
                    looked_at_kept |= look;
                    waits += 1;
                    self.settled();
                }
                result => return result,
            }
        }
    }

    /// [`Engine::allocate`] from the pool's warm set alone, which never waits: no device
    /// call, no wait for memory on its way out — locks held only for bookkeeping, so it
    /// may run on a thread that serves the bus. `Ok(None)` when that is not enough (no
    /// warm region of the size is ready, or the quota or pool has room only once released
    /// memory is gone): then [`Engine::allocate`], off the bus threads.
    pub fn allocate_warm(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &str,
        size: u64,
    ) -> Result<Option<Handout>, EngineError> {
        let pool = self.pool(pool)?;
        let releasing = self.releaser.pending();
        match self
            .registry
            .allocate_warm(owner, limits, pools, session, pool, size)
        {
            Err(e)
                if wants_room(&e)
                    && (self.room_on_its_way(releasing) || self.releaser.kept() > 0) =>
            {
                Ok(None)
            }
            result => result,
        }
    }

    /// Whether an allocation refused for want of room may find it once the releases of
    /// freed memory are done (`settled`): some were under way when the attempt began
    /// (`releasing`), or are now. Both looks count: a release that ends between the
    /// refusal and the second look gave the room back all the same.
    fn room_on_its_way(&self, releasing: bool) -> bool {
        releasing || self.releaser.pending()
    }

    /// Frees region `id` (`owner`'s connection's); returns what was removed. Returns once
    /// nothing can reach the region any more; its registration and memory are released
    /// behind the return (see `releaser`).
    pub fn free(&self, owner: &Owner, id: RegionId) -> Result<Removed, EngineError> {
        let teardown = self.registry.free(owner, id)?;
        Ok(self.release_later(teardown))
    }

    /// Registers `span` of region `id` (`owner`'s connection's; offsets into the region,
    /// `span.iova` the address requests and peers name it by) in domain `number` of the
    /// region's session on the region's device, with `access` (remote rights included),
    /// within the `registrations` limit of `limits`. Its rkey works through the session's
    /// queue pairs in that domain, and no other queue pair.
    pub fn register(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: RegionId,
        number: u32,
        span: Span,
        access: Access,
    ) -> Result<RegistrationHandout, EngineError> {
        if number == 0 {
            return Err(EngineError::InvalidArgument(
                "domain 0 is the daemon's own protection domain: a session's domains are \
                 numbered from 1"
                    .into(),
            ));
        }
        access
            .check_consistent()
            .map_err(EngineError::InvalidArgument)?;
        let (_, device) = self.registry.own_region_mr(owner, id)?;
        let entry = self.device(&device)?;
        self.registry
            .register(owner, limits, id, (entry, number), span, access)
    }

    /// Removes registration `registration` of region `id` (`owner`'s connection's); once
    /// this returns its rkey reaches nothing (but for requests of the session's own still
    /// running that use it: it goes when they complete).
    pub fn deregister(
        &self,
        owner: &Owner,
        id: RegionId,
        registration: RegistrationId,
    ) -> Result<(), EngineError> {
        let teardown = self.registry.deregister(owner, id, registration)?;
        self.release(teardown);
        Ok(())
    }

    /// Creates an access key for region `id` (`owner`'s connection's), within `limits`;
    /// returns the token and the key's id.
    pub fn share(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: RegionId,
        access: AttachMode,
        lifetime: Option<Duration>,
    ) -> Result<(String, KeyId), EngineError> {
        self.registry.share(owner, limits, id, access, lifetime)
    }

    /// Revokes key `key` (its region's owner's, or anyone's in scope `All`).
    pub fn revoke(&self, owner: &Owner, scope: Scope, key: KeyId) -> Result<(), EngineError> {
        self.registry.revoke(owner, scope, key)
    }

    /// Revokes key `key` of region `region`, which `viewer` must see.
    pub fn revoke_of_region(
        &self,
        owner: &Owner,
        scope: Scope,
        region: RegionId,
        key: KeyId,
    ) -> Result<(), EngineError> {
        let info = self.registry.region(owner, scope, region)?;
        if !info.keys.iter().any(|k| k.id == key) {
            return Err(EngineError::NoSuchObject(format!(
                "key {key} of region {region}"
            )));
        }
        self.registry.revoke(owner, scope, key)
    }

    /// Attaches the region `token` grants to `session` (`owner`'s), if `pools` admits its
    /// pool.
    pub fn attach(
        &self,
        owner: &Owner,
        pools: &PoolAccess,
        session: SessionId,
        token: &str,
    ) -> Result<Handout, EngineError> {
        self.registry.attach(owner, pools, session, token)
    }

    /// Ends the attachment of region `id` to a session of `owner`'s connection.
    pub fn detach(&self, owner: &Owner, id: RegionId) -> Result<(), EngineError> {
        self.registry.detach(owner, id)
    }

    pub fn region(
        &self,
        viewer: &Owner,
        scope: Scope,
        id: RegionId,
    ) -> Result<RegionInfo, EngineError> {
        self.registry.region(viewer, scope, id)
    }

    pub fn regions(&self, viewer: &Owner, scope: Scope) -> Vec<RegionInfo> {
        self.registry.regions(viewer, scope)
    }

    // Quotas.

    /// The limits of the user `limits` are for, next to its live use.
    pub fn quota(&self, limits: &Limits) -> Vec<QuotaLine> {
        self.registry.quota(limits)
    }
}
