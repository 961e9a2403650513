//! Allocating and freeing regions from the pools.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::*;

impl Registry {
    /// Removes a region with its keys, attachments and exports; returns its registration
    /// and windows to drop.
    pub(super) fn remove_region(s: &mut State, id: RegionId) -> Option<Garbage> {
        let mut stale = BTreeSet::new();
        let garbage = Self::take_region(s, id, &mut stale);
        Self::refresh_all(s, stale);
        garbage
    }

    /// [`Registry::remove_region`], leaving the rights of the sessions that could reach the
    /// region to rebuild (added to `stale`): a teardown of many regions rebuilds each
    /// session's rights once, not once per region, before it lets go of the lock.
    pub(super) fn take_region(
        s: &mut State,
        id: RegionId,
        stale: &mut BTreeSet<SessionId>,
    ) -> Option<Garbage> {
        let mut garbage = Garbage::default();
        let registrations = s.regions.get(&id)?.registrations.clone();
        for registration in registrations {
            Self::remove_registration(s, registration, &mut garbage);
        }
        let region = s.regions.remove(&id)?;
        // Windows bound through queue pairs still served (those of removed queue pairs
        // were taken out with them).
        for (qp, export) in &region.exports {
            if let Some(record) = s.qps.get(qp) {
                if let Some(e) = lock(&record.exports).remove(export) {
                    garbage.windows.push(TakenWindow::new(e, record));
                }
            }
        }
        for key in &region.keys {
            s.keys.remove(key);
        }
        for session in region.attached.keys() {
            if let Some(attacher) = s.sessions.get_mut(session) {
                attacher.attachments.remove(&id);
            }
            stale.insert(*session);
        }
        if let Some(owner) = s.sessions.get_mut(&region.session) {
            owner.regions.remove(&id);
        }
        stale.insert(region.session);
        let size = region.size();
        // Keys and windows are gone now; the region's bytes count until its memory is.
        if let Some(usage) = s.usage.get_mut(&region.owner_uid) {
            usage.sub(QuotaKind::Keys, region.keys.len() as u64);
            usage.sub(QuotaKind::Exports, region.exports.len() as u64);
        }
        // This teardown's registrations are the region's (taken out above).
        let domain_registrations = garbage.registrations.iter().map(Arc::downgrade).collect();
        garbage.freed.push(Freed {
            mr: region.mr,
            domain_registrations,
            settlement: Some(Settlement {
                uid: region.owner_uid,
                size,
                pool: region.pool,
            }),
        });
        Some(garbage)
    }

    /// Allocates a region of `size` bytes from `pool` into `session` (`owner`'s), within
    /// `limits` and if `pools` admits `pool`.
    pub fn allocate(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
    ) -> Result<Handout, EngineError> {
        self.allocate_from(owner, limits, pools, session, pool, size, false)
            .map(|handout| handout.expect("a pool that may make a region always hands one out"))
    }

