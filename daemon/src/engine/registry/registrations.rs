//! Sessions' own protection domains, and registrations of regions in them.
//!
//! A region is registered once in the daemon's protection domain of its device, without
//! remote rights (peers reach it through exports: windows bound through one QP). A session
//! may also register part of a region in a protection domain of its own, under an address
//! of its choosing and with remote rights: the registration's rkey then works through the
//! session's queue pairs in that domain and no other queue pair on the device, from the
//! moment it is made — before any QP is connected, as verbs programs hand out rkeys.

use std::sync::Arc;

use super::*;
use crate::provider::{Access, Span};

/// A registration of part of a region in a domain of its session's.
#[derive(Debug)]
pub(super) struct Registration {
    pub region: RegionId,
    pub session: SessionId,
    pub owner_uid: u32,
    /// The domain's device and number, as its session calls it.
    pub domain: (String, u32),
    pub domain_id: DomainId,
    pub mr: Arc<dyn MemoryRegion>,
}

/// A new registration: its id and the device's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistrationHandout {
    pub registration: RegistrationId,
    pub lkey: u32,
    pub rkey: u32,
}

impl Registry {
    /// Takes a use of domain `number` of `session` on `entry`'s device, making the domain
    /// (a protection domain on the device) if the session has none by that number; the
    /// caller gives the use back with [`Registry::drop_domain_use`] when what it made in
    /// the domain goes, or if making it fails.
    pub(super) fn take_domain_use(
        &self,
        owner: &Owner,
        session: SessionId,
        entry: &DeviceEntry,
        number: u32,
    ) -> Result<(DomainId, Arc<dyn ProtectionDomain>), EngineError> {
        let key = (entry.device.name().to_owned(), number);
        {
            let mut s = self.lock();
            let x = Self::own_session(&mut s, owner, session)?;
            if let Some(d) = x.domains.get_mut(&key) {
                d.users += 1;
                return Ok((d.id, Arc::clone(&d.pd)));
            }
        }
        // A device call: outside the lock.
        let pd = entry.device.alloc_pd()?;
        let mut s = self.lock();
        s.last_domain = s.last_domain.next();
        let id = s.last_domain;
        let Ok(x) = Self::own_session(&mut s, owner, session) else {
            drop(s);
            drop(pd);
            return Err(EngineError::NoSuchObject(format!(
                "session {session} (closed while its protection domain was made)"
            )));
        };
        if let Some(d) = x.domains.get_mut(&key) {
            // Made meanwhile by another call of the session's: that one it is, and ours
            // goes (outside the lock).
            d.users += 1;
            let found = (d.id, Arc::clone(&d.pd));
            drop(s);
            drop(pd);
            return Ok(found);
        }
        x.domains.insert(
            key,
            Domain {
                id,
                pd: Arc::clone(&pd),
                users: 1,
            },
        );
        Ok((id, pd))
    }

    /// Gives back a use of a session's domain; returns its protection domain if that was
    /// the last use (the caller drops it outside the lock).
    pub(super) fn drop_domain_use(
        s: &mut State,
        session: SessionId,
        key: &(String, u32),
    ) -> Option<Arc<dyn ProtectionDomain>> {
        let x = s.sessions.get_mut(&session)?;
        let d = x.domains.get_mut(key)?;
        d.users = d.users.saturating_sub(1);
        if d.users > 0 {
            return None;
        }
        x.domains.remove(key).map(|d| d.pd)
    }

    /// [`Registry::drop_domain_use`], taking the lock.
    pub(super) fn give_back_domain_use(&self, session: SessionId, key: &(String, u32)) {
        let pd = Self::drop_domain_use(&mut self.lock(), session, key);
        drop(pd);
    }

