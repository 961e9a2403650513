//! Allocating and freeing regions from the pools.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::*;

impl Registry {
    /// Removes a region with its keys, attachments and exports; returns its registration
    /// and windows to drop.
    pub(super) fn remove_region(s: &mut State, id: RegionId) -> Option<Garbage> {
        let region = s.regions.remove(&id)?;
        let mut garbage = Garbage::default();
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
        }
        if let Some(owner) = s.sessions.get_mut(&region.session) {
            owner.regions.remove(&id);
        }
        let size = region.size();
        if let Some(usage) = s.usage.get_mut(&region.owner_uid) {
            usage.sub(QuotaKind::Regions, 1);
            usage.sub(QuotaKind::RegisteredBytes, size);
            usage.sub(QuotaKind::Keys, region.keys.len() as u64);
            usage.sub(QuotaKind::Exports, region.exports.len() as u64);
        }
        region.pool.release(size);
        Self::forget_idle_user(s, region.owner_uid);
        garbage.mrs.push(region.mr);
        Some(garbage)
    }

    /// Allocates a region of `size` bytes from `pool` into `session`.
    pub fn allocate(
        &self,
        config: &Config,
        caller: &Caller,
        session: SessionId,
        pool: &Arc<Pool>,
        size: u64,
    ) -> Result<Handout, EngineError> {
        check_pool_access(pool, caller)?;
        let rounded = pool.round(size)?;
        let limits = quota::limits_for(config, caller.uid, &caller.gids);
        {
            let mut s = self.lock();
            Self::own_session(&mut s, caller, session)?;
            let usage = s.usage.entry(caller.uid).or_default();
            quota::check(&limits, usage, QuotaKind::Regions, 1)?;
            quota::check(&limits, usage, QuotaKind::RegisteredBytes, rounded)?;
            usage.add(QuotaKind::Regions, 1);
            usage.add(QuotaKind::RegisteredBytes, rounded);
        }
        let unreserve = |registry: &Registry| {
            registry.unreserve(
                caller.uid,
                &[
                    (QuotaKind::Regions, 1),
                    (QuotaKind::RegisteredBytes, rounded),
                ],
            )
        };
        let allocation = match pool.allocate(rounded) {
            Ok(a) => a,
            Err(e) => {
                unreserve(self);
                return Err(e.into());
            }
        };
        let mr = allocation.mr;
        let fd = match mr.memory().fd().try_clone_to_owned() {
            Ok(fd) => fd,
            Err(e) => {
                unreserve(self);
                pool.release(rounded);
                return Err(EngineError::Io(format!(
                    "cannot duplicate the region's memfd: {e}"
                )));
            }
        };
        let mut s = self.lock();
        // The session may have been closed while the region was being made.
        if Self::own_session(&mut s, caller, session).is_err() {
            drop(s);
            unreserve(self);
            pool.release(rounded);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed during the allocation)"
            )));
        }
        s.last_region += 1;
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
                owner_uid: caller.uid,
                pool: Arc::clone(pool),
                requested: size,
                mr,
                keys: BTreeSet::new(),
                attached: BTreeMap::new(),
                exports: BTreeSet::new(),
            },
        );
        Ok(Handout {
            region: id,
            fd,
            size: rounded,
            access: AttachMode::ReadWrite,
        })
    }

    /// The region, if `caller`'s connection owns it (through its session).
    pub(super) fn own_region<'a>(
        s: &'a State,
        caller: &Caller,
        id: RegionId,
    ) -> Result<&'a Region, EngineError> {
        let region = s
            .regions
            .get(&id)
            .ok_or(EngineError::NoSuchObject(format!("region {id}")))?;
        let owner = s
            .sessions
            .get(&region.session)
            .map(|x| x.owner.bus_name.as_str());
        if owner != Some(caller.bus_name.as_str()) {
            return Err(not_authorized(format!(
                "region {id} belongs to another session; only its owner may do this"
            )));
        }
        Ok(region)
    }

    /// Frees a region: its keys die, its attachments end, its registration is dropped and
    /// its memory is never handed out again.
    pub fn free(&self, caller: &Caller, id: RegionId) -> Result<(), EngineError> {
        let mut s = self.lock();
        Self::own_region(&s, caller, id)?;
        let garbage = Self::remove_region(&mut s, id);
        drop(s);
        if let Some(g) = garbage {
            self.release(&[], g);
        }
        Ok(())
    }

    /// The registration of a region the caller's connection owns, and its device.
    pub fn own_region_mr(
        &self,
        caller: &Caller,
        id: RegionId,
    ) -> Result<(Arc<dyn MemoryRegion>, String), EngineError> {
        let s = self.lock();
        let r = Self::own_region(&s, caller, id)?;
        Ok((Arc::clone(&r.mr), r.pool.device.clone()))
    }

    /// The region's registration, for the data path (same visibility as `region`).
    pub fn region_mr(&self, id: RegionId) -> Option<Arc<dyn MemoryRegion>> {
        self.lock().regions.get(&id).map(|r| Arc::clone(&r.mr))
    }
}

/// Pool ACL: everyone when the pool lists no users and no groups.
pub(super) fn check_pool_access(pool: &Pool, caller: &Caller) -> Result<(), EngineError> {
    let c = &pool.config;
    if c.open_to_everyone() {
        return Ok(());
    }
    let user = quota::user_name(caller.uid);
    if policy::pool_admits(c, &user, &caller.gids) {
        return Ok(());
    }
    Err(not_authorized(format!(
        "user {user} may not use pool {:?} (allowed users: {}; groups: {})",
        pool.name(),
        if c.users.is_empty() {
            "none".into()
        } else {
            c.users.join(", ")
        },
        if c.groups.is_empty() {
            "none".into()
        } else {
            c.groups.join(", ")
        },
    )))
}