    /// Like [`Registry::allocate`], but only from the pool's warm set: `Ok(None)` (and
    /// nothing changed) when no warm region of the size is ready.
    pub fn allocate_warm(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
    ) -> Result<Option<Handout>, EngineError> {
        self.allocate_from(owner, limits, pools, session, pool, size, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn allocate_from(
        &self,
        owner: &Owner,
        limits: &Limits,
        pools: &PoolAccess,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
        warm_only: bool,
    ) -> Result<Option<Handout>, EngineError> {
        check_pool_access(pool, pools)?;
        let rounded = pool.round(size)?;
        {
            let mut s = self.lock();
            Self::own_session(&mut s, owner, session)?;
            let usage = s.usage.entry(owner.uid).or_default();
            tenancy::check(limits, usage, QuotaKind::Regions, 1)?;
            tenancy::check(limits, usage, QuotaKind::RegisteredBytes, rounded)?;
            usage.add(QuotaKind::Regions, 1);
            usage.add(QuotaKind::RegisteredBytes, rounded);
        }
        let unreserve = |registry: &Registry| {
            registry.unreserve(
                owner.uid,
                &[
                    (QuotaKind::Regions, 1),
                    (QuotaKind::RegisteredBytes, rounded),
                ],
            )
        };
        let taken = if warm_only {
            pool.take_warm(rounded)
        } else {
            pool.allocate(rounded).map(Some)
        };
        let allocation = match taken {
            Ok(Some(a)) => a,
            Ok(None) => {
                unreserve(self);
                return Ok(None);
            }
            Err(e) => {
                unreserve(self);
                return Err(e.into());
            }
        };
        tracing::debug!(
            size = rounded,
            warm = allocation.warm,
            pool = pool.name(),
            "registration taken from the pool"
        );
        let mr = allocation.mr;
        let fd = match mr.memory().fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(e) => {
                unreserve(self);
                pool.release(rounded);
                return Err(EngineError::os("cannot duplicate the region's memfd", e));
            }
        };
        let mut s = self.lock();
        // The session may have been closed while the region was being made.
        if Self::own_session(&mut s, owner, session).is_err() {
            drop(s);
            unreserve(self);
            pool.release(rounded);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed during the allocation)"
            )));
        }
        s.last_region = s.last_region.next();
        let id = s.last_region;
        s.sessions
            .get_mut(&session)
            .expect("checked above")
            .regions
            .insert(id);
        s.regions.insert(
            id,
            Region {
                session,
                owner_uid: owner.uid,
                pool: Arc::clone(pool),
                requested: size,
                mr,
                keys: BTreeSet::new(),
                attached: BTreeMap::new(),
                exports: BTreeSet::new(),
                registrations: BTreeSet::new(),
            },
        );
        Self::refresh_rights(&s, session);
        Ok(Some(Handout {
            region: id,
            fd,
            size: rounded,
            access: AttachMode::ReadWrite,
        }))
    }

    /// The region, if `owner`'s connection owns it (through its session).
    pub(super) fn own_region<'a>(
        s: &'a State,
        owner: &Owner,
        id: RegionId,
    ) -> Result<&'a Region, EngineError> {
        let region = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        let holder = s
            .sessions
            .get(&region.session)
            .map(|x| x.owner.connection.as_str());
        if holder != Some(owner.connection.as_str()) {
            return Err(not_authorized(format!(
                "region {id} belongs to another session; only its owner may do this"
            )));
        }
        Ok(region)
    }

    /// Frees a region: its keys die, its attachments end, its registration is dropped and
    /// its memory is never handed out again.
    pub fn free(&self, owner: &Owner, id: RegionId) -> Result<Teardown<'_>, EngineError> {
        let mut s = self.lock();
        Self::own_region(&s, owner, id)?;
        let garbage = Self::remove_region(&mut s, id).unwrap_or_default();
        let removed = Removed {
            regions: vec![id],
            ..Removed::default()
        };
        Ok(self.teardown(s, removed, garbage))
    }

    /// The registration of a region `owner`'s connection owns, and its device.
    pub fn own_region_mr(
        &self,
        owner: &Owner,
        id: RegionId,
    ) -> Result<(Arc<dyn MemoryRegion>, String), EngineError> {
        let s = self.lock();
        let r = Self::own_region(&s, owner, id)?;
        Ok((Arc::clone(&r.mr), r.pool.device.clone()))
    }

    /// The region's registration.
    #[cfg(test)]
    pub fn region_mr(&self, id: RegionId) -> Option<Arc<dyn MemoryRegion>> {
        self.lock().regions.get(&id).map(|r| Arc::clone(&r.mr))
    }
}

/// Refuses a pool `pools` does not admit, with the policy's reason.
pub(super) fn check_pool_access(pool: &Pool, pools: &PoolAccess) -> Result<(), EngineError> {
    match pools.refusal(pool.name()) {
        None => Ok(()),
        Some(reason) => Err(not_authorized(reason)),
    }
}