    /// Registers `span` of region `id` (`owner`'s connection's) in domain `number` of its
    /// session on `entry`'s device (the region's), with `access`, within the
    /// `registrations` limit of `limits`.
    pub fn register(
        &self,
        owner: &Owner,
        limits: &Limits,
        id: RegionId,
        (entry, number): (&DeviceEntry, u32),
        span: Span,
        access: Access,
    ) -> Result<RegistrationHandout, EngineError> {
        let (session, memory) = {
            let mut s = self.lock();
            let region = Self::own_region(&s, owner, id)?;
            let size = region.size();
            if span.len == 0
                || (span.offset as u64)
                    .checked_add(span.len as u64)
                    .is_none_or(|end| end > size)
            {
                return Err(EngineError::InvalidArgument(format!(
                    "{} bytes from offset {} do not lie inside region {id} ({size} bytes)",
                    span.len, span.offset
                )));
            }
            let found = (region.session, Arc::clone(region.mr.memory()));
            let usage = s.usage.entry(owner.uid).or_default();
            tenancy::check(limits, usage, QuotaKind::Registrations, 1)?;
            usage.add(QuotaKind::Registrations, 1);
            found
        };
        let key = (entry.device.name().to_owned(), number);
        let unreserve =
            |registry: &Registry| registry.unreserve(owner.uid, &[(QuotaKind::Registrations, 1)]);
        let (domain_id, pd) = match self.take_domain_use(owner, session, entry, number) {
            Ok(d) => d,
            Err(e) => {
                unreserve(self);
                return Err(e);
            }
        };
        let mr = match pd.register_span(memory, span, access) {
            Ok(mr) => mr,
            Err(e) => {
                self.give_back_domain_use(session, &key);
                unreserve(self);
                return Err(e.into());
            }
        };
        let mut s = self.lock();
        // The region may have been freed (or its session closed) meanwhile.
        if Self::own_region(&s, owner, id).is_err() {
            let pd = Self::drop_domain_use(&mut s, session, &key);
            drop(s);
            drop((mr, pd));
            unreserve(self);
            return Err(EngineError::NoSuchObject(format!(
                "region {id} (freed while it was being registered)"
            )));
        }
        s.last_registration = s.last_registration.next();
        let registration = s.last_registration;
        let handout = RegistrationHandout {
            registration,
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        };
        s.regions
            .get_mut(&id)
            .expect("checked above")
            .registrations
            .insert(registration);
        s.registrations.insert(
            registration,
            Registration {
                region: id,
                session,
                owner_uid: owner.uid,
                domain: key,
                domain_id,
                mr,
            },
        );
        Self::refresh_rights(&s, session);
        Ok(handout)
    }

    /// Removes registration `registration` of region `id` (`owner`'s connection's): once
    /// the teardown is released its rkey reaches nothing.
    pub fn deregister(
        &self,
        owner: &Owner,
        id: RegionId,
        registration: RegistrationId,
    ) -> Result<Teardown<'_>, EngineError> {
        let mut s = self.lock();
        let region = Self::own_region(&s, owner, id)?;
        if !region.registrations.contains(&registration) {
            return Err(EngineError::NoSuchObject(format!(
                "registration {registration} of region {id}"
            )));
        }
        let session = region.session;
        let mut garbage = Garbage::default();
        Self::remove_registration(&mut s, registration, &mut garbage);
        Self::refresh_rights(&s, session);
        Ok(self.teardown(s, Removed::default(), garbage))
    }

    /// Takes a registration out (of its region, its owner's quota and its domain) into
    /// `garbage`. The caller refreshes its session's rights.
    pub(super) fn remove_registration(
        s: &mut State,
        registration: RegistrationId,
        garbage: &mut Garbage,
    ) {
        let Some(r) = s.registrations.remove(&registration) else {
            return;
        };
        if let Some(region) = s.regions.get_mut(&r.region) {
            region.registrations.remove(&registration);
        }
        if let Some(usage) = s.usage.get_mut(&r.owner_uid) {
            usage.sub(QuotaKind::Registrations, 1);
        }
        Self::forget_idle_user(s, r.owner_uid);
        garbage.registrations.push(r.mr);
        garbage
            .domains
            .extend(Self::drop_domain_use(s, r.session, &r.domain));
    }

    /// The registrations of region `id` in its session's domains, for the data path:
    /// (domain, registration).
    pub(super) fn registrations_of(
        s: &State,
        id: RegionId,
    ) -> Vec<(DomainId, Arc<dyn MemoryRegion>)> {
        let Some(region) = s.regions.get(&id) else {
            return Vec::new();
        };
        region
            .registrations
            .iter()
            .filter_map(|r| s.registrations.get(r))
            .map(|r| (r.domain_id, Arc::clone(&r.mr)))
            .collect()
    }
}
